#include "sql.hpp"

#include <fmt/format.h>

#include <cctype>
#include <cstdint>
#include <string_view>

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

std::string generation_expression(std::chrono::milliseconds length, const std::string& at) {
    // Epoch milliseconds of the generation's start: readable, and independent of the length, so
    // a change of length never maps a time to an existing generation of another length.
    return fmt::format("(floor(extract(epoch FROM {}) * 1000 / {}) * {})::bigint", at, length.count(), length.count());
}

std::string claimable_function(const TableName& t) {
    return (t.schema.empty() ? "" : quote(t.schema) + ".") + quote(t.table + "_claimable");
}

std::string closed_function(const TableName& t) {
    return (t.schema.empty() ? "" : quote(t.schema) + ".") + quote(t.table + "_closed");
}

std::vector<StatementDef> statements(const TableName& t, Generation generation) {
    using namespace oid;
    const std::string& T = t.qualified;
    // Every column of a record, then the lease/expiry verdict and the read time by the database's
    // clock (one clock for every instance; the replay cache measures retention left from read_at).
    // parse_record reads them in this order.
    const std::string columns =
        "state, fingerprint, fingerprint_alg, fence, attempt, result, created_at, lease_until, expires_at, "
        "phase, phase_data";
    const std::string record = columns +
                               ", (state = 'in_progress' AND lease_until < now()), "
                               "(state = 'completed' AND expires_at < now()), now()";
    // The same columns as a RETURNING list. Citus refuses any non-IMMUTABLE function there (now()
    // included, 0A000), so the verdicts are constants — true of every row the statement can return —
    // and the read time is lease_until, which the caller corrects (see kTakeOver).
    const std::string record_returned = columns + ", false, false, lease_until";
    const std::string owned = "scope = $1 AND key = $2 AND fence = $3 AND state = 'in_progress'";
    std::vector<StatementDef> defs(kStmtCount);
    // The claim: the database arbitrates with the primary key. DO NOTHING writes no WAL and takes
    // no row lock on conflict (DO UPDATE ... WHERE would lock the row on every replay).
    //
    // With generations the primary key is (scope, key, generation), so it arbitrates within one
    // generation only. Each claimed row first passes the claimable function: it takes the key's
    // lock (held to the end of the transaction) and only then looks the key up in every
    // generation, in a statement of its own — a snapshot taken after the lock, which sees any
    // claim of the key that held the lock before (docs/design.md, "Generations").
    const std::string conflict = generation ? "ON CONFLICT DO NOTHING" : "ON CONFLICT (scope, key) DO NOTHING";
    const std::string claimable = generation ? claimable_function(t) : std::string();
    // The lease counts from when the row is made (clock_timestamp), not from the transaction's
    // start: a row made after a wait on a key's lock (the claimable function, or an earlier row of
    // a batch) gets its whole lease.
    const std::string claim_values =
        "$1, $2, 'in_progress', $3, $4, $5, clock_timestamp() + $6 * interval '1 millisecond', "
        "now() + $7 * interval '1 second'";
    defs[kClaimInsert] = {
        "idem_claim",
        generation ? fmt::format("INSERT INTO {} (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, "
                                 "expires_at) SELECT {} WHERE {}($1, $2) {} RETURNING fence",
                                 T, claim_values, claimable, conflict)
                   : fmt::format("INSERT INTO {} (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, "
                                 "expires_at) VALUES ({}) {} RETURNING fence",
                                 T, claim_values, conflict),
        {text, text, bytea, int2, int8, int8, int8}};
    // The rows of a batch or group pass the function one by one, in the client's key order: one
    // order of lock acquisition for every batch.
    const std::string claimable_rows = generation ? fmt::format("WHERE {}(u.s, u.k) ", claimable) : std::string();
    // Read by primary key; also sent right after the claim (same Sync) as a statement of its own,
    // so it takes a new snapshot and sees the row that made the claim conflict.
    // With generations a key has at most one row (a re-claim moves it): newest generation first,
    // stopping at the key, as the claimable function looks.
    defs[kSelect] = {"idem_select",
                     fmt::format("SELECT {} FROM {} WHERE scope = $1 AND key = $2{}", record, T,
                                 generation ? " ORDER BY generation DESC LIMIT 1" : ""),
                     {text, text}};
    // Batches: one statement for many keys (arrays in, rows out), so a batch costs two statements
    // however large it is. The client sorts the arrays by key: concurrent batches lock in one order.
    defs[kClaimBatchInsert] = {
        "idem_claim_batch",
        fmt::format("INSERT INTO {} (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, "
                    "expires_at) SELECT u.s, u.k, 'in_progress', u.f, u.a, u.fe, "
                    "clock_timestamp() + $6 * interval '1 millisecond', now() + $7 * interval '1 second' "
                    "FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int2[], $5::int8[]) AS u(s, k, f, a, fe) "
                    "{}{} RETURNING fence",
                    T, claimable_rows, conflict),
        {text_array, text_array, bytea_array, int2_array, int8_array, int8, int8}};
    // Group commit: the claims of concurrent claim() callers, each row with its own lease and
    // retention (callers may differ), in one statement and one commit.
    defs[kClaimGroupInsert] = {
        "idem_claim_group",
        fmt::format("INSERT INTO {} (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, "
                    "expires_at) SELECT u.s, u.k, 'in_progress', u.f, u.a, u.fe, "
                    "clock_timestamp() + u.l * interval '1 millisecond', now() + u.r * interval '1 second' "
                    "FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int2[], $5::int8[], $6::int8[], "
                    "$7::int8[]) AS u(s, k, f, a, fe, l, r) "
                    "{}{} RETURNING fence",
                    T, claimable_rows, conflict),
        {text_array, text_array, bytea_array, int2_array, int8_array, int8_array, int8_array}};
    // The JOIN probes every generation for each key. A per-key LIMIT (a correlated LATERAL) would
    // stop earlier, but Citus refuses it, and this shape must run everywhere: it is what a batch
    // falls back to when the table's layout is not known.
    defs[kSelectBatch] = {"idem_select_batch",
                          fmt::format("SELECT {}, t.scope, t.key FROM unnest($1::text[], $2::text[]) AS u(s, k) "
                                      "JOIN {} AS t ON t.scope = u.s AND t.key = u.k",
                                      record, T),
                          {text_array, text_array}};
    defs[kSaveBatch] = {"idem_save_batch",
                        fmt::format("UPDATE {} AS t SET state = 'completed', result = u.r, completed_at = now() "
                                    "FROM unnest($1::text[], $2::text[], $3::int8[], $4::bytea[]) AS u(s, k, f, r) "
                                    "WHERE t.scope = u.s AND t.key = u.k AND t.fence = u.f AND t.state = 'in_progress' "
                                    "RETURNING t.fence, t.waiters",
                                    T),
                        {text_array, text_array, int8_array, bytea_array}};
    // Batches and groups on a Citus-distributed table (docs/scale-out.md): statements that each stay
    // on one shard. The claims go as one-row idem_claim statements; the reads one per scope (with
    // `scope = $1`, a table distributed by scope routes it to one shard, and one distributed by key
    // prunes it to the shards of the keys); the saves one per scope (by scope) or one per row (by key).
    defs[kSelectScopeKeys] = {
        "idem_select_scope_keys",
        fmt::format("SELECT {}, scope, key FROM {} WHERE scope = $1 AND key = ANY($2::text[])", record, T),
        {text, text_array}};
    defs[kSaveScoped] = {"idem_save_scoped",
                         fmt::format("UPDATE {} AS t SET state = 'completed', result = u.r, completed_at = now() "
                                     "FROM unnest($2::text[], $3::int8[], $4::bytea[]) AS u(k, f, r) "
                                     "WHERE t.scope = $1 AND t.key = u.k AND t.fence = u.f AND t.state = 'in_progress' "
                                     "RETURNING t.fence, t.waiters",
                                     T),
                         {text, text_array, int8_array, bytea_array}};
    defs[kSaveReturningFence] = {"idem_save_returning_fence",
                                 fmt::format("UPDATE {} SET state = 'completed', result = $4, completed_at = now() "
                                             "WHERE {} RETURNING fence, waiters",
                                             T, owned),
                                 {text, text, int8, bytea}};
    // How the table is laid out. Unnamed (parsed when run): pg_dist_partition exists only with Citus.
    defs[kCitusInstalled] = {"", "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_extension WHERE extname = 'citus')", {}};
    defs[kDistributionColumn] = {"", kDistributionColumnSql, {text}};
    // Only the fence holder of an in-progress key completes it. `waiters`: someone LISTENs for it.
    defs[kSave] = {"idem_save",
                   fmt::format("UPDATE {} SET state = 'completed', result = $4, completed_at = now() "
                               "WHERE {} RETURNING waiters",
                               T, owned),
                   {text, text, int8, bytea}};
    defs[kRelease] = {
        "idem_release", fmt::format("DELETE FROM {} WHERE {} RETURNING fence", T, owned), {text, text, int8}};
    // Retention: a completed record past expires_at is claimed again by a conditional UPDATE; the
    // row lock and the re-check of the WHERE clause let exactly one of concurrent claimers win.
    // With generations the row moves to the current generation (generation = DEFAULT), so that an
    // old generation only ever loses rows; a concurrent re-claimer then gets 40001 (the row moved
    // to another partition) and tries again.
    defs[kReclaimExpired] = {
        "idem_reclaim_expired",
        fmt::format("UPDATE {} SET {}state = 'in_progress', fingerprint = $3, fingerprint_alg = $4, fence = $5, "
                    "attempt = 1, result = NULL, phase = NULL, phase_data = NULL, waiters = false, "
                    "created_at = now(), completed_at = NULL, lease_until = now() + $6 * interval '1 millisecond', "
                    "expires_at = now() + $7 * interval '1 second' "
                    "WHERE scope = $1 AND key = $2 AND state = 'completed' AND expires_at < now() RETURNING fence",
                    T, generation ? "generation = DEFAULT, " : ""),
        {text, text, bytea, int2, int8, int8, int8}};
    // A stale claim (lease passed, fence unchanged) gets a new fence: one taker wins. A returned row
    // is in progress with a lease that starts now (so neither verdict holds), and its read time is
    // lease_until - $5 (the caller subtracts: the RETURNING list must stay free of functions).
    defs[kTakeOver] = {"idem_take_over",
                       fmt::format("UPDATE {} SET fence = $4, lease_until = now() + $5 * interval '1 millisecond', "
                                   "attempt = attempt + $6 WHERE {} AND lease_until < now() RETURNING {}",
                                   T, owned, record_returned),
                       {text, text, int8, int8, int8, int4}};
    defs[kExtendLease] = {"idem_extend_lease",
                          fmt::format("UPDATE {} SET lease_until = now() + $4 * interval '1 millisecond' "
                                      "WHERE {} RETURNING fence",
                                      T, owned),
                          {text, text, int8, int8}};
    defs[kRecordPhase] = {"idem_record_phase",
                          fmt::format("UPDATE {} SET phase = $4, phase_data = $5 WHERE {} RETURNING fence", T, owned),
                          {text, text, int8, text, bytea}};
    defs[kMarkWaiter] = {"idem_mark_waiter",
                         fmt::format("UPDATE {} SET waiters = true WHERE scope = $1 AND key = $2 "
                                     "AND state = 'in_progress' RETURNING fence",
                                     T),
                         {text, text}};
    // Sent from the saver's own connection (a trigger's NOTIFY would fire on a Citus worker).
    defs[kNotify] = {"idem_notify", fmt::format("SELECT pg_notify('{}', $1)", kChannel), {text}};
    defs[kListen] = {"", fmt::format("LISTEN {}", kChannel), {}};
    defs[kUnlisten] = {"", fmt::format("UNLISTEN {}", kChannel), {}};
    // ClaimOptions::wait reads the key again (a poll): a row while the attempt waited for (fence $3)
    // is still running, and whether its lease has passed. A plain primary-key SELECT: routed to one
    // shard on Citus, and correct through any pooler (LISTEN is not, see kOwnSession).
    defs[kWaitPoll] = {"idem_wait_poll",
                       fmt::format("SELECT lease_until < now() FROM {} WHERE scope = $1 AND key = $2 "
                                   "AND state = 'in_progress' AND fence = $3",
                                   T),
                       {text, text, int8}};
    // Is this connection a session of its own? $1 is the backend pid libpq was told at connect
    // (BackendKeyData). A pooler (PgBouncer, in any pool mode) makes that key up, so the server's
    // pid differs: LISTEN would then run on a server connection that is not ours to keep.
    defs[kOwnSession] = {"", "SELECT pg_backend_pid() = $1", {int4}};
    // One statement per kind of ScopeFilter rather than one with a mode parameter: only a plain
    // `scope = $2` conjunct lets Citus route the exact form to one shard (and use the primary key).
    // starts_with() compares literally: no LIKE pattern, so nothing in a prefix acts as a wildcard.
    const auto list_stale = [&](std::string_view scope_condition) {
        return fmt::format(
            "SELECT {}, scope, key FROM {} WHERE state = 'in_progress' AND lease_until < now(){} "
            "ORDER BY lease_until LIMIT $1",
            record, T, scope_condition);
    };
    defs[kListStale] = {"idem_list_stale", list_stale(""), {int8}};
    defs[kListStaleInScope] = {"idem_list_stale_in_scope", list_stale(" AND scope = $2"), {int8, text}};
    defs[kListStaleScopePrefix] = {
        "idem_list_stale_scope_prefix", list_stale(" AND starts_with(scope, $2)"), {int8, text}};
    // The same rows counted (count_stale, once a sweep): not prepared on every connection.
    const auto count_stale = [&](std::string_view scope_condition) {
        return fmt::format("SELECT count(*) FROM {} WHERE state = 'in_progress' AND lease_until < now(){}", T,
                           scope_condition);
    };
    defs[kCountStale] = {"", count_stale(""), {}};
    defs[kCountStaleInScope] = {"", count_stale(" AND scope = $1"), {text}};
    defs[kCountStaleScopePrefix] = {"", count_stale(" AND starts_with(scope, $1)"), {text}};
    // One bounded batch; SKIP LOCKED: never waits on a row someone else holds.
    defs[kPurge] = {"idem_purge",
                    fmt::format("WITH victims AS (SELECT scope, key FROM {0} WHERE state = 'completed' "
                                "AND expires_at < now() ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED) "
                                "DELETE FROM {0} AS t USING victims WHERE t.scope = victims.scope "
                                "AND t.key = victims.key",
                                T),
                    {int8}};
    // The same batch on a Citus-distributed table, where FOR UPDATE/SHARE is refused on a statement
    // not routed to one shard (0A000). The DELETE re-checks both conditions on the row it locks, so
    // a key re-claimed since the inner SELECT read it is left alone; it may wait (lock_timeout) on a
    // row being re-claimed instead of skipping it.
    defs[kPurgeDistributed] = {"idem_purge_distributed",
                               fmt::format("DELETE FROM {0} WHERE (scope, key) IN (SELECT scope, key FROM {0} "
                                           "WHERE state = 'completed' AND expires_at < now() "
                                           "ORDER BY expires_at LIMIT $1) "
                                           "AND state = 'completed' AND expires_at < now()",
                                           T),
                               {int8}};
    defs[kBegin] = {"", kBeginSql, {}};
    defs[kCommit] = {"", kCommitSql, {}};
    defs[kRollback] = {"", kRollbackSql, {}};
    // idem's sessions run with enable_seqscan=off (connection.cpp says why). Statements that are
    // meant to scan (list_stale) and the user's statements in in-transaction mode turn it back on,
    // for the session (then back to the connection's default) or for the transaction.
    defs[kSeqscanOn] = {"", "SET enable_seqscan = on", {}};
    defs[kSeqscanDefault] = {"", "SET enable_seqscan TO DEFAULT", {}};
    defs[kSeqscanLocalOn] = {"", "SET LOCAL enable_seqscan = on", {}};
    defs[kSeqscanLocalDefault] = {"", "SET LOCAL enable_seqscan TO DEFAULT", {}};
    // In-transaction mode's TransactionOptions::lock_wait: the claim's INSERT alone runs under
    // lock_timeout $1 (e.g. '250ms'), local to the transaction, then under the session's again.
    defs[kLockTimeoutLocal] = {"", "SELECT set_config('lock_timeout', $1, true)", {text}};
    defs[kLockTimeoutLocalDefault] = {"", "SET LOCAL lock_timeout TO DEFAULT", {}};
    defs[kPing] = {"idem_ping", "SELECT 1", {}};
    // Names unique per table: two stores of different tables behind one pooler never run each
    // other's statements. FNV-1a of the qualified name, 8 hex digits.
    std::uint32_t h = 2166136261u;
    for (unsigned char c : T) h = (h ^ c) * 16777619u;
    const std::string suffix = fmt::format("_{:08x}", h);
    for (auto& def : defs) {
        if (!def.name.empty()) def.name += suffix;
    }
    return defs;
}

static std::int32_t lock_class(const TableName& t) noexcept {
    std::uint32_t h = 2166136261u;
    for (unsigned char c : t.qualified) h = (h ^ c) * 16777619u;
    return static_cast<std::int32_t>(h);
}

std::vector<std::string> schema_statements(const TableName& t, Generation generation) {
    // One statement per string: Citus refuses a multi-statement string once it must propagate DDL
    // (42601, "cannot insert multiple commands into a prepared statement"). No ';' in comments
    // either: tests/unit/sql_test.cpp checks each string is a single statement (function bodies
    // are dollar-quoted).
    const auto literal = t.schema.empty() ? t.table : t.schema + "." + t.table;
    std::vector<std::string> out;
    out.push_back(fmt::format(R"(CREATE TABLE IF NOT EXISTS {} (
    table_name  text PRIMARY KEY,
    version     integer NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
))",
                              t.version_table));
    if (generation) {
        // Before the table: on Citus, a function's DDL cannot follow DDL on a distributed table in
        // one transaction. The claim's gate (see statements()). The lock is the key's within this table: the
        // two-int form, the table's hash as its class, so no other table's or application's
        // advisory locks share it. plpgsql, VOLATILE: each statement gets a fresh snapshot under
        // READ COMMITTED, so the lookup runs after the lock is granted and its plan is cached.
        // Under a stricter isolation (a server's default_transaction_isolation) the lookup would
        // see the transaction's older snapshot: refused. The lookup probes the generations newest
        // first and stops at the key (an ordered Append under LIMIT 1): a retry of a recent key
        // reads one generation's index, not every one; a new key still reads them all.
        out.push_back(fmt::format(R"(CREATE OR REPLACE FUNCTION {0}(claim_scope text, claim_key text)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'idem: generations need READ COMMITTED claims, not %',
            current_setting('transaction_isolation') USING ERRCODE = '0A000';
    END IF;
    PERFORM pg_advisory_xact_lock({1}, hashtext(claim_scope || chr(31) || claim_key));
    PERFORM FROM {2} WHERE scope = claim_scope AND key = claim_key ORDER BY generation DESC LIMIT 1;
    RETURN NOT FOUND;
END
$fn$)",
                                  claimable_function(t), lock_class(t), t.qualified));
        // A retired generation refuses new rows before it is checked and dropped (generations.cpp):
        // a claim that computed it before it ended fails with 40001 and tries again in the
        // current one.
        out.push_back(fmt::format(R"(CREATE OR REPLACE FUNCTION {}()
RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    RAISE EXCEPTION 'idem: generation % of % is closed', NEW.generation, TG_TABLE_NAME USING ERRCODE = '40001';
END
$fn$)",
                                  closed_function(t)));
    }
    out.push_back(fmt::format(R"(CREATE TABLE IF NOT EXISTS {} (
    scope            text COLLATE "C" NOT NULL,   -- tenant/account/endpoint, part of the key
    key              text COLLATE "C" NOT NULL,   -- the client's Idempotency-Key, verbatim
    state            text NOT NULL {}CHECK (state IN ('in_progress', 'completed')),
    fingerprint      bytea NOT NULL,              -- digest of the request
    fingerprint_alg  smallint NOT NULL,           -- 1 = SHA-256, 2 = HMAC-SHA256 (fingerprint_secret)
    fence            bigint NOT NULL,             -- random token of the current claim
    attempt          integer NOT NULL DEFAULT 1,
    result           bytea,                       -- the stored response, byte for byte
    phase            text,                        -- last recovery point recorded by the effect
    phase_data       bytea,                       -- and its data (e.g. the provider's charge id)
    waiters          boolean NOT NULL DEFAULT false,  -- a caller LISTENs for this key's save
    created_at       timestamptz NOT NULL DEFAULT now(),
    lease_until      timestamptz NOT NULL,        -- the claimer owns the key until then
    completed_at     timestamptz,
    expires_at       timestamptz NOT NULL,        -- retention: created_at + retention{}
    {}CHECK ((state = 'completed') = (result IS NOT NULL))
){})",
                              t.qualified,
                              // A generational table names its checks as PostgreSQL names a plain
                              // table's, so a plain table renamed to its first generation (the
                              // migration in docs/design.md) carries the names ATTACH expects.
                              generation ? fmt::format("CONSTRAINT {} ", quote(t.table + "_state_check")) : "",
                              generation ? fmt::format(R"(
    generation       bigint NOT NULL DEFAULT {},  -- epoch ms of the generation's start
    PRIMARY KEY (scope, key, generation),)",
                                                       generation_expression(*generation))
                                         : R"(
    PRIMARY KEY (scope, key),)",
                              generation ? fmt::format("CONSTRAINT {} ", quote(t.table + "_check")) : "",
                              generation ? " PARTITION BY LIST (generation)" : " WITH (fillfactor = 90)"));
    // For purging expired keys. No index on state, lease_until or phase: the completing UPDATE, the
    // heartbeat and recovery points stay HOT updates (no index entry written).
    out.push_back(fmt::format("CREATE INDEX IF NOT EXISTS {} ON {} (expires_at)", t.index, t.qualified));
    out.push_back(fmt::format(R"(INSERT INTO {0} (table_name, version) VALUES ('{1}', {2})
    ON CONFLICT (table_name) DO UPDATE SET version = EXCLUDED.version, applied_at = now()
    WHERE {0}.version < EXCLUDED.version)",
                              t.version_table, literal, kSchemaVersion));
    return out;
}

std::string schema_sql(const TableName& t) {
    std::string sql = fmt::format(
        "-- idem schema version {}: what PostgresStore::ensure_schema() runs, in one transaction, one\n"
        "-- statement at a time. Citus: PostgresStore::distribute() (docs/scale-out.md), or by hand\n"
        "-- SELECT create_distributed_table('{}', 'scope').\n",
        kSchemaVersion, t.schema.empty() ? t.table : t.schema + "." + t.table);
    const auto statements = schema_statements(t);
    for (std::size_t i = 0; i < statements.size(); ++i) {
        if (i == 2) {
            sql +=
                "-- For purging expired keys. No index on state, lease_until or phase: the completing UPDATE, the\n"
                "-- heartbeat and recovery points stay HOT updates (no index entry written).\n";
        }
        sql += statements[i] + ";\n";
    }
    return sql;
}

}  // namespace idem::pg
