// A claim is `claimed` only if the transaction that inserted its row committed; errors tell the
// truth. Each case makes one statement of a pipelined sequence fail after an earlier one succeeded
// (a missing column privilege, a role's statement_timeout, an error raised while reading, a
// deferred constraint at COMMIT, query cancels), then checks what the database holds — never what
// the library says about itself. Also: a store in a fork()ed child, permanent misconfigurations,
// and a store called from inside its own in-transaction effect. (In-transaction mode after a
// restart: disruptive_test.cpp.) Needs IDEM_TEST_DATABASE_URL (run under scripts/with-postgres.sh).
#include "idem/idem.hpp"
#include "pg.hpp"
#include "threads.hpp"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;
using idem_test::PgConn;

namespace {

std::string require_db() {
    const auto url = idem_test::database_url();
    if (url.empty())
        FAIL(idem_test::kNoDatabaseMessage);
    return url;
}

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
        idem::PostgresStore(url_, o).ensure_schema();
        // (USAGE on schema public comes from PUBLIC. No GRANT on the schema: a change to
        // pg_namespace resets every cached plan in every session, which would disturb the plan-cache
        // tests running alongside.)
        admin_.exec("CREATE ROLE " + role_ + " LOGIN");
    }
    ~Fixture() {
        try {
            PgConn admin(url_);
            admin.exec("DROP TABLE IF EXISTS " + table_ + " CASCADE");
            admin.exec("DROP FUNCTION IF EXISTS " + table_ + "_gate() CASCADE");
            admin.exec("DELETE FROM idem_schema_version WHERE table_name = $1", {table_});
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
        for (const char* c : {"scope", "key", "state", "fingerprint", "fingerprint_alg", "fence", "attempt",
                              "result", "phase", "phase_data", "waiters", "created_at", "lease_until",
                              "completed_at", "expires_at"}) {
            if (c == column) continue;
            columns += (columns.empty() ? "" : ", ") + std::string(c);
        }
        admin_.exec("GRANT SELECT (" + columns + ") ON " + table_ + " TO " + role_);
    }

    /// Row-level security whose SELECT policy runs `body` (PL/pgSQL) for every row read by a
    /// statement whose text starts with SELECT — idem's record reads, not its INSERT/UPDATE/DELETE
    /// … RETURNING (whose rows pass the same policy with another statement text).
    void gate_reads(const std::string& body) {
        admin_.exec("CREATE FUNCTION " + table_ + "_gate() RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN "
                    "IF current_query() LIKE 'SELECT%' THEN " + body + " END IF; RETURN true; END $$");
        admin_.exec("ALTER TABLE " + table_ + " ENABLE ROW LEVEL SECURITY");
        admin_.exec("ALTER TABLE " + table_ + " FORCE ROW LEVEL SECURITY");
        admin_.exec("CREATE POLICY everything ON " + table_ + " FOR ALL USING (true) WITH CHECK (true)");
        admin_.exec("CREATE POLICY gate ON " + table_ + " AS RESTRICTIVE FOR SELECT USING (" + table_ +
                    "_gate())");
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
    return idem::execute_once(store, key, fp_of(1), [&] {
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

TEST_CASE("a claim whose record read is refused is never claimed (no SELECT on one column)",
          "[postgres][atomicity]") {
    Fixture fx(require_db());
    fx.grant_all_but_select_of("phase_data");
    idem::PostgresStore store(fx.role_url(), fx.options());
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
    idem::PostgresStore store(fx.role_url(), options);
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
    Fixture fx(require_db());
    fx.grant_all();
    fx.gate_reads("RAISE EXCEPTION 'simulated' USING ERRCODE = 'out_of_memory';");
    idem::PostgresStore store(fx.role_url(), fx.options());
    std::atomic<int> effects{0};
    const auto key = idem::Key(idem_test::unique_name("oom"), "k1");
    CHECK_THROWS_AS(run(store, key, effects), idem::store_unavailable);
    CHECK_THROWS_AS(run(store, key, effects), idem::store_unavailable);
    CHECK(effects == 0);
    CHECK(fx.rows() == 0);
}

TEST_CASE("a claim whose COMMIT fails (deferred constraint) reports the database's error, nothing claimed",
          "[postgres][atomicity]") {
    Fixture fx(require_db());
    fx.grant_all();
    fx.admin().exec("CREATE FUNCTION " + fx.table() + "_gate() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    "RAISE EXCEPTION 'refused at commit' USING ERRCODE = 'check_violation'; END $$");
    fx.admin().exec("CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON " + fx.table() +
                    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION " + fx.table() + "_gate()");
    idem::PostgresStore store(fx.role_url(), fx.options(1));
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
    Fixture fx(require_db());
    fx.grant_all();
    // A short pause in every read widens the window in which a cancel lands after the INSERT.
    fx.gate_reads("PERFORM pg_sleep(0.002);");
    auto options = fx.options(4);
    idem::PostgresStore store(fx.role_url(), options);
    const auto scope = idem_test::unique_name("storm");
    constexpr int kThreads = 4, kKeys = 150;

    std::atomic<bool> stop{false};
    std::atomic<long long> cancels{0};
    std::thread canceller([&] {
        PgConn admin(fx.url());
        while (!stop) {
            cancels += admin.exec("SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
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
    std::printf("ATOMICITY-FIGURES cancel storm: %d threads x %d keys, %lld cancels sent, %d answers, "
                "%d store_unavailable, %zu keys claimed, %d anomalies\n",
                kThreads, kKeys, cancels.load(), answered.load(), unavailable.load(), claimed.size(), anomalies);
}

TEST_CASE("in-transaction mode: a claim whose read is refused never runs the effect",
          "[postgres][atomicity][transaction]") {
    Fixture fx(require_db());
    fx.grant_all_but_select_of("phase_data");
    idem::PostgresStore store(fx.role_url(), fx.options());
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
        idem::PostgresStore store(fx.role_url(), options);
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
            idem::PostgresStore owner(fx.url(), o);
            REQUIRE(owner.claim(keys[3], fps[3]).status == idem::ClaimStatus::claimed);
        }
        fx.grant_all_but_select_of("phase_data");
        idem::PostgresStore store(fx.role_url(), fx.options());
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
    idem::PostgresStore store(fx.role_url(), options);
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
        idem::PostgresStore store(url, o);
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
        idem::PostgresStore store(fx.role_url(), o);
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
    idem::PostgresStore store("host=/nonexistent-idem-dir port=1 dbname=x", o);
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

TEST_CASE("fork(): a child cannot use the parent's store, and destroying it there neither hangs nor "
          "closes the parent's sessions",
          "[postgres][fork]") {
    Fixture fx(require_db());
    fx.grant_all();
    auto options = fx.options(2);
    auto store = std::make_unique<idem::PostgresStore>(fx.role_url(), options);
    const auto scope = idem_test::unique_name("fork");
    std::atomic<int> effects{0};
    REQUIRE(run(*store, idem::Key(scope, "before"), effects) == Outcome::executed);
    const auto backend_pids = [&] {
        return fx.admin().exec("SELECT string_agg(pid::text, ',' ORDER BY pid) FROM pg_stat_activity "
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
