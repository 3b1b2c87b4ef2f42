// What a Reconciler tells its operators: the log line for each key saved, released or left, each
// key it could not resolve and each failed sweep — against an unreachable server and a role without
// the privileges it needs; and the stale keys now (count_stale, each sweep's count, idem_stale_keys).
#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "idem/prometheus.hpp"
#include "idem/reconciler.hpp"
#include "lifecycle.hpp"

using namespace lifecycle;
using namespace std::string_literals;
using idem::Response;
using idem_test::PgConn;

namespace {

/// Keeps the lines a Reconciler logs (the hook may be called from the thread that runs run()).
struct Lines {
    std::mutex mutex;
    std::vector<std::string> lines;

    [[nodiscard]] std::function<void(std::string_view)> hook() {
        return [this](std::string_view line) {
            std::lock_guard lock(mutex);
            lines.emplace_back(line);
        };
    }
    [[nodiscard]] std::vector<std::string> snapshot() {
        std::lock_guard lock(mutex);
        return lines;
    }
    /// Waits (at most 20 s) until `n` lines were logged; returns them.
    std::vector<std::string> wait_for(std::size_t n) {
        const auto deadline = SteadyClock::now() + 20s;
        while (snapshot().size() < n && SteadyClock::now() < deadline) std::this_thread::sleep_for(5ms);
        return snapshot();
    }
};

std::string where(const idem::Key& key) { return " (key '" + key.value() + "' in scope '" + key.scope() + "')"; }

/// A login role, dropped at the end with its privileges on `table`.
class Role {
public:
    Role(std::string conninfo, std::string table)
        : conninfo_(std::move(conninfo)), table_(std::move(table)), name_(idem_test::unique_name("idem_lc_role")) {
        PgConn(conninfo_).exec("CREATE ROLE " + name_ + " LOGIN");
    }
    ~Role() {
        try {
            PgConn admin(conninfo_);
            admin.exec("REVOKE ALL ON " + table_ + " FROM " + name_);
            admin.exec("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", {name_});
            for (int i = 0; i < 200; ++i) {
                if (admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE usename = $1", {name_}) == 0) break;
                std::this_thread::sleep_for(10ms);
            }
            admin.exec("DROP ROLE IF EXISTS " + name_);
        } catch (...) {
        }
    }
    Role(const Role&) = delete;
    Role& operator=(const Role&) = delete;

    void grant(const std::string& privileges) {
        PgConn(conninfo_).exec("GRANT " + privileges + " ON " + table_ + " TO " + name_);
    }
    void revoke_all() { PgConn(conninfo_).exec("REVOKE ALL ON " + table_ + " FROM " + name_); }
    [[nodiscard]] std::string conninfo() const { return conninfo_ + " user=" + name_; }

private:
    std::string conninfo_, table_, name_;
};

}  // namespace

TEMPLATE_TEST_CASE("reconciler log: a line for each key saved, released or left, with the resolver's reason",
                   "[lifecycle][reconciler]", MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& store = backend.make();
    const auto scope = fresh_scope("log");
    const auto fp = idem::fingerprint("log"s);
    // Oldest lease first: handed over in this order.
    const idem::Key found(scope, "found"), absent(scope, "absent"), pending(scope, "pending"), plain(scope, "plain");
    for (const auto& key : {found, absent, pending, plain}) {
        REQUIRE(store.claim(key, fp, Opts().lease_for(30s)).status == idem::ClaimStatus::claimed);
        backend.advance(1s);
    }
    backend.advance(31s);
    Lines log;
    auto options = reconciler_options(10, 45s, idem::ScopeFilter::exact(scope));
    options.log = log.hook();
    idem::Reconciler reconciler(
        store,
        [&](idem::Reconciliation& r) {
            if (r.key() == found) r.save(Response{201, "ch_1"}, "charge ch_1 found");
            if (r.key() == absent) r.release("no charge, and its deadline passed");
            if (r.key() == pending) r.leave("the gateway says pending");
            if (r.key() == plain) r.release();
        },
        options);
    const auto sweep = reconciler.run_once();
    CHECK(sweep.saved == 1);
    CHECK(sweep.released == 2);
    CHECK(sweep.left == 1);
    CHECK(log.snapshot() == std::vector<std::string>{
                                "idem::Reconciler: saved: charge ch_1 found" + where(found),
                                "idem::Reconciler: released: no charge, and its deadline passed" + where(absent),
                                "idem::Reconciler: left in progress: the gateway says pending; listed again in "
                                "45000 ms" +
                                    where(pending),
                                "idem::Reconciler: released" + where(plain),
                            });
    // What the lines say happened did: the retry of `absent` runs, `found` replays, `pending` waits.
    std::atomic<int> runs{0};
    const auto effect = [&] {
        ++runs;
        return Response{200, "ran"};
    };
    CHECK(idem::execute_once(store, absent, fp, effect).outcome() == idem::Outcome::executed);
    CHECK(idem::execute_once(store, found, fp, effect).response().body == "ch_1");
    CHECK(idem::execute_once(store, pending, fp, effect).outcome() == idem::Outcome::in_progress);
    CHECK(runs == 1);
}

TEST_CASE("reconciler log: run() against an unreachable PostgreSQL logs each failed sweep with its error",
          "[lifecycle][reconciler]") {
    idem::PostgresOptions o;
    o.connect_timeout = 1s;
    idem::PostgresStore down("host=127.0.0.1 port=1 dbname=none", o);  // nothing listens on port 1
    Lines log;
    auto options = reconciler_options(10, 30s, idem::ScopeFilter::all());
    options.log = log.hook();
    std::atomic<int> resolved{0};
    idem::Reconciler reconciler(
        down, [&](idem::Reconciliation&) { ++resolved; }, options);
    std::vector<std::string> lines;
    {
        std::jthread loop([&](std::stop_token stop) { reconciler.run(stop, 20ms); });
        lines = log.wait_for(2);  // two sweeps: the loop goes on after the first
    }
    REQUIRE(lines.size() >= 2);
    for (const auto& line : lines) {
        CAPTURE(line);
        CHECK(line.starts_with("idem::Reconciler: sweep failed: store_unavailable: idem: "));
        CHECK(line.find("127.0.0.1") != std::string::npos);  // libpq's words: which server it could not reach
        CHECK(line.ends_with("; sweeping again in 20 ms"));
        CHECK(line.find('\n') == std::string::npos);
    }
    CHECK(resolved == 0);
}

TEST_CASE("reconciler log: a role without the privileges: the key it cannot take, then the sweep it cannot list",
          "[lifecycle][reconciler]") {
    IDEM_NOT_ON_CITUS("the role's grants are the coordinator's");
    PostgresBackend backend;
    auto& owner = backend.make_pg();
    const auto scope = fresh_scope("grants");
    const idem::Key key(scope, "k");
    REQUIRE(owner.claim(key, idem::fingerprint("g"s), Opts().lease_for(30s)).status == idem::ClaimStatus::claimed);
    backend.advance(31s);
    Role role(backend.conninfo(), backend.table());
    role.grant("SELECT");  // it lists stale keys, and cannot take one (an UPDATE)
    idem::PostgresOptions o;
    o.table = backend.table();
    o.pool_size = 2;
    idem::PostgresStore store(role.conninfo(), o);
    Lines log;
    auto options = reconciler_options(10, 30s, idem::ScopeFilter::exact(scope));
    options.log = log.hook();
    std::atomic<int> resolved{0};
    idem::Reconciler reconciler(
        store, [&](idem::Reconciliation&) { ++resolved; }, options);

    const auto sweep = reconciler.run_once();
    REQUIRE(sweep.failures.size() == 1);
    CHECK(sweep.failures[0].error_type == "config_error");
    CHECK(sweep.failures[0].sqlstate == "42501");
    auto lines = log.snapshot();
    REQUIRE(lines.size() == 1);
    CAPTURE(lines[0]);
    CHECK(lines[0].starts_with("idem::Reconciler: could not resolve: take_over: config_error 42501: idem: "));
    CHECK(lines[0].find("permission denied for table " + backend.table()) != std::string::npos);
    CHECK(lines[0].ends_with("; not taken, listed again next sweep" + where(key)));

    role.revoke_all();  // now it cannot even list them
    {
        std::jthread loop([&](std::stop_token stop) { reconciler.run(stop, 20ms); });
        lines = log.wait_for(2);
    }
    REQUIRE(lines.size() >= 2);
    CAPTURE(lines[1]);
    CHECK(lines[1].starts_with("idem::Reconciler: sweep failed: config_error 42501: idem: "));
    CHECK(lines[1].find("permission denied for table " + backend.table()) != std::string::npos);
    CHECK(lines[1].ends_with("; sweeping again in 20 ms"));
    CHECK(resolved == 0);
    auto record = owner.read(key);
    REQUIRE(record);
    CHECK(record->state == idem::RecordState::in_progress);  // nothing was taken or changed
}

TEMPLATE_TEST_CASE("stale keys now: count_stale, each sweep's count, Reconciler::stale_keys and idem_stale_keys",
                   "[lifecycle][reconciler]", MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& store = backend.make();
    const auto fp = idem::fingerprint("backlog"s);
    const std::string base = idem_test::unique_name("stale");
    const std::string mine = base + "acct:1", other = base + "acct:2";
    // 5 stale keys in `mine`, 2 in `other`; and in `mine` a live claim, a completed key and a
    // released one, none of them stale.
    for (int i = 0; i < 5; ++i) {
        REQUIRE(store.claim(idem::Key(mine, "k" + std::to_string(i)), fp, Opts().lease_for(30s)).status ==
                idem::ClaimStatus::claimed);
    }
    for (int i = 0; i < 2; ++i) {
        REQUIRE(store.claim(idem::Key(other, "k" + std::to_string(i)), fp, Opts().lease_for(30s)).status ==
                idem::ClaimStatus::claimed);
    }
    const auto done = store.claim(idem::Key(mine, "done"), fp, Opts().lease_for(30s));
    store.save(idem::Key(mine, "done"), done.fence, encode(Response{200, "done"}));
    const auto gone = store.claim(idem::Key(mine, "gone"), fp, Opts().lease_for(30s));
    store.release(idem::Key(mine, "gone"), gone.fence);
    backend.advance(31s);
    REQUIRE(store.claim(idem::Key(mine, "live"), fp, Opts().lease_for(10min)).status == idem::ClaimStatus::claimed);

    CHECK(store.count_stale(idem::ScopeFilter::exact(mine)) == 5);
    CHECK(store.count_stale(idem::ScopeFilter::exact(other)) == 2);
    CHECK(store.count_stale(idem::ScopeFilter::prefix(base)) == 7);
    CHECK(store.count_stale(idem::ScopeFilter::prefix(base + "zzz")) == 0);
    CHECK(store.count_stale() == 7);  // the backend's own table (or store): nothing else is in it

    // A reconciler of `mine`, 2 keys a sweep: it saves the first it is handed and leaves the rest
    // (which it then holds: not stale until its lease passes).
    int handed = 0;
    idem::Reconciler reconciler(
        store,
        [&](idem::Reconciliation& r) {
            if (++handed == 1) r.save(Response{201, "found"});
        },
        reconciler_options(2, 30s, idem::ScopeFilter::exact(mine)));
    auto metrics = std::make_shared<idem::PrometheusObserver>();
    metrics->set_stale_source([&reconciler] { return reconciler.stale_keys().value_or(0); });
    CHECK_FALSE(reconciler.stale_keys());  // no sweep has counted yet
    CHECK(metrics->render().find("\nidem_stale_keys 0\n") != std::string::npos);

    auto sweep = reconciler.run_once();
    CHECK(sweep.stale == 5);  // counted before it took any
    CHECK(sweep.listed == 2);
    CHECK(sweep.saved == 1);
    CHECK(sweep.left == 1);
    CHECK(reconciler.stale_keys() == 5u);
    CHECK(store.count_stale(idem::ScopeFilter::exact(mine)) == 3);
    CHECK(metrics->render().find(
              "# HELP idem_stale_keys In-progress keys whose lease has passed (none holds them), counted by the "
              "reconciler at its last sweep.\n# TYPE idem_stale_keys gauge\nidem_stale_keys 5\n") != std::string::npos);

    sweep = reconciler.run_once();
    CHECK(sweep.stale == 3);
    CHECK(reconciler.stale_keys() == 3u);
    CHECK(metrics->render().find("\nidem_stale_keys 3\n") != std::string::npos);
    sweep = reconciler.run_once();
    CHECK(sweep.stale == 1);
    CHECK(sweep.listed == 1);
    sweep = reconciler.run_once();
    CHECK(sweep.stale == 0);
    CHECK(sweep.listed == 0);
    CHECK(reconciler.stale_keys() == 0u);
    CHECK(metrics->render().find("\nidem_stale_keys 0\n") != std::string::npos);
    // The 4 it left are stale again once its lease passes; `other` was never its business.
    backend.advance(31s);
    CHECK(reconciler.run_once().stale == 4);
    CHECK(store.count_stale(idem::ScopeFilter::exact(other)) == 2);
}
