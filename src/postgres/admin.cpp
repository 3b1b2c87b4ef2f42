// PostgresStore's administration: the schema (ensure_schema, schema_sql), a Citus distribution
// (distribute), what is deployed (inspect), stale keys for the Reconciler (list_stale) and the
// purge of expired keys (purge_expired).
#include "idem/postgres_store.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

#include "../retry_policy.hpp"
#include "admin_session.hpp"
#include "generations.hpp"
#include "sansio/admin_sql.hpp"
#include "store_impl.hpp"

namespace idem {

int PostgresStore::schema_version() noexcept { return pg::kSchemaVersion; }

std::string PostgresStore::schema_sql(const std::string& table) { return pg::schema_sql(pg::TableName::parse(table)); }

namespace {

using pg::AdminSession;

std::string table_literal(const pg::TableName& t) { return t.schema.empty() ? t.table : t.schema + "." + t.table; }

}  // namespace

void PostgresStore::ensure_schema() {
    Impl& m = *impl_;
    m.check_process();
    AdminSession db(m.settings, "ensure_schema");
    const std::string literal = table_literal(m.table);
    const pg::Generation generation = pg::generation_of(m.options);
    // Serialises concurrent ensure_schema() calls (several instances starting at once): without it,
    // two CREATE TABLE IF NOT EXISTS can still collide on the catalog's unique index. One lock for
    // every table: stores of different tables share the schema's idem_schema_version table. With
    // generations, also the table's maintenance lock (generations.hpp). Both are tried, never
    // waited for: a transaction waiting for them holds a snapshot, and a maintenance's DETACH …
    // CONCURRENTLY waits for every older snapshot while it holds the maintenance lock — a
    // deadlock. Until both are free, the transaction ends and begins again after a pause.
    for (unsigned attempt = 1;; ++attempt) {
        db.exec(pg::kBeginSql);
        // Waits as long as it takes for the table's locks, whatever lock_timeout the role carries
        // (docs/scale-out.md has operators set one for idem's statements). Before anything that
        // may wait: on Citus, even the question whether this is a worker reads a catalog that a
        // concurrent distribution holds locked.
        db.exec(pg::kNoLocalLockTimeoutSql);
        db.refuse_worker();
        if (db.value(pg::kTrySchemaLockSql, {"idem.ensure_schema"}) == "t" &&
            (!generation || pg::try_lock_out_maintenance(db, m.table))) {
            break;
        }
        db.exec(pg::kRollbackSql);
        std::this_thread::sleep_for(std::chrono::milliseconds(detail::jitter(std::min(200u, 10u * attempt))));
    }
    if (!m.table.schema.empty()) db.exec(pg::create_schema_sql(m.table));
    // One statement at a time (Citus refuses multi-statement strings that carry DDL).
    for (const std::string& statement : pg::schema_statements(m.table, generation)) db.exec(statement);
    if (generation) {
        pg::prepare_generations(db, m.table, *generation, m.options.generations->ahead);
    } else if (db.value(pg::kRelkindSql, {m.table.qualified}) == "p") {
        db.exec(pg::kRollbackSql);
        throw config_error("idem: table " + literal +
                           " is partitioned by generation: set PostgresOptions::generations to use it");
    }
    auto r = db.exec(pg::schema_version_sql(m.table), {literal});
    const int found = PQntuples(r.get()) == 1 ? std::stoi(PQgetvalue(r.get(), 0, 0)) : 0;
    if (found > pg::kSchemaVersion) {
        db.exec(pg::kRollbackSql);
        throw config_error("idem: table " + literal + " has schema version " + std::to_string(found) +
                           ", newer than this idem (" + std::to_string(pg::kSchemaVersion) + ")");
    }
    db.exec(pg::kCommitSql);
}

void PostgresStore::distribute(DistributeBy by) {
    Impl& m = *impl_;
    m.check_process();
    AdminSession db(m.settings, "distribute");
    const auto version = db.citus_version();
    if (!version) {
        throw config_error(
            "idem: distribute: the citus extension is not installed in this database "
            "(CREATE EXTENSION citus on the coordinator)");
    }
    db.refuse_worker();
    const std::string column = by == DistributeBy::scope ? "scope" : "key";
    if (!db.value(pg::kRegclassSql, {m.table.qualified})) {
        throw config_error(
            "idem: distribute: table " + table_literal(m.table) + " does not exist (call ensure_schema() first)",
            "42P01");
    }
    if (const auto current = db.distribution_column(m.table.qualified)) {
        if (*current == column) return;  // already done: idempotent
        throw config_error("idem: distribute: table " + table_literal(m.table) + " is already distributed by " +
                           *current + ", not " + column + " (undistribute_table() first to change it)");
    }
    // create_distributed_table copies existing rows into the shards; concurrent calls serialise on
    // Citus's own lock, and the loser finds the table distributed (checked again below).
    try {
        db.exec(pg::kDistributeSql, {m.table.qualified, column});
        // The rows were copied into the shards; their old copies stay in the coordinator's table
        // (unseen, but on disk) until this.
        db.exec(pg::kTruncateLocalDataSql, {m.table.qualified});
    } catch (const database_error&) {
        if (db.distribution_column(m.table.qualified) != column) throw;
    }
    m.citus.store(true, std::memory_order_relaxed);
    m.known_layout(by == DistributeBy::scope ? pg::Layout::by_scope : pg::Layout::by_key);
}

Deployment PostgresStore::inspect() {
    Impl& m = *impl_;
    m.check_process();
    AdminSession db(m.settings, "inspect");
    Deployment d;
    const auto version = db.citus_version();
    if (!version) {
        m.citus.store(false, std::memory_order_relaxed);
        m.known_layout(pg::Layout::plain);
        return d;
    }
    d.citus = true;
    d.citus_version = *version;
    m.citus.store(true, std::memory_order_relaxed);
    d.coordinator = !db.citus_worker();
    const auto column = db.distribution_column(m.table.qualified);
    if (column == "scope") d.distributed_by = DistributeBy::scope;
    if (column == "key") d.distributed_by = DistributeBy::key;
    m.known_layout(!d.distributed_by                          ? pg::Layout::plain
                   : *d.distributed_by == DistributeBy::scope ? pg::Layout::by_scope
                                                              : pg::Layout::by_key);
    if (!d.coordinator) {
        d.warnings.push_back(
            "connected to a Citus worker node: ensure_schema() and distribute() refuse there, and "
            "ClaimOptions::wait only hears saves made through the same node");
        if (m.options.generations) {
            d.warnings.push_back(
                "generations: a claim takes its key's lock on the node it runs on; claims through a worker do "
                "not see those through the coordinator: claim through the coordinator only");
        }
    }
    if (!column && db.value(pg::kCitusTableSql, {m.table.qualified})) {
        d.warnings.push_back("table " + table_literal(m.table) +
                             " is a Citus reference or single-shard table: idem supports a table distributed by "
                             "scope or key (distribute()), or a local one");
    }
    if (column && !d.distributed_by) {
        d.warnings.push_back("table " + table_literal(m.table) + " is distributed by '" + *column +
                             "', which is neither scope nor key");
    }
    if (!d.distributed_by) return d;
    // idem's session settings (startup options) stay on the coordinator: the shards' statements run
    // with the settings of the worker sessions Citus opens, i.e. the role's and the database's.
    struct Wanted {
        const char* name;
        std::string value;
        const char* why;
    };
    const Wanted wanted[] = {
        {"lock_timeout", std::to_string(m.options.lock_timeout.count()),
         "a claim meeting an uncommitted claim of its key waits on the shard up to statement_timeout and fails "
         "as store_unavailable instead of answering in_progress"},
        {"enable_seqscan", "off",
         "cached plans of idem's key lookups on the shards may become sequential scans after an ANALYZE of "
         "a nearly empty table"},
    };
    const std::string role = db.value(pg::kCurrentUserSql).value_or("<role>");
    for (const Wanted& w : wanted) {
        try {
            auto r = db.exec(pg::kOnWorkersSql, {pg::setting_sql(w.name)});
            for (int row = 0; row < PQntuples(r.get()); ++row) {
                const std::string node = std::string(PQgetvalue(r.get(), row, 0)) + ":" + PQgetvalue(r.get(), row, 1);
                const std::string got = PQgetvalue(r.get(), row, 3);
                if (std::string_view(PQgetvalue(r.get(), row, 2)) != "t") {
                    d.warnings.push_back("could not read " + std::string(w.name) + " on worker " + node + ": " + got);
                } else if (got != w.value) {
                    const std::string unit = std::string(w.name) == "lock_timeout" ? "ms" : "";
                    d.warnings.push_back("worker " + node + " runs idem's statements with " + w.name + " = " + got +
                                         unit + " (idem asks for " + w.value + unit + "): " + w.why +
                                         ". Fix, on the coordinator (Citus propagates it to the workers): " +
                                         pg::role_setting_sql(role, w.name, w.value + unit));
                }
            }
        } catch (const error& e) {
            d.warnings.push_back(std::string("could not read the workers' ") + w.name + ": " + e.what());
        }
    }
    return d;
}

namespace {

// Runs a statement that must scan (no index separates in-progress keys): seqscan back on for it,
// each step under its own Sync so that the reset runs even if the scan fails. Sessions without
// idem's options (poolers) never turned it off. Returns the statement's answer.
// (A template: PostgresStore::Impl is private to the store.)
template <class Impl>
StepResult run_scan(Impl& m, pg::Connection& conn, pg::Stmt stmt, Params& p) {
    Params none;
    const bool toggle = m.options.session_options;
    const Step with_toggle[] = {
        {&m.defs[pg::kSeqscanOn], &none}, {&m.defs[stmt], &p}, {&m.defs[pg::kSeqscanDefault], &none}};
    auto res = toggle ? m.run(conn, with_toggle) : m.run_one(conn, stmt, p);
    if (toggle && (!res[0].ok() || !res[2].ok())) conn.mark_broken();  // session state unknown
    return std::move(res[toggle ? 1 : 0]);
}

}  // namespace

std::vector<StaleKey> PostgresStore::list_stale(std::size_t limit, const ScopeFilter& scopes) {
    Impl& m = *impl_;
    m.counters().reads.fetch_add(1, std::memory_order_relaxed);
    const pg::Stmt stmt = scopes.kind() == ScopeFilter::Kind::exact    ? pg::kListStaleInScope
                          : scopes.kind() == ScopeFilter::Kind::prefix ? pg::kListStaleScopePrefix
                                                                       : pg::kListStale;
    return m.with_connection("list_stale", [&](pg::Connection& conn, int) {
        Params p;
        p.int8(static_cast<std::int64_t>(std::min<std::size_t>(limit, INT64_MAX)));
        if (stmt != pg::kListStale) p.text(scopes.text());
        const StepResult listed = run_scan(m, conn, stmt, p);
        if (!listed.ok()) throw_statement_error(listed, "list_stale");
        std::vector<StaleKey> out;
        const PGresult* r = listed.result.get();
        for (int row = 0; row < PQntuples(r); ++row) {
            Key key(std::string(pg::get_bytes(r, row, pg::kRecordColumns)),
                    std::string(pg::get_bytes(r, row, pg::kRecordColumns + 1)));
            // One row that cannot be decoded (written by a newer idem, or damaged) must not stop
            // every other stale key from being listed — and so resolved. It is left out and
            // reported with its key; its clients get corrupt_record from their own claims.
            try {
                Record record = parse_record(r, row);
                out.push_back(StaleKey{std::move(key), std::move(record)});
            } catch (const corrupt_record& e) {
                const std::string detail =
                    "list_stale: corrupt_record: " + std::string(detail::without_prefix(e.what())) +
                    " (left out of the listing)";
                emit(Event::reconcile_failed, &key, {}, 1, detail);
            }
        }
        return out;
    });
}

std::size_t PostgresStore::count_stale(const ScopeFilter& scopes) {
    Impl& m = *impl_;
    m.counters().reads.fetch_add(1, std::memory_order_relaxed);
    const pg::Stmt stmt = scopes.kind() == ScopeFilter::Kind::exact    ? pg::kCountStaleInScope
                          : scopes.kind() == ScopeFilter::Kind::prefix ? pg::kCountStaleScopePrefix
                                                                       : pg::kCountStale;
    return m.with_connection("count_stale", [&](pg::Connection& conn, int) {
        Params p;
        if (stmt != pg::kCountStale) p.text(scopes.text());
        const StepResult counted = run_scan(m, conn, stmt, p);
        if (!counted.ok()) throw_statement_error(counted, "count_stale");
        return static_cast<std::size_t>(pg::get_int8(counted.result.get(), 0, 0));
    });
}

std::size_t PostgresStore::purge_expired(std::size_t batch_size, std::size_t max_batches) {
    Impl& m = *impl_;
    if (batch_size == 0) throw config_error("idem: purge_expired batch_size must be at least 1");
    if (const pg::Generation generation = pg::generation_of(m.options)) {
        // Whole generations instead of batches of rows (generations.hpp).
        m.check_process();
        AdminSession db(m.settings, "purge_expired");
        const auto report =
            pg::maintain_generations(db, m.table, *generation, m.options.generations->ahead, m.options.lock_timeout);
        if (report.rows_removed > 0) emit(Event::purged, nullptr, {}, report.rows_removed);
        return report.rows_removed;
    }
    std::size_t total = 0;
    for (std::size_t batch = 0; batch < max_batches; ++batch) {
        // Each batch its own short transaction: locks are held for one batch only.
        const std::size_t deleted = m.with_connection("purge_expired", [&](pg::Connection& conn, int) {
            Params p;
            p.int8(static_cast<std::int64_t>(std::min<std::size_t>(batch_size, INT64_MAX)));
            const bool distributed = m.purge_distributed.load(std::memory_order_relaxed);
            auto res = m.run_one(conn, distributed ? pg::kPurgeDistributed : pg::kPurge, p);
            if (!distributed && res[0].failed && res[0].sqlstate() == "0A000") {
                // Citus refuses FOR UPDATE on a statement that spans shards: this table is
                // distributed. Its form without SKIP LOCKED, from now on (nothing was deleted).
                m.purge_distributed.store(true, std::memory_order_relaxed);
                res = m.run_one(conn, pg::kPurgeDistributed, p);
            }
            if (!res[0].ok()) throw_statement_error(res[0], "purge_expired");
            return static_cast<std::size_t>(std::strtoull(PQcmdTuples(res[0].result.get()), nullptr, 10));
        });
        total += deleted;
        if (deleted < batch_size) break;
    }
    if (total > 0) emit(Event::purged, nullptr, {}, total);
    return total;
}

}  // namespace idem
