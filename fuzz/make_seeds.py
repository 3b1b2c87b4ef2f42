#!/usr/bin/env python3
"""Writes the seed corpora of idem's fuzz targets into fuzz/corpus/<target>/ (a few dozen files each).

Usage: fuzz/make_seeds.py [OUTPUT_DIR]   (default: fuzz/corpus next to this script)

The input formats are described at the top of each fuzz_<target>.cpp. File names are the SHA-1 of
the content (as libFuzzer names them), so re-running is idempotent.
"""
import hashlib
import os
import struct
import sys

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, hashlib.sha1(data).hexdigest()), "wb") as f:
        f.write(data)


# ---- key: u16 split point, then scope + value ---------------------------------------------------
good = [b"k", b"acct_42:POST /payments", b"'; DROP TABLE x; --", b"caf\xc3\xa9", b"\xe6\x97\xa5\xe6\x9c\xac",
        b"\xf0\x9f\x98\x80", b"\xef\xbf\xbf", b"\xf4\x8f\xbf\xbf", b"550e8400-e29b-41d4-a716-446655440000",
        b"k" * 255, b"\xc2\xa0nbsp", b"\xe0\xa0\x80", b"\xed\x9f\xbf", b"\xf0\x90\x80\x80"]
bad = [b"", b"k" * 256, b"a\x00b", b"a\tb", b"\x1f", b"a\x7f", b"\xc2\x80", b"\xc2\x9f", b"\xff", b"\x80",
       b"abc\xc3", b"\xe2\x82", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf", b"\xed\xa0\x80",
       b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xf8\x88\x80\x80\x80"]
scope = b"acct_42:POST /payments"
for part in good + bad:
    write("key", struct.pack(">H", len(scope)) + scope + part)   # as the value
    write("key", struct.pack(">H", len(part)) + part + b"v")     # as the scope

# ---- fingerprint: u16 hint, then parts (type byte + payload) ------------------------------------
def s(t):
    return bytes([0, len(t)]) + t

def x(t):
    return bytes([1, len(t)]) + t

def i64(v):
    return bytes([2]) + struct.pack(">q", v)

def u64(v):
    return bytes([3]) + struct.pack(">Q", v)

def b(v):
    return bytes([4, 1 if v else 0])

def i32(v):
    return bytes([5]) + struct.pack(">q", v)

def u16(v):
    return bytes([6]) + struct.pack(">Q", v)

def ch(c):
    return bytes([7]) + c

fp_seeds = [
    [], [s(b"")], [s(b"ab"), s(b"c")], [s(b"a"), s(b"bc")], [s(b"POST"), s(b"/payments"), i64(1999), s(b"EUR")],
    [i64(1), s(b"1")], [i64(-1), u64(2**64 - 1)], [b(True), i64(1)], [x(b"\x00\xff"), s(b"\x00\xff")],
    [i32(-5), u16(65535), ch(b"z")], [s(b"x" * 200), x(b"y" * 200), i64(2**63 - 1)], [b(False)] * 4,
    [u64(0), i64(0), b(False), s(b""), x(b"")],
]
for k, parts in enumerate(fp_seeds):
    write("fingerprint", struct.pack(">H", 7 * k + 3) + b"".join(parts))

# ---- response: the v1 layout ----------------------------------------------------------------------
def response(status, body, headers=()):
    out = b"IDR1" + struct.pack(">I", status & 0xFFFFFFFF) + struct.pack(">I", len(headers))
    for n, v in headers:
        out += struct.pack(">I", len(n)) + n + struct.pack(">I", len(v)) + v
    return out + struct.pack(">Q", len(body)) + body

responses = [
    response(200, b""), response(201, b'{"id":"ch_1"}', [(b"content-type", b"application/json")]),
    response(402, b"declined\x00\xff", [(b"a", b""), (b"", b"b")]), response(-1, b"x" * 100),
    response(500, b"", [(b"x-" + bytes([65 + k]), b"v") for k in range(5)]),
]
corrupt = [b"", b"IDR", b"IDR2" + responses[0][4:], responses[1][:-1], responses[1] + b"!",
           b"IDR1" + struct.pack(">II", 200, 0xFFFFFFFF) + struct.pack(">Q", 0),
           b"IDR1" + struct.pack(">II", 200, 1) + struct.pack(">I", 0xFFFFFFF0) + b"\x00" * 12,
           b"IDR1" + struct.pack(">II", 200, 0) + struct.pack(">Q", 2**64 - 1)]
for r in responses + corrupt:
    write("response", r)

# ---- record: header byte, then per column a length byte (0xFF NULL, 0xFE u16 length) + bytes -----
def col(v):
    if v is None:
        return b"\xff"
    if len(v) >= 0xFE:
        return b"\xfe" + struct.pack(">H", len(v)) + v
    return bytes([len(v)]) + v

TS = struct.pack(">q", 817_000_000_000_000)  # 2025-11-20, microseconds since 2000-01-01

def row(state=b"completed", fp=b"\x11" * 32, alg=struct.pack(">h", 1), fence=struct.pack(">q", 123456789),
        attempt=struct.pack(">i", 1), result=None, created=TS, lease=TS, expires=TS, phase=None,
        phase_data=None, lease_expired=b"\x00", expired=b"\x00", read_at=TS, header=0, extra=()):
    cols = [state, fp, alg, fence, attempt, result, created, lease, expires, phase, phase_data, lease_expired,
            expired, read_at, *extra]
    return bytes([header]) + b"".join(col(c) for c in cols)

r1 = responses[1]
record_seeds = [
    row(result=r1), row(state=b"in_progress"), row(state=b"in_progress", phase=b"charge_created", phase_data=b"ch_1"),
    row(result=responses[2], lease_expired=b"\x01", expired=b"\x01"), row(result=b"x" * 300),
    row(result=b""), row(result=corrupt[3]), row(state=b"completed"),        # completed without result
    row(state=b"done", result=r1), row(state=None), row(state=b""),
    row(fp=b"\x11" * 31, result=r1), row(fp=None, result=r1), row(fp=b"\x11" * 33, result=r1),
    row(alg=struct.pack(">h", 2), result=r1), row(alg=b"\x01", result=r1), row(alg=None, result=r1),
    row(fence=b"\x00" * 4, result=r1), row(fence=None, result=r1), row(attempt=b"\x00" * 8, result=r1),
    row(created=None, result=r1), row(lease=b"\x00" * 4, result=r1), row(expires=struct.pack(">q", 2**63 - 1), result=r1),
    row(expires=struct.pack(">q", -2**63), result=r1), row(lease_expired=None, result=r1),
    # past the range of system_clock (year 3000, 'infinity'): saturated, never a signed overflow
    row(expires=struct.pack(">q", (32503680000 - 946684800) * 10**6), result=r1),
    row(state=b"in_progress", lease=struct.pack(">q", 2**63 - 1), created=struct.pack(">q", -(2**62))),
    # before 1970 the representable range reaches 30 years further than after it (epochs differ):
    # year ~1685 is exact, not saturated (a bug the fuzzer found); just past each end saturates
    row(state=b"in_progress", lease=struct.pack(">q", -9_000_000_000_000_000),
        created=struct.pack(">q", -10_170_057_636_854_776), expires=struct.pack(">q", 8_276_687_236_854_775)),
    row(expired=b"\x00\x00", result=r1), row(read_at=None, result=r1), row(read_at=b"\x00" * 4, result=r1), row(result=r1, header=2), row(result=r1, header=3),
    row(result=r1, header=0x08), row(result=r1, header=0x0C, extra=(b"scope", b"key")), row(result=r1, header=0x12),
    row(result=r1)[:40],  # truncated: the columns past the end are NULL
]
for r in record_seeds:
    write("record", r)
