// PostgresStore-only behaviour: round trips, verbatim keys, schema handling, broken connections,
// the pool. Needs IDEM_TEST_DATABASE_URL (run under scripts/with-postgres.sh).
#include "idem/idem.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "threads.hpp"

#include <unistd.h>

#include <array>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <latch>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
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

idem::Fingerprint fp_of(std::int64_t amount) { return idem::fingerprint("POST /charges"s, amount, "BRL"s); }

Response ok(const std::string& body) { return Response{201, body, {{"Content-Type", "text/plain"}}}; }

/// A fresh table with idem's schema, dropped (with its schema-version row) at the end.
class Table {
public:
    explicit Table(std::string conninfo, std::string name = idem_test::unique_name("idem_t"))
        : conninfo_(std::move(conninfo)), name_(std::move(name)) {}
    ~Table() { idem_test::drop_idem_table(conninfo_, name_); }
    Table(const Table&) = delete;
    Table& operator=(const Table&) = delete;
    [[nodiscard]] const std::string& name() const { return name_; }

private:
    std::string conninfo_;
    std::string name_;
};

idem::PostgresOptions options_for(const Table& table, std::size_t pool_size = 4) {
    idem::PostgresOptions o;
    o.table = table.name();
    o.pool_size = pool_size;
    o.application_name = idem_test::unique_name("idem_pgtest");
    return o;
}

/// Terminates every backend whose application_name is `app`; waits until they are gone.
int terminate_backends(PgConn& admin, const std::string& app) {
    const auto killed =
        admin.exec("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", {app});
    const auto deadline = std::chrono::steady_clock::now() + 30s;  // generous: a loaded machine
    while (std::chrono::steady_clock::now() < deadline) {
        if (admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", {app}) == 0) {
            return killed.rows();
        }
        std::this_thread::sleep_for(10ms);
    }
    FAIL("backends of " << app << " still alive 30 s after pg_terminate_backend");
    return killed.rows();
}

/// Waits (at most 30 s: a loaded machine) until one backend of `app` waits on a heavyweight lock;
/// returns whether it came to that.
bool await_lock_wait(PgConn& admin, const std::string& app) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    for (;;) {
        if (admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                         "AND wait_event_type = 'Lock'",
                         {app}) == 1) {
            return true;
        }
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(10ms);
    }
}

}  // namespace

TEST_CASE("round trips: new request 2, replay 1, in_progress 1, mismatch 1", "[postgres][round_trips]") {
    const auto url = require_db();
    Table table(url);
    const bool prepared = GENERATE(true, false);
    CAPTURE(prepared);
    auto options = options_for(table, 1);
    options.prepared_statements = prepared;
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    const auto scope = idem_test::unique_name("rt");
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return ok("charged");
    };
    auto cost = [&](auto&& call) {
        const auto before = store.stats().round_trips;
        call();
        return store.stats().round_trips - before;
    };

    // Warm the one connection through every path (connect, prepare) before counting.
    REQUIRE(idem::execute_once(store, idem::Key(scope, "warm"), fp_of(1), effect).outcome() == Outcome::executed);
    REQUIRE(idem::execute_once(store, idem::Key(scope, "warm"), fp_of(1), effect).outcome() == Outcome::replayed);
    REQUIRE(idem::execute_once(store, idem::Key(scope, "warm"), fp_of(2), effect).outcome() == Outcome::mismatch);

    std::optional<idem::Result<Response>> r;
    CHECK(cost([&] { r.emplace(idem::execute_once(store, idem::Key(scope, "new"), fp_of(1), effect)); }) == 2);
    CHECK(r->outcome() == Outcome::executed);
    CHECK(cost([&] { r.emplace(idem::execute_once(store, idem::Key(scope, "new"), fp_of(1), effect)); }) == 1);
    CHECK(r->outcome() == Outcome::replayed);
    CHECK(cost([&] { r.emplace(idem::execute_once(store, idem::Key(scope, "new"), fp_of(2), effect)); }) == 1);
    CHECK(r->outcome() == Outcome::mismatch);

    const auto held = store.claim(idem::Key(scope, "held"), fp_of(1));
    REQUIRE(held.status == idem::ClaimStatus::claimed);
    CHECK(cost([&] { r.emplace(idem::execute_once(store, idem::Key(scope, "held"), fp_of(1), effect)); }) == 1);
    CHECK(r->outcome() == Outcome::in_progress);
    CHECK(runs == 2);
    CHECK(store.stats().connections_opened == 1);
    CHECK(store.stats().retries == 0);

    // too large: refused before any I/O
    CHECK(cost([&] {
              CHECK_THROWS_AS(
                  store.save(idem::Key(scope, "held"), held.fence, std::string(options.max_result_bytes + 1, 'x')),
                  idem::response_too_large);
          }) == 0);
}

TEST_CASE("SQL-looking and unicode keys are stored and replayed verbatim", "[postgres][keys]") {
    const auto url = require_db();
    Table table(url);
    PgConn admin(url);
    const auto canary = idem_test::unique_name("idem_canary");
    admin.exec("CREATE TABLE " + canary + " (x int)");
    idem::PostgresStore store(url, options_for(table));
    store.ensure_schema();

    const std::vector<std::string> values = {
        "'; DROP TABLE " + canary + "; --",
        "'; DROP TABLE " + table.name() + "; --",
        "'); DELETE FROM " + table.name() + "; --",
        "$1",
        "$2::text",
        "\\x00",
        "\\\\x41",
        "E'\\x41'",
        "' OR '1'='1",
        "\"quoted\"",
        "%",
        "_",
        "a%",
        "NULL",
        "null",
        "ABC",
        "abc",
        "abc ",
        " abc",
        "caf\xc3\xa9",           // café, precomposed
        "cafe\xcc\x81",          // café, decomposed: a different key
        "\xf0\x9f\x92\xb3 pay",  // U+1F4B3
        std::string(255, 'z'),
    };
    const std::string scope = "acct'; DROP TABLE " + canary + "; --";
    int runs = 0;
    for (const auto& value : values) {
        CAPTURE(value);
        const idem::Key key(scope, value);
        const auto first = idem::execute_once(store, key, fp_of(1), [&] {
            ++runs;
            return ok("for:" + value);
        });
        CHECK(first.outcome() == Outcome::executed);
        const auto again = idem::execute_once(store, key, fp_of(1), [&] {
            ++runs;
            return ok("wrong");
        });
        CHECK(again.outcome() == Outcome::replayed);
        CHECK(again.response().body == "for:" + value);
        // the row holds the key byte for byte
        CHECK(admin.scalar("SELECT count(*) FROM " + table.name() + " WHERE scope = $1 AND key = $2", {scope, value}) ==
              1);
    }
    CHECK(runs == static_cast<int>(values.size()));
    CHECK(admin.scalar("SELECT count(*) FROM " + table.name()) == static_cast<long long>(values.size()));
    CHECK(admin.scalar("SELECT count(DISTINCT key) FROM " + table.name() + " WHERE scope = $1", {scope}) ==
          static_cast<long long>(values.size()));
    CHECK(admin.scalar("SELECT count(*) FROM pg_class WHERE relname = $1", {canary}) == 1);
    admin.exec("DROP TABLE " + canary);
}

TEST_CASE("invalid keys are refused before any I/O", "[postgres][keys]") {
    const auto url = require_db();
    Table table(url);
    idem::PostgresStore store(url, options_for(table));
    store.ensure_schema();
    (void)store.read(idem::Key("s", "warm"));
    const auto before = store.stats();
    int runs = 0;
    for (const auto& bad :
         {""s, "a\0b"s, "\xff"s, "\xc0\xaf"s, "\xed\xa0\x80"s, "tab\there"s, "\x7f"s, std::string(256, 'k')}) {
        try {
            const idem::Key key("scope", bad);
            (void)idem::execute_once(store, key, fp_of(1), [&] {
                ++runs;
                return ok("x");
            });
            FAIL("accepted an invalid key");
        } catch (const idem::invalid_key&) {
        }
    }
    CHECK(runs == 0);
    const auto after = store.stats();
    CHECK(after.round_trips == before.round_trips);
    CHECK(after.claims == before.claims);
    CHECK(after.connections_opened == before.connections_opened);
}

TEST_CASE("ensure_schema is idempotent, also from 8 threads at once", "[postgres][schema]") {
    const auto url = require_db();
    Table table(url);
    PgConn admin(url);
    {
        idem::PostgresStore store(url, options_for(table));
        store.ensure_schema();
        store.ensure_schema();
        CHECK(idem::execute_once(store, idem::Key("s", "k"), fp_of(1), [] { return ok("x"); }).outcome() ==
              Outcome::executed);
        store.ensure_schema();  // keeps the data
        CHECK(idem::execute_once(store, idem::Key("s", "k"), fp_of(1), [] { return ok("y"); }).outcome() ==
              Outcome::replayed);
    }

    Table fresh(url);
    constexpr int kThreads = 8;
    std::latch start(kThreads);
    std::vector<std::exception_ptr> errors(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            try {
                idem::PostgresStore store(url, options_for(fresh, 1));
                start.arrive_and_wait();
                store.ensure_schema();
            } catch (...) {
                errors[static_cast<std::size_t>(t)] = std::current_exception();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
        if (e) std::rethrow_exception(e);
    }
    idem::PostgresStore store(url, options_for(fresh));
    CHECK(idem::execute_once(store, idem::Key("s", "k"), fp_of(1), [] { return ok("x"); }).outcome() ==
          Outcome::executed);
    CHECK(admin.scalar("SELECT version FROM idem_schema_version WHERE table_name = $1", {fresh.name()}) ==
          idem::PostgresStore::schema_version());
}

TEST_CASE("ensure_schema for 8 different tables at once, in a fresh schema", "[postgres][schema]") {
    // Several services (or test binaries) with their own tables start together on a new database:
    // they share the schema's idem_schema_version table, so its creation must be serialised too.
    // Also with a short lock_timeout as the session's default (docs/scale-out.md has operators put
    // idem's lock_timeout on the role): ensure_schema waits for the others all the same.
    const auto base = require_db();
    const bool short_lock_timeout = GENERATE(false, true);
    CAPTURE(short_lock_timeout);
    if (short_lock_timeout && base.rfind("postgres", 0) == 0) {
        WARN("IDEM_TEST_DATABASE_URL is a URI: cannot append options; skipping");
        return;
    }
    const std::string url = short_lock_timeout ? base + " options='-c lock_timeout=1'" : base;
    // The test's own statements run without it: on Citus, CREATE SCHEMA records the schema in
    // pg_dist_object, whose lock another test's DDL may hold for a moment.
    PgConn admin(base);
    const auto schema = idem_test::unique_name("idem_s");
    admin.exec("CREATE SCHEMA " + schema);
    struct DropSchema {
        PgConn& admin;
        std::string schema;
        ~DropSchema() {
            try {
                admin.exec("DROP SCHEMA IF EXISTS " + schema + " CASCADE");
            } catch (...) {
            }
        }
    } drop{admin, schema};

    constexpr int kThreads = 8;
    std::latch start(kThreads);
    std::vector<std::string> failures(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            try {
                idem::PostgresOptions options;
                options.table = schema + ".t" + std::to_string(t);
                idem::PostgresStore store(url, options);
                start.arrive_and_wait();
                store.ensure_schema();
            } catch (const std::exception& e) {
                failures[static_cast<std::size_t>(t)] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (int t = 0; t < kThreads; ++t) {
        CAPTURE(t);
        CHECK(failures[static_cast<std::size_t>(t)] == "");
    }
    CHECK(admin.scalar("SELECT count(*) FROM " + schema + ".idem_schema_version") == kThreads);
}

TEST_CASE("a schema-qualified table works; an invalid table name is a config_error", "[postgres][schema]") {
    const auto url = require_db();
    PgConn admin(url);
    const auto schema = idem_test::unique_name("idem_s");
    admin.exec("CREATE SCHEMA " + schema);
    struct DropSchema {
        PgConn& admin;
        std::string schema;
        ~DropSchema() {
            try {
                admin.exec("DROP SCHEMA IF EXISTS " + schema + " CASCADE");
            } catch (...) {
            }
        }
    } drop{admin, schema};

    idem::PostgresOptions options;
    options.table = schema + ".keys";
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return ok("in schema");
    };
    CHECK(idem::execute_once(store, idem::Key("s", "k"), fp_of(1), effect).outcome() == Outcome::executed);
    CHECK(idem::execute_once(store, idem::Key("s", "k"), fp_of(1), effect).outcome() == Outcome::replayed);
    CHECK(runs == 1);
    CHECK(admin.scalar("SELECT count(*) FROM " + schema + ".keys WHERE scope = 's' AND key = 'k'") == 1);
    CHECK(admin.scalar("SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = 'keys'", {schema}) == 1);

    for (const auto& bad : {"x; drop"s, ""s, "bad name"s, "a.b.c"s, "x\"y"s, "1abc"s, "tbl;"s, "a."s, ".b"s, "keys--"s,
                            "t'x"s, "sch.x; drop"s}) {
        CAPTURE(bad);
        idem::PostgresOptions o;
        o.table = bad;
        CHECK_THROWS_AS(idem::PostgresStore(url, o), idem::config_error);
    }
    idem::PostgresOptions zero;
    zero.pool_size = 0;
    CHECK_THROWS_AS(idem::PostgresStore(url, zero), idem::config_error);
}

TEST_CASE("PGOPTIONS reaches the store's connections as it reaches ensure_schema's", "[postgres][schema]") {
    // libpq's environment default for `options`: a search_path there puts the table in that schema
    // (ensure_schema), and every claim must find it there.
    const auto url = require_db();
    if (url.find("options") != std::string::npos) {
        WARN("IDEM_TEST_DATABASE_URL sets options, which PGOPTIONS does not override; skipping");
        return;
    }
    PgConn admin(url);
    const auto schema = idem_test::unique_name("idem_env");
    admin.exec("CREATE SCHEMA " + schema);
    struct Cleanup {  // PGOPTIONS as it was, and the schema dropped
        PgConn& admin;
        std::string schema;
        std::optional<std::string> old;
        ~Cleanup() {
            if (old) {
                ::setenv("PGOPTIONS", old->c_str(), 1);
            } else {
                ::unsetenv("PGOPTIONS");
            }
            try {
                admin.exec("DROP SCHEMA IF EXISTS " + schema + " CASCADE");
            } catch (...) {
            }
        }
    } cleanup{admin, schema,
              std::getenv("PGOPTIONS") ? std::optional<std::string>(std::getenv("PGOPTIONS")) : std::nullopt};
    ::setenv("PGOPTIONS", ("-c search_path=" + schema).c_str(), 1);
    // The same database named through a service (an entry without options of its own, in a
    // service file of the test's): libpq then still takes PGOPTIONS.
    const std::string service_file = "/tmp/" + idem_test::unique_name("idem_pg_service") + ".conf";
    {
        std::string entry = "[idem_test]\n";
        if (PQconninfoOption* opts = PQconninfoParse(url.c_str(), nullptr)) {
            for (PQconninfoOption* o = opts; o->keyword != nullptr; ++o) {
                const std::string keyword = o->keyword;
                if (o->val != nullptr && (keyword == "host" || keyword == "port" || keyword == "dbname" ||
                                          keyword == "user" || keyword == "password")) {
                    entry += keyword + "=" + o->val + "\n";
                }
            }
            PQconninfoFree(opts);
        }
        std::ofstream(service_file) << entry;
    }
    struct ServiceFile {
        std::string path;
        ~ServiceFile() {
            ::unsetenv("PGSERVICEFILE");
            std::remove(path.c_str());
        }
    } service{service_file};
    ::setenv("PGSERVICEFILE", service_file.c_str(), 1);
    for (const std::string& conninfo : {url, "service=idem_test"s}) {
        CAPTURE(conninfo);
        idem::PostgresOptions options;
        options.table = idem_test::unique_name("env_keys");
        options.pool_size = 2;
        idem::PostgresStore store(conninfo, options);
        store.ensure_schema();
        int runs = 0;
        auto effect = [&] {
            ++runs;
            return ok("env");
        };
        CHECK(idem::execute_once(store, idem::Key("s", "k"), fp_of(1), effect).outcome() == Outcome::executed);
        CHECK(idem::execute_once(store, idem::Key("s", "k"), fp_of(1), effect).outcome() == Outcome::replayed);
        CHECK(runs == 1);
        CHECK(admin.scalar("SELECT count(*) FROM " + schema + "." + options.table + " WHERE key = 'k'") == 1);
    }
}

TEST_CASE("an unreachable database: store_unavailable, and the effect is not called", "[postgres][unavailable]") {
    (void)require_db();
    const std::vector<std::string> unreachable = {
        "host=/nonexistent/idem-" + std::to_string(::getpid()) + " port=5999 dbname=postgres user=postgres",
        "host=127.0.0.1 port=1 dbname=postgres user=postgres",
    };
    for (const auto& conninfo : unreachable) {
        CAPTURE(conninfo);
        idem::PostgresOptions options;
        options.connect_timeout = 1s;
        options.pool_wait = 1s;
        idem::PostgresStore store(conninfo, options);  // nothing connects yet
        int runs = 0;
        const auto started = std::chrono::steady_clock::now();
        CHECK_THROWS_AS(idem::execute_once(store, idem::Key("s", "k"), fp_of(1),
                                           [&] {
                                               ++runs;
                                               return ok("x");
                                           }),
                        idem::store_unavailable);
        CHECK(runs == 0);
        CHECK(std::chrono::steady_clock::now() - started < 10s);
        CHECK_THROWS_AS(store.read(idem::Key("s", "k")), idem::store_unavailable);
        CHECK_THROWS_AS(store.ensure_schema(), idem::store_unavailable);
        CHECK(store.stats().claims_won == 0);
    }
}

TEST_CASE("a pooled connection killed between calls: the next call succeeds", "[postgres][reconnect]") {
    const auto url = require_db();
    Table table(url);
    PgConn admin(url);
    auto options = options_for(table, 1);
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    const auto scope = idem_test::unique_name("kill");
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return ok("charged once");
    };

    REQUIRE(idem::execute_once(store, idem::Key(scope, "k1"), fp_of(1), effect).outcome() == Outcome::executed);
    REQUIRE(store.stats().connections_opened == 1);
    CHECK(terminate_backends(admin, options.application_name) == 1);

    const auto replay = idem::execute_once(store, idem::Key(scope, "k1"), fp_of(1), effect);
    CHECK(replay.outcome() == Outcome::replayed);
    CHECK(replay.response() == ok("charged once"));
    CHECK(runs == 1);

    CHECK(terminate_backends(admin, options.application_name) == 1);
    CHECK(idem::execute_once(store, idem::Key(scope, "k2"), fp_of(1), effect).outcome() == Outcome::executed);
    CHECK(runs == 2);
    CHECK(idem::execute_once(store, idem::Key(scope, "k2"), fp_of(1), effect).outcome() == Outcome::replayed);
    CHECK(runs == 2);
    const auto stats = store.stats();
    CHECK(stats.connections_opened == 3);
    CHECK(stats.connections_discarded == 2);
}

TEST_CASE("a pooled connection killed while the effect runs: the save still lands", "[postgres][reconnect]") {
    const auto url = require_db();
    Table table(url);
    PgConn admin(url);
    auto options = options_for(table, 1);
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    const auto scope = idem_test::unique_name("killsave");
    int runs = 0;

    const auto r = idem::execute_once(store, idem::Key(scope, "k"), fp_of(1), [&] {
        ++runs;
        // the claim's connection is back in the pool, idle: kill it before save uses it
        terminate_backends(admin, options.application_name);
        return ok("saved after reconnect");
    });
    CHECK(r.outcome() == Outcome::executed);
    CHECK(runs == 1);
    const auto record = store.read(idem::Key(scope, "k"));
    REQUIRE(record.has_value());
    CHECK(record->state == idem::RecordState::completed);
    CHECK(record->result == idem::codec<Response>::encode(ok("saved after reconnect")));

    // the same for a release after not_performed
    CHECK_THROWS_AS(idem::execute_once(store, idem::Key(scope, "np"), fp_of(1),
                                       [&]() -> Response {
                                           ++runs;
                                           terminate_backends(admin, options.application_name);
                                           throw idem::not_performed("refused");
                                       }),
                    idem::not_performed);
    CHECK_FALSE(store.read(idem::Key(scope, "np")).has_value());
    CHECK(runs == 2);
}

TEST_CASE("two stores on one table see each other's keys", "[postgres]") {
    const auto url = require_db();
    Table table(url);
    idem::PostgresStore a(url, options_for(table, 1));
    idem::PostgresStore b(url, options_for(table, 1));
    a.ensure_schema();
    const idem::Key key("shared", "k");
    const auto claim = a.claim(key, fp_of(1));
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return ok("b");
    };
    CHECK(idem::execute_once(b, key, fp_of(1), effect).outcome() == Outcome::in_progress);
    CHECK(idem::execute_once(b, key, fp_of(2), effect).outcome() == Outcome::mismatch);
    a.save(key, claim.fence, idem::codec<Response>::encode(ok("a")));
    const auto replay = idem::execute_once(b, key, fp_of(1), effect);
    CHECK(replay.outcome() == Outcome::replayed);
    CHECK(replay.response() == ok("a"));
    CHECK(runs == 0);
    CHECK_THROWS_AS(b.release(key, claim.fence), idem::lease_lost);
}

TEST_CASE("corrupt rows are reported as corrupt_record, never a crash", "[postgres][corrupt]") {
    const auto url = require_db();
    Table table(url);
    PgConn admin(url);
    idem::PostgresStore store(url, options_for(table));
    store.ensure_schema();
    const idem::Key key("s", "k");
    REQUIRE(idem::execute_once(store, key, fp_of(1), [] { return ok("x"); }).outcome() == Outcome::executed);

    admin.exec("UPDATE " + table.name() + " SET result = '\\x00ff'::bytea WHERE scope = 's' AND key = 'k'");
    CHECK_THROWS_AS(idem::execute_once(store, key, fp_of(1), [] { return ok("y"); }), idem::corrupt_record);
    admin.exec("UPDATE " + table.name() + " SET fingerprint = '\\x0102'::bytea WHERE scope = 's' AND key = 'k'");
    CHECK_THROWS_AS(store.read(key), idem::corrupt_record);
    CHECK_THROWS_AS(store.claim(key, fp_of(1)), idem::corrupt_record);
    admin.exec("UPDATE " + table.name() + " SET fingerprint_alg = 9, fingerprint = $1::bytea WHERE scope = 's'",
               {"\\x" + fp_of(1).hex()});
    CHECK_THROWS_AS(store.read(key), idem::corrupt_record);
    admin.exec("UPDATE " + table.name() + " SET fingerprint_alg = 1 WHERE scope = 's'");
    CHECK(store.read(key).has_value());
}

TEST_CASE("a pool of 2 serves 16 threads", "[postgres][pool]") {
    const auto url = require_db();
    Table table(url);
    auto options = options_for(table, 2);
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    const auto scope = idem_test::unique_name("pool");
    constexpr int kThreads = 16;
    constexpr int kShared = 20;
    constexpr int kOwn = 10;
    std::array<std::atomic<int>, kShared> shared_runs{};
    std::atomic<int> own_runs{0};
    std::atomic<int> bad{0};
    idem_test::run_threads(kThreads, [&](int t) {
        for (int i = 0; i < kShared; ++i) {
            const int k = (i + t) % kShared;
            const auto r = idem::execute_once(store, idem::Key(scope, "shared-" + std::to_string(k)), fp_of(1), [&] {
                ++shared_runs[static_cast<std::size_t>(k)];
                return ok(std::to_string(k));
            });
            if (r.has_response() && r.response() != ok(std::to_string(k))) ++bad;
            if (r.outcome() == Outcome::mismatch) ++bad;
        }
        for (int i = 0; i < kOwn; ++i) {
            const auto key = "own-" + std::to_string(t) + "-" + std::to_string(i);
            const auto r = idem::execute_once(store, idem::Key(scope, key), fp_of(1), [&] {
                ++own_runs;
                return ok(key);
            });
            if (r.outcome() != Outcome::executed) ++bad;
        }
    });
    CHECK(bad == 0);
    CHECK(own_runs == kThreads * kOwn);
    for (int k = 0; k < kShared; ++k) {
        CAPTURE(k);
        CHECK(shared_runs[static_cast<std::size_t>(k)] == 1);
    }
    CHECK(store.stats().connections_opened <= 2);
    CHECK(store.stats().claims_won == kShared + kThreads * kOwn);
}

TEST_CASE("pool_timeout: the only connection is stuck on a lock, the next caller gives up", "[postgres][pool]") {
    const auto url = require_db();
    Table table(url);
    PgConn locker(url);
    PgConn admin(url);
    auto options = options_for(table, 1);
    options.pool_wait = 200ms;
    options.lock_timeout = 10s;
    options.statement_timeout = 20s;
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    const auto scope = idem_test::unique_name("pooltimeout");
    (void)store.read(idem::Key(scope, "warm"));

    std::atomic<int> runs{0};
    locker.exec("BEGIN");
    locker.exec("LOCK TABLE " + table.name() + " IN ACCESS EXCLUSIVE MODE");
    std::optional<idem::Result<Response>> blocked;
    std::exception_ptr blocked_error;
    std::thread holder([&] {
        try {
            blocked.emplace(idem::execute_once(store, idem::Key(scope, "first"), fp_of(1), [&] {
                ++runs;
                return ok("first");
            }));
        } catch (...) {
            blocked_error = std::current_exception();
        }
    });
    struct Unlock {  // on any early exit: free the table, then wait for the blocked call
        PgConn& locker;
        std::thread& holder;
        ~Unlock() {
            if (!holder.joinable()) return;
            try {
                locker.exec("COMMIT");
            } catch (...) {
            }
            holder.join();
        }
    } unlock{locker, holder};

    // wait until the store's connection waits on our lock
    REQUIRE(await_lock_wait(admin, options.application_name));

    const auto started = std::chrono::steady_clock::now();
    CHECK_THROWS_AS(idem::execute_once(store, idem::Key(scope, "second"), fp_of(1),
                                       [&] {
                                           ++runs;
                                           return ok("second");
                                       }),
                    idem::pool_timeout);
    const auto waited = std::chrono::steady_clock::now() - started;
    CHECK(waited >= 190ms);
    CHECK(waited < 5s);
    CHECK(runs == 0);

    locker.exec("COMMIT");
    holder.join();
    if (blocked_error) std::rethrow_exception(blocked_error);
    REQUIRE(blocked.has_value());
    CHECK(blocked->outcome() == Outcome::executed);
    CHECK(runs == 1);
    CHECK_FALSE(store.read(idem::Key(scope, "second")).has_value());
}

namespace {

/// Sequential scans of `table` counted by the server, once every backend of `app` has exited: a
/// backend reports its counters when it exits (while it lives, only when idle and at most once a
/// second, or up to 10 s later — too late to read reliably). The counters live in shared memory
/// (PostgreSQL 15 and later), and an exiting backend flushes its own there before it leaves
/// pg_stat_activity (a before_shmem_exit hook; its pg_stat_activity entry is cleared by an
/// on_shmem_exit one, which runs after): once none of `app`'s backends is listed, every count is in.
long long seq_scans_when_closed(PgConn& admin, const std::string& table, const std::string& app) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", {app}) != 0) {
        if (std::chrono::steady_clock::now() > deadline) FAIL("backends of " << app << " still open after 30 s");
        std::this_thread::sleep_for(10ms);
    }
    admin.exec("SELECT pg_stat_clear_snapshot()");
    return admin.scalar("SELECT seq_scan FROM pg_stat_user_tables WHERE relid = $1::regclass", {table});
}

/// The plan-cache trap: the table ANALYZEd while empty, a few calls (the connection's prepared
/// statements cache their generic plans), then 5,000 rows, then 300 more calls. Returns how many
/// sequential scans the store's connection made in all (≥ 300 when the cached plans scan).
long long seq_scans_after_empty_analyze(const std::string& url, idem::PostgresOptions options) {
    Table table(url);
    options.table = table.name();
    options.pool_size = 1;  // one connection: every call uses the plans it cached
    PgConn admin(url);
    long long baseline = 0;
    {
        idem::PostgresStore store(url, options);
        store.ensure_schema();  // (its index builds scan the table: counted before the store connects)
        baseline = seq_scans_when_closed(admin, table.name(), options.application_name);
        // No autovacuum on this table: its ANALYZE after the bulk insert would replan (and hide the trap).
        admin.exec("ALTER TABLE " + table.name() + " SET (autovacuum_enabled = false)");
        admin.exec("ANALYZE " + table.name());
        const std::string scope = idem_test::unique_name("trap");
        const auto body = [] { return ok("done"); };
        for (int i = 0; i < 12; ++i) {
            REQUIRE(
                idem::execute_once(store, idem::Key(scope, "warm-" + std::to_string(i)), fp_of(1), body).outcome() ==
                Outcome::executed);
        }
        admin.exec("INSERT INTO " + table.name() +
                       " (scope, key, state, fingerprint, fingerprint_alg, fence, result, lease_until, expires_at) "
                       "SELECT $1, 'bulk-' || i, 'completed', '\\x00', 1, i, '\\x00', now(), "
                       "now() + interval '1 day' FROM generate_series(1, 5000) AS i",
                   {scope});
        for (int i = 0; i < 150; ++i) {
            const idem::Key key(scope, "late-" + std::to_string(i));
            REQUIRE(idem::execute_once(store, key, fp_of(1), body).outcome() == Outcome::executed);
            REQUIRE(idem::execute_once(store, key, fp_of(1), body).outcome() == Outcome::replayed);
        }
    }
    return seq_scans_when_closed(admin, table.name(), options.application_name) - baseline;
}

}  // namespace

TEST_CASE("a table ANALYZEd while empty: claims and saves still use the primary key", "[postgres][plans]") {
    IDEM_NOT_ON_CITUS("counts seq scans in the coordinator's pg_stat_user_tables");
    const auto url = require_db();
    idem::PostgresOptions options;
    options.application_name = idem_test::unique_name("idem_plans");
    // idem's sessions run with enable_seqscan=off: no lookup scans the table, whatever the statistics.
    CHECK(seq_scans_after_empty_analyze(url, options) == 0);

    SECTION("negative control: without idem's session options the cached plans scan the table") {
        // (a store behind a pooler that keeps prepared statements, without the startup options:
        // docs/reliability.md says to set enable_seqscan=off for idem's role there)
        options.session_options = false;
        CHECK(seq_scans_after_empty_analyze(url, options) >= 300);
    }
}

TEST_CASE("list_stale still scans, and leaves the session's enable_seqscan off", "[postgres][plans]") {
    IDEM_NOT_ON_CITUS("counts seq scans in the coordinator's pg_stat_user_tables");
    const auto url = require_db();
    Table table(url);
    auto options = options_for(table, 1);  // one connection: list_stale and the reads share it
    PgConn admin(url);
    long long baseline = 0;
    {
        idem::PostgresStore store(url, options);
        store.ensure_schema();
        baseline = seq_scans_when_closed(admin, table.name(), options.application_name);
        admin.exec("ALTER TABLE " + table.name() + " SET (autovacuum_enabled = false)");
        const std::string scope = idem_test::unique_name("stale");
        idem::ClaimOptions claim;
        claim.lease = 1ms;
        for (int i = 0; i < 3; ++i) {
            REQUIRE(store.claim(idem::Key(scope, "k" + std::to_string(i)), fp_of(1), claim).status ==
                    idem::ClaimStatus::claimed);
        }
        std::this_thread::sleep_for(20ms);
        admin.exec("ANALYZE " + table.name());     // a one-page table: a scan is the plan of choice
        for (int round = 0; round < 8; ++round) {  // past the point where its generic plan is cached
            CHECK(store.list_stale(10, idem::ScopeFilter::prefix(scope)).size() == 3);
        }
        for (int round = 0; round < 20; ++round) {
            CHECK(store.read(idem::Key(scope, "k0")).has_value());
        }
    }
    // 8 scans: one per list_stale (seqscan on for it), none for the 3 claims and the 20 reads
    // after it (the session is back to idem's enable_seqscan=off).
    CHECK(seq_scans_when_closed(admin, table.name(), options.application_name) - baseline == 8);
}

// The claim's INSERT and SELECT share one transaction (one Sync). Under READ COMMITTED the SELECT,
// a statement of its own, sees a conflicting claim that committed while the INSERT waited; under a
// database default of REPEATABLE READ or SERIALIZABLE that case is a 40001 from the INSERT, which
// the claim retries. Either way: one effect per key, every other caller replayed or in_progress.
TEST_CASE("16 threads race on the same keys under each default isolation level", "[postgres][isolation]") {
    const auto url = require_db();
    if (url.rfind("postgres", 0) == 0) {
        WARN("IDEM_TEST_DATABASE_URL is a URI: cannot append options; skipping");
        return;
    }
    // (conninfo: "\\ " is an escaped backslash, so the server's options parser gets "\ ", a space
    // inside one value)
    for (const std::string level : {"read\\\\ committed", "repeatable\\\\ read", "serializable"}) {
        CAPTURE(level);
        Table table(url);
        auto options = options_for(table, 8);
        idem::PostgresStore store(url + " options='-c default_transaction_isolation=" + level + "'", options);
        store.ensure_schema();
        const auto scope = idem_test::unique_name("iso");
        constexpr int kThreads = 16;
        constexpr int kKeys = 30;
        std::array<std::atomic<int>, kKeys> runs{};
        std::atomic<int> executed{0}, bad{0};
        idem_test::run_threads(kThreads, [&](int) {
            for (int k = 0; k < kKeys; ++k) {
                const auto r = idem::execute_once(store, idem::Key(scope, "k" + std::to_string(k)), fp_of(1), [&] {
                    ++runs[static_cast<std::size_t>(k)];
                    return ok(std::to_string(k));
                });
                if (r.outcome() == Outcome::executed) ++executed;
                if (r.outcome() == Outcome::mismatch) ++bad;
                if (r.has_response() && r.response() != ok(std::to_string(k))) ++bad;
            }
        });
        CHECK(bad == 0);
        CHECK(executed == kKeys);
        for (int k = 0; k < kKeys; ++k) {
            CAPTURE(k);
            CHECK(runs[static_cast<std::size_t>(k)] == 1);
            const auto again = idem::execute_once(store, idem::Key(scope, "k" + std::to_string(k)), fp_of(1),
                                                  [] { return ok("never"); });
            CHECK(again.outcome() == Outcome::replayed);
            CHECK(again.response() == ok(std::to_string(k)));
        }
    }
}

// Under a REPEATABLE READ default, a save whose row another transaction updated (and committed)
// while the save waited for its lock fails with 40001 "could not serialize access due to concurrent
// update". The save was rolled back whole, so idem sends it again: the effect's result is saved,
// not lost to a serialization failure. Deterministic: the test holds the row lock itself.
TEST_CASE("a save chosen as a serialization victim is sent again and lands", "[postgres][isolation]") {
    IDEM_NOT_ON_CITUS("it waits for the save's lock wait in the coordinator's pg_stat_activity");
    const auto url = require_db();
    if (url.rfind("postgres", 0) == 0) {
        WARN("IDEM_TEST_DATABASE_URL is a URI: cannot append options; skipping");
        return;
    }
    Table table(url);
    auto options = options_for(table, 2);
    idem::PostgresStore store(url + " options='-c default_transaction_isolation=repeatable\\\\ read'", options);
    store.ensure_schema();
    PgConn locker(url), admin(url);
    const idem::Key key(idem_test::unique_name("victim"), "k");
    const auto claim = store.claim(key, fp_of(1));
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    const std::string bytes = idem::codec<Response>::encode(ok("saved after a 40001"));

    // The heartbeat-like UPDATE keeps the fence: the save must still own the key afterwards.
    locker.exec("BEGIN");
    locker.exec("UPDATE " + table.name() +
                    " SET lease_until = lease_until + interval '1 second' "
                    "WHERE scope = $1 AND key = $2",
                {key.scope(), key.value()});
    const auto retries_before = store.stats().retries;
    std::exception_ptr failed;
    std::thread saver([&] {
        try {
            store.save(key, claim.fence, bytes);
        } catch (...) {
            failed = std::current_exception();
        }
    });
    const bool waiting = await_lock_wait(admin, options.application_name);
    locker.exec("COMMIT");
    saver.join();
    REQUIRE(waiting);
    if (failed) std::rethrow_exception(failed);  // without the retry: database_error, sqlstate 40001
    CHECK(store.stats().retries - retries_before >= 1);
    const auto record = store.read(key);
    REQUIRE(record.has_value());
    CHECK(record->state == idem::RecordState::completed);
    CHECK(record->result == bytes);
    CHECK(record->fence == claim.fence);
}

// Thread affinity of the pool: a thread gets back the connection it gave back last when that one is
// idle (a connection moving between threads costs cache misses on every call). With two threads
// and a pool of two, once both connections exist each thread keeps its own: after a short warm-up
// every call of a thread runs on one backend. A plain LIFO pool hands each thread the other's
// connection whenever they interleave, and fails this.
TEST_CASE("a thread keeps its own pooled connection", "[postgres][pool]") {
    const auto url = require_db();
    Table table(url);
    idem::PostgresStore store(url, options_for(table, 2));
    store.ensure_schema();
    const auto scope = idem_test::unique_name("affinity");
    constexpr int kCalls = 80, kWarmUp = 10;
    std::array<std::vector<std::string>, 2> pids;
    // Both threads' first calls meet inside their effects, each holding a connection: both
    // connections exist from then on, however late the scheduler starts either thread.
    std::atomic<int> holding{0};
    idem_test::run_threads(2, [&](int t) {
        for (int i = 0; i < kCalls; ++i) {
            const idem::Key key(scope, std::to_string(t) + "-" + std::to_string(i));
            const auto r = idem::execute_once_in_transaction(store, key, fp_of(1), [&](idem::Transaction& tx) {
                if (i == 0) {
                    ++holding;
                    const auto deadline = std::chrono::steady_clock::now() + 30s;
                    while (holding.load() < 2) {
                        if (std::chrono::steady_clock::now() > deadline) {
                            throw std::runtime_error("the other thread's first call never held a connection");
                        }
                        std::this_thread::sleep_for(1ms);
                    }
                }
                return *tx.exec("SELECT pg_backend_pid()::text").rows.at(0).at(0);
            });
            pids[static_cast<std::size_t>(t)].push_back(r.response());
            // Let the other thread's calls interleave with ours.
            std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
    });
    for (int t = 0; t < 2; ++t) {
        CAPTURE(t);
        const auto& seen = pids[static_cast<std::size_t>(t)];
        REQUIRE(seen.size() == static_cast<std::size_t>(kCalls));
        const std::set<std::string> steady(seen.begin() + kWarmUp, seen.end());
        CHECK(steady.size() == 1);
    }
    CHECK(pids[0].back() != pids[1].back());
    CHECK(store.stats().connections_opened == 2);
}

// A connection parked in one thread's slot is an idle connection like any other: threads that come
// later (other slots) take it instead of opening their own, so the pool grows with concurrency,
// not with the number of threads that ever called. One thread at a time, pool of four: one
// connection in all. (A pool that opened a connection per empty slot would open four.)
TEST_CASE("later threads reuse a parked connection instead of opening new ones", "[postgres][pool]") {
    const auto url = require_db();
    Table table(url);
    idem::PostgresStore store(url, options_for(table, 4));
    store.ensure_schema();
    const auto opened_before = store.stats().connections_opened;
    const auto scope = idem_test::unique_name("parked");
    int executed = 0;  // written by one thread at a time (each is joined before the next starts)
    for (int t = 0; t < 8; ++t) {
        std::thread([&] {
            for (int i = 0; i < 3; ++i) {
                const idem::Key key(scope, std::to_string(t) + "-" + std::to_string(i));
                const auto r = idem::execute_once(store, key, fp_of(1), [] { return std::string("ok"); });
                if (r.outcome() == idem::Outcome::executed) ++executed;
            }
        }).join();
    }
    CHECK(executed == 24);
    CHECK(store.stats().connections_opened - opened_before == 1);  // the first thread's, then reused
}
