// The binary-format columns of a result, decoded (internal).
#pragma once

#include <chrono>
#include <cstdint>
#include <string_view>

#include "result.hpp"

namespace idem::pg {

/// A binary fixed-width column (1 ≤ width ≤ 8 bytes, big-endian) as an unsigned number; throws
/// corrupt_record when it is NULL or has another width.
std::uint64_t get_be(const PGresult* r, int row, int col, int width);
/// Reads a binary-format column of row `row`.
std::int64_t get_int8(const PGresult* r, int row, int col);
std::int32_t get_int4(const PGresult* r, int row, int col);
std::int16_t get_int2(const PGresult* r, int row, int col);
std::string_view get_bytes(const PGresult* r, int row, int col);
std::chrono::system_clock::time_point get_timestamptz(const PGresult* r, int row, int col);
/// A binary timestamptz (microseconds since 2000-01-01 UTC) as system_clock time, saturated to
/// time_point::max()/min() beyond its range ('infinity' included).
std::chrono::system_clock::time_point timestamptz_from_pg(std::int64_t us) noexcept;
bool is_null(const PGresult* r, int row, int col);
bool get_bool(const PGresult* r, int row, int col);

}  // namespace idem::pg
