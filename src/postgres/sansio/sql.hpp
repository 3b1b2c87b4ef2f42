// The SQL of the claim path's statements and of the schema (internal); admin_sql.hpp has the SQL of
// administration and maintenance. docs/schema.sql is schema_sql("idem_keys"), checked by a test.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "columns.hpp"
#include "params.hpp"
#include "result.hpp"
#include "sqlstate.hpp"

namespace idem::pg {

/// A validated, quoted table name and the names derived from it.
struct TableName {
    std::string schema;         ///< unquoted; empty when not qualified
    std::string table;          ///< unquoted
    std::string qualified;      ///< quoted, e.g. "billing"."idem_keys"
    std::string version_table;  ///< quoted idem_schema_version in the same schema
    std::string index;          ///< quoted expiry index name (unqualified)

    /// Throws config_error unless `name` is `table` or `schema.table` of plain identifiers.
    static TableName parse(const std::string& name);
};

constexpr int kSchemaVersion = 1;

enum Stmt : std::size_t {
    kClaimInsert,
    kSelect,
    kClaimBatchInsert,
    kClaimGroupInsert,
    kSelectBatch,
    kSaveBatch,
    kSelectScopeKeys,
    kSaveScoped,
    kSaveReturningFence,
    kCitusInstalled,
    kDistributionColumn,
    kSave,
    kRelease,
    kReclaimExpired,
    kTakeOver,
    kExtendLease,
    kRecordPhase,
    kMarkWaiter,
    kNotify,
    kListen,
    kUnlisten,
    kWaitPoll,
    kOwnSession,
    kListStale,
    kListStaleInScope,
    kListStaleScopePrefix,
    kCountStale,
    kCountStaleInScope,
    kCountStaleScopePrefix,
    kPurge,
    kPurgeDistributed,
    kBegin,
    kCommit,
    kRollback,
    kSeqscanOn,
    kSeqscanDefault,
    kSeqscanLocalOn,
    kSeqscanLocalDefault,
    kLockTimeoutLocal,
    kLockTimeoutLocalDefault,
    kPing,
    kStmtCount
};

/// Transaction control, for the claim path's statements (kBegin …) and administration alike.
inline constexpr const char* kBeginSql = "BEGIN";
inline constexpr const char* kCommitSql = "COMMIT";
inline constexpr const char* kRollbackSql = "ROLLBACK";

/// On a Citus node: the distribution column of table $1 (a quoted, qualified name); no row when it
/// is not distributed, or is a reference or single-shard table (whose partkey is NULL).
inline constexpr const char* kDistributionColumnSql =
    "SELECT pg_catalog.column_to_column_name(logicalrelid, partkey) "
    "FROM pg_catalog.pg_dist_partition "
    "WHERE logicalrelid = pg_catalog.to_regclass($1) AND partkey IS NOT NULL";

/// Columns of a record, in this order, in every statement that returns one (see parse_record).
inline constexpr int kRecordColumns = 14;

/// The LISTEN/NOTIFY channel for "a waited-for key was saved"; the payload names table and key.
inline constexpr const char* kChannel = "idem_saved";

/// The table's layout: one plain table (nullopt), or generations of this length
/// (PostgresOptions::generations; generations.hpp maintains them).
using Generation = std::optional<std::chrono::milliseconds>;
template <class Options>
[[nodiscard]] Generation generation_of(const Options& o) {
    return o.generations ? Generation(o.generations->length) : std::nullopt;
}

/// The prepared statements of a store, indexed by Stmt. With generations the claims take their
/// key's lock and look the key up in every generation first (generation_function_sql), and the
/// re-claim of an expired key moves its row into the current generation.
std::vector<StatementDef> statements(const TableName& t, Generation generation = {});

/// The DDL that ensure_schema() runs (idempotent), inside one transaction: one statement per
/// string, no trailing ';'. With generations: the partitioned table and its functions, not the
/// partitions themselves (generations.hpp creates those).
std::vector<std::string> schema_statements(const TableName& t, Generation generation = {});

/// The generation a claim made now goes to: epoch milliseconds of its start, as SQL (the
/// generation column's DEFAULT; generations.cpp computes upcoming ones with it).
std::string generation_expression(std::chrono::milliseconds length, const std::string& at = "now()");
/// The names of a generational table's SQL objects, quoted and qualified like the table.
std::string claimable_function(const TableName& t);
std::string closed_function(const TableName& t);

/// schema_statements() as one SQL script with comments (docs/schema.sql).
std::string schema_sql(const TableName& t);

}  // namespace idem::pg
