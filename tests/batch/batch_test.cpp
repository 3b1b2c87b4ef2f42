// execute_batch over PostgresStore: exactly-once effects under redelivery from several threads and
// consumer instances, round trips per batch, and the per-message semantics of batch_semantics.hpp.
// Needs IDEM_TEST_DATABASE_URL (run under scripts/with-postgres.sh).
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "batch_semantics.hpp"
#include "idem/postgres_store.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "store_env.hpp"

using namespace std::chrono_literals;
using namespace batch_test;
using idem_test::PgConn;

namespace {

using idem_test::require_db;

/// idem's table for one test, with its schema; dropped (with its version row) at the end.
class IdemTable {
public:
    explicit IdemTable(std::string url) : url_(std::move(url)), name_(idem_test::unique_name("idem_batch")) {}
    ~IdemTable() { idem_test::drop_idem_table(url_, name_); }
    IdemTable(const IdemTable&) = delete;
    IdemTable& operator=(const IdemTable&) = delete;

    [[nodiscard]] const std::string& name() const { return name_; }

    [[nodiscard]] std::unique_ptr<idem::PostgresStore> store(std::size_t pool_size = 4) const {
        idem::PostgresOptions options;
        options.table = name_;
        options.pool_size = pool_size;
        auto s = std::make_unique<idem::PostgresStore>(url_, idem_test::env_options(options));
        s->ensure_schema();
        return s;
    }

private:
    std::string url_;
    std::string name_;
};

struct Tally {
    std::uint64_t executed = 0, replayed = 0, duplicate = 0, in_progress = 0, other = 0, batches = 0;
    std::vector<std::string> other_outcomes;  // anything that must not happen, for the report
    std::exception_ptr error;
};

/// One consumer thread: delivers its slice in batches of `batch_size`; whatever comes back
/// in_progress (another thread holds the key right now) is nacked and redelivered after the slice,
/// until nothing of the slice is in progress. The effect inserts the event id into `effects` over
/// the thread's own connection (autocommit).
void consume(idem::IdempotencyStore& store, const std::string& url, const std::string& effects,
             const std::string& scope, std::vector<std::string> pending, std::size_t batch_size, Tally& tally) {
    try {
        PgConn conn(url);
        const std::string insert = "INSERT INTO " + effects + " (event_id) VALUES ($1)";
        const auto deadline = std::chrono::steady_clock::now() + 120s;
        while (!pending.empty()) {
            std::vector<std::string> nacked;
            for (std::size_t begin = 0; begin < pending.size(); begin += batch_size) {
                const std::size_t n = std::min(batch_size, pending.size() - begin);
                std::vector<idem::Message> batch;
                batch.reserve(n);
                for (std::size_t j = 0; j < n; ++j) batch.push_back(message(scope, pending[begin + j]));
                auto results = idem::execute_batch(store, batch, [&](std::size_t i) {
                    conn.exec(insert, {batch[i].key.value()});
                    return std::string("applied");
                });
                ++tally.batches;
                for (std::size_t j = 0; j < n; ++j) {
                    switch (results[j].outcome) {
                        case BatchOutcome::executed: ++tally.executed; break;
                        case BatchOutcome::replayed: ++tally.replayed; break;
                        case BatchOutcome::duplicate: ++tally.duplicate; break;
                        case BatchOutcome::in_progress:
                            ++tally.in_progress;
                            nacked.push_back(pending[begin + j]);
                            break;
                        default:
                            ++tally.other;
                            tally.other_outcomes.push_back(pending[begin + j] + ": " +
                                                           std::string(idem::to_string(results[j].outcome)) + " " +
                                                           error_as<std::exception>(results[j].error));
                    }
                }
            }
            pending = std::move(nacked);
            if (pending.empty()) break;
            if (std::chrono::steady_clock::now() > deadline) {
                throw std::runtime_error(std::to_string(pending.size()) + " messages still in progress after 120 s");
            }
            std::this_thread::sleep_for(2ms);  // redelivery comes a little later
        }
    } catch (...) {
        tally.error = std::current_exception();
    }
}

/// 3,000 events, each delivered 3 times, shuffled, split over 4 threads (a slice each), batches of
/// 64; the threads share `instances` stores (consumer instances) round-robin.
void redelivery_run(std::size_t instances) {
    const std::string url = require_db();
    IdemTable table(url);
    const std::string effects = idem_test::unique_name("effects");
    idem_test::DropTable drop_effects(url, effects);
    PgConn admin(url);
    admin.exec("CREATE TABLE " + effects + " (event_id text NOT NULL)");  // no unique key: count them

    constexpr std::size_t kEvents = 3000, kCopies = 3, kThreads = 4, kBatch = 64;
    std::vector<std::unique_ptr<idem::PostgresStore>> stores;
    for (std::size_t i = 0; i < instances; ++i) stores.push_back(table.store(4));

    std::vector<std::string> deliveries;
    deliveries.reserve(kEvents * kCopies);
    for (std::size_t copy = 0; copy < kCopies; ++copy) {
        for (std::size_t e = 0; e < kEvents; ++e) deliveries.push_back("evt-" + std::to_string(e));
    }
    const auto seed = Catch::rngSeed();
    INFO("shuffle seed (--rng-seed) " << seed);
    std::mt19937_64 rng(seed);
    std::shuffle(deliveries.begin(), deliveries.end(), rng);

    std::vector<Tally> tallies(kThreads);
    std::vector<std::thread> threads;
    const std::size_t slice = deliveries.size() / kThreads;
    for (std::size_t t = 0; t < kThreads; ++t) {
        std::vector<std::string> mine(
            deliveries.begin() + static_cast<std::ptrdiff_t>(t * slice),
            t + 1 == kThreads ? deliveries.end() : deliveries.begin() + static_cast<std::ptrdiff_t>((t + 1) * slice));
        threads.emplace_back(consume, std::ref(*stores[t % instances]), std::cref(url), std::cref(effects),
                             std::string("consumer"), std::move(mine), kBatch, std::ref(tallies[t]));
    }
    for (auto& th : threads) th.join();

    Tally sum;
    for (const auto& t : tallies) {
        if (t.error) {
            try {
                std::rethrow_exception(t.error);
            } catch (const std::exception& e) {
                FAIL("consumer thread failed: " << e.what());
            }
        }
        sum.executed += t.executed;
        sum.replayed += t.replayed;
        sum.duplicate += t.duplicate;
        sum.in_progress += t.in_progress;
        sum.other += t.other;
        sum.batches += t.batches;
        sum.other_outcomes.insert(sum.other_outcomes.end(), t.other_outcomes.begin(), t.other_outcomes.end());
    }
    INFO("executed " << sum.executed << ", replayed " << sum.replayed << ", duplicate " << sum.duplicate
                     << ", in_progress (redelivered) " << sum.in_progress << ", batches " << sum.batches);
    INFO("first unexpected outcome: " << (sum.other_outcomes.empty() ? "-" : sum.other_outcomes.front()));
    WARN("instances " << instances << ": executed " << sum.executed << ", replayed " << sum.replayed << ", duplicate "
                      << sum.duplicate << ", in_progress (redelivered) " << sum.in_progress << ", batches "
                      << sum.batches);
    CHECK(sum.other == 0);
    CHECK(sum.executed == kEvents);
    // Every delivery ends as exactly one of executed / replayed / duplicate (in_progress ones were
    // redelivered until they did).
    CHECK(sum.executed + sum.replayed + sum.duplicate == kEvents * kCopies);

    // Exactly once: one effect row per event id, none twice.
    CHECK(admin.scalar("SELECT count(*) FROM " + effects) == static_cast<long long>(kEvents));
    CHECK(admin.scalar("SELECT count(DISTINCT event_id) FROM " + effects) == static_cast<long long>(kEvents));
    CHECK(admin.exec("SELECT event_id FROM " + effects + " GROUP BY event_id HAVING count(*) > 1").rows() == 0);
    // And every key is completed in idem's table.
    CHECK(admin.scalar("SELECT count(*) FROM " + table.name() + " WHERE state = 'completed'") ==
          static_cast<long long>(kEvents));
    CHECK(admin.scalar("SELECT count(*) FROM " + table.name() + " WHERE state <> 'completed'") == 0);
}

}  // namespace

// --- exactly once under redelivery ----------------------------------------------------------------

TEST_CASE("postgres: 3,000 events delivered 3 times, shuffled, 4 threads on one store: effects exactly once",
          "[batch][postgres][redelivery]") {
    redelivery_run(1);
}

TEST_CASE("postgres: the same over 2 consumer instances (2 stores): effects exactly once",
          "[batch][postgres][redelivery]") {
    redelivery_run(2);
}

// --- round trips ----------------------------------------------------------------------------------

TEST_CASE("postgres: a batch of 64 fresh keys costs 2 round trips, 64 completed keys 1", "[batch][postgres]") {
    const std::string url = require_db();
    IdemTable table(url);
    auto store = table.store(1);
    // Warm the pooled connection up (connect, prepare) outside the measurement.
    (void)idem::execute_once(*store, idem::Key{"warm", "up"}, idem::fingerprint("x"s), [] { return "ok"s; });

    std::vector<std::string> ids;
    for (int i = 0; i < 64; ++i) ids.push_back("rt-" + std::to_string(i));
    const auto batch = messages("rt", ids);
    const auto fn = [](std::size_t i) { return "r" + std::to_string(i); };

    auto before = store->stats().round_trips;
    auto fresh = idem::execute_batch(*store, batch, fn);
    CHECK(store->stats().round_trips - before == 2);
    CHECK(std::count_if(fresh.begin(), fresh.end(), [](auto& r) { return r.outcome == BatchOutcome::executed; }) == 64);

    before = store->stats().round_trips;
    auto replay = idem::execute_batch(*store, batch, fn);
    CHECK(store->stats().round_trips - before == 1);
    CHECK(std::count_if(replay.begin(), replay.end(), [](auto& r) { return r.outcome == BatchOutcome::replayed; }) ==
          64);

    // A batch with copies of its keys: still 1 (the copies are settled locally).
    std::vector<idem::Message> doubled = batch;
    doubled.insert(doubled.end(), batch.begin(), batch.end());
    before = store->stats().round_trips;
    auto dup = idem::execute_batch(*store, doubled, fn);
    CHECK(store->stats().round_trips - before == 1);
    CHECK(std::count_if(dup.begin(), dup.end(), [](auto& r) { return r.outcome == BatchOutcome::duplicate; }) == 64);
}

TEST_CASE("postgres: a cold store also pays 2 round trips for a fresh batch (set-up not counted)",
          "[batch][postgres]") {
    const std::string url = require_db();
    IdemTable table(url);
    auto store = table.store(1);
    const auto batch = messages("cold", {"c1", "c2", "c3"});
    auto results = idem::execute_batch(*store, batch, [](std::size_t) { return "ok"s; });
    CHECK(store->stats().round_trips == 2);
    CHECK(outcomes(results) == std::vector<BatchOutcome>(3, BatchOutcome::executed));
}

TEST_CASE("postgres: a batch larger than one claim chunk (600 keys)", "[batch][postgres]") {
    const std::string url = require_db();
    IdemTable table(url);
    auto store = table.store(2);
    std::vector<std::string> ids;
    for (int i = 0; i < 600; ++i) ids.push_back("big-" + std::to_string(i));
    const auto batch = messages("big", ids);
    std::size_t calls = 0;
    auto first = idem::execute_batch(*store, batch, [&](std::size_t i) {
        ++calls;
        return std::to_string(i);
    });
    CHECK(calls == 600);
    CHECK(std::all_of(first.begin(), first.end(), [](auto& r) { return r.outcome == BatchOutcome::executed; }));
    auto again = idem::execute_batch(*store, batch, [&](std::size_t i) {
        ++calls;
        return std::to_string(i);
    });
    CHECK(calls == 600);
    for (std::size_t i = 0; i < again.size(); ++i) {
        CHECK(again[i].outcome == BatchOutcome::replayed);
        CHECK(again[i].response == std::to_string(i));
    }
    CHECK(PgConn(url).scalar("SELECT count(*) FROM " + table.name() + " WHERE state = 'completed'") == 600);
}

// --- per-message semantics (the same checks run on MemoryStore) -----------------------------------

TEST_CASE("postgres: batch semantics", "[batch][postgres]") {
    const std::string url = require_db();
    IdemTable table(url);
    auto store = table.store(2);
    SECTION("empty batch") {
        check_empty_batch(*store);
        CHECK(store->stats().round_trips == 0);
    }
    SECTION("fresh then replayed") { check_fresh_then_replayed(*store, "fresh"); }
    SECTION("duplicates inside one batch") { check_duplicates_in_batch(*store, "dups"); }
    SECTION("mismatch across batches") { check_mismatch_across_batches(*store, "mismatch"); }
    SECTION("not_performed") { check_not_performed(*store, "released"); }
    SECTION("unknown failure") { check_failed(*store, "failed"); }
    SECTION("fn(message), Response") { check_fn_by_message_and_response(*store, "response"); }
    SECTION("mixed batch") { check_mixed_batch(*store, "mixed"); }
}

TEST_CASE("postgres: a result over max_result_bytes fails that message only", "[batch][postgres]") {
    const std::string url = require_db();
    IdemTable table(url);
    idem::PostgresOptions options;
    options.table = table.name();
    options.max_result_bytes = 64;
    idem::PostgresStore store(url, idem_test::env_options(options));
    store.ensure_schema();
    check_result_too_large(store, "large");
}

// Inside one batch, a second copy with other content is a mismatch, as it would be in a later batch.
TEST_CASE("postgres: same id with other content inside one batch is a mismatch", "[batch][postgres]") {
    const std::string url = require_db();
    IdemTable table(url);
    auto store = table.store(1);
    check_mismatch_inside_batch(*store, "inbatch");
}

// An undecodable replay fails that message alone; the rest of the batch is executed and saved.
TEST_CASE("postgres: an undecodable replay fails alone", "[batch][postgres]") {
    const std::string url = require_db();
    IdemTable table(url);
    auto store = table.store(1);
    check_undecodable_replay(*store, "poison");
}

// A result that cannot be encoded fails that message alone (response_not_saved, left in progress).
TEST_CASE("postgres: an unencodable result fails alone, in progress", "[batch][postgres]") {
    const std::string url = require_db();
    IdemTable table(url);
    auto store = table.store(1);
    check_unencodable_result(*store, "unencodable");
}
