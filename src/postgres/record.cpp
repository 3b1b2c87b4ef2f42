#include "record.hpp"

#include "connection.hpp"
#include "sql.hpp"
#include "idem/errors.hpp"

namespace idem::pg {

Record parse_record(const PGresult* r, int row) {
    if (PQnfields(r) < kRecordColumns || row < 0 || row >= PQntuples(r)) {
        throw corrupt_record("idem: a stored row with missing columns");
    }
    Record rec;
    const std::string_view state = get_bytes(r, row, 0);
    if (state == "in_progress") {
        rec.state = RecordState::in_progress;
    } else if (state == "completed") {
        rec.state = RecordState::completed;
    } else {
        throw corrupt_record("idem: unknown state '" + std::string(state) + "'");
    }
    rec.fingerprint = Fingerprint::from_bytes(get_int2(r, row, 2), get_bytes(r, row, 1));
    rec.fence = get_int8(r, row, 3);
    rec.attempt = get_int4(r, row, 4);
    if (!is_null(r, row, 5)) rec.result = std::string(get_bytes(r, row, 5));
    if (rec.state == RecordState::completed && !rec.result) {
        throw corrupt_record("idem: completed record without a result");
    }
    rec.created_at = get_timestamptz(r, row, 6);
    rec.lease_until = get_timestamptz(r, row, 7);
    rec.expires_at = get_timestamptz(r, row, 8);
    if (!is_null(r, row, 9)) rec.phase = std::string(get_bytes(r, row, 9));
    if (!is_null(r, row, 10)) rec.phase_data = std::string(get_bytes(r, row, 10));
    rec.lease_expired = get_bool(r, row, 11);
    rec.expired = get_bool(r, row, 12);
    return rec;
}


}  // namespace idem::pg
