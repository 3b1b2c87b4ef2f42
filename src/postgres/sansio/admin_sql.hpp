// The SQL of administration and maintenance (internal): ensure_schema(), distribute(), inspect(),
// the upkeep of generations (../generations.cpp) and idemctl's own reads. sql.hpp has the claim
// path's statements and the schema's DDL. Values are text parameters ($1 …); identifiers come from
// a TableName (validated and quoted). The few values written into a text (numbers, a setting's
// name) are the code's own: SET, COMMENT and DDL take no parameters.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "sql.hpp"

namespace idem::pg {

// --- lock waits and advisory locks ---------------------------------------------------------

/// Lifts lock_timeout for the rest of the transaction: its lock waits last as long as they take.
inline constexpr const char* kNoLocalLockTimeoutSql = "SET LOCAL lock_timeout = 0";
/// Bounds each lock wait of the session to `wait` (at least 1 ms: 0 would lift the bound).
std::string lock_timeout_sql(std::chrono::milliseconds wait);
/// Bounds each lock wait to `wait` (at least 1 ms) for the rest of the transaction.
std::string local_lock_timeout_sql(std::chrono::milliseconds wait);

/// ensure_schema()'s lock: takes the transaction's advisory lock hashtext($1) if it is free ('t').
inline constexpr const char* kTrySchemaLockSql = "SELECT pg_try_advisory_xact_lock(hashtext($1))";
/// Takes the transaction's advisory lock hashtextextended($1, 0) if it is free ('t').
inline constexpr const char* kTryXactLockSql = "SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))";
/// Takes the session's advisory lock hashtextextended($1, 0) if it is free ('t').
inline constexpr const char* kTrySessionLockSql = "SELECT pg_try_advisory_lock(hashtextextended($1, 0))";
/// Releases the session's advisory lock hashtextextended($1, 0) (kTrySessionLockSql's).
inline constexpr const char* kSessionUnlockSql = "SELECT pg_advisory_unlock(hashtextextended($1, 0))";

// --- the catalog -------------------------------------------------------------------------------

/// The relkind of relation $1 (a quoted, qualified name) as text ('r' plain, 'p' partitioned);
/// no row when there is no such relation.
inline constexpr const char* kRelkindSql =
    "SELECT relkind::text FROM pg_catalog.pg_class WHERE oid = pg_catalog.to_regclass($1)";
/// Relation $1 (a quoted, qualified name) as a regclass; NULL when there is no such relation.
inline constexpr const char* kRegclassSql = "SELECT pg_catalog.to_regclass($1)";
/// The session's role.
inline constexpr const char* kCurrentUserSql = "SELECT current_user";
/// The database's clock, in epoch milliseconds.
inline constexpr const char* kNowMillisSql = "SELECT (extract(epoch FROM now()) * 1000)::bigint";

/// Creates the table's schema unless it exists (`t` names one).
std::string create_schema_sql(const TableName& t);
/// The schema version recorded for the table named $1 (unquoted, schema.table or table).
std::string schema_version_sql(const TableName& t);

// --- Citus -------------------------------------------------------------------------------------

/// The citus extension's version; no row without the extension.
inline constexpr const char* kCitusVersionSql =
    "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'citus'";
/// On a Citus node: whether it is a worker ('t': its group is not the coordinator's, 0).
inline constexpr const char* kCitusWorkerSql = "SELECT groupid <> 0 FROM pg_catalog.pg_dist_local_group";
/// Whether Citus's catalog exists in this database ('t').
inline constexpr const char* kCitusCatalogSql =
    "SELECT pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL";
/// A row when relation $1 (a quoted, qualified name) is a Citus table of any kind.
inline constexpr const char* kCitusTableSql =
    "SELECT 1 FROM pg_catalog.pg_dist_partition WHERE logicalrelid = pg_catalog.to_regclass($1)";
/// Distributes table $1 (a quoted, qualified name) by column $2 (scope or key).
inline constexpr const char* kDistributeSql = "SELECT pg_catalog.create_distributed_table($1::regclass, $2)";
/// Removes the rows that distributing table $1 (a quoted, qualified name) copied into the shards
/// from the coordinator's own table.
inline constexpr const char* kTruncateLocalDataSql =
    "SELECT pg_catalog.truncate_local_data_after_distributing_table($1::regclass)";
/// Runs the statement $1 on every worker: one row each, its node name, port, success ('t') and
/// the statement's answer or error.
inline constexpr const char* kOnWorkersSql =
    "SELECT nodename, nodeport, success, result FROM pg_catalog.run_command_on_workers($1)";
/// The setting `name` of the session it runs in (a setting's name from idem's code, written into
/// the text: kOnWorkersSql runs it as its $1).
std::string setting_sql(std::string_view name);
/// The statement an operator runs to give `role` the setting `name` = `value` (inspect()'s advice:
/// shown, never sent).
std::string role_setting_sql(std::string_view role, std::string_view name, std::string_view value);

// --- generations -------------------------------------------------------------------------------

/// The generation column's comment: this, then the length (ms) the table's generations have.
inline constexpr std::string_view kGenerationLengthNote = "idem generation length (ms): ";
/// The comment of a generation made ahead but not attached yet, so that one left behind is
/// recognised as idem's.
inline constexpr std::string_view kMadeAheadNote = "idem: a generation made ahead, attached when it is due";

/// The unquoted name of a generation's table without its start: "<table>_g".
std::string generation_prefix(const TableName& t);
/// The unquoted name of the generation that starts at `start` (epoch ms): "<table>_g<start>", in
/// the table's schema (at most 48 + 15 bytes).
std::string generation_name(const TableName& t, std::int64_t start);
/// The generation table `name` (unquoted, generation_name's form), quoted and qualified like the table.
std::string generation_table(const TableName& t, std::string_view name);

/// The table's partitions (parent $1, a quoted, qualified name): relname, and whether a detach of
/// it is pending ('t'), a row each.
inline constexpr const char* kPartitionsSql =
    "SELECT c.relname, i.inhdetachpending FROM pg_catalog.pg_inherits i "
    "JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = pg_catalog.to_regclass($1)";
/// The comment on the generation column of table $1 (a quoted, qualified name); NULL without one.
inline constexpr const char* kGenerationNoteSql =
    "SELECT pg_catalog.col_description(a.attrelid, a.attnum) FROM pg_catalog.pg_attribute a "
    "WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attname = 'generation'";
/// Makes `length` the table's generation length: the generation column's DEFAULT.
std::string generation_default_sql(const TableName& t, std::chrono::milliseconds length);
/// Records `length` in the generation column's comment (kGenerationLengthNote).
std::string record_generation_length_sql(const TableName& t, std::chrono::milliseconds length);
/// The starts (epoch ms, ascending, each once) of the current generation and of the next `ahead`.
std::string upcoming_generations_sql(std::chrono::milliseconds length, std::size_t ahead);
/// Creates the table of the generation that starts at `start` unless it exists: the table's
/// columns, defaults, checks and indexes, not attached.
std::string create_generation_sql(const TableName& t, std::int64_t start);
/// Marks the generation that starts at `start` as made ahead (kMadeAheadNote).
std::string mark_made_ahead_sql(const TableName& t, std::int64_t start);
/// Takes the table's SHARE lock to the end of the transaction: every write waits, reads do not.
std::string lock_out_writes_sql(const TableName& t);
/// Attaches the generation that starts at `start` as the table's partition for that value.
std::string attach_generation_sql(const TableName& t, std::int64_t start);
/// Whether generation `name` holds a key not expired yet ('t'; NULL when it is empty).
std::string generation_unexpired_sql(const TableName& t, std::string_view name);
/// Whether generation table $1 (a quoted, qualified name) is closed: it has the idem_closed trigger.
inline constexpr const char* kGenerationClosedSql =
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger WHERE tgrelid = pg_catalog.to_regclass($1) "
    "AND tgname = 'idem_closed')";
/// Lets Citus create triggers on a distributed table's shards for the rest of the transaction (a
/// mere placeholder setting on plain PostgreSQL).
inline constexpr const char* kAllowCitusTriggersSql = "SET LOCAL citus.enable_unsafe_triggers = on";
/// Closes generation `name`: every INSERT into it fails (closed_function(), 40001).
std::string close_generation_sql(const TableName& t, std::string_view name);
/// Refuses an UPDATE of generation `name` that revives a completed row in place (a re-claim that
/// computed this generation before it ended); moving a row out, and every update of a key in
/// progress, still pass.
std::string close_generation_updates_sql(const TableName& t, std::string_view name);
/// Generation `name`'s keys: how many, how many are in progress, whether one has not expired ('t').
std::string generation_keys_sql(const TableName& t, std::string_view name);
/// Tables a maintenance left behind in schema $1 ('': the current one), by relname: tables named
/// $2 (generation_prefix()) then digits, not partitions, that either carry the idem_closed trigger,
/// or carry comment $3 (kMadeAheadNote) and started at least $4 (the length, ms) ago.
inline constexpr const char* kLeftoverGenerationsSql =
    "SELECT c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = coalesce(nullif($1, ''), current_schema()) AND c.relkind = 'r' AND NOT c.relispartition "
    "AND starts_with(c.relname, $2) AND substr(c.relname, length($2) + 1) ~ '^[0-9]+$' "
    "AND (EXISTS (SELECT 1 FROM pg_catalog.pg_trigger g WHERE g.tgrelid = c.oid AND g.tgname = 'idem_closed') "
    "OR (pg_catalog.obj_description(c.oid, 'pg_class') = $3 "
    "AND substr(c.relname, length($2) + 1)::numeric + $4 <= extract(epoch FROM now()) * 1000))";
/// How a generation is detached.
enum class Detach {
    plain,         ///< at once, under the table's ACCESS EXCLUSIVE lock
    concurrently,  ///< CONCURRENTLY: waits for the transactions that may still see it
    finalize,      ///< FINALIZE: ends a CONCURRENTLY detach left pending
};
/// Detaches generation `name` from the table.
std::string detach_generation_sql(const TableName& t, std::string_view name, Detach how);
/// Drops generation table `name` unless it is gone.
std::string drop_generation_sql(const TableName& t, std::string_view name);

// --- idemctl's reads ---------------------------------------------------------------------------

/// idemctl list: the table's keys, oldest first, at most $6 rows. Filters, each NULL for none:
/// $1 scope, $2 scope prefix, $3 state (in_progress, completed, or expired), $4 stale keys only
/// (bool), $5 created more than $5 seconds ago. Columns: scope, key, state, attempt, fence, phase,
/// created_at, lease_until and expires_at (epoch µs), the result's size, stale, expired, now (µs).
std::string list_keys_sql(const TableName& t);
/// idemctl stats: the keys in progress, those of them stale, the completed, those of them expired,
/// and now (epoch µs).
std::string key_counts_sql(const TableName& t);
/// idemctl stats: the oldest key in progress, if any: scope, key, created_at (epoch µs).
std::string oldest_in_progress_sql(const TableName& t);
/// idemctl stats: the sizes (bytes) of table $1 (a quoted, qualified name): its data, its indexes,
/// both.
inline constexpr const char* kTableSizesSql =
    "SELECT pg_table_size(c), pg_indexes_size(c), pg_total_relation_size(c) "
    "FROM (SELECT to_regclass($1) AS c) AS t";

}  // namespace idem::pg
