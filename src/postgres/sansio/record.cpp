#include "record.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "columns.hpp"
#include "idem/errors.hpp"
#include "params.hpp"
#include "result.hpp"
#include "sql.hpp"
#include "sqlstate.hpp"

namespace idem::pg {

namespace {

// One stored row, read column by column with two libpq calls per column (value, length); a NULL in
// a fixed-width column shows as length 0, which get_be() refuses. PQgetisnull is asked only where
// NULL is allowed. (The replay path decodes a row per call.)
class Row {
public:
    Row(const PGresult* r, int row) noexcept : r_(r), row_(row) {}

    [[nodiscard]] std::string_view bytes(int col) const { return get_bytes(r_, row_, col); }
    [[nodiscard]] std::optional<std::string> nullable(int col) const {
        if (is_null(r_, row_, col)) return std::nullopt;
        return std::string(bytes(col));
    }
    [[nodiscard]] std::uint64_t be(int col, int width) const { return get_be(r_, row_, col, width); }

private:
    const PGresult* r_;
    int row_;
};

}  // namespace

Record parse_record(const PGresult* r, int row) {
    Record rec;
    parse_record(r, row, rec);
    return rec;
}

void parse_record(const PGresult* r, int row, Record& rec) {
    if (result_columns(r) < kRecordColumns || row < 0 || row >= result_rows(r)) {
        throw corrupt_record("idem: a stored row with missing columns");
    }
    const Row cols(r, row);
    const std::string_view state = cols.bytes(0);
    if (state == "in_progress") {
        rec.state = RecordState::in_progress;
    } else if (state == "completed") {
        rec.state = RecordState::completed;
    } else {
        throw corrupt_record("idem: unknown state '" + std::string(state) + "'");
    }
    rec.fingerprint = Fingerprint::from_bytes(static_cast<std::int16_t>(cols.be(2, 2)), cols.bytes(1));
    rec.fence = static_cast<std::int64_t>(cols.be(3, 8));
    rec.attempt = static_cast<std::int32_t>(static_cast<std::uint32_t>(cols.be(4, 4)));
    rec.result = cols.nullable(5);
    if (rec.state == RecordState::completed && !rec.result) {
        throw corrupt_record("idem: completed record without a result");
    }
    rec.created_at = timestamptz_from_pg(static_cast<std::int64_t>(cols.be(6, 8)));
    rec.lease_until = timestamptz_from_pg(static_cast<std::int64_t>(cols.be(7, 8)));
    rec.expires_at = timestamptz_from_pg(static_cast<std::int64_t>(cols.be(8, 8)));
    rec.phase = cols.nullable(9);
    rec.phase_data = cols.nullable(10);
    rec.lease_expired = cols.be(11, 1) != 0;
    rec.expired = cols.be(12, 1) != 0;
    rec.read_at = timestamptz_from_pg(static_cast<std::int64_t>(cols.be(13, 8)));
}

}  // namespace idem::pg
