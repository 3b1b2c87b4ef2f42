// The I/O-free core's view of a result (sansio/result.hpp, sansio/columns.hpp), over libpq: the one
// place where a result's cells, rows and error message are read.
#include <libpq-fe.h>

#include <bit>
#include <cstring>
#include <string>

#include "idem/errors.hpp"
#include "sansio/columns.hpp"
#include "sansio/result.hpp"
#include "sansio/sqlstate.hpp"

namespace idem::pg {

void ResultDeleter::operator()(PGresult* result) const noexcept { PQclear(result); }
int result_rows(const PGresult* r) noexcept { return PQntuples(r); }
int result_columns(const PGresult* r) noexcept { return PQnfields(r); }

std::string StepResult::message() const {
    if (aborted) return "skipped: an earlier statement of the pipeline failed";
    if (rolled_back) return "rolled back: a later statement of its transaction failed";
    if (!failed || !result) return {};
    return trim(PQresultErrorMessage(result.get()));
}

// ---- binary result columns --------------------------------------------------------------------------

std::uint64_t get_be(const PGresult* r, int row, int col, int width) {
    // A NULL reads as length 0, which no width here allows: two libpq calls, not three.
    if (PQgetlength(r, row, col) != width) {
        throw corrupt_record("idem: unexpected NULL or width in column " + std::to_string(col));
    }
    // Big-endian, `width` ≤ 8 bytes: load into one end of a word, one byte swap.
    const auto n = static_cast<std::size_t>(width);
    std::uint64_t v = 0;
    std::memcpy(reinterpret_cast<char*>(&v) + (std::endian::native == std::endian::little ? 0 : 8 - n),
                PQgetvalue(r, row, col), n);
    if constexpr (std::endian::native == std::endian::little) v = __builtin_bswap64(v) >> (8 * (8 - n));
    return v;
}

std::int64_t get_int8(const PGresult* r, int row, int col) { return static_cast<std::int64_t>(get_be(r, row, col, 8)); }
std::int32_t get_int4(const PGresult* r, int row, int col) {
    return static_cast<std::int32_t>(static_cast<std::uint32_t>(get_be(r, row, col, 4)));
}
std::int16_t get_int2(const PGresult* r, int row, int col) {
    return static_cast<std::int16_t>(static_cast<std::uint16_t>(get_be(r, row, col, 2)));
}
std::string_view get_bytes(const PGresult* r, int row, int col) {
    return {PQgetvalue(r, row, col), static_cast<std::size_t>(PQgetlength(r, row, col))};
}
bool is_null(const PGresult* r, int row, int col) { return PQgetisnull(r, row, col) != 0; }
bool get_bool(const PGresult* r, int row, int col) { return get_be(r, row, col, 1) != 0; }

std::chrono::system_clock::time_point get_timestamptz(const PGresult* r, int row, int col) {
    return timestamptz_from_pg(get_int8(r, row, col));
}

std::chrono::system_clock::time_point timestamptz_from_pg(std::int64_t us) noexcept {
    // Binary timestamptz: microseconds since 2000-01-01 00:00:00 UTC (integer datetimes);
    // INT64_MAX / INT64_MIN are 'infinity' / '-infinity'. system_clock counts nanoseconds here, so
    // values beyond its range (±292 years around 1970) are clamped instead of overflowing.
    using namespace std::chrono;
    using tp = system_clock::time_point;
    constexpr std::int64_t pg_epoch_unix_us = 946684800LL * 1000000LL;
    // Both bounds in PostgreSQL's epoch; the range is not symmetric around it (the epochs differ
    // by 30 years), so each side gets its own limit.
    constexpr std::int64_t max_us = duration_cast<microseconds>(tp::duration::max()).count() - pg_epoch_unix_us;
    constexpr std::int64_t min_us = duration_cast<microseconds>(tp::duration::min()).count() - pg_epoch_unix_us;
    if (us > max_us) return tp::max();
    if (us < min_us) return tp::min();
    return tp(duration_cast<tp::duration>(microseconds(us + pg_epoch_unix_us)));
}

}  // namespace idem::pg
