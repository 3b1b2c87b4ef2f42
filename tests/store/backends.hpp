// tests/store/backends.hpp — how the contract suite makes a store of each kind.
//
// A backend object lives for one test case; it owns the stores it makes and, for PostgreSQL, a
// private table (dropped afterwards), so test binaries and test cases never see each other's keys.
#pragma once

#include "store_env.hpp"
#include "idem/idem.hpp"
#include "test_env.hpp"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>
#if defined(IDEM_CONTRACT_POSTGRES)
#include "pg.hpp"
#endif

namespace idem_test {

/// The knobs the contract tests turn, in store-neutral terms.
struct StoreConfig {
    std::size_t max_result_bytes = 16u << 20;
    std::chrono::milliseconds max_retry_after{std::chrono::seconds(1)};
    std::chrono::milliseconds default_lease{std::chrono::seconds(30)};
};

/// A scope nobody else uses (unique within this process; the table is private to it anyway).
inline std::string fresh_scope(const std::string& what) {
    return unique_name("scope") + ":" + what;
}

class MemoryBackend {
public:
    static constexpr const char* name = "MemoryStore";

    idem::IdempotencyStore& make(const StoreConfig& config = {}) {
        idem::MemoryStoreOptions options;
        options.max_result_bytes = config.max_result_bytes;
        options.max_retry_after = config.max_retry_after;
        options.default_lease = config.default_lease;
        stores_.push_back(std::make_unique<idem::MemoryStore>(options));
        return *stores_.back();
    }

    /// A second store on the same data, when the backend can share it (memory cannot).
    static constexpr bool shares_data = false;

private:
    std::vector<std::unique_ptr<idem::MemoryStore>> stores_;
};

#if defined(IDEM_CONTRACT_POSTGRES)
class PostgresBackend {
public:
    static constexpr const char* name = "PostgresStore";
    static constexpr bool shares_data = true;

    PostgresBackend() : conninfo_(database_url()), table_(unique_name("idem_t")) {
        if (conninfo_.empty())
            FAIL(kNoDatabaseMessage);
    }

    ~PostgresBackend() {
        stores_.clear(); // close every pooled connection before dropping the table
        if (!created_)
            return;
        try {
            PgConn conn(conninfo_);
            conn.exec("DROP TABLE IF EXISTS " + table_);
            conn.exec("DELETE FROM idem_schema_version WHERE table_name = $1", {table_});
        } catch (...) { // best effort: the cluster is throwaway
        }
    }

    PostgresBackend(const PostgresBackend&) = delete;
    PostgresBackend& operator=(const PostgresBackend&) = delete;

    idem::IdempotencyStore& make(const StoreConfig& config = {}) {
        idem::PostgresOptions options;
        options.table = table_;
        options.pool_size = 4;
        options.max_result_bytes = config.max_result_bytes;
        options.max_retry_after = config.max_retry_after;
        options.default_lease = config.default_lease;
        options.application_name = "idem_contract_test";
        auto store = std::make_unique<idem::PostgresStore>(conninfo_, idem_test::env_options(options));
        if (!created_) {
            store->ensure_schema();
            created_ = true;
        }
        stores_.push_back(std::move(store));
        return *stores_.back();
    }

    [[nodiscard]] const std::string& table() const { return table_; }
    [[nodiscard]] const std::string& conninfo() const { return conninfo_; }

private:
    std::string conninfo_;
    std::string table_;
    bool created_ = false;
    std::vector<std::unique_ptr<idem::PostgresStore>> stores_;
};
#endif

} // namespace idem_test
