// The generations of a partitioned idem table (PostgresOptions::generations), apart from the
// claims (sql.cpp): creating them ahead of the clock, and retiring the old ones (internal).
//
// Retiring a generation, in this order (docs/design.md, "Generations", has the argument):
//   1. it has ended (the clock is past its span) and its newest expiry has passed (index probe);
//   2. close: a BEFORE INSERT trigger that fails with 40001. Creating it waits for every
//      transaction that wrote into the generation; afterwards no row can enter it;
//   3. check, with a snapshot taken after 2: no key in progress, every expiry passed;
//   4. DETACH PARTITION … CONCURRENTLY, then DROP TABLE.
// A generation that fails 3 stays (closed) and is checked again at the next maintenance. Only
// one process maintains a table at a time (an advisory lock; the others skip).
#pragma once

#include <chrono>
#include <cstddef>

#include "admin_session.hpp"
#include "sansio/sql.hpp"

namespace idem::pg {

/// What one maintenance did.
struct GenerationReport {
    std::size_t created = 0;       ///< generations added ahead
    std::size_t retired = 0;       ///< generations dropped
    std::size_t rows_removed = 0;  ///< keys they held (all expired)
    std::size_t kept = 0;          ///< ended generations still holding a live or in-progress key
};

/// ensure_schema()'s first step, inside its transaction, before any DDL on the table: takes the
/// maintainer's lock to the end of the transaction if it is free (returns whether), so that the
/// two never create the same generation at once (and a maintainer never waits on a lock
/// ensure_schema() holds meanwhile). Never waits: see ensure_schema().
[[nodiscard]] bool try_lock_out_maintenance(AdminSession& db, const TableName& t);

/// ensure_schema()'s part, inside its transaction, after schema_statements(): checks that the
/// table is partitioned (config_error for a plain table), records `length` (changing it when the
/// table had another) and creates the current generation and `ahead` more.
void prepare_generations(AdminSession& db, const TableName& t, std::chrono::milliseconds length, std::size_t ahead);

/// purge_expired()'s: outside any transaction on `db`. Creates the generations ahead and retires
/// the ended ones that hold only expired keys; `lock_wait` bounds each wait for a lock (a
/// generation that cannot be closed in time is tried again next time). Throws config_error when
/// the table is not partitioned or records another length.
GenerationReport maintain_generations(AdminSession& db, const TableName& t, std::chrono::milliseconds length,
                                      std::size_t ahead, std::chrono::milliseconds lock_wait);

}  // namespace idem::pg
