// Fuzz target: decoding a stored row (idem::pg::parse_record) and its result (codec<Response>).
//
// Input: a header byte, then for each column a length byte (0xFF: NULL, 0xFE: a 2-byte length
// follows, else the length) and that many bytes; a column the input does not reach is NULL.
//   header bit 0-1: row passed to parse_record (0, 0, 1, -1); bit 2-3: columns (14, 14, 13, 16);
//   bit 4: a second row (a copy of the first).
// The PGresult is built by hand (PQmakeEmptyPGresult + PQsetResultAttrs, binary format, the real
// type OIDs) as a SELECT of kRecordColumns columns would return it. parse_record must return a
// Record or throw idem::corrupt_record, agree with an independent reference of what is decodable,
// and return exactly the bytes and numbers stored. The result bytes must decode to a Response or
// throw corrupt_record; a decoded Response re-encodes to the same bytes (the layout is canonical).
//
// Timestamps: exact where std::chrono::system_clock (int64 nanoseconds since 1970) can hold them;
// beyond that ('infinity', years past ~2262, which PostgreSQL allows) saturated to
// time_point::max()/min() — never a signed overflow (that was a bug the fuzzer found).
#include <libpq-fe.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_support.hpp"
#include "idem/errors.hpp"
#include "idem/response.hpp"
#include "idem/store.hpp"
#include "postgres/sansio/record.hpp"
#include "postgres/sansio/sql.hpp"

namespace {

constexpr int kCols = idem::pg::kRecordColumns;
static_assert(kCols == 14, "the fuzz target mirrors the 14 record columns of src/postgres/sql.cpp");

// Column types of the record, in parse_record's order.
constexpr Oid kText = 25, kBytea = 17, kInt2 = 21, kInt4 = 23, kInt8 = 20, kTimestamptz = 1184, kBool = 16;
constexpr Oid kTypes[kCols] = {kText,        kBytea,       kInt2, kInt8,  kInt4, kBytea, kTimestamptz,
                               kTimestamptz, kTimestamptz, kText, kBytea, kBool, kBool,  kTimestamptz};

constexpr std::int64_t kEpochShiftUs = 946684800LL * 1000000LL;  // 2000-01-01 in Unix microseconds

std::int64_t be(const std::string& s) {
    std::uint64_t v = 0;
    for (unsigned char c : s) v = (v << 8) | c;
    return static_cast<std::int64_t>(v);
}

struct Cell {
    std::optional<std::string> value;  // nullopt: SQL NULL
};

struct ResultDeleter {
    void operator()(PGresult* r) const noexcept { PQclear(r); }
};
using ResultPtr = std::unique_ptr<PGresult, ResultDeleter>;

ResultPtr make_result(const std::vector<Cell>& cells, int ncols, int nrows) {
    ResultPtr res(PQmakeEmptyPGresult(nullptr, PGRES_TUPLES_OK));
    FUZZ_CHECK(res != nullptr, "PQmakeEmptyPGresult");
    std::vector<std::string> names(static_cast<std::size_t>(ncols));
    std::vector<PGresAttDesc> attrs(static_cast<std::size_t>(ncols));
    for (int c = 0; c < ncols; ++c) {
        names[static_cast<std::size_t>(c)] = "c" + std::to_string(c);
        PGresAttDesc& a = attrs[static_cast<std::size_t>(c)];
        a.name = names[static_cast<std::size_t>(c)].data();
        a.tableid = 0;
        a.columnid = 0;
        a.format = 1;  // binary, as idem's own statements ask for
        a.typid = c < kCols ? kTypes[c] : kText;
        a.typlen = -1;
        a.atttypmod = -1;
    }
    FUZZ_CHECK(PQsetResultAttrs(res.get(), ncols, attrs.data()) == 1, "PQsetResultAttrs");
    for (int row = 0; row < nrows; ++row) {
        for (int c = 0; c < ncols; ++c) {
            const Cell& cell = cells[static_cast<std::size_t>(c)];
            const int ok = cell.value ? PQsetvalue(res.get(), row, c, const_cast<char*>(cell.value->data()),
                                                   static_cast<int>(cell.value->size()))
                                      : PQsetvalue(res.get(), row, c, nullptr, -1);
            FUZZ_CHECK(ok == 1, "PQsetvalue");
        }
    }
    return res;
}

// What parse_record must accept, written from the column contract (sql.cpp / record.hpp).
bool decodable(const std::vector<Cell>& cells, int ncols, int nrows, int row) {
    if (ncols < kCols || row < 0 || row >= nrows) return false;
    const auto fixed = [&](int c, std::size_t width) {
        return cells[static_cast<std::size_t>(c)].value && cells[static_cast<std::size_t>(c)].value->size() == width;
    };
    const auto& state = cells[0].value;
    if (!state || (*state != "in_progress" && *state != "completed")) return false;
    if (!fixed(2, 2) || (be(*cells[2].value) != 1 && be(*cells[2].value) != 2)) return false;  // sha256, hmac
    if (!cells[1].value || cells[1].value->size() != 32) return false;                         // 32-byte digest
    if (!fixed(3, 8) || !fixed(4, 4)) return false;              // fence int8, attempt int4
    if (*state == "completed" && !cells[5].value) return false;  // completed needs a result
    for (int c : {6, 7, 8, 13}) {
        if (!fixed(c, 8)) return false;
    }
    return fixed(11, 1) && fixed(12, 1);
}

// Whether parse_record decoded a binary timestamptz right: exact when representable, else
// saturated (a boundary value within 2 µs of the limit may be either).
bool time_ok(std::chrono::system_clock::time_point got, const std::string& be8) {
    using tp = std::chrono::system_clock::time_point;
    const __int128 ns = (static_cast<__int128>(be(be8)) + kEpochShiftUs) * 1000;
    constexpr __int128 slack = 2000;
    if (ns > INT64_MAX) return got == tp::max();
    if (ns < INT64_MIN) return got == tp::min();
    const tp exact{std::chrono::nanoseconds(static_cast<std::int64_t>(ns))};
    if (got == exact) return true;
    return (got == tp::max() && ns > INT64_MAX - slack) || (got == tp::min() && ns < INT64_MIN + slack);
}

void check_response(const std::string& bytes) {
    try {
        const idem::Response r = idem::codec<idem::Response>::decode(bytes);
        const std::string again = idem::codec<idem::Response>::encode(r);
        FUZZ_CHECK(again == bytes, "decode/encode not canonical: %s -> %s", idem_fuzz::hex(bytes).c_str(),
                   idem_fuzz::hex(again).c_str());
    } catch (const idem::corrupt_record&) {
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "codec<Response>::decode threw something other than corrupt_record: %s", e.what());
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    idem_fuzz::Reader in(data, size);
    const std::uint8_t header = in.u8();
    constexpr int kRows[] = {0, 0, 1, -1};
    constexpr int kNcols[] = {kCols, kCols, kCols - 1, kCols + 2};
    const int row = kRows[header & 3];
    const int ncols = kNcols[(header >> 2) & 3];
    const int nrows = (header & 0x10) ? 2 : 1;

    std::vector<Cell> cells(static_cast<std::size_t>(ncols));
    for (int c = 0; c < ncols && !in.empty(); ++c) {
        std::size_t len = in.u8();
        if (len == 0xFF) continue;  // NULL
        if (len == 0xFE) len = in.u16();
        cells[static_cast<std::size_t>(c)].value = in.bytes(len);
    }
    const ResultPtr res = make_result(cells, ncols, nrows);
    const bool expect = decodable(cells, ncols, nrows, row);
    std::optional<idem::Record> rec;
    try {
        rec = idem::pg::parse_record(res.get(), row);
    } catch (const idem::corrupt_record& e) {
        FUZZ_CHECK(!expect, "parse_record refused a decodable row: %s", e.what());
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "parse_record threw something other than corrupt_record: %s", e.what());
    }

    if (rec) {
        FUZZ_CHECK(expect, "parse_record accepted a row the reference refuses");
        const auto& v = [&](int c) -> const std::string& { return *cells[static_cast<std::size_t>(c)].value; };
        FUZZ_CHECK(std::string(idem::to_string(rec->state)) == v(0), "state");
        FUZZ_CHECK(rec->fingerprint.bytes() == v(1), "fingerprint bytes");
        FUZZ_CHECK(rec->fence == be(v(3)), "fence");
        FUZZ_CHECK(rec->attempt == static_cast<std::int32_t>(be(v(4))), "attempt");
        const auto same_opt = [&](const std::optional<std::string>& got, int c) {
            return got == cells[static_cast<std::size_t>(c)].value;
        };
        FUZZ_CHECK(same_opt(rec->result, 5), "result");
        FUZZ_CHECK(same_opt(rec->phase, 9), "phase");
        FUZZ_CHECK(same_opt(rec->phase_data, 10), "phase_data");
        FUZZ_CHECK(time_ok(rec->created_at, v(6)), "created_at of %s", idem_fuzz::hex(v(6)).c_str());
        FUZZ_CHECK(time_ok(rec->lease_until, v(7)), "lease_until of %s", idem_fuzz::hex(v(7)).c_str());
        FUZZ_CHECK(time_ok(rec->expires_at, v(8)), "expires_at of %s", idem_fuzz::hex(v(8)).c_str());
        FUZZ_CHECK(time_ok(rec->read_at, v(13)), "read_at of %s", idem_fuzz::hex(v(13)).c_str());
        FUZZ_CHECK(rec->lease_expired == (v(11)[0] != 0) && rec->expired == (v(12)[0] != 0), "flags");
        if (rec->state == idem::RecordState::completed) FUZZ_CHECK(rec->result.has_value(), "completed without result");
    }
    // The stored result, whatever the rest of the row: Response or corrupt_record.
    if (ncols > 5 && cells[5].value) check_response(*cells[5].value);
    return 0;
}
