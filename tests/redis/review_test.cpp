// RedisStore and RedisReplayCache against what an independent review found: each test case failed
// while the bug it guards existed (the comment above it says what that was) and passes since its
// fix. Each test case starts its own redis-server(s) (tests/support/redis_server.hpp).
#include "idem/idem.hpp"
#include "idem/redis/replay_cache.hpp"
#include "idem/redis/store.hpp"
#include "redis_server.hpp"
#include "test_env.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/evp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem_test::RedisServer;

namespace {

std::string record_key(const std::string& prefix, const idem::Key& key) {
    return prefix + "r:" + std::to_string(key.scope().size()) + ":" + key.scope() + key.value();
}

}  // namespace

// Found by review: the claim script's `taken` answer carries the record *before* the takeover
// (attempt 1), and `own` decrements the attempt; Context::attempt() is taken_over->attempt, so fn
// is told it is attempt 1 when it is attempt 2. MemoryStore and PostgresStore say 2
// (tests/lifecycle/resume_test.cpp checks it for them only).
TEST_CASE("RedisStore: a resume-mode takeover tells fn it is attempt 2", "[redis][review]") {
    RedisServer server;
    idem::RedisStore store(server.store_options());
    const idem::Key key("review", "resume");
    const auto fp = idem::fingerprint("resume"s);
    const auto first = store.claim(key, fp, idem::ClaimOptions{.lease = 20ms});
    REQUIRE(first.status == idem::ClaimStatus::claimed);
    store.record_phase(key, first.fence, "charged", "ch_1");
    std::this_thread::sleep_for(60ms);
    int seen_attempt = 0;
    std::optional<std::string> seen_phase;
    const auto r = idem::execute_once(
        store, key, fp,
        [&](idem::Context& ctx) {
            seen_attempt = ctx.attempt();
            seen_phase = ctx.phase();
            return std::string("done");
        },
        idem::ClaimOptions{.lease = 30s, .resume_stale = true});
    CHECK(r.outcome() == idem::Outcome::executed);
    CHECK(seen_phase == "charged");
    CHECK(seen_attempt == 2);
    CHECK(store.read(key)->attempt == 2);
}

// Found by review (each case failed before its fix): with wait_replicas > 0 every write is EVALSHA + WAIT in one
// pipeline. When the script's reply is an error (here OOM: maxmemory reached), script_reply throws before WAIT's answer
// is read, the connection is not broken, and it goes back to the pool with WAIT's answer still unread. Every later call
// on it reads the previous call's answer, for good: save_batch statuses are shifted by one (a refused save reported
// saved, a done one lease_lost), and every claim that Redis granted comes back store_unavailable ("only 0 of 1
// replicas"), leaving the key in progress with a fence nobody holds.
TEST_CASE("RedisStore: with wait_replicas an error reply leaves no answer unread on a pooled connection",
          "[redis][review][replica]") {
    idem_test::ReplicatedRedis pair;
    RedisServer& primary = pair.primary;
    auto options = primary.store_options();
    options.wait_replicas = 1;
    // Generous: every write here must be acknowledged, also on a loaded machine.
    options.wait_replicas_timeout = 60s;
    options.command_timeout = 70s;
    options.pool_size = 1;  // one connection: the next call gets the same one
    idem::RedisStore store(options);
    REQUIRE_FALSE(store.read(idem::Key("review", "warm")).has_value());
    const idem::Key a("review", "a"), b("review", "b");
    const auto claim_a = store.claim(a, idem::fingerprint("a"s));
    const auto claim_b = store.claim(b, idem::fingerprint("b"s));
    REQUIRE(claim_a.status == idem::ClaimStatus::claimed);
    REQUIRE(claim_b.status == idem::ClaimStatus::claimed);

    // Redis runs out of memory for a moment: the claim is refused (as it should be).
    REQUIRE(primary.command({"CONFIG", "SET", "maxmemory", "1"}) == "+OK");
    CHECK_THROWS_AS(store.claim(idem::Key("review", "oom"), idem::fingerprint("a"s)), idem::store_unavailable);
    REQUIRE(primary.command({"CONFIG", "SET", "maxmemory", "0"}) == "+OK");

    // A batch of saves: a's with a fence that does not own a (refused), b's with b's fence (saved).
    // With the unread WAIT answer in front, every status is the previous save's: a "saved", b
    // "lease_lost" — the opposite of what Redis did.
    const std::vector<idem::SaveRequest> saves = {{a, claim_a.fence ^ 1, "ra"}, {b, claim_b.fence, "rb"}};
    std::vector<idem::SaveStatus> statuses;
    try {
        statuses = store.save_batch(saves);
    } catch (const idem::error& e) {
        FAIL_CHECK("save_batch threw: " << e.what());
    }
    CHECK(primary.command({"HGET", record_key("idem:", a), "s"}) == "$1\np");  // Redis refused a's save
    CHECK(primary.command({"HGET", record_key("idem:", b), "s"}) == "$1\nc");  // and did b's
    REQUIRE(statuses.size() == 2);
    CHECK(statuses[0] == idem::SaveStatus::lease_lost);
    CHECK(statuses[1] == idem::SaveStatus::saved);

    // Memory is back: a fresh key must be claimed, and saved.
    const idem::Key key("review", "after-oom");
    idem::Claim claim;
    try {
        claim = store.claim(key, idem::fingerprint("b"s));
    } catch (const idem::error& e) {
        FAIL_CHECK("claim after the OOM threw: " << e.what());
    }
    CHECK(claim.status == idem::ClaimStatus::claimed);
    // What Redis actually holds: the claim did land.
    CHECK(primary.command({"HGET", record_key("idem:", key), "s"}) == "$1\np");
}

// Found by review: the persistence check
// read appendonly / appendfsync only. A server that evicts
// keys (maxmemory with an allkeys-* or volatile-* policy: the usual "Redis as a cache" setup)
// deletes acknowledged records — a completed record (it has a TTL) first under volatile-*, any
// record under allkeys-* — and the next request runs the effect again. The store should refuse
// (config_error) any maxmemory-policy but noeviction unless durability is `unchecked`.
TEST_CASE("RedisStore: a server that may evict keys is refused before an evicted record can run the effect twice",
          "[redis][review]") {
    RedisServer server({.extra_args = {"--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"}});
    auto options = server.store_options();
    REQUIRE(options.durability == idem::RedisDurability::fsync_always);
    idem::RedisStore store(options);
    const idem::Key key("review", "evicted");
    const auto fp = idem::fingerprint("pay 10"s);
    int runs = 0;
    auto fn = [&] {
        ++runs;
        return std::string("paid");
    };
    try {
        const auto first = idem::execute_once(store, key, fp, fn);  // not inside CHECK: it would catch
        CHECK(first.outcome() == idem::Outcome::executed);
    } catch (const idem::config_error&) {
        SUCCEED("the store refused a server that evicts keys");
        return;
    }
    // Other data fills the server (another application, a cache sharing the instance).
    const std::string filler(64 * 1024, 'x');
    for (int i = 0; i < 4000 && server.command({"EXISTS", record_key("idem:", key)}) == ":1"; ++i) {
        (void)server.command({"SET", "other:" + std::to_string(i), filler});
    }
    INFO("record still there: " << server.command({"EXISTS", record_key("idem:", key)}));
    const auto again = idem::execute_once(store, key, fp, fn);
    CHECK(again.outcome() == idem::Outcome::replayed);
    CHECK(runs == 1);
}

// Found by review (each case failed before its fix): appendfsync always with no-appendfsync-on-rewrite yes does not
// fsync while a BGSAVE / AOF rewrite runs (Redis docs: up to 30 s of writes can be lost then), so an acknowledged claim
// can be lost in a power cut. fsync_always accepts it.
TEST_CASE("RedisStore: fsync_always refuses no-appendfsync-on-rewrite yes", "[redis][review]") {
    RedisServer server({.extra_args = {"--no-appendfsync-on-rewrite", "yes"}});
    idem::RedisStore store(server.store_options());
    CHECK_THROWS_AS(store.read(idem::Key("review", "k")), idem::config_error);
}

// Found by review (each case failed before its fix): a member of the in-progress index whose record is gone (evicted,
// deleted by an operator, FLUSH of part of the keys...) is never removed: list_stale counts it against the limit on
// every call, forever. `limit` such members at the head of the index (their lease ends are old) starve the reconciler:
// list_stale(limit) never again lists a real stale key.
TEST_CASE("RedisStore: a member of the in-progress index without its record is dropped and does not starve list_stale",
          "[redis][review]") {
    RedisServer server;
    idem::RedisStore store(server.store_options());
    const idem::Key ghost("review", "ghost");
    const idem::Key stale("review", "stale");
    REQUIRE(store.claim(ghost, idem::fingerprint("g"s), idem::ClaimOptions{.lease = 1ms}).status ==
            idem::ClaimStatus::claimed);
    std::this_thread::sleep_for(5ms);
    REQUIRE(store.claim(stale, idem::fingerprint("s"s), idem::ClaimOptions{.lease = 1ms}).status ==
            idem::ClaimStatus::claimed);
    REQUIRE(server.command({"DEL", record_key("idem:", ghost)}) == ":1");  // e.g. evicted
    std::this_thread::sleep_for(20ms);
    for (int pass = 0; pass < 3; ++pass) {
        const auto listed = store.list_stale(1);
        INFO("pass " << pass);
        REQUIRE(listed.size() == 1);
        CHECK(listed[0].key == stale);
    }
}

// Found by review (each case failed before its fix): the persistence check does not look at the server's role. A
// replica with replica-read-only no (or any replica the store is pointed at after a failover mix-up) accepts claims
// that the primary never sees: the same key is claimed once on each, two effects.
TEST_CASE("RedisStore: a replica is refused as the store's server (a writable one would run an effect twice)",
          "[redis][review][replica]") {
    idem_test::ReplicatedRedis pair(std::vector<std::string>{"--replica-read-only", "no"});
    RedisServer& primary = pair.primary;
    RedisServer& replica = pair.replica;
    idem::RedisStore on_primary(primary.store_options());
    idem::RedisStore on_replica(replica.store_options());
    const idem::Key key("review", "split");
    const auto fp = idem::fingerprint("x"s);
    int runs = 0;
    auto fn = [&] {
        ++runs;
        return std::string("r");
    };
    try {
        (void)idem::execute_once(on_replica, key, fp, fn);
    } catch (const idem::error&) {
        // refused: what the fix should do (config_error or store_unavailable)
    }
    (void)idem::execute_once(on_primary, key, fp, fn);
    CHECK(runs == 1);
}

// Found by review (each case failed before its fix): RedisReplayCache's decode turns
// the entry's millisecond fields into system_clock time points (nanoseconds) with no range check,
// so an entry whose created_at / lease_until / expires_at exceeds ~9.2e12 ms (year 2262) overflows a
// signed 64-bit multiply. Entries are bytes anyone with access to the Redis instance (or an older /
// newer idem writing another layout under the same magic) can put there; decode should reject
// them as corrupt (a miss), not invoke UB. Run in a child so UBSan's abort fails only this test.
TEST_CASE("RedisReplayCache: a cache entry with an out-of-range time field is a miss and no UB",
          "[redis][review][cache]") {
    RedisServer server({.appendonly = false});
    idem::RedisReplayCacheOptions o;
    o.connection.unix_socket = server.socket();
    o.connection.key_prefix = "rc:";
    const idem::Key key("review", "hostile");
    {
        idem::RedisReplayCache cache(o);
        idem::Record r;
        r.state = idem::RecordState::completed;
        r.fingerprint = idem::fingerprint("a"s);
        r.result = "x";
        r.read_at = std::chrono::system_clock::now();
        r.expires_at = r.read_at + 1h;
        REQUIRE(cache.insert(key, r, cache.now()));
    }
    const std::string entry = "rc:c:6:reviewhostile";
    std::string got = server.command({"GET", entry});
    REQUIRE(got.size() > 30);
    std::string bytes = got.substr(got.find('\n') + 1);
    // created_at is the third integer before the 32-byte tag: 2^62 ms. Without an entry_secret the
    // tag is a plain SHA-256, which a writer to Redis recomputes: the entry reaches the decoder.
    const std::size_t tag = bytes.size() - 32;
    const std::uint64_t big = std::uint64_t{1} << 62;
    for (int i = 0; i < 8; ++i)
        bytes[tag - 24 + static_cast<std::size_t>(i)] = static_cast<char>((big >> (8 * i)) & 0xff);
    unsigned int size = 0;
    REQUIRE(EVP_Digest(bytes.data(), tag, reinterpret_cast<unsigned char*>(bytes.data() + tag), &size, EVP_sha256(),
                       nullptr) == 1);
    REQUIRE(size == 32);
    REQUIRE(server.command({"SET", entry, bytes, "PX", "600000"}) == "+OK");

    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        idem::RedisReplayCache cache(o);
        const auto hit = cache.find(key);
        ::_exit(hit ? 3 : 0);  // a hit with a time 2^62 ms after the epoch is no answer either
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    INFO("child status " << status << " (UBSan aborts: signed integer overflow in the ms -> ns conversion)");
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
}

// Found by review (each case failed before its fix): a hash idem did not write (documented: corrupt_record) makes the
// claim script itself fail (Lua compares a missing 'e' with a number: "attempt to compare nil with number"), which
// comes back as database_error, not corrupt_record. The scripts should check the fields they compare (or the C++ side
// map script errors on a record to corrupt_record).
TEST_CASE("RedisStore: a completed hash without its expiry is corrupt_record", "[redis][review]") {
    RedisServer server;
    idem::RedisStore store(server.store_options());
    const idem::Key key("review", "half");
    REQUIRE(server.command({"HSET", record_key("idem:", key), "s", "c"}) == ":1");
    CHECK_THROWS_AS(store.claim(key, idem::fingerprint("h"s)), idem::corrupt_record);
}

// Found by review (each case failed before its fix): CachedStore::forget is the documented remedy after an operator
// edits or deletes a completed row by hand, but RedisReplayCache::erase goes through the same
// pause_after_error gate as find/insert: for a second after any error (here: one undecodable
// entry under another key) erase does not reach Redis and answers false, exactly what "there was no
// entry" answers. The stale entry stays, every instance keeps replaying it (and copying it back
// into its in-process tier) until its TTL ends. An erase should not be skipped by the pause (or
// must say it could not erase).
TEST_CASE("RedisReplayCache: forget() reaches Redis during the pause after an error", "[redis][review][cache]") {
    RedisServer server({.appendonly = false});
    idem::RedisReplayCacheOptions o;
    o.connection.unix_socket = server.socket();
    o.connection.key_prefix = "rc:";
    auto tier = std::make_shared<idem::RedisReplayCache>(o);
    idem::MemoryStore primary;
    idem::CachedStore store(primary, std::vector<std::shared_ptr<idem::ReplayTier>>{tier});
    const idem::Key key("review", "edited");
    idem::Record r;
    r.state = idem::RecordState::completed;
    r.fingerprint = idem::fingerprint("a"s);
    r.result = "old";
    r.read_at = std::chrono::system_clock::now();
    r.expires_at = r.read_at + 1h;
    REQUIRE(tier->insert(key, r, tier->now()));
    // Some other entry cannot be decoded (another version, a stray write): one error, a pause.
    REQUIRE(server.command({"SET", "rc:c:6:reviewjunk", "junk", "PX", "600000"}) == "+OK");
    CHECK(tier->find(idem::Key("review", "junk")) == nullptr);
    REQUIRE(tier->stats().untrusted == 1);
    // The operator fixed the row by hand and forgets the key.
    const bool forgotten = store.forget(key);
    INFO("forget answered " << forgotten);
    CHECK(server.command({"EXISTS", "rc:c:6:reviewedited"}) == ":0");
}

// CHECK (PASSES: found correct): list_stale's scope filters walk the index past pages of keys of
// other scopes (ZRANGEBYSCORE ... LIMIT offset 256 inside one script), by lease end.
TEST_CASE("RedisStore: list_stale finds a matching key behind 600 stale keys of other scopes", "[redis][review]") {
    RedisServer server({.appendonly = false});
    idem::RedisStore store(server.store_options());
    for (int i = 0; i < 600; ++i) {
        REQUIRE(store
                    .claim(idem::Key("acct_1", "k" + std::to_string(i)), idem::fingerprint("x"s),
                           idem::ClaimOptions{.lease = 1ms})
                    .status == idem::ClaimStatus::claimed);
    }
    std::this_thread::sleep_for(5ms);
    REQUIRE(
        store.claim(idem::Key("acct_10:x", "late"), idem::fingerprint("y"s), idem::ClaimOptions{.lease = 1ms}).status ==
        idem::ClaimStatus::claimed);
    REQUIRE(
        store.claim(idem::Key("acct_2", "late"), idem::fingerprint("y"s), idem::ClaimOptions{.lease = 1ms}).status ==
        idem::ClaimStatus::claimed);
    std::this_thread::sleep_for(20ms);
    const auto exact = store.list_stale(5, idem::ScopeFilter::exact("acct_2"));
    REQUIRE(exact.size() == 1);
    CHECK(exact[0].key == idem::Key("acct_2", "late"));
    const auto prefix = store.list_stale(5, idem::ScopeFilter::prefix("acct_10:"));
    REQUIRE(prefix.size() == 1);
    CHECK(prefix[0].key == idem::Key("acct_10:x", "late"));
    CHECK(store.list_stale(1000).size() == 602);
    const auto first = store.list_stale(3);
    REQUIRE(first.size() == 3);
    CHECK(first[0].record.lease_until <= first[1].record.lease_until);
    CHECK(first[1].record.lease_until <= first[2].record.lease_until);
}

// Found by review (each case failed before its fix): RedisReplayCache took an entry's freshness
// from Redis's PTTL alone, which whoever can write to the Redis sets, and never held it against the
// expires_at sealed inside the entry. A genuine entry, copied while it lived and SET back with a
// long PX once its retention had ended (the primary has forgotten the key), answered a new request
// with the same key and body with the old bytes: its effect never ran.
TEST_CASE("RedisReplayCache: a genuine entry put back after its sealed expiry is a miss; the effect runs again",
          "[redis][review][cache]") {
    const std::string secret = GENERATE(Catch::Generators::as<std::string>{}, std::string(32, 's'), "");
    RedisServer server({.appendonly = false});
    idem::RedisReplayCacheOptions o;
    o.connection.unix_socket = server.socket();
    o.connection.key_prefix = "rc:";
    o.entry_secret = secret;
    auto tier = std::make_shared<idem::RedisReplayCache>(o);
    idem::MemoryStoreOptions primary_options;
    primary_options.default_retention = 1s;
    idem::MemoryStore primary(primary_options);
    idem::CachedStore store(primary, std::vector<std::shared_ptr<idem::ReplayTier>>{tier});
    const idem::Key key("review", "replayed-late");
    const idem::Fingerprint fp = idem::fingerprint("POST /charges"s, "100 EUR"s);
    int runs = 0;
    auto effect = [&] { return "charge #" + std::to_string(++runs); };

    REQUIRE(idem::execute_once(store, key, fp, effect).outcome() == idem::Outcome::executed);
    REQUIRE(idem::execute_once(store, key, fp, effect).outcome() == idem::Outcome::replayed);  // fills Redis
    const auto record = primary.read(key);
    REQUIRE(record);
    const std::string entry = "rc:c:6:reviewreplayed-late";
    const std::string got = server.command({"GET", entry});
    REQUIRE(got.rfind("$", 0) == 0);
    REQUIRE(got != "$-1");
    const std::string bytes = got.substr(got.find('\n') + 1);

    // The sealed expiry passes (with a margin for the clock's reading); the entry is put back.
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (std::chrono::system_clock::now() < record->expires_at + 200ms) {
        REQUIRE(std::chrono::steady_clock::now() < deadline);
        std::this_thread::sleep_for(20ms);
    }
    REQUIRE(server.command({"SET", entry, bytes, "PX", "600000"}) == "+OK");

    const auto claims = primary.stats().claims;
    const auto r = idem::execute_once(store, key, fp, effect);
    CHECK(r.outcome() == idem::Outcome::executed);
    CHECK(r.response() == "charge #2");
    CHECK(runs == 2);
    CHECK(primary.stats().claims == claims + 1);
    CHECK(tier->stats().hits == 0);
    CHECK(tier->stats().untrusted == 1);
    CHECK(tier->stats().errors == 0);
}

// Found by review (failed before its fix): a hit's retention left came from the PTTL alone, so an
// entry SET with a PX past its sealed expires_at was handed to the tiers in front (and to the
// caller) as living that long.
TEST_CASE("RedisReplayCache: a hit states no more retention than its sealed expires_at leaves",
          "[redis][review][cache]") {
    RedisServer server({.appendonly = false});
    idem::RedisReplayCacheOptions o;
    o.connection.unix_socket = server.socket();
    o.connection.key_prefix = "rc:";
    idem::RedisReplayCache cache(o);
    const idem::Key key("review", "stretched");
    idem::Record r;
    r.state = idem::RecordState::completed;
    r.fingerprint = idem::fingerprint("a"s);
    r.result = "x";
    r.read_at = std::chrono::system_clock::now();
    r.expires_at = r.read_at + 1h;
    REQUIRE(cache.insert(key, r, cache.now()));
    REQUIRE(server.command({"PEXPIRE", "rc:c:6:reviewstretched", std::to_string(24 * 3600 * 1000)}) == ":1");
    const auto hit = cache.find(key);
    REQUIRE(hit);
    CHECK(hit->expires_at == std::chrono::floor<std::chrono::milliseconds>(r.expires_at));  // sealed in ms
    CHECK(hit->expires_at - hit->read_at <= 1h);
    CHECK(hit->expires_at - hit->read_at > 1h - 5min);
}
