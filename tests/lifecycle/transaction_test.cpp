// In-transaction mode (PostgresStore only): claim, the effect's statements and the saved result
// commit or roll back together.
#include <catch2/catch.hpp>

#include <atomic>
#include <future>
#include <latch>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "idem/postgres_transaction.hpp"
#include "lifecycle.hpp"
#include "threads.hpp"

using namespace lifecycle;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;
using idem_test::PgConn;

TEST_CASE("in-transaction mode: commit together, roll back together, duplicates, mismatch",
          "[lifecycle][transaction]") {
    PostgresBackend backend;
    auto& store = backend.make_pg(knobs(4, "idem_lifecycle_test", 200ms, 2));
    EffectsTable effects(backend.conninfo());
    PgConn admin(backend.conninfo());
    const auto scope = fresh_scope("tx");
    const auto fp = idem::fingerprint("POST /orders"s, 2500);
    const std::string insert = "INSERT INTO " + effects.name() + " (scope, key, note) VALUES ($1, $2, $3) RETURNING id";
    std::atomic<int> runs{0};

    SECTION("executed: the effect's row and the saved response are both there; a replay does not run fn") {
        const idem::Key key(scope, "order-1");
        std::string row_id;
        const auto r = idem::execute_once_in_transaction(store, key, fp, [&](idem::Transaction& tx) {
            ++runs;
            const auto rows = tx.exec(insert, {key.scope(), key.value(), "it's \"quoted\"; --"s});
            REQUIRE(rows.rows.size() == 1);
            CHECK(rows.affected == 1);
            row_id = rows.rows[0][0].value();
            const auto none = tx.exec("SELECT NULL::text, $1::int + 1", {"41"});
            CHECK_FALSE(none.rows[0][0]);
            CHECK(none.rows[0][1] == "42"s);
            return Response{201, "order " + row_id + "\0"s};
        });
        REQUIRE(r.outcome() == Outcome::executed);
        CHECK(runs == 1);
        CHECK(effects.count(admin, key) == 1);
        CHECK(admin.scalar("SELECT count(*) FROM " + effects.name() + " WHERE note = $1", {"it's \"quoted\"; --"}) ==
              1);
        auto rec = store.read(key);
        REQUIRE(rec);
        CHECK(rec->state == idem::RecordState::completed);
        CHECK(*rec->result == encode(r.response()));

        const auto replay = idem::execute_once_in_transaction(store, key, fp, [&](idem::Transaction&) {
            ++runs;
            return Response{500, "must not run"};
        });
        CHECK(replay.outcome() == Outcome::replayed);
        CHECK(runs == 1);
        CHECK(encode(replay.response()) == *rec->result);
        CHECK(replay.response().body == "order " + row_id + "\0"s);
        // Plain execute_once on the same key replays it too.
        CHECK(idem::execute_once(store, key, fp, [&] {
                  ++runs;
                  return Response{500, "no"};
              }).outcome() == Outcome::replayed);
        CHECK(runs == 1);
        // Mismatch.
        const auto other = idem::fingerprint("POST /orders"s, 2501);
        CHECK(idem::execute_once_in_transaction(store, key, other, [&](idem::Transaction&) {
                  ++runs;
                  return Response{500, "no"};
              }).outcome() == Outcome::mismatch);
        CHECK(runs == 1);
        CHECK(effects.count(admin, key) == 1);
    }

    SECTION("fn throws: the effect's rows and the claim roll back; the key then executes") {
        const idem::Key key(scope, "order-2");
        CHECK_THROWS_WITH(idem::execute_once_in_transaction(store, key, fp,
                                                            [&](idem::Transaction& tx) -> Response {
                                                                ++runs;
                                                                tx.exec(insert, {key.scope(), key.value(), "first"});
                                                                throw std::runtime_error("card declined upstream");
                                                            }),
                          "card declined upstream");
        CHECK_FALSE(store.read(key));
        CHECK(effects.count(admin) == 0);
        // A failing statement rolls back too (database_error from exec).
        CHECK_THROWS_AS(idem::execute_once_in_transaction(store, key, fp,
                                                          [&](idem::Transaction& tx) {
                                                              ++runs;
                                                              tx.exec(insert, {key.scope(), key.value(), "second"});
                                                              tx.exec("SELECT 1/0");
                                                              return Response{200, "x"};
                                                          }),
                        idem::database_error);
        CHECK_FALSE(store.read(key));
        CHECK(effects.count(admin) == 0);

        const auto r = idem::execute_once_in_transaction(store, key, fp, [&](idem::Transaction& tx) {
            ++runs;
            tx.exec(insert, {key.scope(), key.value(), "third"});
            return Response{201, "third time"};
        });
        CHECK(r.outcome() == Outcome::executed);
        CHECK(runs == 3);
        CHECK(effects.count(admin) == 1);
        CHECK(admin.scalar("SELECT count(*) FROM " + effects.name() + " WHERE note = 'third'") == 1);
        CHECK(store.read(key)->state == idem::RecordState::completed);
    }

    SECTION("a duplicate while the first transaction is open: in_progress; after the commit: replayed") {
        const idem::Key key(scope, "order-3");
        std::latch in_effect(1);
        // A's transaction stays open until the duplicate has its answer (at most 30 s, so that a
        // duplicate that never answers fails the test instead of hanging it).
        std::promise<void> dup_answered;
        auto dup_answered_signal = dup_answered.get_future();
        std::optional<idem::Result<Response>> first;
        std::atomic<bool> open_until_answered{false};
        std::string first_error;
        std::thread a([&] {
            try {
                first.emplace(idem::execute_once_in_transaction(store, key, fp, [&](idem::Transaction& tx) {
                    ++runs;
                    tx.exec(insert, {key.scope(), key.value(), "A"});
                    in_effect.count_down();
                    open_until_answered = dup_answered_signal.wait_for(30s) == std::future_status::ready;
                    return Response{201, "A's order"};
                }));
            } catch (const std::exception& ex) {
                first_error = ex.what();
                in_effect.count_down();
            }
        });
        in_effect.wait();
        const auto t0 = SteadyClock::now();
        const auto dup = idem::execute_once_in_transaction(store, key, fp, [&](idem::Transaction&) {
            ++runs;
            return Response{500, "duplicate ran"};
        });
        const auto t1 = SteadyClock::now();
        dup_answered.set_value();
        a.join();
        REQUIRE(first_error.empty());
        REQUIRE(first);
        CHECK(first->outcome() == Outcome::executed);
        CHECK(open_until_answered);  // answered while A's transaction was still open
        CHECK(dup.outcome() == Outcome::in_progress);
        CHECK(dup.retry_after().count() > 0);
        INFO("the duplicate answered after " << ms(t1 - t0) << " ms");
        CHECK(ms(t1 - t0) >= 350.0);   // waited lock_timeout (200 ms) on each of its 2 attempts
        CHECK(ms(t1 - t0) < 10000.0);  // and not for A's transaction (open 30 s unless answered)
        CHECK(runs == 1);

        const auto after = idem::execute_once_in_transaction(store, key, fp, [&](idem::Transaction&) {
            ++runs;
            return Response{500, "duplicate ran"};
        });
        CHECK(after.outcome() == Outcome::replayed);
        CHECK(after.response() == first->response());
        CHECK(runs == 1);
        CHECK(effects.count(admin, key) == 1);
    }
}

TEST_CASE(
    "in-transaction mode, TransactionOptions::lock_wait: duplicates answer in_progress at once instead of "
    "waiting on the open transaction's row lock",
    "[lifecycle][transaction]") {
    PostgresBackend backend;
    // A long lock_timeout (under the 5 s statement_timeout) and one attempt: a duplicate that
    // waited on the lock would take 4.5 s.
    auto& store = backend.make_pg(knobs(8, "idem_lifecycle_test", 4500ms, 1));
    const auto scope = fresh_scope("txnowait");
    const auto fp = idem::fingerprint("POST /orders"s, 4200);
    idem::ClaimOptions claim;
    idem::TransactionOptions at_once;
    at_once.lock_wait = 1ms;
    const idem::Key key(scope, "order-nowait");
    std::atomic<int> runs{0};

    // The winner's own statements run under the session's lock_timeout, not the short one.
    std::latch in_effect(1);
    std::promise<void> answered;
    auto answered_signal = answered.get_future();
    std::optional<idem::Result<Response>> first;
    std::string first_error, winner_lock_timeout;
    std::thread a([&] {
        try {
            first.emplace(idem::execute_once_in_transaction(
                store, key, fp,
                [&](idem::Transaction& tx) {
                    ++runs;
                    winner_lock_timeout = tx.exec("SHOW lock_timeout").rows.at(0).at(0).value_or("");
                    in_effect.count_down();
                    (void)answered_signal.wait_for(30s);
                    return Response{201, "A's order"};
                },
                claim, at_once));
        } catch (const std::exception& ex) {
            first_error = ex.what();
            in_effect.count_down();
        }
    });
    in_effect.wait();
    constexpr int kDuplicates = 6;
    std::vector<std::optional<idem::Result<Response>>> dups(kDuplicates);
    std::vector<double> took(kDuplicates);
    idem_test::run_threads(kDuplicates, [&](int t) {
        const auto t0 = SteadyClock::now();
        dups[static_cast<std::size_t>(t)].emplace(idem::execute_once_in_transaction(
            store, key, fp,
            [&](idem::Transaction&) {
                ++runs;
                return Response{500, "duplicate ran"};
            },
            claim, at_once));
        took[static_cast<std::size_t>(t)] = ms(SteadyClock::now() - t0);
    });
    answered.set_value();
    a.join();
    REQUIRE(first_error.empty());
    REQUIRE(first);
    CHECK(first->outcome() == Outcome::executed);
    CHECK(winner_lock_timeout == "4500ms");
    for (int t = 0; t < kDuplicates; ++t) {
        REQUIRE(dups[static_cast<std::size_t>(t)]);
        CHECK(dups[static_cast<std::size_t>(t)]->outcome() == Outcome::in_progress);
        CHECK(dups[static_cast<std::size_t>(t)]->retry_after().count() > 0);
        INFO("duplicate " << t << " answered after " << took[static_cast<std::size_t>(t)] << " ms");
        CHECK(took[static_cast<std::size_t>(t)] < 3000.0);  // not the 4.5 s lock_timeout
    }
    CHECK(runs == 1);
    // After the commit, a call that waits for locks replays. (One with a 1 ms lock_wait may still
    // answer in_progress: on Citus the worker's side of the just-committed distributed transaction
    // can hold the row a moment longer, and lock_wait answers in_progress for any lock held.)
    const auto after = idem::execute_once_in_transaction(
        store, key, fp,
        [&](idem::Transaction&) {
            ++runs;
            return Response{500, "duplicate ran"};
        },
        idem::ClaimOptions{}, idem::TransactionOptions{});
    CHECK(after.outcome() == Outcome::replayed);
    CHECK(after.response() == first->response());
    CHECK(runs == 1);
}

TEST_CASE("in-transaction mode: TransactionOptions::lock_wait is checked before any I/O", "[lifecycle][transaction]") {
    PostgresBackend backend;
    auto& store = backend.make_pg(knobs(2, "idem_lifecycle_test", 1000ms, 1));
    const auto scope = fresh_scope("txwaitcheck");
    const auto fp = idem::fingerprint("POST /orders"s, 4200);
    std::atomic<int> runs{0};
    const auto effect = [&](idem::Transaction&) {
        ++runs;
        return Response{201, "ran"};
    };
    // Not below the store's statement_timeout: config_error, nothing claimed, nothing run.
    const idem::TransactionOptions too_long{.lock_wait = store.options().statement_timeout};
    CHECK_THROWS_AS(idem::execute_once_in_transaction(store, idem::Key(scope, "k1"), fp, effect, {}, too_long),
                    idem::config_error);
    CHECK_FALSE(store.read(idem::Key(scope, "k1")));
    CHECK(runs == 0);
}
