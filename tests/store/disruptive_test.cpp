// Stops the real PostgreSQL server under a live store, then starts it again.
// Runs only under scripts/with-postgres.sh (which exports IDEM_PG_BIN, IDEM_PG_DATA,
// IDEM_PG_CTL_USER, IDEM_PG_LOG); otherwise it warns and does nothing. CTest runs it alone
// (RUN_SERIAL).
#include "idem/idem.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "shell.hpp"
#include "threads.hpp"

#include <unistd.h>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <latch>
#include <optional>
#include <string>
#include <thread>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;

namespace {

std::string env(const char* name) {
    const char* v = std::getenv(name);
    return v ? std::string(v) : std::string();
}

using idem_test::shell_quote;

/// pg_ctl as the cluster's owner (runuser when we are root, directly when we are that user).
int pg_ctl(const std::string& args) {
    const std::string user = env("IDEM_PG_CTL_USER");
    const std::string bin = env("IDEM_PG_BIN").empty() ? "/usr/lib/postgresql/15/bin" : env("IDEM_PG_BIN");
    std::string cmd = shell_quote(bin + "/pg_ctl") + " -D " + shell_quote(env("IDEM_PG_DATA")) + " " + args;
    if (::geteuid() == 0 && !user.empty() && user != "root") {
        cmd = "cd / && runuser -u " + shell_quote(user) + " -- " + cmd;
    }
    cmd += " >/dev/null";
    return std::system(cmd.c_str());
}

void start_server() {
    std::string args = "-w -t 60 start";
    if (!env("IDEM_PG_LOG").empty()) args = "-l " + shell_quote(env("IDEM_PG_LOG")) + " " + args;
    REQUIRE(pg_ctl(args) == 0);
}

/// Restarts the server if a test left it stopped.
struct EnsureRunning {
    bool stopped = false;
    ~EnsureRunning() {
        if (stopped) {
            std::string args = "-w -t 60 start";
            if (!env("IDEM_PG_LOG").empty()) args = "-l " + shell_quote(env("IDEM_PG_LOG")) + " " + args;
            (void)pg_ctl(args);
        }
    }
};

}  // namespace

TEST_CASE("server stopped: store_unavailable without running fn; restarted: the store heals", "[disruptive]") {
    const std::string url = idem_test::require_db();
    if (env("IDEM_PG_DATA").empty()) {
        WARN(
            "IDEM_PG_DATA is not set (the database was not started by scripts/with-postgres.sh): "
            "cannot stop and restart it; skipping the disruptive test");
        return;
    }

    const std::string table = idem_test::unique_name("idem_t");
    idem::PostgresOptions options;
    options.table = table;
    options.pool_size = 2;
    options.connect_timeout = 2s;
    options.statement_timeout = 3s;
    options.lock_timeout = 1s;
    options.pool_wait = 2s;
    std::optional<idem::PostgresStore> store;
    store.emplace(url, options);
    store->ensure_schema();
    idem_test::DropTable drop(url, table);
    const auto scope = idem_test::unique_name("disrupt");
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return Response{201, "charged " + std::to_string(runs), {}};
    };

    // Warm pool: both connections opened.
    REQUIRE(idem::execute_once(*store, idem::Key(scope, "before"), idem::fingerprint(1), effect).outcome() ==
            Outcome::executed);
    REQUIRE(runs == 1);

    EnsureRunning guard;
    guard.stopped = true;
    REQUIRE(pg_ctl("-m fast -w -t 60 stop") == 0);

    for (const auto* name : {"during-1", "during-2", "before"}) {
        CAPTURE(name);
        const auto started = std::chrono::steady_clock::now();
        CHECK_THROWS_AS(idem::execute_once(*store, idem::Key(scope, name), idem::fingerprint(1), effect),
                        idem::store_unavailable);
        CHECK(std::chrono::steady_clock::now() - started < 15s);
    }
    CHECK(runs == 1);
    CHECK_THROWS_AS(store->read(idem::Key(scope, "before")), idem::store_unavailable);

    start_server();
    guard.stopped = false;

    // The same store works again: a new key executes, the old one replays (it survived the
    // restart).
    const auto after = idem::execute_once(*store, idem::Key(scope, "after"), idem::fingerprint(1), effect);
    CHECK(after.outcome() == Outcome::executed);
    CHECK(runs == 2);
    const auto before = idem::execute_once(*store, idem::Key(scope, "before"), idem::fingerprint(1), effect);
    CHECK(before.outcome() == Outcome::replayed);
    CHECK(before.response().body == "charged 1");
    // the calls refused while the server was down claimed nothing
    CHECK_FALSE(store->read(idem::Key(scope, "during-1")).has_value());
    const auto during = idem::execute_once(*store, idem::Key(scope, "during-1"), idem::fingerprint(1), effect);
    CHECK(during.outcome() == Outcome::executed);
    CHECK(runs == 3);
    store.reset();
}

TEST_CASE("in-transaction mode after a restart: no call fails for the pool's dead connections",
          "[disruptive][transaction]") {
    const std::string url = idem_test::require_db();
    if (env("IDEM_PG_DATA").empty()) {
        WARN("IDEM_PG_DATA is not set: cannot restart the server; skipping");
        return;
    }
    constexpr int kPool = 8;
    const std::string table = idem_test::unique_name("idem_t");
    idem::PostgresOptions options;
    options.table = table;
    options.pool_size = kPool;
    options.application_name = idem_test::unique_name("idem_restart");
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    idem_test::DropTable drop(url, table);
    const auto scope = idem_test::unique_name("txrestart");

    // Every pooled connection opened and idle: kPool effects inside at once.
    std::latch inside(kPool);
    idem_test::run_threads(kPool, [&](int t) {
        auto r = idem::execute_once_in_transaction(store, idem::Key(scope, "warm" + std::to_string(t)),
                                                   idem::fingerprint(t), [&](idem::Transaction&) {
                                                       inside.arrive_and_wait();
                                                       return Response{200, "warm", {}};
                                                   });
        REQUIRE(r.outcome() == Outcome::executed);
    });
    REQUIRE(store.stats().connections_opened == kPool);

    EnsureRunning guard;
    guard.stopped = true;
    REQUIRE(pg_ctl("-m fast -w -t 60 stop") == 0);
    start_server();
    guard.stopped = false;

    int effects = 0;
    for (int i = 0; i < kPool + 1; ++i) {
        CAPTURE(i);
        auto r = idem::execute_once_in_transaction(store, idem::Key(scope, "after" + std::to_string(i)),
                                                   idem::fingerprint(i), [&](idem::Transaction& tx) {
                                                       ++effects;
                                                       tx.exec("SELECT 1");
                                                       return Response{201, "ok", {}};
                                                   });
        CHECK(r.outcome() == Outcome::executed);
    }
    CHECK(effects == kPool + 1);
}
