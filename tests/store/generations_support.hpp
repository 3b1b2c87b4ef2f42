// tests/store/generations_support.hpp — what the generations suites share: the layout's options
// for a test table, a maintainer thread, an in-transaction claim held open, and waiting on state
// the database shows (never on a wall-clock offset).
#pragma once

#include "idem/idem.hpp"
#include "idem/postgres_transaction.hpp"
#include "pg.hpp"
#include "race_run.hpp"
#include "store_env.hpp"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace idem_test::gen {

using namespace std::chrono_literals;
using namespace std::string_literals;
namespace race = idem_test::race;

constexpr auto kLength = 1s;  // a new generation every second: the shortest length allowed

struct Tables : race::Tables {
    explicit Tables(std::string url) : race::Tables(std::move(url), "idem_gen", "idem_gen_effects") {}
};

inline idem::PostgresOptions gen_options(const std::string& table, std::size_t pool = 8, std::size_t ahead = 3) {
    idem::PostgresOptions o;
    o.table = table;
    o.pool_size = pool;
    o = idem_test::env_options(o);
    o.generations = idem::PostgresOptions::Generations{kLength, ahead};
    return o;
}

// purge_expired() on a store of its own, every 50 ms, until stopped: generations are created
// ahead and retired while the test's claims run.
class Maintainer {
public:
    // 20 generations ahead: 20 s of slack for a maintenance slowed down by a busy machine, and
    // short lock waits, so that a generation it cannot attach, close or detach at once waits for
    // the next round instead of holding up the others.
    Maintainer(const std::string& url, const std::string& table)
        : store_(url, maintainer_options(table)), thread_([this] { loop(); }) {}
    static constexpr std::size_t kAhead = 20;
    ~Maintainer() { stop(); }
    void stop() {
        stop_ = true;
        if (thread_.joinable()) thread_.join();
    }
    std::size_t removed() const { return removed_; }
    std::size_t runs() const { return runs_; }
    std::vector<std::string> errors() const {
        std::lock_guard lock(mutex_);
        return errors_;
    }

private:
    static idem::PostgresOptions maintainer_options(const std::string& table) {
        auto o = gen_options(table, 1, kAhead);
        o.lock_timeout = 200ms;
        return o;
    }
    void loop() {
        while (!stop_) {
            try {
                removed_ += store_.purge_expired();
                ++runs_;
            } catch (const std::exception& e) {
                std::lock_guard lock(mutex_);
                errors_.push_back(e.what());
            }
            std::this_thread::sleep_for(50ms);
        }
    }
    idem::PostgresStore store_;
    std::atomic<bool> stop_{false};
    std::atomic<std::size_t> removed_{0}, runs_{0};
    mutable std::mutex mutex_;
    std::vector<std::string> errors_;
    std::thread thread_;
};

// Sets an environment variable for this process and the workers it starts, back at the end.
class ScopedEnv {
public:
    ScopedEnv(const char* name, const std::string& value) : name_(name) {
        if (const char* old = std::getenv(name)) old_ = old;
        ::setenv(name, value.c_str(), 1);
    }
    ~ScopedEnv() {
        if (old_) {
            ::setenv(name_, old_->c_str(), 1);
        } else {
            ::unsetenv(name_);
        }
    }

private:
    const char* name_;
    std::optional<std::string> old_;
};

// An in-transaction call of `key` that holds its uncommitted claim (and the key's lock) open from
// construction until release(); `runs` counts its effect's runs.
class HeldClaim {
public:
    HeldClaim(idem::PostgresStore& store, const idem::Key& key, const idem::Fingerprint& fp,
              const idem::ClaimOptions& options = {}, std::atomic<int>* runs = nullptr) {
        first_ = std::async(std::launch::async, [&store, key, fp, options, runs, this] {
            return idem::execute_once_in_transaction(
                store, key, fp,
                [this, runs](idem::Transaction&) {
                    if (runs != nullptr) ++*runs;
                    claimed_.set_value();
                    released_.wait();
                    return "first"s;
                },
                options);
        });
        claimed_.get_future().wait();
    }
    ~HeldClaim() {
        if (first_.valid()) (void)release();
    }
    HeldClaim(const HeldClaim&) = delete;
    HeldClaim& operator=(const HeldClaim&) = delete;
    idem::Result<std::string> release() {
        release_.set_value();
        return first_.get();
    }

private:
    std::promise<void> claimed_, release_;
    std::shared_future<void> released_{release_.get_future()};
    std::future<idem::Result<std::string>> first_;
};

// Waits (up to 20 s) until `sql` counts at least one row.
inline void wait_for(PgConn& db, const std::string& sql, const std::vector<std::string>& params = {}) {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (db.scalar(sql, params) == 0) {
        if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("timed out waiting for: " + sql);
        std::this_thread::sleep_for(10ms);
    }
}

}  // namespace idem_test::gen
