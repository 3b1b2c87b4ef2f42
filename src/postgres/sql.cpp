#include "sql.hpp"

#include <fmt/format.h>

#include <cctype>

#include "idem/errors.hpp"

namespace idem::pg {
namespace {

bool plain_identifier(const std::string& s) {
    // Unquoted-style identifiers only, so a name means the same quoted or not, and fits the derived
    // index name in PostgreSQL's 63-byte limit.
    if (s.empty() || s.size() > 48) return false;
    if (!(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
    for (char c : s) {
        if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
    }
    return true;
}

std::string quote(const std::string& id) { return "\"" + id + "\""; }

}  // namespace

TableName TableName::parse(const std::string& name) {
    TableName t;
    const auto dot = name.find('.');
    if (dot == std::string::npos) {
        t.table = name;
    } else {
        t.schema = name.substr(0, dot);
        t.table = name.substr(dot + 1);
    }
    if ((dot != std::string::npos && !plain_identifier(t.schema)) || !plain_identifier(t.table)) {
        throw config_error("idem: invalid table name '" + name +
                           "': use table or schema.table, letters, digits and _ only, at most 48 each");
    }
    const std::string prefix = t.schema.empty() ? "" : quote(t.schema) + ".";
    t.qualified = prefix + quote(t.table);
    t.version_table = prefix + quote("idem_schema_version");
    t.index = quote(t.table + "_expires_at_idx");
    return t;
}

std::vector<StatementDef> statements(const TableName& t) {
    using namespace oid;
    const std::string& T = t.qualified;
    std::vector<StatementDef> defs(kStmtCount);
    // The claim: the database arbitrates with the primary key. DO NOTHING writes no WAL on conflict.
    // Times are computed by the server (one clock for every instance).
    defs[kClaimInsert] = {"idem_claim",
                          fmt::format("INSERT INTO {} (scope, key, state, fingerprint, fingerprint_alg, fence, "
                                      "lease_until, expires_at) VALUES ($1, $2, 'in_progress', $3, $4, $5, "
                                      "now() + $6 * interval '1 millisecond', now() + $7 * interval '1 second') "
                                      "ON CONFLICT (scope, key) DO NOTHING RETURNING fence",
                                      T),
                          {text, text, bytea, int2, int8, int8, int8}};
    // Read by primary key; also sent right after the claim under its own Sync, so it takes a new
    // snapshot and sees the row that made the claim conflict.
    defs[kSelect] = {"idem_select",
                     fmt::format("SELECT state, fingerprint, fingerprint_alg, fence, attempt, result, created_at, "
                                 "lease_until, expires_at FROM {} WHERE scope = $1 AND key = $2",
                                 T),
                     {text, text}};
    // Only the fence holder of an in-progress key completes it.
    defs[kSave] = {"idem_save",
                   fmt::format("UPDATE {} SET state = 'completed', result = $4, completed_at = now() "
                               "WHERE scope = $1 AND key = $2 AND fence = $3 AND state = 'in_progress' "
                               "RETURNING fence",
                               T),
                   {text, text, int8, bytea}};
    defs[kRelease] = {"idem_release",
                      fmt::format("DELETE FROM {} WHERE scope = $1 AND key = $2 AND fence = $3 "
                                  "AND state = 'in_progress' RETURNING fence",
                                  T),
                      {text, text, int8}};
    defs[kListStale] = {"idem_list_stale",
                        fmt::format("SELECT state, fingerprint, fingerprint_alg, fence, attempt, result, "
                                    "created_at, lease_until, expires_at, scope, key FROM {} "
                                    "WHERE state = 'in_progress' AND lease_until < now() "
                                    "ORDER BY lease_until LIMIT $1",
                                    T),
                        {int8}};
    defs[kPing] = {"idem_ping", "SELECT 1", {}};
    return defs;
}

std::string schema_sql(const TableName& t) {
    return fmt::format(
        R"(-- idem schema version {version}: what PostgresStore::ensure_schema() runs, in one transaction.
-- Citus: distribute the table by scope (SELECT create_distributed_table('{table}', 'scope')).
CREATE TABLE IF NOT EXISTS {version_table} (
    table_name  text PRIMARY KEY,
    version     integer NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {qualified} (
    scope            text COLLATE "C" NOT NULL,   -- tenant/account/endpoint; part of the key
    key              text COLLATE "C" NOT NULL,   -- the client's Idempotency-Key, verbatim
    state            text NOT NULL CHECK (state IN ('in_progress', 'completed')),
    fingerprint      bytea NOT NULL,              -- digest of the request
    fingerprint_alg  smallint NOT NULL,           -- 1 = SHA-256
    fence            bigint NOT NULL,             -- random token of the current claim
    attempt          integer NOT NULL DEFAULT 1,
    result           bytea,                       -- the stored response, byte for byte
    created_at       timestamptz NOT NULL DEFAULT now(),
    lease_until      timestamptz NOT NULL,        -- the claimer owns the key until then
    completed_at     timestamptz,
    expires_at       timestamptz NOT NULL,        -- retention: created_at + retention
    PRIMARY KEY (scope, key),
    CHECK ((state = 'completed') = (result IS NOT NULL))
) WITH (fillfactor = 90);
-- For purging expired keys. No index on state: the completing UPDATE stays a HOT update.
CREATE INDEX IF NOT EXISTS {index} ON {qualified} (expires_at);
INSERT INTO {version_table} (table_name, version) VALUES ('{literal}', {version})
    ON CONFLICT (table_name) DO UPDATE SET version = EXCLUDED.version, applied_at = now()
    WHERE {version_table}.version < EXCLUDED.version;
)",
        fmt::arg("version", kSchemaVersion), fmt::arg("table", t.table), fmt::arg("qualified", t.qualified),
        fmt::arg("version_table", t.version_table), fmt::arg("index", t.index),
        fmt::arg("literal", t.schema.empty() ? t.table : t.schema + "." + t.table));
}

}  // namespace idem::pg
