// Decoding a stored row into a Record (internal; also the target of the row-decoding fuzzer).
#pragma once

#include "idem/store.hpp"
#include "result.hpp"

namespace idem::pg {

/// Reads the kRecordColumns record columns (binary format) of `row`. Throws corrupt_record on an
/// unknown state, a wrong fingerprint length or algorithm, a NULL or mis-sized fixed-width column,
/// or a completed record without a result.
Record parse_record(const PGresult* r, int row);
/// The same, into `out` (every field is assigned): the claim decodes straight into the Claim it
/// returns. On corrupt_record, `out` is left partly assigned.
void parse_record(const PGresult* r, int row, Record& out);

}  // namespace idem::pg
