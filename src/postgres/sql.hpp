// Every SQL statement idem runs, in one place (internal). docs/schema.sql is schema_sql("idem_keys"),
// checked by a test.
#pragma once

#include <string>
#include <vector>

#include "connection.hpp"

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
    kPing,
    kStmtCount
};

/// Columns of a record, in this order, in every statement that returns one (see parse_record).
inline constexpr int kRecordColumns = 14;

/// The LISTEN/NOTIFY channel for "a waited-for key was saved"; the payload names table and key.
inline constexpr const char* kChannel = "idem_saved";

/// The prepared statements of a store, indexed by Stmt.
std::vector<StatementDef> statements(const TableName& t);

/// The DDL that ensure_schema() runs (idempotent), inside one transaction: one statement per
/// string, no trailing ';'.
std::vector<std::string> schema_statements(const TableName& t);

/// schema_statements() as one SQL script with comments (docs/schema.sql).
std::string schema_sql(const TableName& t);

}  // namespace idem::pg
