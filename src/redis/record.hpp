// How a key's record is kept in Redis (internal): the hash fields scripts.hpp writes, read back.
#pragma once

#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include <fmt/format.h>

#include "idem/errors.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"

struct redisReply;

namespace idem::redis {

/// The member naming `key` in the in-progress index: the scope's length, ':', the scope, the key
/// (unambiguous, as a scope may hold ':').
[[nodiscard]] std::string member_of(const Key& key);

/// A record field that holds an integer; throws corrupt_record naming `field` when it does not.
template <class Int>
[[nodiscard]] Int parse_int(std::string_view text, const char* field) {
    Int value{};
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc{} || end != text.data() + text.size()) {
        throw corrupt_record(fmt::format("idem: Redis record field '{}' is not an integer", field));
    }
    return value;
}

/// A record's time field (milliseconds since the Unix epoch).
[[nodiscard]] std::chrono::system_clock::time_point from_ms(std::int64_t ms);

/// The 11 fields of a record (scripts.hpp: s fa fp f a r ph pd c l e) at reply[first..], as read at
/// `now` (Unix milliseconds); nullopt when there is none. Throws corrupt_record.
[[nodiscard]] std::optional<Record> decode_record(const redisReply& reply, std::size_t first, std::int64_t now);

}  // namespace idem::redis
