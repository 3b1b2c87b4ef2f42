// tests/lifecycle/lifecycle.hpp — shared helpers of the key-lifecycle tests (retention, leases,
// reconciler, resume, in-transaction, wait, observer).
//
// A backend object lives for one test case. MemoryBackend hands out ONE store (so "another party"
// shares its data); PostgresBackend hands out a new PostgresStore per make() on a private table
// (dropped at the end), so two stores are two independent parties on the same data.
//
// Time: a test never sleeps for a lease or a retention to pass; it calls backend.advance(d).
// MemoryBackend moves its store's injected clock; PostgresBackend moves every timestamp of its
// table d into the past, which to PostgresStore (it compares them with the database's now()) is the
// same as d passing. Real time still passes for PostgreSQL, so a test that needs a lease NOT to
// have passed gives it tens of seconds of margin.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "idem/errors.hpp"
#include "idem/execute_once.hpp"
#include "idem/memory_store.hpp"
#include "idem/postgres_store.hpp"
#include "idem/reconciler.hpp"
#include "idem/response.hpp"
#include "manual_clock.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "test_env.hpp"

namespace lifecycle {

using namespace std::chrono_literals;
using SteadyClock = std::chrono::steady_clock;

using idem_test::require_db;

/// Knobs for a PostgresStore (ignored by the memory backend).
struct StoreKnobs {
    std::size_t pool_size = 8;
    std::chrono::milliseconds lock_timeout{1000};
    int claim_attempts = 3;
    std::string application_name = "idem_lifecycle_test";
};

class MemoryBackend {
public:
    static constexpr const char* name = "MemoryStore";
    static constexpr bool is_postgres = false;

    idem::IdempotencyStore& make(const StoreKnobs& = {}) {
        if (!store_) {
            idem::MemoryStoreOptions options;
            options.clock = idem_test::ManualClock::function(clock_);
            store_ = std::make_unique<idem::MemoryStore>(options);
        }
        return *store_;
    }

    /// `d` passes for the store (its clock moves; no real time passes).
    void advance(std::chrono::milliseconds d) { clock_->advance(d); }

private:
    std::shared_ptr<idem_test::ManualClock> clock_ = std::make_shared<idem_test::ManualClock>();
    std::unique_ptr<idem::MemoryStore> store_;
};

class PostgresBackend {
public:
    static constexpr const char* name = "PostgresStore";
    static constexpr bool is_postgres = true;

    PostgresBackend() : conninfo_(require_db()), table_(idem_test::unique_name("idem_lc")) {}
    ~PostgresBackend() {
        stores_.clear();  // close the pools before dropping the table
        idem_test::drop_idem_table(conninfo_, table_);
    }
    PostgresBackend(const PostgresBackend&) = delete;
    PostgresBackend& operator=(const PostgresBackend&) = delete;

    idem::PostgresStore& make_pg(const StoreKnobs& knobs = {}) {
        idem::PostgresOptions options;
        options.table = table_;
        options.pool_size = knobs.pool_size;
        options.lock_timeout = knobs.lock_timeout;
        options.claim_attempts = knobs.claim_attempts;
        options.application_name = knobs.application_name;
        auto store = std::make_unique<idem::PostgresStore>(conninfo_, options);
        if (!created_) {
            store->ensure_schema();
            created_ = true;
        }
        stores_.push_back(std::move(store));
        return *stores_.back();
    }
    idem::IdempotencyStore& make(const StoreKnobs& knobs = {}) { return make_pg(knobs); }

    /// `d` passes for the stores: every timestamp of the table moves `d` into the past.
    /// (Arithmetic on `timestamp`, converted at UTC both ways: timestamptz - interval is STABLE,
    /// which Citus refuses with column references in an UPDATE; this form is IMMUTABLE.)
    void advance(std::chrono::milliseconds d) {
        idem_test::PgConn conn(conninfo_);
        std::string set;
        for (const char* column : {"created_at", "lease_until", "completed_at", "expires_at"}) {
            set += std::string(set.empty() ? "" : ", ") + column + " = ((" + column +
                   " AT TIME ZONE 'UTC') - $1 * interval '1 millisecond') AT TIME ZONE 'UTC'";
        }
        conn.exec("UPDATE " + table_ + " SET " + set, {std::to_string(d.count())});
    }

    [[nodiscard]] const std::string& conninfo() const { return conninfo_; }
    [[nodiscard]] const std::string& table() const { return table_; }

private:
    std::string conninfo_;
    std::string table_;
    bool created_ = false;
    std::vector<std::unique_ptr<idem::PostgresStore>> stores_;
};

/// ClaimOptions built step by step (GCC warns on designated initializers that omit members).
struct Opts : idem::ClaimOptions {
    Opts& lease_for(std::chrono::milliseconds d) {
        lease = d;
        return *this;
    }
    Opts& retain(std::chrono::seconds d) {
        retention = d;
        return *this;
    }
    Opts& resume() {
        resume_stale = true;
        return *this;
    }
    Opts& wait_up_to(std::chrono::milliseconds d) {
        wait = d;
        return *this;
    }
};

inline StoreKnobs knobs(std::size_t pool_size, std::string application_name = "idem_lifecycle_test",
                        std::chrono::milliseconds lock_timeout = std::chrono::milliseconds(1000),
                        int claim_attempts = 3) {
    StoreKnobs k;
    k.pool_size = pool_size;
    k.application_name = std::move(application_name);
    k.lock_timeout = lock_timeout;
    k.claim_attempts = claim_attempts;
    return k;
}

inline idem::ReconcilerOptions reconciler_options(std::size_t batch, std::chrono::milliseconds lease,
                                                  idem::ScopeFilter scopes) {
    idem::ReconcilerOptions o;
    o.batch = batch;
    o.lease = lease;
    o.scopes = std::move(scopes);
    return o;
}

/// A scope nobody else uses.
inline std::string fresh_scope(const std::string& what) { return idem_test::unique_name("lc") + ":" + what; }

inline std::string encode(const idem::Response& r) { return idem::codec<idem::Response>::encode(r); }

/// A table the effects write to (its own connection, autocommit); dropped at the end.
class EffectsTable {
public:
    explicit EffectsTable(std::string conninfo)
        : conninfo_(std::move(conninfo)), name_(idem_test::unique_name("idem_lc_effects")) {
        idem_test::PgConn(conninfo_).exec("CREATE TABLE " + name_ +
                                          " (id bigserial PRIMARY KEY, scope text NOT NULL, key text NOT NULL, "
                                          "note text)");
    }
    ~EffectsTable() {
        try {
            idem_test::PgConn(conninfo_).exec("DROP TABLE IF EXISTS " + name_);
        } catch (...) {
        }
    }
    EffectsTable(const EffectsTable&) = delete;
    EffectsTable& operator=(const EffectsTable&) = delete;

    [[nodiscard]] const std::string& name() const { return name_; }
    long long count(idem_test::PgConn& conn) const { return conn.scalar("SELECT count(*) FROM " + name_); }
    long long count(idem_test::PgConn& conn, const idem::Key& key) const {
        return conn.scalar("SELECT count(*) FROM " + name_ + " WHERE scope = $1 AND key = $2",
                           {key.scope(), key.value()});
    }

private:
    std::string conninfo_;
    std::string name_;
};

template <class Duration>
double ms(Duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
}

inline double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

inline double percentile(std::vector<double> v, double p) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    const auto i = static_cast<std::size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
}

}  // namespace lifecycle
