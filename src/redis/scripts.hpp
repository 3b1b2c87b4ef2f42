// The Lua scripts of RedisStore (internal). Each runs atomically on the server (Redis runs one
// script at a time), reads the clock with TIME (Redis 7 replicates a script's effects, not the
// script, so TIME is allowed), and every script that writes after the claim is fenced: it compares
// the record's fence with the caller's and changes nothing when they differ.
//
// A record is a hash: s (state: p in progress, c completed), fa / fp (fingerprint algorithm and
// bytes), f (fence, decimal: a Lua number would lose bits of a 63-bit fence), a (attempt), r (result),
// ph / pd (phase and its data), c / l / e (created, lease end, expiry: Unix ms by Redis's clock).
// In-progress records are also members of the index (a sorted set scored by lease end), the member
// being the record's key without the prefix; only the scripts write either.
#pragma once

#include <array>
#include <cstddef>
#include <string_view>

namespace idem::redis {

enum Script : std::size_t {
    kClaim,
    kSave,
    kRelease,
    kExtend,
    kPhase,
    kTakeOver,
    kRead,
    kListStale,
    kAclProbe,
    kScriptCount
};

// Shared prologue: `now` in Unix ms by the server's clock; `ms` formats an integer without the
// exponent Lua's tostring would use for large numbers.
#define IDEM_REDIS_PROLOGUE                                                   \
    "local t = redis.call('TIME')\n"                                          \
    "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n" \
    "local function ms(x) return string.format('%.0f', x) end\n"              \
    "local FIELDS = {'s','fa','fp','f','a','r','ph','pd','c','l','e'}\n"

inline constexpr std::array<std::string_view, kScriptCount> kScripts = {
    // kClaim. KEYS: record, index. ARGV: fence, fp algorithm, fp bytes (as stored: keyed with a
    // FingerprintSecret; never the plain digest, which Redis's SLOWLOG and MONITOR would show),
    // lease ms, retention ms, resume (1/0), index member. Resume mode takes over only a record of
    // the same algorithm and bytes; one written without the secret (fa 1) is compared by the
    // client. Answers {tag, now, 11 fields of the record found}:
    //   claimed — created (no fields); own — the record already has this fence (a retry of our own
    //   claim whose answer was lost); taken — resume mode took the stale record over (the fields
    //   are the record before); found — someone else's record; corrupt — a hash idem did not write
    //   (no fields; nothing changed).
    IDEM_REDIS_PROLOGUE
    "local r = redis.call('HMGET', KEYS[1], unpack(FIELDS))\n"
    "if r[1] ~= false and ((r[1] ~= 'p' and r[1] ~= 'c') or not tonumber(r[10]) or not tonumber(r[11]) or\n"
    "                      not tonumber(r[5]) or r[4] == false) then return {'corrupt', now} end\n"
    "if r[1] == false or (r[1] == 'c' and tonumber(r[11]) < now) then\n"
    "  if r[1] ~= false then redis.call('DEL', KEYS[1]) end\n"
    "  local lease_until = now + tonumber(ARGV[4])\n"
    "  redis.call('HSET', KEYS[1], 's', 'p', 'fa', ARGV[2], 'fp', ARGV[3], 'f', ARGV[1], 'a', '1',\n"
    "             'c', ms(now), 'l', ms(lease_until), 'e', ms(now + tonumber(ARGV[5])))\n"
    "  redis.call('ZADD', KEYS[2], ms(lease_until), ARGV[7])\n"
    "  return {'claimed', now}\n"
    "end\n"
    "if r[1] == 'p' and r[4] == ARGV[1] then return {'own', now, unpack(r)} end\n"
    "local same = r[2] == ARGV[2] and r[3] == ARGV[3]\n"
    "if ARGV[6] == '1' and r[1] == 'p' and tonumber(r[10]) < now and same then\n"
    "  local lease_until = now + tonumber(ARGV[4])\n"
    "  redis.call('HSET', KEYS[1], 'f', ARGV[1], 'a', ms(tonumber(r[5]) + 1), 'l', ms(lease_until))\n"
    "  redis.call('ZADD', KEYS[2], ms(lease_until), ARGV[7])\n"
    "  return {'taken', now, unpack(r)}\n"
    "end\n"
    "return {'found', now, unpack(r)}\n",

    // kSave. KEYS: record, index. ARGV: fence, result, index member. 1 saved, 0 fence lost, -1 a
    // hash idem did not write (nothing changed). The
    // record then expires at its e (PEXPIREAT). A completed record with this fence and these bytes is
    // our own earlier save (its answer was lost): saved.
    IDEM_REDIS_PROLOGUE
    "local r = redis.call('HMGET', KEYS[1], 's', 'f', 'e')\n"
    "if r[2] ~= ARGV[1] then return 0 end\n"
    "if (r[1] ~= 'p' and r[1] ~= 'c') or not tonumber(r[3]) then return -1 end\n"
    "if r[1] == 'c' then\n"
    "  if redis.call('HGET', KEYS[1], 'r') == ARGV[2] then return 1 end\n"
    "  return 0\n"
    "end\n"
    "redis.call('HSET', KEYS[1], 's', 'c', 'r', ARGV[2])\n"
    "redis.call('ZREM', KEYS[2], ARGV[3])\n"
    "redis.call('PEXPIREAT', KEYS[1], r[3])\n"
    "return 1\n",

    // kRelease. KEYS: record, index. ARGV: fence, index member. 1 deleted, 0 fence lost.
    "local r = redis.call('HMGET', KEYS[1], 's', 'f')\n"
    "if r[1] ~= 'p' or r[2] ~= ARGV[1] then return 0 end\n"
    "redis.call('DEL', KEYS[1])\n"
    "redis.call('ZREM', KEYS[2], ARGV[2])\n"
    "return 1\n",

    // kExtend. KEYS: record, index. ARGV: fence, lease ms, index member. 1 extended, 0 fence lost.
    IDEM_REDIS_PROLOGUE
    "local r = redis.call('HMGET', KEYS[1], 's', 'f')\n"
    "if r[1] ~= 'p' or r[2] ~= ARGV[1] then return 0 end\n"
    "local lease_until = now + tonumber(ARGV[2])\n"
    "redis.call('HSET', KEYS[1], 'l', ms(lease_until))\n"
    "redis.call('ZADD', KEYS[2], ms(lease_until), ARGV[3])\n"
    "return 1\n",

    // kPhase. KEYS: record. ARGV: fence, phase, data. 1 recorded, 0 fence lost.
    "local r = redis.call('HMGET', KEYS[1], 's', 'f')\n"
    "if r[1] ~= 'p' or r[2] ~= ARGV[1] then return 0 end\n"
    "redis.call('HSET', KEYS[1], 'ph', ARGV[2], 'pd', ARGV[3])\n"
    "return 1\n",

    // kTakeOver. KEYS: record, index. ARGV: stale fence, new fence, lease ms, new attempt (1/0),
    // index member. 1 taken (or already ours: a retry), 0 not stale / fence moved on / gone, -1 a
    // hash idem did not write.
    IDEM_REDIS_PROLOGUE
    "local r = redis.call('HMGET', KEYS[1], 's', 'f', 'l', 'a')\n"
    "if r[1] ~= 'p' then return 0 end\n"
    "if not tonumber(r[3]) or not tonumber(r[4]) then return -1 end\n"
    "if r[2] == ARGV[2] then return 1 end\n"
    "if r[2] ~= ARGV[1] or tonumber(r[3]) >= now then return 0 end\n"
    "local lease_until = now + tonumber(ARGV[3])\n"
    "local attempt = tonumber(r[4])\n"
    "if ARGV[4] == '1' then attempt = attempt + 1 end\n"
    "redis.call('HSET', KEYS[1], 'f', ARGV[2], 'l', ms(lease_until), 'a', ms(attempt))\n"
    "redis.call('ZADD', KEYS[2], ms(lease_until), ARGV[5])\n"
    "return 1\n",

    // kRead. KEYS: record. Answers {now, 11 fields} (all nil: no record).
    IDEM_REDIS_PROLOGUE "return {now, unpack(redis.call('HMGET', KEYS[1], unpack(FIELDS)))}\n",

    // kListStale. KEYS: index. ARGV: record key prefix, limit, filter (a all / e exact / p prefix),
    // scope or prefix. Walks the index in score (lease end) order by rank, 256 members at a time,
    // while the leases have passed; answers {now, then per key: member, 11 fields}. A member whose
    // record is gone or completed (deleted or edited outside these scripts) is dropped from the
    // index and not counted, so it cannot hide real stale keys from the reconciler.
    IDEM_REDIS_PROLOGUE
    "local out = {now}\n"
    "local limit = tonumber(ARGV[2])\n"
    "local n, rank, ghosts = 0, 0, {}\n"
    "while n < limit do\n"
    "  local page = redis.call('ZRANGE', KEYS[1], rank, rank + 255, 'WITHSCORES')\n"
    "  if #page == 0 then break end\n"
    "  local passed = true\n"
    "  for i = 1, #page, 2 do\n"
    "    local m = page[i]\n"
    "    if tonumber(page[i + 1]) >= now then passed = false break end\n"
    "    local colon = string.find(m, ':', 1, true)\n"
    "    local len = colon and tonumber(string.sub(m, 1, colon - 1))\n"
    "    local scope = len and string.sub(m, colon + 1, colon + len) or ''\n"
    "    if ARGV[3] == 'a' or (ARGV[3] == 'e' and scope == ARGV[4]) or\n"
    "       (ARGV[3] == 'p' and string.sub(scope, 1, #ARGV[4]) == ARGV[4]) then\n"
    "      local r = redis.call('HMGET', ARGV[1] .. m, unpack(FIELDS))\n"
    "      if r[1] == false or r[1] == 'c' then\n"
    "        ghosts[#ghosts + 1] = m\n"
    "      else\n"
    "        out[#out + 1] = m\n"
    "        for j = 1, 11 do out[#out + 1] = r[j] end\n"
    "        n = n + 1\n"
    "        if n >= limit then break end\n"
    "      end\n"
    "    end\n"
    "  end\n"
    "  if not passed then break end\n"
    "  rank = rank + 256\n"
    "end\n"
    "for _, m in ipairs(ghosts) do redis.call('ZREM', KEYS[1], m) end\n"
    "return out\n",

    // kAclProbe (at connect, before anything is written). ARGV: key prefix, 1 when WAIT follows
    // writes. Answers the commands the connection's ACL user may not run as the store runs them
    // — the scripts' own calls on a key under the prefix, and WAIT — as "COMMAND" or
    // "COMMAND on <key>" (empty: every one allowed). Writes nothing (redis.acl_check_cmd, Redis 7).
    "local denied = {}\n"
    "local k = ARGV[1] .. 'acl-probe'\n"
    "local checks = {{'TIME'}, {'HMGET', k, 's'}, {'HGET', k, 'r'}, {'HSET', k, 's', 'p'}, {'DEL', k},\n"
    "                {'PEXPIREAT', k, '1'}, {'ZADD', k, '1', 'm'}, {'ZREM', k, 'm'}, {'ZRANGE', k, '0', '1'}}\n"
    "if ARGV[2] == '1' then checks[#checks + 1] = {'WAIT', '0', '0'} end\n"
    "for _, c in ipairs(checks) do\n"
    "  if not redis.acl_check_cmd(unpack(c)) then\n"
    "    denied[#denied + 1] = c[2] and (c[1] .. ' on ' .. c[2]) or c[1]\n"
    "  end\n"
    "end\n"
    "return denied\n",
};

#undef IDEM_REDIS_PROLOGUE

}  // namespace idem::redis
