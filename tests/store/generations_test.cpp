// Generations (PostgresOptions::generations) at their boundaries: claims of one key on both sides
// of a new generation, generations retired while keys are claimed, an in-progress key in an ended
// generation, and the layout's configuration errors. Effects are counted in tables of their own.
#include "generations_support.hpp"
#include "require_db.hpp"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem_test::PgConn;
namespace race = idem_test::race;
using namespace idem_test::gen;

TEST_CASE("generations: threads and processes race on keys while generations rotate and retire",
          "[generations][concurrency][processes]") {
    const auto url = idem_test::require_db();
    Tables tables(url);
    const ScopedEnv env("IDEM_TEST_GENERATIONS",
                        std::to_string(std::chrono::milliseconds(kLength).count()));  // the workers' layout
    idem::PostgresStore store(url, gen_options(tables.idem, 16, Maintainer::kAhead));
    store.ensure_schema();
    // Two connections for three threads: their claims and saves go out in commit groups.
    idem::PostgresStore grouped(url, gen_options(tables.idem, 2, Maintainer::kAhead));
    PgConn admin(url);
    const std::string spans = tables.effects + "_spans";
    admin.exec("CREATE TABLE " + spans +
               " (kind text NOT NULL, key text NOT NULL, created_us bigint NOT NULL, expires_us bigint NOT NULL)");
    const idem_test::DropTable drop_spans(url, spans);
    const std::string long_effects = tables.effects + "_long";
    admin.exec("CREATE TABLE " + long_effects + " (key text NOT NULL, tid int NOT NULL)");
    const idem_test::DropTable drop_long_effects(url, long_effects);
    Maintainer maintainer(url, tables.idem);

    // In this process, until the processes' races are over and at least 4 s have passed (or
    // IDEM_TEST_GENERATIONS_SOAK seconds, for a longer run by hand):
    //  - "long" keys (retention 1 h): each must run once, whatever generations come and go, claimed
    //    alone, in commit groups (threads 3 to 5) and in batches of three (thread 2);
    //  - "short" keys (retention 1 s): they expire, their generations retire, they run again; each
    //    run must begin only after the previous run's retention has passed;
    //  - "tx" keys, in-transaction mode with effects of up to 600 ms: the claim's transaction stays
    //    open across generation boundaries while maintenance tries to close its generation.
    constexpr int kThreads = 6, kLongKeys = 40, kShortKeys = 12;
    const std::string scope = idem_test::unique_name("gen");
    std::atomic<bool> done{false};
    std::atomic<int> calls{0}, executed_long{0}, wrong_replays{0};
    std::mutex errors_mutex;
    std::vector<std::string> errors;
    const auto record_span = [&](PgConn& db, const std::string& kind, const idem::Key& key) {
        const auto record = store.read(key);
        if (!record) throw std::runtime_error("the running key has no record");
        const auto us = [](auto t) {
            return std::to_string(std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count());
        };
        db.exec("INSERT INTO " + spans + " VALUES ($1, $2, $3, $4)",
                {kind, key.value(), us(record->created_at), us(record->expires_at)});
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            PgConn db(url);
            idem::PostgresStore& calls_store = t >= 3 ? grouped : store;
            std::mt19937 rng(static_cast<unsigned>(t) * 7919u + 1u);
            idem::ClaimOptions long_retention, short_retention;
            long_retention.retention = std::chrono::hours(1);
            short_retention.retention = 1s;
            while (!done) {
                const int pick = static_cast<int>(rng() % 10);
                try {
                    ++calls;
                    if (pick == 9 && t == 1) {
                        // A key claimed once: its expired row stays until its generation retires.
                        const idem::Key key(scope, "once-" + std::to_string(calls.load()));
                        (void)idem::execute_once(
                            store, key, idem::fingerprint("POST"s), [] { return "once"s; }, short_retention);
                    } else if (pick < 5 && t == 2) {
                        std::vector<std::string> names;
                        while (names.size() < 3) {
                            const std::string name = "long-" + std::to_string(rng() % kLongKeys);
                            if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
                        }
                        std::vector<idem::Message> batch;
                        for (const auto& name : names) {
                            batch.push_back({idem::Key(scope, name), idem::fingerprint("POST"s, name)});
                        }
                        const auto results = idem::execute_batch(
                            store, batch,
                            [&](std::size_t i) {
                                db.exec("INSERT INTO " + long_effects + " VALUES ($1, $2)",
                                        {names[i], std::to_string(t)});
                                ++executed_long;
                                return "body-" + names[i];
                            },
                            long_retention);
                        for (std::size_t i = 0; i < results.size(); ++i) {
                            if (results[i].response && *results[i].response != "body-" + names[i]) ++wrong_replays;
                        }
                    } else if (pick < 5) {
                        const std::string name = "long-" + std::to_string(rng() % kLongKeys);
                        const idem::Key key(scope, name);
                        auto r = idem::execute_once(
                            calls_store, key, idem::fingerprint("POST"s, name),
                            [&] {
                                db.exec("INSERT INTO " + long_effects + " VALUES ($1, $2)", {name, std::to_string(t)});
                                ++executed_long;
                                return "body-" + name;
                            },
                            long_retention);
                        if (r.has_response() && r.response() != "body-" + name) ++wrong_replays;
                    } else if (pick < 9 || t != 0) {
                        const std::string name = "short-" + std::to_string(rng() % kShortKeys);
                        const idem::Key key(scope, name);
                        const auto sleep = std::chrono::milliseconds(pick == 8 ? 400 : rng() % 20);
                        auto r = idem::execute_once(
                            store, key, idem::fingerprint("POST"s, name),
                            [&] {
                                record_span(db, "short", key);
                                std::this_thread::sleep_for(sleep);
                                return "body-" + name;
                            },
                            short_retention);
                        if (r.has_response() && r.response() != "body-" + name) ++wrong_replays;
                    } else {
                        const std::string name = "tx-" + std::to_string(rng() % 4);
                        const idem::Key key(scope, name);
                        const auto sleep = std::chrono::milliseconds(rng() % 600);
                        auto r = idem::execute_once_in_transaction(
                            store, key, idem::fingerprint("POST"s, name),
                            [&](idem::Transaction& tx) {
                                tx.exec("INSERT INTO " + spans +
                                            " SELECT 'tx', key, "
                                            "(extract(epoch FROM created_at) * 1000000)::bigint, "
                                            "(extract(epoch FROM expires_at) * 1000000)::bigint FROM " +
                                            tables.idem + " WHERE scope = $1 AND key = $2",
                                        {scope, name});
                                std::this_thread::sleep_for(sleep);
                                return "body-" + name;
                            },
                            short_retention);
                        if (r.has_response() && r.response() != "body-" + name) ++wrong_replays;
                    }
                } catch (const std::exception& e) {
                    std::lock_guard lock(errors_mutex);
                    errors.push_back(e.what());
                }
            }
        });
    }
    const auto started = std::chrono::steady_clock::now();
    const char* soak_env = std::getenv("IDEM_TEST_GENERATIONS_SOAK");
    const auto soak = std::chrono::seconds(soak_env != nullptr ? std::atoi(soak_env) : 4);
    // Meanwhile, 3 processes x 4 threads race on 150 keys of their own (retention 24 h), one race
    // after another until the soak is over: one effect row per key, every replay the executed bytes.
    int races = 0;
    do {
        const auto ran = race::run_race(IDEM_RACE_WORKER, tables, "genprocs", 3, 150, 4, 500ms);
        race::check_race(admin, tables, ran, 150, 4);
        admin.exec("TRUNCATE " + tables.effects);  // the next race counts its own effects
        ++races;
    } while (std::chrono::steady_clock::now() < started + soak);
    std::this_thread::sleep_until(std::max(started + 4s, std::chrono::steady_clock::now() + 2s));
    done = true;
    for (auto& th : threads) th.join();
    maintainer.stop();
    // Every short retention has passed: one more maintenance retires every ended generation that
    // holds no key of a long retention (those claimed by the processes, and the long keys).
    std::this_thread::sleep_for(1500ms);
    const auto removed_last = store.purge_expired();

    CHECK(errors == std::vector<std::string>{});
    CHECK(maintainer.errors() == std::vector<std::string>{});
    CHECK(wrong_replays == 0);
    // Long keys: one effect each (the processes' scope is checked by check_race below).
    CHECK(admin.scalar("SELECT count(*) FROM " + long_effects) == executed_long.load());
    CHECK(admin.scalar("SELECT count(DISTINCT key) FROM " + long_effects) == executed_long.load());
    CHECK(executed_long >= kLongKeys / 2);
    // Short and tx keys: no run began before the previous run's retention had passed.
    const auto overlaps = admin.scalar(
        "SELECT count(*) FROM (SELECT created_us, lag(expires_us) OVER (PARTITION BY kind, key ORDER BY created_us) "
        "AS previous_expiry FROM " +
        spans + ") s WHERE created_us < previous_expiry");
    CHECK(overlaps == 0);
    const auto reruns = admin.scalar("SELECT count(*) - count(DISTINCT (kind, key)) FROM " + spans);
    CHECK(reruns > 0);  // keys did expire and run again
    CHECK(admin.scalar("SELECT count(*) FROM " + spans + " WHERE kind = 'tx'") > 0);
    // Generations were retired with keys in them, and none is left that could go.
    CHECK(maintainer.removed() + removed_last > 0);
    CHECK(admin.scalar(
              "SELECT count(*) FROM " + tables.idem + " t WHERE t.generation + " +
              std::to_string(std::chrono::milliseconds(kLength).count()) +
              " <= (extract(epoch FROM now()) * 1000)::bigint AND NOT EXISTS (SELECT 1 FROM " + tables.idem +
              " u WHERE u.generation = t.generation AND (u.state = 'in_progress' OR u.expires_at >= now()))") == 0);
    UNSCOPED_INFO("process races " << races << ", calls " << calls << ", long executions " << executed_long
                                   << ", reruns " << reruns << ", rows removed with their generations "
                                   << maintainer.removed() << " in " << maintainer.runs() << " maintenances");
}

TEST_CASE("generations: a claim waits for a claim of its key in an older generation", "[generations]") {
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, gen_options(tables.idem, 4, 20));
    store.ensure_schema();
    const idem::Key key(idem_test::unique_name("wait"), "k");
    const auto fp = idem::fingerprint("POST"s, "k"s);
    HeldClaim first(store, key, fp);           // its claim open in generation g
    std::this_thread::sleep_for(kLength * 2);  // a newer generation is current now
    // The second claim goes to the newer generation: without the key's lock its lookup would not
    // see the uncommitted row, and it would win (a second effect). It waits, then answers in_progress.
    const auto second = store.claim(key, fp);
    CHECK(second.status == idem::ClaimStatus::in_progress);
    CHECK(first.release().outcome() == idem::Outcome::executed);
    const auto third = store.claim(key, fp);
    REQUIRE(third.status == idem::ClaimStatus::completed);
    PgConn admin(url);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.idem + " WHERE scope = $1", {key.scope()}) == 1);
}

TEST_CASE("generations: a replay of a key in the newest live generation reads no older generation", "[generations]") {
    // A retry usually comes soon after its claim: its key is in the current generation, and the
    // claim's lookups (the claimable function, then the read) stop there, newest first. Counted
    // with PostgreSQL's index statistics: an older generation's index is never scanned.
    const auto url = idem_test::require_db();
    Tables tables(url);
    PgConn admin(url);
    std::vector<std::string> generations;  // every partition's start, oldest first
    {
        idem::PostgresStore maker(url, gen_options(tables.idem, 1, 20));
        maker.ensure_schema();
    }
    const auto starts = [&] {
        std::vector<std::string> out;
        const auto r = admin.exec(
            "SELECT substring(c.relname FROM '_g([0-9]+)$')::bigint FROM pg_inherits i JOIN pg_class c ON c.oid = "
            "i.inhrelid WHERE i.inhparent = $1::regclass ORDER BY 1",
            {tables.idem});
        for (int i = 0; i < PQntuples(r.get()); ++i) out.emplace_back(PQgetvalue(r.get(), i, 0));
        return out;
    };
    generations = starts();
    REQUIRE(generations.size() >= 3);
    // Wait until the oldest generation has ended by the database's clock: the next one is current.
    const std::string current = generations[1];
    for (int i = 0; i < 100 && admin.scalar("SELECT ((extract(epoch FROM now()) * 1000)::bigint >= $1::bigint)::int",
                                            {current}) == 0;
         ++i) {
        std::this_thread::sleep_for(50ms);
    }
    const std::string scope = idem_test::unique_name("newest");
    const auto fp = idem::fingerprint("POST"s, "k"s);
    std::string fp_hex = "\\x";
    fp_hex += fp.hex();
    // "old" in the ended generation, "new" in the current one, both completed (written directly:
    // an INSERT scans no index).
    for (const auto& [key, generation] : {std::pair{"old"s, generations[0]}, std::pair{"new"s, current}}) {
        admin.exec("INSERT INTO " + tables.idem +
                       " (scope, key, state, fingerprint, fingerprint_alg, fence, attempt, result, created_at, "
                       "lease_until, completed_at, expires_at, generation) VALUES ($1, $2, 'completed', $3::bytea, 1, "
                       "1, 1, 'stored'::bytea, now(), now(), now(), now() + interval '1 hour', $4::bigint)",
                   {scope, key, fp_hex, generation});
    }
    // Index scans per generation so far (statistics of ended sessions; ours scans none).
    const auto scans = [&](const std::string& generation) {
        return admin.scalar("SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_user_indexes WHERE relname = $1",
                            {tables.idem + "_g" + generation});
    };
    const long long old_before = scans(generations[0]), new_before = scans(current);
    constexpr int kReplays = 20;
    {
        idem::PostgresStore store(url, gen_options(tables.idem, 1, 20));
        for (int i = 0; i < kReplays; ++i) {
            const auto c = store.claim(idem::Key(scope, "new"), fp);
            REQUIRE(c.status == idem::ClaimStatus::completed);
            REQUIRE(c.existing);
            CHECK(c.existing->result == "stored");
        }
    }  // its session ends: PostgreSQL publishes the session's statistics
    // Each replay scans the current generation at least once (the claimable function's lookup).
    for (int i = 0; i < 300 && scans(current) - new_before < kReplays; ++i) std::this_thread::sleep_for(50ms);
    REQUIRE(scans(current) - new_before >= kReplays);
    CHECK(scans(generations[0]) - old_before == 0);
}

TEST_CASE("generations: negative control, a lookup without the key's lock lets the newer generation win",
          "[generations]") {
    // The same steps as above on a table whose claimable function looks the key up without
    // taking its lock first: the second claim does not see the uncommitted claim in the older
    // generation, and wins. The test above would catch a claim path that skipped the lock.
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, gen_options(tables.idem, 4, 20));
    store.ensure_schema();
    PgConn admin(url);
    admin.exec("CREATE OR REPLACE FUNCTION " + tables.idem +
               "_claimable(claim_scope text, claim_key text) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $fn$ "
               "BEGIN RETURN NOT EXISTS (SELECT 1 FROM " +
               tables.idem + " WHERE scope = claim_scope AND key = claim_key); END $fn$");
    const idem::Key key(idem_test::unique_name("nolock"), "k");
    const auto fp = idem::fingerprint("POST"s, "k"s);
    HeldClaim first(store, key, fp);
    std::this_thread::sleep_for(kLength * 2);
    const auto second = store.claim(key, fp);
    (void)first.release();
    CHECK(second.status == idem::ClaimStatus::claimed);  // the double claim the lock prevents
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.idem + " WHERE scope = $1", {key.scope()}) == 2);
}

TEST_CASE("generations: an uncommitted claim keeps its ended generation from being retired", "[generations]") {
    // Its row is invisible to the maintenance's reads until it commits: closing the generation
    // waits for its transaction (lock_timeout, then the generation is kept for next time).
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, gen_options(tables.idem, 4, 20));
    store.ensure_schema();
    PgConn admin(url);
    const idem::Key key(idem_test::unique_name("open"), "k");
    const auto fp = idem::fingerprint("POST"s, "k"s);
    idem::ClaimOptions options;
    options.retention = 60s;
    std::atomic<int> runs{0};
    HeldClaim first(store, key, fp, options, &runs);
    std::this_thread::sleep_for(kLength * 2);  // its generation has ended
    CHECK(store.purge_expired() == 0);         // waits lock_timeout (1 s) to close it, keeps it
    CHECK(first.release().outcome() == idem::Outcome::executed);
    CHECK(store.purge_expired() == 0);  // closed now, and holding a live key: kept
    const auto again = idem::execute_once(
        store, key, fp,
        [&] {
            ++runs;
            return "second"s;
        },
        options);
    CHECK(again.outcome() == idem::Outcome::replayed);
    CHECK(again.response() == "first");
    CHECK(runs == 1);
}

TEST_CASE("generations: an ended generation with a key in progress is kept until it completes and expires",
          "[generations]") {
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, gen_options(tables.idem, 2, 20));
    store.ensure_schema();
    PgConn admin(url);
    const idem::Key key(idem_test::unique_name("kept"), "k");
    const auto fp = idem::fingerprint("POST"s, "k"s);
    idem::ClaimOptions options;
    options.retention = 1s;
    const auto claim = store.claim(key, fp, options);
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    std::this_thread::sleep_for(1500ms);  // its generation has ended and its retention passed
    CHECK(store.purge_expired() == 0);
    REQUIRE(store.read(key).has_value());
    CHECK(store.claim(key, fp, options).status == idem::ClaimStatus::in_progress);
    // The generation is closed: nothing can enter it any more, and it is checked again next time.
    CHECK(admin.scalar("SELECT count(*) FROM pg_trigger t JOIN pg_inherits i ON i.inhrelid = t.tgrelid "
                       "WHERE i.inhparent = to_regclass($1) AND t.tgname = 'idem_closed'",
                       {tables.idem}) >= 1);
    store.save(key, claim.fence, "done");  // completed, and past its retention already
    const std::string partition =
        tables.idem + "_g" +
        std::to_string(admin.scalar("SELECT generation FROM " + tables.idem + " WHERE scope = $1", {key.scope()}));
    CHECK(admin.scalar("SELECT count(*) FROM pg_class WHERE relname = $1", {partition}) == 1);
    CHECK(store.purge_expired() == 1);
    CHECK(admin.scalar("SELECT count(*) FROM pg_class WHERE relname = $1", {partition}) == 0);
    CHECK_FALSE(store.read(key).has_value());
    CHECK(store.claim(key, fp, options).status == idem::ClaimStatus::claimed);
}

TEST_CASE("generations: configuration errors are config_error, an outage of generations is not", "[generations]") {
    const auto url = idem_test::require_db();
    SECTION("a plain table refuses a generational store, and the other way round") {
        Tables plain(url);
        idem::PostgresOptions o;
        o.table = plain.idem;
        idem::PostgresStore(url, o).ensure_schema();
        CHECK_THROWS_AS(idem::PostgresStore(url, gen_options(plain.idem)).ensure_schema(), idem::config_error);
        CHECK_THROWS_AS(idem::PostgresStore(url, gen_options(plain.idem)).purge_expired(), idem::config_error);
        CHECK_THROWS_AS(
            (void)idem::PostgresStore(url, gen_options(plain.idem)).claim(idem::Key("s", "k"), idem::fingerprint("x"s)),
            idem::config_error);
        Tables gen(url);
        idem::PostgresStore(url, gen_options(gen.idem)).ensure_schema();
        o.table = gen.idem;
        CHECK_THROWS_AS(idem::PostgresStore(url, o).ensure_schema(), idem::config_error);
        CHECK_THROWS_AS((void)idem::PostgresStore(url, o).claim(idem::Key("s", "k"), idem::fingerprint("x"s)),
                        idem::config_error);
    }
    SECTION("another length than the table's") {
        Tables gen(url);
        idem::PostgresStore(url, gen_options(gen.idem)).ensure_schema();
        auto other = gen_options(gen.idem);
        other.generations->length = 600ms;
        CHECK_THROWS_AS(idem::PostgresStore(url, other).purge_expired(), idem::config_error);
    }
    SECTION("out of generations: claims fail with store_unavailable until maintenance runs") {
        Tables gen(url);
        // Two ahead: once purge_expired() has made them again, the claim after it has at least two
        // generation lengths to start in, whatever the machine's stalls.
        idem::PostgresStore store(url, gen_options(gen.idem, 2, 2));
        store.ensure_schema();
        std::this_thread::sleep_for(kLength * 4);  // past the current generation and the two ahead
        const idem::Key key(idem_test::unique_name("late"), "k");
        CHECK_THROWS_AS((void)store.claim(key, idem::fingerprint("x"s)), idem::store_unavailable);
        store.purge_expired();
        CHECK(store.claim(key, idem::fingerprint("x"s)).status == idem::ClaimStatus::claimed);
    }
    SECTION("a server whose transactions default to SERIALIZABLE") {
        Tables gen(url);
        idem::PostgresStore(url, gen_options(gen.idem)).ensure_schema();
        idem::PostgresStore strict(url + " options='-c default_transaction_isolation=serializable'",
                                   gen_options(gen.idem));
        CHECK_THROWS_AS((void)strict.claim(idem::Key("s", "k"), idem::fingerprint("x"s)), idem::config_error);
    }
    SECTION("invalid options") {
        auto o = gen_options("idem_keys");
        o.generations->length = 999ms;  // maintenance cannot keep up with shorter ones
        CHECK_THROWS_AS(idem::PostgresStore(url, o), idem::config_error);
        o.generations->length = 1s;
        o.generations->ahead = 0;
        CHECK_THROWS_AS(idem::PostgresStore(url, o), idem::config_error);
    }
}

TEST_CASE("generations: a detach cut short is finished by the next maintenance", "[generations]") {
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, gen_options(tables.idem, 2, 20));
    store.ensure_schema();
    PgConn admin(url);
    const idem::Key key(idem_test::unique_name("pending"), "k");
    const auto fp = idem::fingerprint("POST"s, "k"s);
    idem::ClaimOptions options;
    options.retention = 1s;
    const auto claim = store.claim(key, fp, options);
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    store.save(key, claim.fence, "done");
    const std::string partition =
        tables.idem + "_g" +
        std::to_string(admin.scalar("SELECT generation FROM " + tables.idem + " WHERE scope = $1", {key.scope()}));
    std::this_thread::sleep_for(1500ms);
    // A reader's open transaction holds the table: DETACH … CONCURRENTLY waits for it, past the
    // store's lock_timeout, and stays pending.
    PgConn reader(url);
    reader.exec("BEGIN");
    (void)reader.scalar("SELECT count(*) FROM " + tables.idem);
    CHECK(store.purge_expired() == 0);
    CHECK(admin.scalar("SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1) AND inhdetachpending",
                       {tables.idem}) == 1);
    reader.exec("COMMIT");
    (void)store.purge_expired();
    CHECK(admin.scalar("SELECT count(*) FROM pg_class WHERE relname = $1", {partition}) == 0);
    CHECK(store.claim(key, fp, options).status == idem::ClaimStatus::claimed);  // expired and gone: new
}

TEST_CASE("generations: a plain table migrated as docs/design.md says keeps every key", "[generations]") {
    // Also for a plain table whose CHECK constraints carry other names than PostgreSQL gives them
    // (made by hand, or renamed): ATTACH matches a partition's constraints to the table's by name.
    const bool other_names = GENERATE(false, true);
    CAPTURE(other_names);
    const auto url = idem_test::require_db();
    Tables tables(url);
    const std::string& t = tables.idem;
    idem::PostgresOptions plain_options;
    plain_options.table = t;
    idem::PostgresStore plain(url, plain_options);
    plain.ensure_schema();
    if (other_names) {
        PgConn owner(url);
        owner.exec("ALTER TABLE " + t + " RENAME CONSTRAINT " + t + "_state_check TO known_states");
        owner.exec("ALTER TABLE " + t + " RENAME CONSTRAINT " + t + "_check TO result_when_completed");
    }
    const std::string scope = idem_test::unique_name("migrate");
    const auto fp = idem::fingerprint("POST"s);
    idem::ClaimOptions long_retention, short_retention;
    long_retention.retention = std::chrono::hours(1);
    short_retention.retention = 1s;
    const auto saved = plain.claim(idem::Key(scope, "saved"), fp, long_retention);
    plain.save(idem::Key(scope, "saved"), saved.fence, "old bytes");
    const auto expired = plain.claim(idem::Key(scope, "expired"), fp, short_retention);
    plain.save(idem::Key(scope, "expired"), expired.fence, "gone");
    const auto running = plain.claim(idem::Key(scope, "running"), fp, long_retention);
    REQUIRE(running.status == idem::ClaimStatus::claimed);

    // The migration, with the service stopped: the statements docs/design.md lists.
    PgConn admin(url);
    admin.exec("BEGIN");
    admin.exec("ALTER TABLE " + t + " RENAME TO " + t + "_g0");
    admin.exec("ALTER INDEX " + t + "_expires_at_idx RENAME TO " + t + "_g0_expires_at_idx");
    admin.exec("ALTER TABLE " + t + "_g0 RENAME CONSTRAINT " + t + "_pkey TO " + t + "_g0_pkey");
    admin.exec("ALTER TABLE " + t + "_g0 ADD COLUMN generation bigint NOT NULL DEFAULT 0");
    admin.exec("ALTER TABLE " + t + "_g0 DROP CONSTRAINT " + t + "_g0_pkey, ADD PRIMARY KEY (scope, key, generation)");
    if (other_names) {  // the names the partitioned table gives its checks
        admin.exec("ALTER TABLE " + t + "_g0 RENAME CONSTRAINT known_states TO " + t + "_state_check");
        admin.exec("ALTER TABLE " + t + "_g0 RENAME CONSTRAINT result_when_completed TO " + t + "_check");
    }
    admin.exec("COMMIT");
    idem::PostgresStore store(url, gen_options(t, 2, 20));
    store.ensure_schema();
    admin.exec("ALTER TABLE " + t + " ATTACH PARTITION " + t + "_g0 FOR VALUES IN (0)");

    const auto replay = store.claim(idem::Key(scope, "saved"), fp);
    REQUIRE(replay.status == idem::ClaimStatus::completed);
    CHECK(replay.existing->result == "old bytes");
    CHECK(store.claim(idem::Key(scope, "running"), fp).status == idem::ClaimStatus::in_progress);
    std::this_thread::sleep_for(1100ms);
    CHECK(store.claim(idem::Key(scope, "expired"), fp).status == idem::ClaimStatus::claimed);
    CHECK(store.purge_expired() == 0);  // generation 0 still holds a live key and a running one
    store.save(idem::Key(scope, "running"), running.fence, "late");
    CHECK(store.claim(idem::Key(scope, "running"), fp).status == idem::ClaimStatus::completed);
    CHECK(admin.scalar("SELECT count(*) FROM " + t + " WHERE scope = $1", {scope}) == 3);
    CHECK(admin.scalar("SELECT count(*) FROM pg_indexes WHERE tablename = $1 AND indexdef LIKE '%expires_at%'", {t}) ==
          1);
}

TEST_CASE("generations: a key re-claimed in its closed generation after the check is not dropped with it",
          "[generations]") {
    // An in-transaction claim whose transaction began before its generation g ended reads an
    // expired key of g and re-claims it. Its now() is still in g, so `generation = DEFAULT` keeps
    // the row in g: an update in place, which the close (a BEFORE INSERT trigger) does not stop.
    // If maintenance closed and checked g in between, dropping g would drop the re-claimed key
    // with its fresh retention, and the next claim would run the effect again. Every step waits
    // for what the database shows: the key's expiry and g's end by its clock, the claim's wait on
    // the key's lock (which the test holds), the closing trigger and the detach's wait on the
    // table's SHARE UPDATE EXCLUSIVE lock (which the test holds too).
    constexpr auto length = 8s;
    const auto url = idem_test::require_db();
    Tables tables(url);
    const auto options_of = [&](std::size_t ahead) {
        auto o = gen_options(tables.idem, 2, ahead);
        o.generations->length = length;
        o.lock_timeout = 20s;
        o.statement_timeout = 40s;
        return o;
    };
    idem::PostgresStore store(url, options_of(4));
    store.ensure_schema();
    idem::PostgresStore maintenance(url, options_of(1));  // every generation it needs exists
    PgConn admin(url), key_lock(url), table_lock(url);
    const idem::Key key(idem_test::unique_name("inplace"), "k");
    const auto fp = idem::fingerprint("POST"s, "k"s);
    std::atomic<int> runs{0};
    const auto effect = [&](std::string body) {
        return [&runs, body](idem::Transaction&) {
            ++runs;
            return body;
        };
    };
    idem::ClaimOptions short_retention, long_retention;
    short_retention.retention = 1s;
    long_retention.retention = 60s;
    const auto clock_ms = [&] { return admin.scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"); };
    const auto wait_for_clock = [&](long long ms) {
        wait_for(admin, "SELECT ((extract(epoch FROM clock_timestamp()) * 1000)::bigint >= $1::bigint)::int",
                 {std::to_string(ms)});
    };
    const long long length_ms = std::chrono::milliseconds(length).count();

    // The first claim, at least 6 s before its generation ends (else in the next one).
    if (const long long now = clock_ms(); now % length_ms > length_ms - 6000) {
        wait_for_clock((now / length_ms + 1) * length_ms);
    }
    REQUIRE(idem::execute_once_in_transaction(store, key, fp, effect("first"), short_retention).outcome() ==
            idem::Outcome::executed);
    const auto g = admin.scalar("SELECT generation FROM " + tables.idem + " WHERE scope = $1", {key.scope()});
    (void)maintenance.purge_expired();  // the generations before g are gone: g is the next to retire
    wait_for(admin, "SELECT (expires_at < clock_timestamp())::int FROM " + tables.idem + " WHERE scope = $1",
             {key.scope()});  // the key has expired

    key_lock.exec("BEGIN");
    key_lock.exec("SELECT " + tables.idem + "_claimable($1, $2)", {key.scope(), key.value()});
    auto reclaim = std::async(std::launch::async, [&] {
        return idem::execute_once_in_transaction(store, key, fp, effect("second"), long_retention);
    });
    wait_for(admin, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'");
    // The scenario needs the re-claim's transaction to have begun in g.
    REQUIRE(admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' AND "
                         "(extract(epoch FROM xact_start) * 1000)::bigint < $1::bigint",
                         {std::to_string(g + length_ms)}) == 1);

    wait_for_clock(g + length_ms);  // g has ended: maintenance closes and checks it, then waits to detach it
    table_lock.exec("BEGIN");
    table_lock.exec("LOCK TABLE ONLY " + tables.idem + " IN SHARE UPDATE EXCLUSIVE MODE");
    auto maintained = std::async(std::launch::async, [&] { return maintenance.purge_expired(); });
    wait_for(admin,
             "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%DETACH%' AND "
             "query LIKE '%' || $1 || '%'",
             {tables.idem + "_g" + std::to_string(g)});
    CHECK(admin.scalar("SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = 'idem_closed'",
                       {tables.idem + "_g" + std::to_string(g)}) == 1);

    key_lock.exec("COMMIT");  // the claim reads the expired key and re-claims it
    const auto second = reclaim.get();
    CHECK(second.outcome() == idem::Outcome::executed);
    table_lock.exec("COMMIT");  // maintenance detaches and drops g
    (void)maintained.get();
    (void)maintenance.purge_expired();

    // Within the second run's retention: a replay of its bytes, no third run.
    const auto third = idem::execute_once_in_transaction(store, key, fp, effect("third"), long_retention);
    CHECK(third.outcome() == idem::Outcome::replayed);
    CHECK(third.response() == "second");
    CHECK(runs == 2);
}

TEST_CASE("generations: ensure_schema() while purge_expired() creates generations neither fails", "[generations]") {
    // Instances starting (ensure_schema) while another maintains the table (purge_expired): the
    // two take the table's locks and the maintenance lock, and must not take them in opposite
    // orders (a deadlock: PostgreSQL cancels one of them). A lock the test holds on the table makes
    // the maintenance wait with its lock taken, and ensure_schema() start meanwhile: it tries the
    // maintenance lock, and tries again until the maintenance is done.
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, gen_options(tables.idem, 2, 2));
    store.ensure_schema();
    auto maintainer_options = gen_options(tables.idem, 1, 8);  // six generations to create
    maintainer_options.lock_timeout = 30s;
    maintainer_options.statement_timeout = 60s;
    idem::PostgresStore maintainer(url, maintainer_options);
    PgConn admin(url), table_lock(url);
    const auto started_ms = admin.scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint");
    table_lock.exec("BEGIN");
    table_lock.exec("LOCK TABLE ONLY " + tables.idem + " IN SHARE MODE");
    auto maintained = std::async(std::launch::async, [&] { return maintainer.purge_expired(); });
    wait_for(admin, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%ATTACH%'");
    auto starting = gen_options(tables.idem, 1, 2);
    starting.application_name = idem_test::unique_name("starting");
    auto ensured = std::async(std::launch::async, [&] { idem::PostgresStore(url, starting).ensure_schema(); });
    wait_for(admin,
             "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND (wait_event_type = 'Lock' OR "
             "query = 'ROLLBACK')",
             {starting.application_name});
    table_lock.exec("COMMIT");
    CHECK_NOTHROW(ensured.get());
    CHECK_NOTHROW(maintained.get());
    // The maintenance attached its generations: the newest is 8 past the one current when it began
    // (however many ended ones it also retired meanwhile).
    CHECK(admin.scalar("SELECT max(substring(c.relname FROM '_g([0-9]+)$')::bigint) FROM pg_inherits i JOIN pg_class "
                       "c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass($1)",
                       {tables.idem}) >= started_ms + 7 * std::chrono::milliseconds(kLength).count());
}

TEST_CASE("generations: an in-transaction re-claim that loses to a concurrent re-claimer answers in_progress",
          "[generations]") {
    // A re-claim moves the row to the current generation; a second re-claimer waiting on the
    // row's lock then gets 40001 (the row moved to another partition). It reads the key again and
    // finds it in progress (docs/design.md, "Generations"), in in-transaction mode too.
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, gen_options(tables.idem, 2, 20));
    store.ensure_schema();
    PgConn admin(url), mover(url);
    const idem::Key key(idem_test::unique_name("moved"), "k");
    const auto fp = idem::fingerprint("POST"s, "k"s);
    idem::ClaimOptions short_retention;
    short_retention.retention = 1s;
    std::atomic<int> runs{0};
    const auto effect = [&](idem::Transaction&) {
        ++runs;
        return "body"s;
    };
    REQUIRE(idem::execute_once_in_transaction(store, key, fp, effect, short_retention).outcome() ==
            idem::Outcome::executed);
    std::this_thread::sleep_for(1200ms);  // expired, and a newer generation is current
    // Another re-claimer, its transaction still open: the row is in the current generation now,
    // in progress, and locked.
    mover.exec("BEGIN");
    REQUIRE(std::atoll(PQcmdTuples(
                mover
                    .exec("UPDATE " + tables.idem +
                              " SET generation = DEFAULT, state = 'in_progress', fence = 7, result = NULL, "
                              "lease_until = now() + interval '1 hour', expires_at = now() + interval '1 hour' "
                              "WHERE scope = $1 AND key = $2 AND state = 'completed' AND expires_at < now()",
                          {key.scope(), key.value()})
                    .get())) == 1);
    auto second = std::async(
        std::launch::async, [&] { return idem::execute_once_in_transaction(store, key, fp, effect, short_retention); });
    wait_for(admin, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE%'");
    mover.exec("COMMIT");
    const auto result = second.get();  // before the fix: a database_error (40001)
    CHECK(result.outcome() == idem::Outcome::in_progress);
    CHECK(runs == 1);
}

// A key saved with a retention of 1 s and past it now (its row completed and expired), for the
// tests of a re-claim. reclaim_in(mover): `mover` re-claims the row (fence 7), as a concurrent
// re-claimer would, and keeps its transaction open, holding the row.
struct ExpiredKey {
    idem::Key key;
    idem::Fingerprint fp = idem::fingerprint("POST"s, "k"s);
    idem::ClaimOptions options;
    std::string table;

    ExpiredKey(idem::PostgresStore& store, PgConn& admin, std::string idem_table, const std::string& name)
        : key(idem_test::unique_name(name), "k"), table(std::move(idem_table)) {
        options.retention = 1s;
        const auto first = store.claim(key, fp, options);
        REQUIRE(first.status == idem::ClaimStatus::claimed);
        store.save(key, first.fence, "first");
        wait_for(admin, "SELECT (expires_at < clock_timestamp())::int FROM " + table + " WHERE scope = $1",
                 {key.scope()});
    }
    void reclaim_in(PgConn& mover) const {
        mover.exec("BEGIN");
        REQUIRE(mover
                    .exec("UPDATE " + table +
                              " SET generation = DEFAULT, state = 'in_progress', fence = 7, result = NULL, "
                              "lease_until = now() + interval '1 hour', expires_at = now() + interval '1 hour' "
                              "WHERE scope = $1 AND key = $2 AND state = 'completed' AND expires_at < now() "
                              "RETURNING fence",
                          {key.scope(), key.value()})
                    .rows() == 1);
    }
};

TEST_CASE("generations: a re-claim that waits past lock_timeout on a concurrent re-claimer answers in_progress",
          "[generations]") {
    // Another re-claimer (an in-transaction one, say) holds the expired row while its effect runs.
    // Waiting on it is the key being busy, as for the claim's INSERT: tried again, then
    // in_progress — never store_unavailable, which says the database is away.
    const auto url = idem_test::require_db();
    Tables tables(url);
    auto options = gen_options(tables.idem, 2, 20);
    options.lock_timeout = 200ms;
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    PgConn admin(url), mover(url);
    const ExpiredKey expired(store, admin, tables.idem, "held");
    const auto& key = expired.key;
    const auto& fp = expired.fp;
    const auto& short_retention = expired.options;
    expired.reclaim_in(mover);
    std::atomic<int> runs{0};
    const auto second = idem::execute_once(
        store, key, fp,
        [&] {
            ++runs;
            return "second"s;
        },
        short_retention);  // before: store_unavailable (55P03 from the re-claim's UPDATE)
    CHECK(second.outcome() == idem::Outcome::in_progress);
    CHECK(runs == 0);
    mover.exec("ROLLBACK");
    CHECK(store.claim(key, fp, short_retention).status == idem::ClaimStatus::claimed);  // free again: re-claimed
}

TEST_CASE("generations: an in-transaction re-claim that waits past lock_timeout on a re-claimer answers in_progress",
          "[generations]") {
    // The same wait from in-transaction mode, whose claim decides by the same machine: busy, tried
    // again, then in_progress — never store_unavailable.
    const auto url = idem_test::require_db();
    Tables tables(url);
    auto options = gen_options(tables.idem, 2, 20);
    options.lock_timeout = 200ms;
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    PgConn admin(url), mover(url);
    const ExpiredKey expired(store, admin, tables.idem, "held_tx");
    const auto& key = expired.key;
    const auto& fp = expired.fp;
    const auto& short_retention = expired.options;
    expired.reclaim_in(mover);
    std::atomic<int> runs{0};
    const auto second = store.run_in_transaction(key, fp, short_retention, [&](idem::Transaction&) {
        ++runs;
        return "second"s;
    });  // before: store_unavailable (55P03 from the re-claim's UPDATE)
    CHECK(second.status == idem::ClaimStatus::in_progress);
    CHECK(second.retry_after == options.max_retry_after);
    CHECK(runs == 0);
    mover.exec("ROLLBACK");
    const auto third = store.run_in_transaction(key, fp, short_retention, [&](idem::Transaction&) {
        ++runs;
        return "third"s;
    });
    CHECK(third.status == idem::ClaimStatus::claimed);  // free again: re-claimed, and run once
    CHECK(runs == 1);
}

TEST_CASE("generations: an in-transaction re-claim whose connection breaks starts again on a fresh one",
          "[generations]") {
    // The re-claim's UPDATE waits on a row another transaction holds; its backend is terminated
    // meanwhile. Nothing of the claim committed: it starts again, re-claims the key once the row
    // is free and runs the effect once — not an in_progress answer for a key nobody holds.
    const auto url = idem_test::require_db();
    Tables tables(url);
    auto options = gen_options(tables.idem, 2, 20);
    options.application_name = idem_test::unique_name("reclaim_broken");
    options.statement_timeout = 60s;  // the re-claim waits on the row until the test lets it go
    options.lock_timeout = 50s;
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    PgConn admin(url), mover(url);
    const ExpiredKey expired(store, admin, tables.idem, "broken_tx");
    const auto& key = expired.key;
    const auto& fp = expired.fp;
    const auto& short_retention = expired.options;
    expired.reclaim_in(mover);
    std::atomic<int> runs{0};
    auto second = std::async(std::launch::async, [&] {
        return store.run_in_transaction(key, fp, short_retention, [&](idem::Transaction&) {
            ++runs;
            return "second"s;
        });
    });
    const std::string waiting = "FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'";
    wait_for(admin, "SELECT count(*) " + waiting, {options.application_name});
    CHECK(admin.scalar("SELECT count(pg_terminate_backend(pid)) " + waiting, {options.application_name}) == 1);
    // The retry waits on the same row again: then it is free.
    wait_for(admin, "SELECT count(*) " + waiting, {options.application_name});
    mover.exec("ROLLBACK");
    const auto outcome = second.get();  // before: in_progress, retry_after 0
    CHECK(outcome.status == idem::ClaimStatus::claimed);
    CHECK(runs == 1);
}

TEST_CASE("generations: generations a maintenance left behind are dropped by the next one", "[generations]") {
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, gen_options(tables.idem, 2, 20));
    store.ensure_schema();
    PgConn admin(url);
    const idem::Key key(idem_test::unique_name("leftover"), "k");
    const auto claim = store.claim(key, idem::fingerprint("POST"s));
    store.save(key, claim.fence, "done");
    const std::string part =
        tables.idem + "_g" +
        std::to_string(admin.scalar("SELECT generation FROM " + tables.idem + " WHERE scope = $1", {key.scope()}));
    // What a maintenance cut off between its detach and its DROP leaves: an ended, closed
    // generation that is no partition any more. A table of the same name pattern without the
    // trigger is not idem's.
    std::this_thread::sleep_for(kLength * 2);
    admin.exec("CREATE TRIGGER idem_closed BEFORE INSERT ON " + part + " FOR EACH ROW EXECUTE FUNCTION " + tables.idem +
               "_closed()");
    admin.exec("ALTER TABLE " + tables.idem + " DETACH PARTITION " + part);
    const std::string lookalike = tables.idem + "_g42";
    admin.exec("CREATE TABLE " + lookalike + " (x int)");
    const idem_test::DropTable drop_lookalike(url, lookalike);
    // And what one cut off between making a generation ahead and attaching it leaves: a table
    // with the "made ahead" comment, of a generation whose time has passed.
    const std::string made_ahead = tables.idem + "_g1000";
    admin.exec("CREATE TABLE " + made_ahead + " (LIKE " + tables.idem + ")");
    admin.exec("COMMENT ON TABLE " + made_ahead + " IS 'idem: a generation made ahead, attached when it is due'");
    (void)store.purge_expired();
    CHECK(admin.scalar("SELECT count(*) FROM pg_class WHERE relname = $1", {part}) == 0);
    CHECK(admin.scalar("SELECT count(*) FROM pg_class WHERE relname = $1", {made_ahead}) == 0);
    CHECK(admin.scalar("SELECT count(*) FROM pg_class WHERE relname = $1", {lookalike}) == 1);
}

TEST_CASE("generations: instances starting while maintenance finishes a detach do not deadlock with it",
          "[generations]") {
    // ensure_schema() of starting instances serialises on a lock and, with generations, takes the
    // maintenance lock. A maintenance holding that lock finishes a pending detach (DETACH …
    // FINALIZE), which waits for every transaction with an older snapshot. Had an ensure_schema()
    // waited for those locks with a snapshot held, the waits closed a cycle (instance A holds the
    // schema lock and waits for maintenance; maintenance waits for B's snapshot; B waits for A) and
    // PostgreSQL broke it by failing one of them. Steps ordered by what pg_stat_activity shows.
    const auto url = idem_test::require_db();
    Tables tables(url);
    auto quick = gen_options(tables.idem, 2, 2);
    quick.lock_timeout = 300ms;
    idem::PostgresStore store(url, quick);
    store.ensure_schema();
    PgConn admin(url), reader(url), writer(url);
    const auto fp = idem::fingerprint("POST"s);
    idem::ClaimOptions short_retention;
    short_retention.retention = 1s;
    const idem::Key key(idem_test::unique_name("startup"), "k");
    const auto claim = store.claim(key, fp, short_retention);
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    store.save(key, claim.fence, "done");
    const auto g = admin.scalar("SELECT generation FROM " + tables.idem + " WHERE scope = $1", {key.scope()});
    wait_for(admin, "SELECT ((extract(epoch FROM clock_timestamp()) * 1000)::bigint >= $1::bigint)::int",
             {std::to_string(g + std::chrono::milliseconds(kLength).count())});
    wait_for(admin, "SELECT (expires_at < clock_timestamp())::int FROM " + tables.idem + " WHERE scope = $1",
             {key.scope()});
    // A detach cut short (a reader holds the table past lock_timeout): pending.
    reader.exec("BEGIN");
    (void)reader.scalar("SELECT count(*) FROM " + tables.idem);
    (void)store.purge_expired();
    REQUIRE(admin.scalar("SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1) AND inhdetachpending",
                         {tables.idem}) == 1);
    reader.exec("COMMIT");
    // A maintenance that waits (holding its lock) to attach generations behind a writer, then
    // finishes the pending detach.
    writer.exec("BEGIN");
    writer.exec("LOCK TABLE " + tables.idem + " IN ROW EXCLUSIVE MODE");
    auto patient = gen_options(tables.idem, 2, 8);  // 8 ahead: fewer than half are ready, it attaches
    patient.lock_timeout = 30s;
    patient.statement_timeout = 60s;
    idem::PostgresStore maintainer(url, patient);
    auto maintained = std::async(std::launch::async, [&] { return maintainer.purge_expired(); });
    wait_for(admin,
             "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'LOCK TABLE%'");
    // Two instances start: A gets the schema lock and asks for the maintenance lock, B asks for
    // the schema lock.
    const auto start_instance = [&](const std::string& app) {
        auto o = patient;
        o.application_name = app;
        return std::async(std::launch::async, [&url, o] { idem::PostgresStore(url, o).ensure_schema(); });
    };
    const std::string app_a = idem_test::unique_name("inst_a"), app_b = idem_test::unique_name("inst_b");
    // Each has asked for its lock: waits for it, or (tried in vain) has rolled back to try again.
    auto a = start_instance(app_a);
    wait_for(admin,
             "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND ((wait_event = 'advisory' AND "
             "query LIKE '%hashtextextended%') OR query = 'ROLLBACK')",
             {app_a});
    auto b = start_instance(app_b);
    wait_for(admin,
             "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND (wait_event = 'advisory' OR "
             "query = 'ROLLBACK')",
             {app_b});
    writer.exec("COMMIT");  // maintenance attaches, then finishes the detach: it waits for older snapshots
    CHECK_NOTHROW(maintained.get());
    CHECK_NOTHROW(a.get());
    CHECK_NOTHROW(b.get());
    CHECK(admin.scalar("SELECT count(*) FROM pg_class WHERE relname = $1", {tables.idem + "_g" + std::to_string(g)}) ==
          0);
}
