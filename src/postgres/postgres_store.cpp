#include "idem/postgres_store.hpp"

#include <atomic>
#include <random>
#include <thread>

#include "../common.hpp"
#include "connection.hpp"
#include "pool.hpp"
#include "sql.hpp"

namespace idem {

using pg::Clock;
using pg::Params;
using pg::Step;
using pg::StepResult;

namespace {

bool claim_retryable(const std::string& sqlstate) {
    // serialization_failure, deadlock_detected, lock_not_available (lock_timeout while waiting on a
    // concurrent, uncommitted claim of the same key)
    return sqlstate == "40001" || sqlstate == "40P01" || sqlstate == "55P03";
}

[[noreturn]] void throw_statement_error(const StepResult& r, const char* what) {
    const std::string msg = std::string("idem: ") + what + " failed: " + r.message;
    if (r.sqlstate == "42P01") {
        throw database_error(msg + " (run PostgresStore::ensure_schema())", r.sqlstate);
    }
    // Timeouts and resource exhaustion: the database is there but cannot serve us now.
    if (r.sqlstate == "57014" || r.sqlstate.starts_with("53")) throw store_unavailable(msg, r.sqlstate);
    throw database_error(msg, r.sqlstate);
}

Record parse_record(const PGresult* r, int row) {
    using namespace pg;
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
    return rec;
}

}  // namespace

struct PostgresStore::Impl {
    PostgresOptions options;
    pg::ConnectSettings settings;
    pg::TableName table;
    std::vector<pg::StatementDef> defs;
    std::unique_ptr<pg::Pool> pool;

    struct Counters {
        std::atomic<std::uint64_t> round_trips{0}, claims{0}, claims_won{0}, saves{0}, releases{0}, reads{0},
            retries{0}, opened{0}, discarded{0};
    } counters;

    Clock::time_point deadline() const {
        return Clock::now() + options.statement_timeout + options.lock_timeout + std::chrono::seconds(1);
    }

    std::vector<StepResult> run(pg::Connection& conn, std::span<const Step> steps) {
        counters.round_trips.fetch_add(1, std::memory_order_relaxed);
        return conn.run(steps, deadline());
    }

    std::vector<StepResult> run_one(pg::Connection& conn, pg::Stmt stmt, Params& params) {
        const Step step{&defs[stmt], &params};
        return run(conn, std::span(&step, 1));
    }

    std::optional<Record> select(pg::Connection& conn, const Key& key) {
        Params p;
        p.text(key.scope()).text(key.value());
        auto res = run_one(conn, pg::kSelect, p);
        if (!res[0].ok()) throw_statement_error(res[0], "read");
        if (res[0].rows() == 0) return std::nullopt;
        return parse_record(res[0].result.get(), 0);
    }

    // Runs `f` on a pooled connection; on a broken connection retries on a fresh one, up to
    // claim_attempts times in all. f(conn, attempt) gets the 1-based attempt number.
    template <class F>
    auto with_connection(const char* what, F&& f) {
        for (int attempt = 1;; ++attempt) {
            try {
                pg::Lease lease = pool->acquire();
                return f(*lease, attempt);
            } catch (const pg::connection_broken& e) {
                if (attempt >= options.claim_attempts) {
                    throw store_unavailable(std::string("idem: ") + what + ": " + e.what(), e.sqlstate());
                }
                counters.retries.fetch_add(1, std::memory_order_relaxed);
            }
        }
    }
};

PostgresStore::PostgresStore(std::string conninfo, PostgresOptions options) : impl_(std::make_unique<Impl>()) {
    Impl& m = *impl_;
    if (options.pool_size == 0) throw config_error("idem: pool_size must be at least 1");
    if (options.claim_attempts < 1) throw config_error("idem: claim_attempts must be at least 1");
    if (options.statement_timeout.count() <= 0 || options.lock_timeout.count() <= 0) {
        throw config_error("idem: statement_timeout and lock_timeout must be positive");
    }
    if (options.lock_timeout >= options.statement_timeout) {
        throw config_error("idem: lock_timeout must be shorter than statement_timeout");
    }
    if (options.default_lease.count() <= 0 || options.default_retention.count() <= 0) {
        throw config_error("idem: default_lease and default_retention must be positive");
    }
    m.table = pg::TableName::parse(options.table);
    m.defs = pg::statements(m.table);
    m.settings = pg::ConnectSettings{std::move(conninfo),     options.application_name,
                                     options.connect_timeout, options.statement_timeout,
                                     options.lock_timeout,    options.prepared_statements};
    m.options = std::move(options);
    m.pool = std::make_unique<pg::Pool>(
        m.options.pool_size, m.options.pool_wait, m.options.health_check_after,
        [&m] { return std::make_unique<pg::Connection>(m.settings, m.defs); },
        [&m](pg::Connection& conn) {
            try {
                Params none;
                return m.run_one(conn, pg::kPing, none)[0].ok();
            } catch (const error&) {
                return false;
            }
        },
        [&m](bool opened) { (opened ? m.counters.opened : m.counters.discarded).fetch_add(1); });
}

PostgresStore::~PostgresStore() = default;

int PostgresStore::schema_version() noexcept { return pg::kSchemaVersion; }

std::string PostgresStore::schema_sql(const std::string& table) {
    return pg::schema_sql(pg::TableName::parse(table));
}

const PostgresOptions& PostgresStore::options() const noexcept { return impl_->options; }

std::size_t PostgresStore::max_result_bytes() const noexcept { return impl_->options.max_result_bytes; }

void PostgresStore::ensure_schema() {
    Impl& m = *impl_;
    // A plain (non-pipelined) connection of its own: DDL runs as one simple-protocol transaction.
    pg::ConnectSettings settings = m.settings;
    const std::string timeout = std::to_string(std::max<long long>(2, (settings.connect_timeout.count() + 999) / 1000));
    const char* keys[] = {"dbname", "connect_timeout", "application_name", nullptr};
    const char* values[] = {settings.conninfo.c_str(), timeout.c_str(), settings.application_name.c_str(), nullptr};
    pg::ConnPtr conn(PQconnectdbParams(keys, values, 1));
    if (!conn || PQstatus(conn.get()) != CONNECTION_OK) {
        throw store_unavailable(std::string("idem: ensure_schema cannot connect: ") +
                                (conn ? PQerrorMessage(conn.get()) : "out of memory"));
    }
    pg::quiet_notices(conn.get());
    const auto exec = [&](const std::string& sql, std::vector<std::string> params = {}) {
        std::vector<const char*> args;
        for (const auto& p : params) args.push_back(p.c_str());
        pg::ResultPtr r(params.empty() ? PQexec(conn.get(), sql.c_str())
                                       : PQexecParams(conn.get(), sql.c_str(), static_cast<int>(args.size()),
                                                      nullptr, args.data(), nullptr, nullptr, 0));
        const auto status = r ? PQresultStatus(r.get()) : PGRES_FATAL_ERROR;
        if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
            const char* state = r ? PQresultErrorField(r.get(), PG_DIAG_SQLSTATE) : nullptr;
            const std::string sqlstate = state ? state : "";
            const std::string msg = "idem: ensure_schema failed: " + std::string(PQerrorMessage(conn.get()));
            if (sqlstate.empty() || pg::is_connection_sqlstate(sqlstate)) throw store_unavailable(msg, sqlstate);
            throw database_error(msg, sqlstate);
        }
        return r;
    };
    const std::string literal = m.table.schema.empty() ? m.table.table : m.table.schema + "." + m.table.table;
    exec("BEGIN");
    // Serialises concurrent ensure_schema() calls (several instances starting at once): without it,
    // two CREATE TABLE IF NOT EXISTS can still collide on the catalog's unique index.
    exec("SELECT pg_advisory_xact_lock(hashtext($1))", {"idem.ensure_schema:" + literal});
    if (!m.table.schema.empty()) exec("CREATE SCHEMA IF NOT EXISTS \"" + m.table.schema + "\"");
    exec(pg::schema_sql(m.table));
    auto r = exec("SELECT version FROM " + m.table.version_table + " WHERE table_name = $1", {literal});
    const int found = PQntuples(r.get()) == 1 ? std::stoi(PQgetvalue(r.get(), 0, 0)) : 0;
    if (found > pg::kSchemaVersion) {
        exec("ROLLBACK");
        throw config_error("idem: table " + literal + " has schema version " + std::to_string(found) +
                           ", newer than this idem (" + std::to_string(pg::kSchemaVersion) + ")");
    }
    exec("COMMIT");
}

Claim PostgresStore::claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options) {
    Impl& m = *impl_;
    m.counters.claims.fetch_add(1, std::memory_order_relaxed);
    const auto lease = options.lease.value_or(m.options.default_lease);
    const auto retention = options.retention.value_or(m.options.default_retention);
    // One fence for every attempt: after a broken connection, the retry recognises its own claim.
    const Fence fence = detail::new_fence();

    for (int attempt = 1;; ++attempt) {
        const bool last = attempt >= m.options.claim_attempts;
        std::vector<StepResult> res = m.with_connection("claim", [&](pg::Connection& conn, int) {
            Params ins;
            ins.text(key.scope())
                .text(key.value())
                .bytes(fp.bytes())
                .int2(static_cast<std::int16_t>(fp.algorithm()))
                .int8(fence)
                .int8(lease.count())
                .int8(retention.count());
            Params sel;
            sel.text(key.scope()).text(key.value());
            // INSERT and SELECT each under their own Sync: two transactions, one round trip.
            const Step steps[] = {{&m.defs[pg::kClaimInsert], &ins}, {&m.defs[pg::kSelect], &sel}};
            return m.run(conn, steps);
        });
        const StepResult& inserted = res[0];
        const StepResult& selected = res[1];
        if (inserted.ok() && inserted.rows() == 1) {
            m.counters.claims_won.fetch_add(1, std::memory_order_relaxed);
            return Claim{ClaimStatus::claimed, fence, std::nullopt, {}};
        }
        if (!inserted.ok() && !claim_retryable(inserted.sqlstate)) throw_statement_error(inserted, "claim");
        if (!selected.ok()) throw_statement_error(selected, "claim (read)");
        if (selected.rows() == 1) {
            Record record = parse_record(selected.result.get(), 0);
            if (record.fence == fence && record.state == RecordState::in_progress) {
                // Our own claim from an attempt whose answer was lost with its connection.
                m.counters.claims_won.fetch_add(1, std::memory_order_relaxed);
                return Claim{ClaimStatus::claimed, fence, std::nullopt, {}};
            }
            Claim claim{classify(record, fp), 0, std::move(record), {}};
            if (claim.status == ClaimStatus::in_progress) {
                claim.retry_after = detail::retry_after_hint(claim.existing->lease_until,
                                                             std::chrono::system_clock::now(),
                                                             m.options.max_retry_after);
            }
            return claim;
        }
        // Nothing to read: the conflicting claim was released or rolled back in between, or we timed
        // out waiting for a concurrent uncommitted claim. Try again; past the bound, tell the caller
        // the key is busy — never a generic failure.
        if (last) return Claim{ClaimStatus::in_progress, 0, std::nullopt, m.options.max_retry_after};
        m.counters.retries.fetch_add(1, std::memory_order_relaxed);
        if (!inserted.ok()) {
            thread_local std::minstd_rand jitter{std::random_device{}()};
            std::this_thread::sleep_for(std::chrono::milliseconds(1 + jitter() % (10 * attempt)));
        }
    }
}

void PostgresStore::save(const Key& key, Fence fence, std::string_view result) {
    Impl& m = *impl_;
    if (result.size() > m.options.max_result_bytes) {
        throw response_too_large("idem: result of " + std::to_string(result.size()) +
                                     " bytes exceeds max_result_bytes " + std::to_string(m.options.max_result_bytes),
                                 std::string(result));
    }
    m.counters.saves.fetch_add(1, std::memory_order_relaxed);
    m.with_connection("save", [&](pg::Connection& conn, int) {
        Params p;
        p.text(key.scope()).text(key.value()).int8(fence).bytes(result);
        auto res = m.run_one(conn, pg::kSave, p);
        if (!res[0].ok()) throw_statement_error(res[0], "save");
        if (res[0].rows() == 1) return;
        // Not updated: either an earlier attempt of this save landed before its connection broke,
        // or the fence lost the key.
        auto record = m.select(conn, key);
        if (record && record->fence == fence && record->state == RecordState::completed) return;
        throw lease_lost("idem: save refused: fence " + std::to_string(fence) + " no longer owns the key");
    });
}

void PostgresStore::release(const Key& key, Fence fence) {
    Impl& m = *impl_;
    m.counters.releases.fetch_add(1, std::memory_order_relaxed);
    m.with_connection("release", [&](pg::Connection& conn, int attempt) {
        Params p;
        p.text(key.scope()).text(key.value()).int8(fence);
        auto res = m.run_one(conn, pg::kRelease, p);
        if (!res[0].ok()) throw_statement_error(res[0], "release");
        if (res[0].rows() == 1) return;
        if (attempt > 1) {
            // A retry: our first DELETE may have landed (and someone may have claimed since).
            auto record = m.select(conn, key);
            if (!record || record->fence != fence) return;
        }
        throw lease_lost("idem: release refused: fence " + std::to_string(fence) + " no longer owns the key");
    });
}

std::optional<Record> PostgresStore::read(const Key& key) {
    Impl& m = *impl_;
    m.counters.reads.fetch_add(1, std::memory_order_relaxed);
    return m.with_connection("read", [&](pg::Connection& conn, int) { return m.select(conn, key); });
}

std::vector<StaleKey> PostgresStore::list_stale(std::size_t limit) {
    Impl& m = *impl_;
    m.counters.reads.fetch_add(1, std::memory_order_relaxed);
    return m.with_connection("list_stale", [&](pg::Connection& conn, int) {
        Params p;
        p.int8(static_cast<std::int64_t>(limit));
        auto res = m.run_one(conn, pg::kListStale, p);
        if (!res[0].ok()) throw_statement_error(res[0], "list_stale");
        std::vector<StaleKey> out;
        const PGresult* r = res[0].result.get();
        for (int row = 0; row < PQntuples(r); ++row) {
            out.push_back(StaleKey{Key(std::string(pg::get_bytes(r, row, 9)), std::string(pg::get_bytes(r, row, 10))),
                                   parse_record(r, row)});
        }
        return out;
    });
}

StoreStats PostgresStore::stats() const {
    const auto& c = impl_->counters;
    StoreStats s;
    s.round_trips = c.round_trips.load();
    s.claims = c.claims.load();
    s.claims_won = c.claims_won.load();
    s.saves = c.saves.load();
    s.releases = c.releases.load();
    s.reads = c.reads.load();
    s.retries = c.retries.load();
    s.connections_opened = c.opened.load();
    s.connections_discarded = c.discarded.load();
    return s;
}

}  // namespace idem
