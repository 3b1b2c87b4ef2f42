// A claim is `claimed` only if the transaction that inserted its row committed; errors tell the
// truth. Each case makes one statement of a pipelined sequence fail after an earlier one succeeded
// (a missing column privilege, a role's statement_timeout, an error raised while reading, a
// deferred constraint at COMMIT, query cancels), then checks what the database holds — never what
// the library says about itself. Also: a store in a fork()ed child, permanent misconfigurations,
// and a store called from inside its own in-transaction effect. (In-transaction mode after a
// restart: disruptive_test.cpp.) Needs IDEM_TEST_DATABASE_URL (run under scripts/with-postgres.sh).
#include "idem/idem.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "store_env.hpp"
#include "threads.hpp"

#include <sys/wait.h>
#include <unistd.h>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;
using idem_test::PgConn;

namespace {

using idem_test::require_db;

idem::Fingerprint fp_of(int n) { return idem::fingerprint("POST /charges"s, n); }

/// A fresh idem table (created by the superuser), and a login role that the test restricts.
/// Dropped at the end, with everything that depends on them.
class Fixture {
public:
    explicit Fixture(std::string url)
        : url_(std::move(url)),
          table_(idem_test::unique_name("idem_at")),
          role_(idem_test::unique_name("idem_role")),
          admin_(url_) {
        idem::PostgresOptions o;
        o.table = table_;
        idem::PostgresStore(url_, idem_test::env_options(o)).ensure_schema();
        // (USAGE on schema public comes from PUBLIC. No GRANT on the schema: a change to
        // pg_namespace resets every cached plan in every session, which would disturb the plan-cache
        // tests running alongside.)
        admin_.exec("CREATE ROLE " + role_ + " LOGIN");
    }
    ~Fixture() {
        idem_test::drop_idem_table(url_, table_);
        try {
            PgConn admin(url_);
            admin.exec("DROP FUNCTION IF EXISTS " + table_ + "_gate() CASCADE");
            admin.exec("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", {role_});
            for (int i = 0; i < 200; ++i) {
                if (admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE usename = $1", {role_}) == 0) break;
                std::this_thread::sleep_for(10ms);
            }
            admin.exec("DROP ROLE IF EXISTS " + role_);
        } catch (...) {
        }
    }
    Fixture(const Fixture&) = delete;
    Fixture& operator=(const Fixture&) = delete;

    /// Every privilege idem needs on the table.
    void grant_all() { admin_.exec("GRANT SELECT, INSERT, UPDATE, DELETE ON " + table_ + " TO " + role_); }

    /// Every privilege except SELECT on `column`: the claim's INSERT … RETURNING fence works, the
    /// record read that follows it in the same transaction fails (42501).
    void grant_all_but_select_of(const std::string& column) {
        admin_.exec("REVOKE ALL ON " + table_ + " FROM " + role_);
        admin_.exec("GRANT INSERT, UPDATE, DELETE ON " + table_ + " TO " + role_);
        std::string columns;
        for (const char* c :
             {"scope", "key", "state", "fingerprint", "fingerprint_alg", "fence", "attempt", "result", "phase",
              "phase_data", "waiters", "created_at", "lease_until", "completed_at", "expires_at"}) {
            if (c == column) continue;
            columns += (columns.empty() ? "" : ", ") + std::string(c);
        }
        admin_.exec("GRANT SELECT (" + columns + ") ON " + table_ + " TO " + role_);
    }

    /// Row-level security whose SELECT policy runs `body` (PL/pgSQL) for every row read by a
    /// statement whose text starts with SELECT — idem's record reads, not its INSERT/UPDATE/DELETE
    /// … RETURNING (whose rows pass the same policy with another statement text).
    void gate_reads(const std::string& body) {
        admin_.exec("CREATE FUNCTION " + table_ +
                    "_gate() RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN "
                    "IF current_query() LIKE 'SELECT%' THEN " +
                    body + " END IF; RETURN true; END $$");
        admin_.exec("ALTER TABLE " + table_ + " ENABLE ROW LEVEL SECURITY");
        admin_.exec("ALTER TABLE " + table_ + " FORCE ROW LEVEL SECURITY");
        admin_.exec("CREATE POLICY everything ON " + table_ + " FOR ALL USING (true) WITH CHECK (true)");
        admin_.exec("CREATE POLICY gate ON " + table_ + " AS RESTRICTIVE FOR SELECT USING (" + table_ + "_gate())");
    }

    [[nodiscard]] std::string role_url() const { return url_ + " user=" + role_; }
    [[nodiscard]] idem::PostgresOptions options(std::size_t pool_size = 2) const {
        idem::PostgresOptions o;
        o.table = table_;
        o.pool_size = pool_size;
        o.application_name = idem_test::unique_name("idem_at_app");
        return o;
    }
    /// Rows of the table (read as the superuser: RLS and grants do not apply).
    long long rows() { return admin_.scalar("SELECT count(*) FROM " + table_); }
    long long rows_with(const std::string& key, idem::Fence fence) {
        return admin_.scalar("SELECT count(*) FROM " + table_ + " WHERE key = $1 AND fence = $2",
                             {key, std::to_string(fence)});
    }
    PgConn& admin() { return admin_; }
    [[nodiscard]] const std::string& table() const { return table_; }
    [[nodiscard]] const std::string& role() const { return role_; }
    [[nodiscard]] const std::string& url() const { return url_; }

private:
    std::string url_, table_, role_;
    PgConn admin_;
};

/// Runs execute_once, counting how often the effect ran (outside the library).
Outcome run(idem::IdempotencyStore& store, const idem::Key& key, std::atomic<int>& effects) {
    return idem::execute_once(store, key, fp_of(1),
                              [&] {
                                  ++effects;
                                  return Response{201, "charged"};
                              })
        .outcome();
}

/// Exactly one "idem: " in a message: wrappers do not repeat the prefix of what they wrap.
void check_one_prefix(const std::string& what) {
    CAPTURE(what);
    CHECK(what.rfind("idem: ", 0) == 0);
    CHECK(what.find("idem: ", 1) == std::string::npos);
}

}  // namespace

TEST_CASE("a claim whose record read is refused is never claimed (no SELECT on one column)", "[postgres][atomicity]") {
    Fixture fx(require_db());
    fx.grant_all_but_select_of("phase_data");
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options()));
    std::atomic<int> effects{0};
    const auto scope = idem_test::unique_name("perm");
    for (int i = 0; i < 3; ++i) {  // the same key again: it must not be "claimed" a second time either
        try {
            (void)run(store, idem::Key(scope, "k1"), effects);
            FAIL("execute_once succeeded although the role cannot read the record");
        } catch (const idem::config_error& e) {
            CHECK(e.sqlstate() == "42501");
            check_one_prefix(e.what());
        }
    }
    CHECK(effects == 0);
    CHECK(fx.rows() == 0);
    CHECK(store.stats().claims_won == 0);
}

TEST_CASE("a role's statement_timeout cancelling the claim's read: store_unavailable, nothing claimed",
          "[postgres][atomicity]") {
    IDEM_NOT_ON_CITUS("its fault is a row-level security policy calling a function");
    Fixture fx(require_db());
    fx.grant_all();
    fx.gate_reads("PERFORM pg_sleep(60);");
    const bool role_setting = GENERATE(true, false);
    CAPTURE(role_setting);
    auto options = fx.options();
    if (role_setting) {
        // The role's own setting, which idem's session options would otherwise override.
        // (1 s, not less: an INSERT slowed past it on a busy machine would be the same answer,
        // but the batch case below needs its INSERT to finish)
        fx.admin().exec("ALTER ROLE " + fx.role() + " SET statement_timeout = '1s'");
        options.session_options = false;
    } else {
        options.statement_timeout = 1s;
        options.lock_timeout = 500ms;
    }
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(options));
    std::atomic<int> effects{0};
    const auto scope = idem_test::unique_name("sto");
    for (int i = 0; i < 2; ++i) {
        try {
            (void)run(store, idem::Key(scope, "k1"), effects);
            FAIL("execute_once succeeded although every read is cancelled");
        } catch (const idem::store_unavailable& e) {
            CHECK(e.sqlstate() == "57014");
            check_one_prefix(e.what());
        }
    }
    CHECK(effects == 0);
    CHECK(fx.rows() == 0);
}

TEST_CASE("an error raised by the claim's read (out of memory): store_unavailable, nothing claimed",
          "[postgres][atomicity]") {
    IDEM_NOT_ON_CITUS("its fault is a row-level security policy calling a function");
    Fixture fx(require_db());
    fx.grant_all();
    fx.gate_reads("RAISE EXCEPTION 'simulated' USING ERRCODE = 'out_of_memory';");
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options()));
    std::atomic<int> effects{0};
    const auto key = idem::Key(idem_test::unique_name("oom"), "k1");
    CHECK_THROWS_AS(run(store, key, effects), idem::store_unavailable);
    CHECK_THROWS_AS(run(store, key, effects), idem::store_unavailable);
    CHECK(effects == 0);
    CHECK(fx.rows() == 0);
}

TEST_CASE("a claim whose COMMIT fails (deferred constraint) reports the database's error, nothing claimed",
          "[postgres][atomicity]") {
    IDEM_NOT_ON_CITUS("its fault is a trigger on the table (and a sequence owned by it)");
    Fixture fx(require_db());
    fx.grant_all();
    fx.admin().exec("CREATE FUNCTION " + fx.table() +
                    "_gate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    "RAISE EXCEPTION 'refused at commit' USING ERRCODE = 'check_violation'; END $$");
    fx.admin().exec("CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON " + fx.table() +
                    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION " + fx.table() + "_gate()");
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options(1)));
    std::atomic<int> effects{0};
    const auto key = idem::Key(idem_test::unique_name("commit"), "k1");
    try {
        (void)run(store, key, effects);
        FAIL("execute_once succeeded although its claim cannot commit");
    } catch (const idem::database_error& e) {
        CHECK(e.sqlstate() == "23514");
        check_one_prefix(e.what());
    }
    CHECK(effects == 0);
    CHECK(fx.rows() == 0);
    // A statement's error is not a broken connection: the one connection is still in use.
    CHECK(store.stats().connections_discarded == 0);
}

TEST_CASE("a cancel storm against the store's backends: every claimed answer has its committed row",
          "[postgres][atomicity]") {
    IDEM_NOT_ON_CITUS("its fault is a row-level security policy calling a function");
    Fixture fx(require_db());
    fx.grant_all();
    // A short pause in every read widens the window in which a cancel lands after the INSERT.
    fx.gate_reads("PERFORM pg_sleep(0.002);");
    auto options = fx.options(4);
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(options));
    const auto scope = idem_test::unique_name("storm");
    constexpr int kThreads = 4, kKeys = 150;

    std::atomic<bool> stop{false};
    std::atomic<long long> cancels{0};
    std::thread canceller([&] {
        PgConn admin(fx.url());
        while (!stop) {
            cancels += admin
                           .exec(
                               "SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
                               "WHERE application_name = $1 AND state = 'active'",
                               {options.application_name})
                           .rows();
        }
    });

    std::mutex mutex;
    std::map<std::string, std::vector<idem::Fence>> claimed;  // key → fences answered `claimed`
    std::atomic<int> unavailable{0}, answered{0};
    idem_test::run_threads(kThreads, [&](int t) {
        for (int i = 0; i < kKeys; ++i) {
            // Every thread claims every key (in a different order): at most one may win each.
            const std::string k = "k" + std::to_string((i * 7 + t * 37) % kKeys);
            try {
                const auto c = store.claim(idem::Key(scope, k), fp_of(1));
                ++answered;
                if (c.status == idem::ClaimStatus::claimed) {
                    std::lock_guard lock(mutex);
                    claimed[k].push_back(c.fence);
                }
            } catch (const idem::store_unavailable&) {
                ++unavailable;
            }
        }
    });
    stop = true;
    canceller.join();
    INFO("cancels sent: " << cancels << ", answers: " << answered << ", store_unavailable: " << unavailable);
    CHECK(cancels > 0);
    CHECK(unavailable > 0);  // the storm did hit claims
    int anomalies = 0;
    for (const auto& [k, fences] : claimed) {
        CAPTURE(k);
        CHECK(fences.size() == 1);  // no key claimed twice
        anomalies += static_cast<int>(fences.size()) - 1;
        for (idem::Fence f : fences) {
            const long long found = fx.rows_with(k, f);
            CHECK(found == 1);  // and its claim committed
            anomalies += found == 1 ? 0 : 1;
        }
    }
    CHECK(static_cast<long long>(claimed.size()) == fx.rows());  // no row that nobody was told about
    std::printf(
        "ATOMICITY-FIGURES cancel storm: %d threads x %d keys, %lld cancels sent, %d answers, "
        "%d store_unavailable, %zu keys claimed, %d anomalies\n",
        kThreads, kKeys, cancels.load(), answered.load(), unavailable.load(), claimed.size(), anomalies);
}

TEST_CASE("in-transaction mode: a claim whose read is refused never runs the effect",
          "[postgres][atomicity][transaction]") {
    Fixture fx(require_db());
    fx.grant_all_but_select_of("phase_data");
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options()));
    int effects = 0;
    const auto key = idem::Key(idem_test::unique_name("tx"), "k1");
    CHECK_THROWS_AS(idem::execute_once_in_transaction(store, key, fp_of(1),
                                                      [&](idem::Transaction&) {
                                                          ++effects;
                                                          return Response{201, "ok"};
                                                      }),
                    idem::config_error);
    CHECK(effects == 0);
    CHECK(fx.rows() == 0);
}

TEST_CASE("claim_batch: won claims are kept when only the read fails, released when the batch throws",
          "[postgres][atomicity][batch]") {
    IDEM_NOT_ON_CITUS("its fault is a row-level security policy calling a function");
    Fixture fx(require_db());
    fx.grant_all();
    const auto scope = idem_test::unique_name("batch");
    std::vector<idem::Key> keys;
    std::vector<idem::Fingerprint> fps;
    for (int i = 0; i < 8; ++i) {
        keys.emplace_back(scope, "k" + std::to_string(i));
        fps.push_back(fp_of(i));
    }

    SECTION("every key fresh, the read times out: the committed claims are answered claimed") {
        fx.gate_reads("PERFORM pg_sleep(60);");
        auto options = fx.options();
        options.statement_timeout = 2s;  // generous: the INSERT before the read must finish in time
        options.lock_timeout = 1s;
        idem::PostgresStore store(fx.role_url(), idem_test::env_options(options));
        const auto claims = store.claim_batch(keys, fps);
        REQUIRE(claims.size() == keys.size());
        for (std::size_t i = 0; i < keys.size(); ++i) {
            CHECK(claims[i].status == idem::ClaimStatus::claimed);
            CHECK(fx.rows_with(keys[i].value(), claims[i].fence) == 1);
        }
    }
    SECTION("one key already taken, the read is refused: the batch throws and leaves nothing in progress") {
        {
            idem::PostgresOptions o = fx.options();
            idem::PostgresStore owner(fx.url(), idem_test::env_options(o));
            REQUIRE(owner.claim(keys[3], fps[3]).status == idem::ClaimStatus::claimed);
        }
        fx.grant_all_but_select_of("phase_data");
        idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options()));
        CHECK_THROWS_AS(store.claim_batch(keys, fps), idem::config_error);
        CHECK(fx.rows() == 1);  // only the key that was taken before
    }
}

TEST_CASE("a store called from inside its own in-transaction effect with a pool of one: a clear error at once",
          "[postgres][transaction]") {
    Fixture fx(require_db());
    fx.grant_all();
    auto options = fx.options(1);
    options.pool_wait = 5s;
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(options));
    const auto scope = idem_test::unique_name("nested");
    const auto started = std::chrono::steady_clock::now();
    try {
        (void)idem::execute_once_in_transaction(store, idem::Key(scope, "outer"), fp_of(1), [&](idem::Transaction&) {
            (void)store.read(idem::Key(scope, "inner"));
            return Response{201, "ok"};
        });
        FAIL("the nested call was expected to fail");
    } catch (const idem::config_error& e) {
        CHECK(std::string(e.what()).find("in-transaction") != std::string::npos);
        check_one_prefix(e.what());
    }
    // Told at once, not after pool_wait (a generous bound: the point is "not 5 s").
    CHECK(std::chrono::steady_clock::now() - started < 3s);
    CHECK(fx.rows() == 0);  // the outer claim rolled back with the effect
}

TEST_CASE("permanent misconfiguration is a config_error, not store_unavailable", "[postgres][errors]") {
    const auto url = require_db();
    std::atomic<int> effects{0};
    const auto key = idem::Key(idem_test::unique_name("cfg"), "k1");
    SECTION("the database does not exist") {
        idem::PostgresStore store(url + " dbname=" + idem_test::unique_name("nosuchdb"));
        try {
            (void)run(store, key, effects);
            FAIL("no error");
        } catch (const idem::config_error& e) {
            CHECK(e.sqlstate() == "3D000");
            check_one_prefix(e.what());
        }
    }
    SECTION("the role does not exist") {
        idem::PostgresStore store(url + " user=" + idem_test::unique_name("nosuchrole"));
        try {
            (void)run(store, key, effects);
            FAIL("no error");
        } catch (const idem::config_error& e) {
            CHECK(e.sqlstate() == "28000");
            check_one_prefix(e.what());
        }
    }
    SECTION("the table does not exist: the message says to call ensure_schema()") {
        idem::PostgresOptions o;
        o.table = idem_test::unique_name("idem_missing");
        idem::PostgresStore store(url, idem_test::env_options(o));
        try {
            (void)run(store, key, effects);
            FAIL("no error");
        } catch (const idem::config_error& e) {
            CHECK(e.sqlstate() == "42P01");
            CHECK(std::string(e.what()).find("ensure_schema()") != std::string::npos);
            check_one_prefix(e.what());
        }
    }
    SECTION("ensure_schema without the right to create: config_error") {
        Fixture fx(url);
        idem::PostgresOptions o = fx.options();
        o.table = idem_test::unique_name("idem_nocreate");
        idem::PostgresStore store(fx.role_url(), idem_test::env_options(o));
        try {
            store.ensure_schema();
            FAIL("no error");
        } catch (const idem::config_error& e) {
            CHECK(e.sqlstate() == "42501");
            check_one_prefix(e.what());
        }
    }
    CHECK(effects == 0);
}

TEST_CASE("an unreachable server is store_unavailable with one idem: prefix", "[postgres][errors]") {
    idem::PostgresOptions o;
    o.connect_timeout = 2s;
    idem::PostgresStore store("host=/nonexistent-idem-dir port=1 dbname=x", idem_test::env_options(o));
    std::atomic<int> effects{0};
    try {
        (void)run(store, idem::Key("scope", "k"), effects);
        FAIL("no error");
    } catch (const idem::config_error&) {
        FAIL("an unreachable server is an outage, not a misconfiguration");
    } catch (const idem::store_unavailable& e) {
        check_one_prefix(e.what());
    }
    CHECK(effects == 0);
}

TEST_CASE("several hosts: config_error only when every host refuses for good", "[postgres][errors]") {
    const auto url = require_db();
    const char* host = std::getenv("IDEM_PG_HOST");
    const char* port = std::getenv("IDEM_PG_PORT");
    if (host == nullptr || port == nullptr) {
        WARN("IDEM_PG_HOST / IDEM_PG_PORT unset (not started by scripts/with-postgres.sh): skipping");
        return;
    }
    const std::string nosuchdb = idem_test::unique_name("nosuchdb");
    std::atomic<int> effects{0};
    const auto key = idem::Key(idem_test::unique_name("hosts"), "k1");
    idem::PostgresOptions o;
    o.connect_timeout = 2s;
    // (libpq stops at the first host that answers with a refusal; hosts before it that could not be
    // reached are in its message too)
    SECTION("the first host is down (restarting), the second says no such database: an outage") {
        idem::PostgresStore store(
            url + " host=/nonexistent-idem-dir," + host + " port=1," + port + " dbname=" + nosuchdb,
            idem_test::env_options(o));
        CHECK_THROWS_AS(run(store, key, effects), idem::store_unavailable);
        try {
            (void)run(store, key, effects);
        } catch (const idem::config_error&) {
            FAIL("a host that is only down makes the failure an outage");
        } catch (const idem::store_unavailable&) {
        }
    }
    SECTION("the first host says no such database: config_error") {
        idem::PostgresStore store(
            url + " host=" + host + "," + host + " port=" + port + "," + port + " dbname=" + nosuchdb,
            idem_test::env_options(o));
        try {
            (void)run(store, key, effects);
            FAIL("no error");
        } catch (const idem::config_error& e) {
            CHECK(e.sqlstate() == "3D000");
        }
    }
    CHECK(effects == 0);
}

TEST_CASE("a backend terminated while a new connection prepares: retried on a fresh connection", "[postgres][errors]") {
    Fixture fx(require_db());
    fx.grant_all();
    auto options = fx.options(2);
    options.lock_timeout = 10s;  // generous: the PREPARE waits on our lock until we terminate it
    options.statement_timeout = 20s;
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(options));
    PgConn locker(fx.url());
    locker.exec("BEGIN");
    locker.exec("LOCK TABLE " + fx.table() + " IN ACCESS EXCLUSIVE MODE");
    std::atomic<int> effects{0};
    std::optional<Outcome> outcome;
    std::string error;
    std::thread caller([&] {
        try {
            outcome = run(store, idem::Key(idem_test::unique_name("prep"), "k1"), effects);
        } catch (const std::exception& e) {
            error = e.what();
        }
    });
    // The store's first connection is preparing its statements, blocked on the lock: end it.
    long long killed = 0;
    for (int i = 0; i < 1000 && killed == 0; ++i) {
        killed = fx.admin().scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = $1 AND wait_event_type = 'Lock'",
            {options.application_name});
        if (killed == 0) std::this_thread::sleep_for(10ms);
    }
    locker.exec("COMMIT");
    caller.join();
    REQUIRE(killed == 1);
    INFO("error: " << error);
    REQUIRE(outcome.has_value());
    CHECK(*outcome == Outcome::executed);
    CHECK(effects == 1);
    CHECK(store.stats().retries >= 1);
}

TEST_CASE(
    "fork(): a child cannot use the parent's store, and destroying it there neither hangs nor "
    "closes the parent's sessions",
    "[postgres][fork]") {
    Fixture fx(require_db());
    fx.grant_all();
    auto options = fx.options(2);
    auto store = std::make_unique<idem::PostgresStore>(fx.role_url(), idem_test::env_options(options));
    const auto scope = idem_test::unique_name("fork");
    std::atomic<int> effects{0};
    REQUIRE(run(*store, idem::Key(scope, "before"), effects) == Outcome::executed);
    const auto backend_pids = [&] {
        return fx.admin()
            .exec(
                "SELECT string_agg(pid::text, ',' ORDER BY pid) FROM pg_stat_activity "
                "WHERE application_name = $1",
                {options.application_name})
            .text(0, 0);
    };
    const std::string before = backend_pids();
    REQUIRE_FALSE(before.empty());

    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        // Exit codes: 0 ok, 2 the store ran a claim, 3 the claim threw something else.
        int code = 0;
        try {
            (void)store->claim(idem::Key(scope, "child"), fp_of(1));
            code = 2;
        } catch (const idem::config_error&) {
        } catch (...) {
            code = 3;
        }
        store.reset();  // must return, and must not end the parent's sessions
        _exit(code);
    }
    int status = 0;
    pid_t done = 0;
    for (int i = 0; i < 3000 && done == 0; ++i) {  // 30 s: generous; a hang is forever
        done = waitpid(child, &status, WNOHANG);
        if (done == 0) std::this_thread::sleep_for(10ms);
    }
    if (done == 0) {
        kill(child, SIGKILL);
        waitpid(child, &status, 0);
        FAIL("the child hung destroying the store it inherited");
    }
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);

    // The parent's pooled sessions are untouched and still serve it.
    const auto opened = store->stats().connections_opened;
    REQUIRE(run(*store, idem::Key(scope, "after"), effects) == Outcome::executed);
    CHECK(store->stats().connections_opened == opened);
    CHECK(store->stats().connections_discarded == 0);
    CHECK(backend_pids() == before);
    CHECK(fx.admin().scalar("SELECT count(*) FROM " + fx.table() + " WHERE key = 'child'") == 0);
}

// ---- Adversarial review of the atomicity fix (branch wt-review) ------------------------------------
// Each case states what it expects from the library; the report says which ones fail and why.

namespace {

/// A deferred constraint trigger on idem's table that raises `sqlstate` at COMMIT for the rows whose
/// key is `key` (every row when `key` is empty), only while the sequence `<table>_gate_seq` has
/// drawn fewer than `times` values (times < 0: always).
void fail_commit(Fixture& fx, const std::string& sqlstate, const std::string& key, int times = -1) {
    fx.admin().exec("CREATE SEQUENCE " + fx.table() + "_gate_seq OWNED BY " + fx.table() + ".fence");
    fx.admin().exec("GRANT USAGE ON SEQUENCE " + fx.table() + "_gate_seq TO " + fx.role());
    const std::string when = key.empty() ? "true" : "NEW.key = '" + key + "'";
    const std::string budget =
        times < 0 ? "true" : "nextval('" + fx.table() + "_gate_seq') <= " + std::to_string(times);
    fx.admin().exec("CREATE FUNCTION " + fx.table() +
                    "_gate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    "IF " +
                    when + " AND " + budget + " THEN RAISE EXCEPTION 'refused at commit' USING ERRCODE = '" + sqlstate +
                    "'; END IF; RETURN NULL; END $$");
    fx.admin().exec("CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT OR UPDATE ON " + fx.table() +
                    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION " + fx.table() + "_gate()");
}

}  // namespace

TEST_CASE(
    "claim_batch whose INSERT cannot commit (one key refused at COMMIT): the database's error, "
    "nothing claimed, the connection stays in step",
    "[postgres][atomicity][batch]") {
    IDEM_NOT_ON_CITUS("its fault is a trigger on the table (and a sequence owned by it)");
    Fixture fx(require_db());
    fx.grant_all();
    fail_commit(fx, "23514", "k5");
    // One connection: a pipeline that lost its place after the failed COMMIT would show in the next call.
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options(1)));
    const auto scope = idem_test::unique_name("bcommit");
    std::vector<idem::Key> keys;
    std::vector<idem::Fingerprint> fps;
    for (int i = 0; i < 8; ++i) {
        keys.emplace_back(scope, "k" + std::to_string(i));
        fps.push_back(fp_of(i));
    }
    try {
        (void)store.claim_batch(keys, fps);
        FAIL("claim_batch succeeded although its INSERT cannot commit");
    } catch (const idem::database_error& e) {
        CHECK(e.sqlstate() == "23514");
        check_one_prefix(e.what());
    } catch (const idem::error& e) {
        FAIL("expected database_error 23514, got " << e.what() << " (" << e.sqlstate() << ")");
    }
    CHECK(fx.rows() == 0);
    if (store.options().statement_shape == idem::PostgresOptions::StatementShape::per_key) {
        // One key per segment (a Citus table distributed by key): the other 7 committed on their
        // own, and were released when the batch failed.
        CHECK(store.stats().claims_won == 7);
        CHECK(store.stats().releases == 7);
    } else {
        CHECK(store.stats().claims_won == 0);  // one transaction for the batch: nothing committed
    }
    CHECK(store.stats().connections_discarded == 0);
    // The same connection answers the next batch (without the refused key) correctly.
    keys.erase(keys.begin() + 5);
    fps.erase(fps.begin() + 5);
    const auto claims = store.claim_batch(keys, fps);
    REQUIRE(claims.size() == keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
        CHECK(claims[i].status == idem::ClaimStatus::claimed);
        CHECK(fx.rows_with(keys[i].value(), claims[i].fence) == 1);
    }
    CHECK(store.stats().connections_opened == 1);
}

TEST_CASE("a claim whose COMMIT fails once with a serialization failure is retried and claimed once",
          "[postgres][atomicity]") {
    IDEM_NOT_ON_CITUS("its fault is a trigger on the table (and a sequence owned by it)");
    Fixture fx(require_db());
    fx.grant_all();
    fail_commit(fx, "40001", "", 1);
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options(1)));
    std::atomic<int> effects{0};
    const auto key = idem::Key(idem_test::unique_name("ser"), "k1");
    CHECK(run(store, key, effects) == Outcome::executed);
    CHECK(run(store, key, effects) == Outcome::replayed);
    CHECK(effects == 1);
    CHECK(fx.rows() == 1);
    CHECK(store.stats().claims_won == 1);
    CHECK(store.stats().connections_discarded == 0);
}

TEST_CASE("claim_batch whose INSERT's COMMIT fails once with a serialization failure is retried",
          "[postgres][atomicity][batch]") {
    IDEM_NOT_ON_CITUS("its fault is a trigger on the table (and a sequence owned by it)");
    Fixture fx(require_db());
    fx.grant_all();
    fail_commit(fx, "40001", "", 1);
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options(1)));
    const auto scope = idem_test::unique_name("bser");
    std::vector<idem::Key> keys{idem::Key(scope, "a"), idem::Key(scope, "b"), idem::Key(scope, "c")};
    std::vector<idem::Fingerprint> fps{fp_of(1), fp_of(2), fp_of(3)};
    const auto claims = store.claim_batch(keys, fps);
    REQUIRE(claims.size() == 3);
    for (std::size_t i = 0; i < keys.size(); ++i) {
        CHECK(claims[i].status == idem::ClaimStatus::claimed);
        CHECK(fx.rows_with(keys[i].value(), claims[i].fence) == 1);
    }
    CHECK(fx.rows() == 3);
    CHECK(store.stats().connections_discarded == 0);
}

TEST_CASE("in-transaction mode whose COMMIT fails: effect and claim rolled back, the database's error",
          "[postgres][atomicity][transaction]") {
    IDEM_NOT_ON_CITUS("its fault is a trigger on the table (and a sequence owned by it)");
    Fixture fx(require_db());
    fx.grant_all();
    const std::string side = fx.table() + "_side";
    fx.admin().exec("CREATE TABLE " + side + " (id int)");
    fx.admin().exec("GRANT INSERT, SELECT ON " + side + " TO " + fx.role());
    // Refused at COMMIT, once the save made the row completed (the claim's INSERT passes).
    fx.admin().exec("CREATE FUNCTION " + fx.table() +
                    "_gate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    "IF NEW.state = 'completed' THEN RAISE EXCEPTION 'refused at commit' USING ERRCODE = "
                    "'check_violation'; END IF; RETURN NULL; END $$");
    fx.admin().exec("CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT OR UPDATE ON " + fx.table() +
                    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION " + fx.table() + "_gate()");
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options(1)));
    int effects = 0;
    const auto key = idem::Key(idem_test::unique_name("txc"), "k1");
    try {
        (void)idem::execute_once_in_transaction(store, key, fp_of(1), [&](idem::Transaction& tx) {
            ++effects;
            tx.exec("INSERT INTO " + side + " VALUES (1)");
            return Response{201, "ok"};
        });
        FAIL("no error although the COMMIT failed");
    } catch (const idem::database_error& e) {
        CHECK(e.sqlstate() == "23514");
        check_one_prefix(e.what());
    }
    CHECK(effects == 1);
    CHECK(fx.rows() == 0);
    CHECK(fx.admin().scalar("SELECT count(*) FROM " + side) == 0);
    fx.admin().exec("DROP TABLE " + side);
}

TEST_CASE(
    "fork() inside an in-transaction effect: the child going on never speaks on the parent's "
    "session",
    "[postgres][fork][transaction]") {
    Fixture fx(require_db());
    fx.grant_all();
    const std::string side = fx.table() + "_side";
    fx.admin().exec("CREATE TABLE " + side + " (who text)");
    fx.admin().exec("GRANT INSERT, SELECT ON " + side + " TO " + fx.role());
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options(2)));
    const auto key = idem::Key(idem_test::unique_name("txfork"), "k1");
    const pid_t parent = getpid();
    int child_status = -1;
    bool child_hung = false;
    std::string parent_error;
    Outcome outcome = Outcome::in_progress;
    try {
        outcome = idem::execute_once_in_transaction(store, key, fp_of(1), [&](idem::Transaction& tx) {
                      tx.exec("INSERT INTO " + side + " VALUES ('parent')");
                      const pid_t child = fork();
                      if (child == 0) return Response{201, "child"};  // a careless effect: the child goes on
                      for (int i = 0; i < 3000; ++i) {                // 30 s
                          if (waitpid(child, &child_status, WNOHANG) == child) return Response{201, "parent"};
                          std::this_thread::sleep_for(10ms);
                      }
                      kill(child, SIGKILL);
                      waitpid(child, &child_status, 0);
                      child_hung = true;
                      return Response{201, "parent"};
                  }).outcome();
    } catch (const idem::config_error&) {
        if (getpid() != parent) _exit(0);  // the child was refused: what we expect
        parent_error = "config_error";
    } catch (const std::exception& e) {
        if (getpid() != parent) _exit(3);
        parent_error = e.what();
    }
    if (getpid() != parent) _exit(2);  // the child finished the parent's transaction
    INFO("the parent's error: " << parent_error);
    CHECK_FALSE(child_hung);
    REQUIRE(WIFEXITED(child_status));
    CHECK(WEXITSTATUS(child_status) == 0);  // 2: the child committed the parent's transaction
    CHECK(parent_error.empty());
    CHECK(outcome == Outcome::executed);
    CHECK(fx.admin().scalar("SELECT count(*) FROM " + side) == 1);
    CHECK(fx.admin().scalar("SELECT count(*) FROM " + fx.table() + " WHERE state = 'completed'") == 1);
    // The stored response is the parent's (the child's would mean the child committed it).
    CHECK(fx.admin().scalar("SELECT count(*) FROM " + fx.table() + " WHERE position('parent'::bytea in result) > 0") ==
          1);
    fx.admin().exec("DROP TABLE " + side);
}

TEST_CASE("a malformed conninfo is a permanent misconfiguration (config_error), not an outage", "[postgres][errors]") {
    const auto url = require_db();
    std::atomic<int> effects{0};
    const auto key = idem::Key(idem_test::unique_name("conninfo"), "k1");
    const std::string bad = GENERATE(as<std::string>{}, " port=notaport", " nosuchoption=1");
    CAPTURE(bad);
    idem::PostgresStore store(url + bad);
    try {
        (void)run(store, key, effects);
        FAIL("no error");
    } catch (const idem::config_error& e) {
        check_one_prefix(e.what());
    } catch (const idem::store_unavailable& e) {
        FAIL("a malformed conninfo reported as an outage (store_unavailable): " << e.what());
    }
    CHECK(effects == 0);
}

TEST_CASE(
    "pg_hba.conf verdicts: an authentication server that is down (LDAP) is an outage, a "
    "connection pg_hba.conf rejects is config_error",
    "[postgres][errors]") {
    const auto url = require_db();
    // ldap: nothing listens on 127.0.0.1:9, the LDAP server is "down" (heals when it is back).
    // reject: the server's configuration refuses the role for good.
    const std::string method = GENERATE(as<std::string>{},
                                        "ldap ldapserver=127.0.0.1 ldapport=9 ldapprefix=\"cn=\" "
                                        "ldapsuffix=\",dc=example,dc=org\"",
                                        "reject");
    const bool outage = method.starts_with("ldap");
    const std::string libpq_says = outage ? "LDAP authentication failed" : "pg_hba.conf rejects connection";
    CAPTURE(method);
    PgConn admin(url);
    const std::string hba_file = admin.exec("SHOW hba_file").text(0, 0);
    std::string original;
    {
        std::ifstream in(hba_file);
        if (!in) {
            WARN("cannot read " << hba_file << ": skipped");
            return;
        }
        std::ostringstream s;
        s << in.rdbuf();
        original = s.str();
    }
    const std::string role = idem_test::unique_name("idem_hba");
    admin.exec("CREATE ROLE " + role + " LOGIN");
    const auto write_hba = [&](const std::string& text) {
        std::ofstream out(hba_file, std::ios::trunc);
        out << text;
        return static_cast<bool>(out);
    };
    if (!write_hba("local all " + role + " " + method + "\n" + original)) {
        WARN("cannot write " << hba_file << ": skipped");
        admin.exec("DROP ROLE " + role);
        return;
    }
    admin.exec("SELECT pg_reload_conf()");
    const std::string role_url = url + " user=" + role + " password=secret";
    std::string seen;
    // The postmaster reloads asynchronously: until libpq's answer shows it (generous: a loaded
    // machine; the check below fails if it never does).
    const auto reloaded_by = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::steady_clock::now() < reloaded_by) {
        PGconn* c = PQconnectdb(role_url.c_str());
        seen = PQerrorMessage(c);
        PQfinish(c);
        if (seen.find(libpq_says) != std::string::npos) break;
        std::this_thread::sleep_for(10ms);
    }
    std::string outcome;
    std::atomic<int> effects{0};
    {
        idem::PostgresOptions o;
        o.connect_timeout = 2s;
        idem::PostgresStore store(role_url, idem_test::env_options(o));
        try {
            (void)run(store, idem::Key("hba", "k"), effects);
            outcome = "no error";
        } catch (const idem::config_error&) {
            outcome = "config_error";
        } catch (const idem::store_unavailable&) {
            outcome = "store_unavailable";
        }
    }
    write_hba(original);
    admin.exec("SELECT pg_reload_conf()");
    admin.exec("DROP ROLE " + role);
    INFO("libpq said: " << seen);
    CHECK(seen.find(libpq_says) != std::string::npos);
    CHECK(outcome == (outage ? "store_unavailable" : "config_error"));
    CHECK(effects == 0);
}

TEST_CASE(
    "claim_batch that throws after taking over a stale key does not delete that key's record "
    "(the earlier attempt's outcome is unknown)",
    "[postgres][atomicity][batch]") {
    IDEM_NOT_ON_CITUS("its fault is a trigger on the table (and a sequence owned by it)");
    Fixture fx(require_db());
    fx.grant_all();
    const auto scope = idem_test::unique_name("btake");
    const idem::Key stale(scope, "a"), expired(scope, "b");
    {
        idem::PostgresStore owner(fx.url(), idem_test::env_options(fx.options()));
        // An earlier worker claimed "a", reached a recovery point (it charged), then died.
        idem::ClaimOptions short_lease;
        short_lease.lease = 50ms;
        const auto c = owner.claim(stale, fp_of(1), short_lease);
        REQUIRE(c.status == idem::ClaimStatus::claimed);
        owner.record_phase(stale, c.fence, "charged", "ch_123");
        // "b" completed long ago: past its retention, it will be claimed again.
        const auto d = owner.claim(expired, fp_of(2));
        REQUIRE(d.status == idem::ClaimStatus::claimed);
        owner.save(expired, d.fence, "old");
    }
    fx.admin().exec("UPDATE " + fx.table() + " SET expires_at = now() - interval '1 second' WHERE key = 'b'");
    // Re-claiming "b" fails (any error after the take-over of "a" will do).
    fx.admin().exec("CREATE FUNCTION " + fx.table() +
                    "_gate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    "IF OLD.key = 'b' AND NEW.state = 'in_progress' THEN RAISE EXCEPTION 'boom' USING ERRCODE = "
                    "'XX000'; END IF; RETURN NEW; END $$");
    fx.admin().exec("CREATE TRIGGER gate BEFORE UPDATE ON " + fx.table() + " FOR EACH ROW EXECUTE FUNCTION " +
                    fx.table() + "_gate()");
    std::this_thread::sleep_for(200ms);  // the lease of "a" passes
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(fx.options()));
    const std::vector<idem::Key> keys{stale, expired};
    const std::vector<idem::Fingerprint> fps{fp_of(1), fp_of(2)};
    idem::ClaimOptions resume;
    resume.resume_stale = true;
    CHECK_THROWS_AS(store.claim_batch(keys, fps, resume), idem::database_error);
    // The batch ran no effect for "a"; its record (in progress, with the earlier attempt's recovery
    // point) must survive for the reconciler. Deleted, the key is free: the next claim — resume or
    // not — runs the effect again with no trace of the first charge.
    CHECK(fx.admin().scalar("SELECT count(*) FROM " + fx.table() + " WHERE key = 'a' AND phase = 'charged'") == 1);
    std::atomic<int> effects{0};
    CHECK(run(store, stale, effects) == Outcome::in_progress);  // not executed again
    CHECK(effects == 0);
}

TEST_CASE(
    "cancel and terminate storms on claim_batch and in-transaction mode: every claimed answer "
    "has its committed row, no key claimed twice, effect and record commit together",
    "[postgres][atomicity]") {
    IDEM_NOT_ON_CITUS("its fault is a row-level security policy calling a function");
    Fixture fx(require_db());
    fx.grant_all();
    const std::string side = fx.table() + "_side";
    fx.admin().exec("CREATE TABLE " + side + " (key text)");
    fx.admin().exec("GRANT INSERT, SELECT ON " + side + " TO " + fx.role());
    fx.gate_reads("PERFORM pg_sleep(0.002);");
    const std::string how = GENERATE(as<std::string>{}, "pg_cancel_backend", "pg_terminate_backend");
    const std::string mode = GENERATE(as<std::string>{}, "batch", "transaction");
    CAPTURE(how, mode);
    auto options = fx.options(4);
    idem::PostgresStore store(fx.role_url(), idem_test::env_options(options));
    const auto scope = idem_test::unique_name("storm2");
    constexpr int kThreads = 4, kKeys = 40;

    std::atomic<bool> stop{false};
    std::atomic<long long> hits{0};
    std::thread storm([&] {
        PgConn admin(fx.url());
        while (!stop) {
            hits += admin
                        .exec("SELECT " + how +
                                  "(pid) FROM pg_stat_activity WHERE application_name = $1 AND "
                                  "state = 'active'",
                              {options.application_name})
                        .rows();
            std::this_thread::sleep_for(1ms);
        }
    });
    std::mutex mutex;
    std::map<std::string, std::vector<idem::Fence>> claimed;  // batch: key → fences answered claimed
    std::map<std::string, int> executed;                      // transaction: key → executed answers
    std::atomic<int> errors{0};
    idem_test::run_threads(kThreads, [&](int t) {
        for (int i = 0; i < kKeys; i += 4) {
            std::vector<idem::Key> keys;
            std::vector<idem::Fingerprint> fps;
            for (int j = 0; j < 4; ++j) {
                keys.emplace_back(scope, "k" + std::to_string((i + j + t * 8) % kKeys));
                fps.push_back(fp_of(1));
            }
            try {
                if (mode == "batch") {
                    const auto claims = store.claim_batch(keys, fps);
                    std::lock_guard lock(mutex);
                    for (std::size_t j = 0; j < keys.size(); ++j) {
                        if (claims[j].status == idem::ClaimStatus::claimed) {
                            claimed[keys[j].value()].push_back(claims[j].fence);
                        }
                    }
                } else {
                    for (const auto& key : keys) {
                        try {
                            const auto r =
                                idem::execute_once_in_transaction(store, key, fp_of(1), [&](idem::Transaction& tx) {
                                    tx.exec("INSERT INTO " + side + " VALUES ($1)", {key.value()});
                                    return Response{201, "ok"};
                                });
                            if (r.outcome() == Outcome::executed) {
                                std::lock_guard lock(mutex);
                                ++executed[key.value()];
                            }
                        } catch (const idem::error&) {
                            ++errors;
                        }
                    }
                }
            } catch (const idem::error&) {
                ++errors;
            }
        }
    });
    stop = true;
    storm.join();
    INFO("hits: " << hits << ", errors: " << errors);
    CHECK(hits > 0);
    if (mode == "batch") {
        for (const auto& [k, fences] : claimed) {
            CAPTURE(k);
            CHECK(fences.size() == 1);
            for (idem::Fence f : fences) CHECK(fx.rows_with(k, f) == 1);
        }
    } else {
        for (const auto& [k, n] : executed) {
            CAPTURE(k);
            CHECK(n == 1);
        }
        // The effect's row and the completed record exist together or not at all, once per key.
        CHECK(fx.admin().scalar("SELECT count(*) FROM (SELECT key FROM " + side +
                                " GROUP BY key HAVING count(*) > 1) d") == 0);
        CHECK(fx.admin().scalar(
                  "SELECT count(*) FROM " + side + " s FULL JOIN " + fx.table() +
                  " t ON t.key = s.key AND t.state = 'completed' WHERE (s.key IS NULL) <> (t.key IS NULL)") == 0);
        for (const auto& [k, n] : executed) {
            CHECK(fx.admin().scalar("SELECT count(*) FROM " + side + " WHERE key = $1", {k}) == 1);
        }
    }
    fx.admin().exec("DROP TABLE " + side);
}
