// The replay cache (idem/replay_cache.hpp, idem/cached_store.hpp) in front of MemoryStore and
// PostgresStore: hits cost no round trip and replay the same bytes, the fingerprint is checked on
// every hit, in-progress records are never cached, entries expire with the retention the store
// stated (injected clocks, no sleeps), LRU eviction by bytes, and exactly-once under 16 threads.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "idem/cached_store.hpp"
#include "idem/replay_cache.hpp"
#include "lifecycle.hpp"
#include "threads.hpp"

using namespace lifecycle;
using namespace std::string_literals;
using idem::ClaimStatus;
using idem::Outcome;
using idem::Response;

namespace {

/// A steady clock the test moves by hand (ReplayCacheOptions::clock).
class ManualSteady {
public:
    [[nodiscard]] SteadyClock::time_point now() const {
        return SteadyClock::time_point(SteadyClock::duration(ns_.load(std::memory_order_acquire)));
    }
    void advance(std::chrono::milliseconds d) {
        ns_.fetch_add(std::chrono::duration_cast<SteadyClock::duration>(d).count(), std::memory_order_acq_rel);
    }
    static std::function<SteadyClock::time_point()> function(const std::shared_ptr<ManualSteady>& c) {
        return [c] { return c->now(); };
    }

private:
    std::atomic<SteadyClock::rep> ns_{SteadyClock::now().time_since_epoch().count()};
};

idem::ReplayCacheOptions cache_options(std::size_t max_bytes, std::size_t shards,
                                       const std::shared_ptr<ManualSteady>& clock = nullptr) {
    idem::ReplayCacheOptions o;
    o.max_bytes = max_bytes;
    o.shards = shards;
    if (clock) o.clock = ManualSteady::function(clock);
    return o;
}

const auto kFp = idem::fingerprint("POST /payments"s, 4200);
const auto kOtherFp = idem::fingerprint("POST /payments"s, 9900);

/// A response with every byte value, NUL included, so "identical" means identical.
Response binary_response() {
    std::string body;
    for (int i = 0; i < 512; ++i) body.push_back(static_cast<char>(i & 0xFF));
    return Response{201, body, {{"Content-Type", "application/octet-stream"}}};
}

/// Completes `key` through the primary (claim + save), as another instance would.
void complete(idem::IdempotencyStore& primary, const idem::Key& key, const std::string& result,
              const idem::ClaimOptions& options = {}) {
    const auto c = primary.claim(key, kFp, options);
    REQUIRE(c.status == ClaimStatus::claimed);
    primary.save(key, c.fence, result);
}

/// A completed record read at `read_at` with `left` retention, for ReplayCache alone.
idem::Record record_of(std::size_t result_bytes, std::chrono::seconds left = 3600s) {
    idem::Record r;
    r.state = idem::RecordState::completed;
    r.fingerprint = kFp;
    r.result = std::string(result_bytes, 'r');
    r.read_at = std::chrono::system_clock::now();
    r.created_at = r.read_at;
    r.expires_at = r.read_at + left;
    return r;
}

}  // namespace

TEMPLATE_TEST_CASE("a cached replay costs no round trip and replays the same bytes", "[cache]", MemoryBackend,
                   PostgresBackend) {
    TestType backend;
    auto& primary = backend.make();
    idem::CachedStore store(primary, cache_options(1 << 20, 4));
    const idem::Key key(fresh_scope("hit"), "k1");
    const Response response = binary_response();
    int effects = 0;
    const auto fn = [&] {
        ++effects;
        return response;
    };

    REQUIRE(idem::execute_once(store, key, kFp, fn).outcome() == Outcome::executed);
    // The first replay asks the primary (one round trip) and keeps the record.
    auto before = primary.stats().round_trips;
    auto r = idem::execute_once(store, key, kFp, fn);
    REQUIRE(r.outcome() == Outcome::replayed);
    CHECK(primary.stats().round_trips == before + 1);
    CHECK(store.cache().stats().entries == 1);

    before = primary.stats().round_trips;
    const auto claims_before = primary.stats().claims;
    for (int i = 0; i < 50; ++i) {
        r = idem::execute_once(store, key, kFp, fn);
        REQUIRE(r.outcome() == Outcome::replayed);
        REQUIRE(r.response().status == 201);
        REQUIRE(r.response().body == response.body);
        REQUIRE(r.response().headers == response.headers);
    }
    CHECK(primary.stats().round_trips == before);  // zero round trips for 50 replays
    CHECK(primary.stats().claims == claims_before);
    CHECK(store.cache().stats().hits == 50);
    CHECK(effects == 1);
}

TEMPLATE_TEST_CASE("a cache hit with another fingerprint is the primary's mismatch; the right one still replays",
                   "[cache]", MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& primary = backend.make();
    idem::CachedStore store(primary, cache_options(1 << 20, 4));
    const idem::Key key(fresh_scope("mismatch"), "k1");
    complete(primary, key, "stored");

    REQUIRE(store.claim(key, kFp).status == ClaimStatus::completed);  // miss: cached now
    const auto claims = primary.stats().claims;
    const auto wrong = store.claim(key, kOtherFp);
    CHECK(wrong.status == ClaimStatus::mismatch);
    REQUIRE(wrong.existing);
    CHECK(wrong.existing->fingerprint == kFp);
    CHECK(primary.stats().claims == claims + 1);  // asked of the primary, in its words
    const auto before = primary.stats().round_trips;
    const auto right = store.claim(key, kFp);
    CHECK(right.status == ClaimStatus::completed);
    CHECK(right.existing->result == "stored");
    CHECK(primary.stats().round_trips == before);

    // A mismatch found by the primary caches the completed record too: the right request then hits.
    const idem::Key other(fresh_scope("mismatch"), "k2");
    complete(primary, other, "second");
    CHECK(store.claim(other, kOtherFp).status == ClaimStatus::mismatch);
    const auto before2 = primary.stats().round_trips;
    CHECK(store.claim(other, kFp).status == ClaimStatus::completed);
    CHECK(primary.stats().round_trips == before2);
}

TEMPLATE_TEST_CASE("in-progress records are never cached", "[cache]", MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& primary = backend.make();
    idem::CachedStore store(primary, cache_options(1 << 20, 4));
    const idem::Key key(fresh_scope("in_progress"), "k1");
    const auto c = primary.claim(key, kFp);
    REQUIRE(c.status == ClaimStatus::claimed);

    for (int i = 0; i < 3; ++i) {
        const auto before = primary.stats().round_trips;
        CHECK(store.claim(key, kFp).status == ClaimStatus::in_progress);
        CHECK(store.claim(key, kOtherFp).status == ClaimStatus::mismatch);  // mismatch on in-progress
        CHECK(primary.stats().round_trips == before + 2);
    }
    CHECK(store.cache().stats().entries == 0);

    // Once saved, the next claim asks the primary, sees completed, and caches it.
    primary.save(key, c.fence, "done");
    CHECK(store.claim(key, kFp).status == ClaimStatus::completed);
    const auto before = primary.stats().round_trips;
    CHECK(store.claim(key, kFp).existing->result == "done");
    CHECK(primary.stats().round_trips == before);
}

TEMPLATE_TEST_CASE("a cache entry expires with the retention the store stated, by the injected clock", "[cache]",
                   MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& primary = backend.make();
    const auto clock = std::make_shared<ManualSteady>();
    idem::CachedStore store(primary, cache_options(1 << 20, 4, clock));
    const idem::Key key(fresh_scope("expiry"), "k1");
    complete(primary, key, "kept", Opts().retain(3600s));
    // 3000 s of the retention pass for the store before the cache first sees the record: what is
    // left, as the store states it (expires_at - read_at), is ~600 s, not 3600 s.
    backend.advance(3000s);

    REQUIRE(store.claim(key, kFp).status == ClaimStatus::completed);  // miss, cached
    // Real time passes for PostgreSQL too: 60 s of margin on either side.
    clock->advance(540s);
    auto before = primary.stats().round_trips;
    CHECK(store.claim(key, kFp).status == ClaimStatus::completed);
    CHECK(primary.stats().round_trips == before);  // still a hit

    clock->advance(61s);  // 601 s after the read: past the retention the store stated
    before = primary.stats().round_trips;
    CHECK(store.claim(key, kFp).status == ClaimStatus::completed);  // the primary is asked again
    CHECK(primary.stats().round_trips == before + 1);
    CHECK(store.cache().stats().misses == 2);
}

TEMPLATE_TEST_CASE("the store states when it read a record (Record::read_at, the store's clock)", "[cache]",
                   MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& primary = backend.make();
    const idem::Key key(fresh_scope("read_at"), "k1");
    complete(primary, key, "r", Opts().retain(3600s));
    backend.advance(1000s);
    const auto rec = primary.read(key);
    REQUIRE(rec);
    const auto left = std::chrono::duration_cast<std::chrono::seconds>(rec->expires_at - rec->read_at);
    // 2600 s left; 60 s of margin for the real time that passes meanwhile (PostgreSQL).
    CHECK(left <= 2600s);
    CHECK(left > 2540s);
    const auto c = primary.claim(key, kFp);
    REQUIRE(c.existing);
    CHECK(c.existing->read_at >= rec->read_at);
    CHECK(c.existing->expires_at - c.existing->read_at <= 2600s);
}

TEST_CASE("a record whose retention passed is never served, even if the store still answers it", "[cache]") {
    const auto clock = std::make_shared<ManualSteady>();
    idem::ReplayCache cache(cache_options(1 << 20, 1, clock));
    const idem::Key key("s", "k");
    CHECK_FALSE(cache.insert(key, record_of(10, 0s), clock->now()));  // nothing left
    auto expired = record_of(10);
    expired.expired = true;
    CHECK_FALSE(cache.insert(key, expired, clock->now()));
    auto unknown = record_of(10);
    unknown.read_at = {};  // a store that does not say when it read
    CHECK_FALSE(cache.insert(key, unknown, clock->now()));
    auto in_progress = record_of(10);
    in_progress.state = idem::RecordState::in_progress;
    in_progress.result.reset();
    CHECK_FALSE(cache.insert(key, in_progress, clock->now()));
    CHECK(cache.stats().rejected == 4);

    // asked_at is when the store was asked: time spent waiting for it counts against the entry.
    const auto asked = clock->now();
    clock->advance(50s);
    REQUIRE(cache.insert(key, record_of(10, 60s), asked));
    clock->advance(9s);
    CHECK(cache.find(key));
    clock->advance(1s);  // exactly 60 s after asked_at
    CHECK_FALSE(cache.find(key));
    CHECK(cache.stats().entries == 0);
}

TEST_CASE("the cache evicts the least recently used entries by bytes", "[cache]") {
    idem::ReplayCache cache(cache_options(8192, 1));
    std::vector<idem::Key> keys;
    for (int i = 0; i < 8; ++i) keys.emplace_back("s", "k" + std::to_string(i));
    // Each entry: 1000 result bytes + key + ~300 bookkeeping: 6 fit in 8192 bytes, not 7.
    for (int i = 0; i < 6; ++i) REQUIRE(cache.insert(keys[i], record_of(1000), cache.now()));
    CHECK(cache.stats().entries == 6);
    CHECK(cache.stats().evictions == 0);
    REQUIRE(cache.find(keys[0]));  // k0 is now the most recently used; k1 the least
    REQUIRE(cache.insert(keys[6], record_of(1000), cache.now()));
    CHECK(cache.stats().evictions == 1);
    CHECK_FALSE(cache.find(keys[1]));
    CHECK(cache.find(keys[0]));
    CHECK(cache.find(keys[6]));
    CHECK(cache.stats().bytes <= 8192);

    // A larger entry evicts as many as it needs.
    REQUIRE(cache.insert(keys[7], record_of(3000), cache.now()));
    CHECK(cache.stats().bytes <= 8192);
    CHECK(cache.find(keys[7]));

    // erase and clear (what an operator who deleted rows by hand calls).
    CHECK(cache.erase(keys[7]));
    CHECK_FALSE(cache.erase(keys[7]));
    CHECK_FALSE(cache.find(keys[7]));
    cache.clear();
    CHECK(cache.stats().entries == 0);
    CHECK(cache.stats().bytes == 0);
    CHECK_FALSE(cache.find(keys[0]));
}

TEMPLATE_TEST_CASE("a result larger than the cache is not cached and still replays", "[cache]", MemoryBackend,
                   PostgresBackend) {
    TestType backend;
    auto& primary = backend.make();
    idem::CachedStore store(primary, cache_options(4096, 1));
    const idem::Key key(fresh_scope("large"), "k1");
    const std::string big(5000, 'x');
    complete(primary, key, big);
    for (int i = 0; i < 3; ++i) {
        const auto before = primary.stats().round_trips;
        const auto c = store.claim(key, kFp);
        REQUIRE(c.status == ClaimStatus::completed);
        CHECK(c.existing->result == big);
        CHECK(primary.stats().round_trips == before + 1);
    }
    CHECK(store.cache().stats().entries == 0);
    CHECK(store.cache().stats().rejected == 3);
}

TEST_CASE("bad replay cache options are config_error", "[cache]") {
    CHECK_THROWS_AS(idem::ReplayCache(cache_options(0, 1)), idem::config_error);
    CHECK_THROWS_AS(idem::ReplayCache(cache_options(std::size_t{1} << 41, 1)), idem::config_error);
    CHECK_THROWS_AS(idem::ReplayCache(cache_options(1 << 20, 0)), idem::config_error);
    CHECK_THROWS_AS(idem::ReplayCache(cache_options(1 << 30, 5000)), idem::config_error);
    CHECK_THROWS_AS(idem::ReplayCache(cache_options(1000, 1)), idem::config_error);
    CHECK_THROWS_AS(idem::ReplayCache(cache_options(16 * 1024, 32)), idem::config_error);
    idem::MemoryStore primary;
    CHECK_THROWS_AS(idem::CachedStore(primary, cache_options(0, 1)), idem::config_error);
    CHECK_NOTHROW(idem::ReplayCache(cache_options(1024, 1)));
}

TEMPLATE_TEST_CASE("claim_batch answers hits from the cache and asks the primary for the rest", "[cache]",
                   MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& primary = backend.make();
    idem::CachedStore store(primary, cache_options(1 << 20, 4));
    const std::string scope = fresh_scope("batch");
    const std::vector<idem::Key> keys{{scope, "a"}, {scope, "b"}, {scope, "c"}};
    complete(primary, keys[0], "A");
    complete(primary, keys[1], "B");
    REQUIRE(store.claim(keys[0], kFp).status == ClaimStatus::completed);  // a is cached
    const std::vector<idem::Fingerprint> fps{kOtherFp, kFp, kFp};
    const auto claims = store.claim_batch(keys, fps);
    REQUIRE(claims.size() == 3);
    CHECK(claims[0].status == ClaimStatus::mismatch);
    CHECK(claims[1].status == ClaimStatus::completed);
    CHECK(claims[1].existing->result == "B");
    CHECK(claims[2].status == ClaimStatus::claimed);
    // b is cached now; c (in progress) is not.
    const auto before = primary.stats().round_trips;
    CHECK(store.claim(keys[1], kFp).status == ClaimStatus::completed);
    CHECK(primary.stats().round_trips == before);
    CHECK(store.claim(keys[2], kFp).status == ClaimStatus::in_progress);
    CHECK(primary.stats().round_trips == before + 1);
}

TEMPLATE_TEST_CASE("16 threads hammer a small cache: every answer is right", "[cache][concurrency]", MemoryBackend,
                   PostgresBackend) {
    TestType backend;
    auto& primary = backend.make(knobs(8));
    // Small on purpose: 4 shards of 4 KiB, so entries are evicted and re-read all the time.
    idem::CachedStore store(primary, cache_options(16 * 1024, 4));
    const std::string scope = fresh_scope("hammer");
    constexpr int kKeys = 64;
    std::vector<idem::Key> keys;
    for (int i = 0; i < kKeys; ++i) {
        keys.emplace_back(scope, "k" + std::to_string(i));
        complete(primary, keys.back(),
                 "result-" + std::to_string(i) + std::string(static_cast<std::size_t>(i * 7), '.'));
    }
    constexpr int kThreads = 16;
    constexpr int kCalls = 1000;
    std::vector<int> wrong(kThreads, 0), mismatches(kThreads, 0);
    idem_test::run_threads(kThreads, [&](int t) {
        std::uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(t + 1);
        for (int i = 0; i < kCalls; ++i) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            const int k = static_cast<int>(x % kKeys);
            const bool other = (x >> 20) % 10 == 0;
            if (t == 0 && i % 100 == 0) store.cache().erase(keys[static_cast<std::size_t>((k + 1) % kKeys)]);
            if (t == 1 && i == kCalls / 2) store.cache().clear();
            const auto c = store.claim(keys[static_cast<std::size_t>(k)], other ? kOtherFp : kFp);
            const std::string expected =
                "result-" + std::to_string(k) + std::string(static_cast<std::size_t>(k * 7), '.');
            const bool ok = c.existing && c.existing->result == expected &&
                            c.status == (other ? ClaimStatus::mismatch : ClaimStatus::completed);
            if (!ok) ++wrong[static_cast<std::size_t>(t)];
            if (other) ++mismatches[static_cast<std::size_t>(t)];
        }
    });
    for (int t = 0; t < kThreads; ++t) CHECK(wrong[static_cast<std::size_t>(t)] == 0);
    const auto s = store.cache().stats();
    CHECK(s.hits + s.misses == static_cast<std::uint64_t>(kThreads) * kCalls);
    CHECK(s.hits > 0);
    CHECK(s.evictions > 0);
    CHECK(s.bytes <= 16 * 1024);
}

TEMPLATE_TEST_CASE("execute_once through a CachedStore: one effect per key under 16 threads", "[cache][concurrency]",
                   MemoryBackend, PostgresBackend) {
    TestType backend;
    auto& primary = backend.make(knobs(8));
    idem::CachedStore store(primary, cache_options(1 << 20, 8));
    const std::string scope = fresh_scope("once");
    constexpr int kKeys = 8;
    constexpr int kThreads = 16;
    constexpr int kRounds = 40;
    std::vector<std::atomic<int>> effects(kKeys);  // counted outside the library
    std::vector<int> executed(kThreads, 0), replayed(kThreads, 0), in_progress(kThreads, 0), bad(kThreads, 0);
    idem_test::run_threads(kThreads, [&](int t) {
        const auto ti = static_cast<std::size_t>(t);
        for (int round = 0; round < kRounds; ++round) {
            const int k = (round + t) % kKeys;
            const idem::Key key(scope, "k" + std::to_string(k));
            const auto r = idem::execute_once(store, key, kFp, [&] {
                effects[static_cast<std::size_t>(k)].fetch_add(1);
                return Response{200, "paid " + std::to_string(k)};
            });
            switch (r.outcome()) {
                case Outcome::executed: ++executed[ti]; break;
                case Outcome::replayed:
                    ++replayed[ti];
                    if (r.response().body != "paid " + std::to_string(k)) ++bad[ti];
                    break;
                case Outcome::in_progress: ++in_progress[ti]; break;
                default: ++bad[ti]; break;
            }
        }
    });
    int total_executed = 0, total_replayed = 0, total_bad = 0;
    for (int t = 0; t < kThreads; ++t) {
        total_executed += executed[static_cast<std::size_t>(t)];
        total_replayed += replayed[static_cast<std::size_t>(t)];
        total_bad += bad[static_cast<std::size_t>(t)];
    }
    for (int k = 0; k < kKeys; ++k) CHECK(effects[static_cast<std::size_t>(k)].load() == 1);
    CHECK(total_executed == kKeys);
    CHECK(total_bad == 0);
    CHECK(total_replayed > 0);
    CHECK(store.cache().stats().hits > 0);
}

TEST_CASE("a completed row deleted by hand is replayed from the cache until erase()", "[cache]") {
    PostgresBackend backend;
    auto& primary = backend.make();
    idem::CachedStore store(primary, cache_options(1 << 20, 4));
    const idem::Key key(fresh_scope("deleted"), "k1");
    complete(primary, key, "old");
    REQUIRE(store.claim(key, kFp).status == ClaimStatus::completed);  // cached

    idem_test::PgConn(backend.conninfo())
        .exec("DELETE FROM " + backend.table() + " WHERE scope = $1 AND key = $2", {key.scope(), key.value()});
    // The documented staleness: this process does not see the deletion...
    const auto stale = store.claim(key, kFp);
    CHECK(stale.status == ClaimStatus::completed);
    CHECK(stale.existing->result == "old");
    CHECK_FALSE(primary.read(key));
    // ...until the operator flushes the entry: the key is new again.
    CHECK(store.cache().erase(key));
    CHECK(store.claim(key, kFp).status == ClaimStatus::claimed);
}
