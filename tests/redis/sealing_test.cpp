// Sealed responses (idem/sealing.hpp) in Redis: RedisStore — what is in Redis (read with the
// test's own connection), and a result altered, truncated or copied from another key answered with
// corrupt_record, the effect never run again — and RedisReplayCache entries sealed under a keyring
// (nothing readable; an altered entry or one sealed under other keys is a miss answered by the
// primary). The record format itself is tests/store/sealing_test.cpp's.
#include "idem/sealing.hpp"
#include "idem/idem.hpp"
#include "idem/redis/replay_cache.hpp"
#include "idem/redis/store.hpp"
#include "redis_server.hpp"
#include "test_env.hpp"

#include <catch2/catch.hpp>
#include <memory>
#include <string>

using namespace std::string_literals;
using idem::Outcome;
using idem_test::RedisServer;

namespace {

const std::string kBody = "card 4242 charged 1999 BRL";

std::string record_key(const std::string& prefix, const idem::Key& key) {
    return prefix + "r:" + std::to_string(key.scope().size()) + ":" + key.scope() + key.value();
}

/// The bytes of a bulk-string answer of redis_command ("$<n>\n<bytes>").
std::string bulk(const std::string& answer) {
    REQUIRE(answer.size() > 1);
    REQUIRE(answer[0] == '$');
    const std::size_t header = answer.find('\n');
    const std::size_t n = std::stoul(answer.substr(1, header - 1));
    REQUIRE(answer.size() == header + 1 + n);
    return answer.substr(header + 1, n);
}

}  // namespace

TEST_CASE("RedisStore sealed: nothing of the response in Redis; altered or copied results are corrupt_record",
          "[redis][sealing]") {
    RedisServer server;
    idem::RedisOptions o = server.store_options();
    o.key_prefix = idem_test::unique_name("t") + ":";
    auto ring = std::make_shared<idem::Keyring>();
    ring->add(1, std::string(32, 'k'));
    o.sealing.keyring = ring;
    idem::RedisStore store(o);
    int runs = 0;
    const auto charge = [&](const idem::Key& key) {
        return idem::execute_once(store, key, idem::fingerprint("POST /charges"s, 1999), [&] {
            ++runs;
            return kBody;
        });
    };
    const std::string scope = idem_test::unique_name("seal");
    for (const char* k : {"a", "flip", "cut", "copy"})
        REQUIRE(charge(idem::Key(scope, k)).outcome() == Outcome::executed);
    REQUIRE(runs == 4);
    const idem::Key a(scope, "a");
    CHECK(charge(a).response() == kBody);

    const std::string stored = bulk(server.command({"HGET", record_key(o.key_prefix, a), "r"}));
    CHECK(stored.find(kBody) == std::string::npos);
    CHECK(idem::sealed_key_id(stored) == 1u);
    // Bound to the claim that saved it (its fence) and the store's key prefix (format 2).
    const auto fence = std::stoll(bulk(server.command({"HGET", record_key(o.key_prefix, a), "f"})));
    CHECK(idem::open_sealed(*ring, a, stored, idem::SealBinding{fence, o.key_prefix}).find(kBody) != std::string::npos);
    CHECK_THROWS_AS(idem::open_sealed(*ring, a, stored, idem::SealBinding{fence, "another:"}), idem::corrupt_record);

    const auto set = [&](const char* k, std::string bytes) {
        (void)server.command({"HSET", record_key(o.key_prefix, idem::Key(scope, k)), "r", std::move(bytes)});
    };
    std::string flipped = bulk(server.command({"HGET", record_key(o.key_prefix, idem::Key(scope, "flip")), "r"}));
    flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x01);
    set("flip", flipped);
    const std::string cut = bulk(server.command({"HGET", record_key(o.key_prefix, idem::Key(scope, "cut")), "r"}));
    set("cut", cut.substr(0, cut.size() - 1));
    set("copy", stored);  // a's sealed result in copy's record
    for (const char* k : {"flip", "cut", "copy"}) {
        CAPTURE(k);
        CHECK_THROWS_AS(charge(idem::Key(scope, k)), idem::corrupt_record);
        CHECK_THROWS_AS(store.read(idem::Key(scope, k)), idem::corrupt_record);
    }
    CHECK(runs == 4);
    CHECK(charge(a).response() == kBody);
    CHECK(runs == 4);
}

TEST_CASE("RedisReplayCache sealed: nothing readable in the entry; altered or foreign entries are misses",
          "[redis][cache][sealing]") {
    RedisServer server(idem_test::RedisServerOptions{.appendonly = false});
    idem::MemoryStore primary;
    const auto tier_options = [&](char key_byte) {
        idem::RedisReplayCacheOptions o;
        o.connection.unix_socket = server.socket();
        o.connection.key_prefix = "tier:";
        o.connection.command_timeout = std::chrono::seconds(2);  // a busy machine: no spurious misses
        auto ring = std::make_shared<idem::Keyring>();
        ring->add(1, std::string(32, key_byte));
        o.connection.sealing.keyring = ring;
        return o;
    };
    const auto instance = [&](char key_byte) {
        return std::make_unique<idem::CachedStore>(
            primary, std::vector<std::shared_ptr<idem::ReplayTier>>{
                         std::make_shared<idem::RedisReplayCache>(tier_options(key_byte))});
    };
    auto one = instance('x');
    auto two = instance('x');
    auto other_keys = instance('y');
    const idem::Key key("acct_secret_scope", "key-value-visible?");
    int runs = 0;
    const auto charge = [&](idem::CachedStore& store) {
        return idem::execute_once(store, key, idem::fingerprint("POST /charges"s, 1999), [&] {
            ++runs;
            return kBody;
        });
    };
    REQUIRE(charge(*one).outcome() == Outcome::executed);
    REQUIRE(charge(*one).outcome() == Outcome::replayed);  // reaches the primary, fills Redis
    const std::string entry_key = "tier:c:" + std::to_string(key.scope().size()) + ":" + key.scope() + key.value();
    const std::string entry = bulk(server.command({"GET", entry_key}));
    CHECK(entry.starts_with("idem-c3g"));
    for (const std::string& secret : {kBody, key.scope(), key.value()}) CHECK(entry.find(secret) == std::string::npos);

    const auto claims = primary.stats().claims;
    CHECK(charge(*two).response() == kBody);
    CHECK(primary.stats().claims == claims);  // from Redis
    auto& tier_two = dynamic_cast<idem::RedisReplayCache&>(*two->tiers()[0]);
    CHECK(tier_two.stats().hits == 1);

    // sealed under other keys: a miss, answered by the primary
    CHECK(charge(*other_keys).response() == kBody);
    CHECK(primary.stats().claims == claims + 1);
    CHECK(dynamic_cast<idem::RedisReplayCache&>(*other_keys->tiers()[0]).stats().untrusted == 1);

    // one byte altered: a miss, answered by the primary (a fresh instance: no in-process copy)
    (void)charge(*one);  // refills Redis if the other instance's miss replaced the entry
    std::string altered = bulk(server.command({"GET", entry_key}));
    REQUIRE(altered.starts_with("idem-c3g"));
    altered[altered.size() - 20] = static_cast<char>(altered[altered.size() - 20] ^ 0x01);
    (void)server.command({"SET", entry_key, altered, "KEEPTTL"});
    auto three = instance('x');
    const auto before = primary.stats().claims;
    CHECK(charge(*three).response() == kBody);
    CHECK(primary.stats().claims == before + 1);
    CHECK(dynamic_cast<idem::RedisReplayCache&>(*three->tiers()[0]).stats().untrusted == 1);
    CHECK(runs == 1);
}

TEST_CASE("sealed: a tier entry's sealed bytes moved into RedisStore's record are corrupt_record, not a result",
          "[redis][sealing]") {
    // One keyring for the store and its tier, one Redis for both (the configuration security.md
    // describes). The tier's 'g' entry is idem::seal() of its own body under the same key: with
    // no domain separation it opens as the store's result.
    RedisServer server;
    auto ring = std::make_shared<idem::Keyring>();
    ring->add(1, std::string(32, 'k'));
    idem::RedisOptions o = server.store_options();
    o.key_prefix = idem_test::unique_name("t") + ":";
    o.sealing.keyring = ring;
    idem::RedisStore store(o);
    idem::RedisReplayCacheOptions t;
    t.connection = server.store_options();
    t.connection.key_prefix = "tier:";
    t.connection.command_timeout = std::chrono::seconds(2);
    t.connection.sealing.keyring = ring;
    idem::CachedStore cached(
        store, std::vector<std::shared_ptr<idem::ReplayTier>>{std::make_shared<idem::RedisReplayCache>(t)});
    const idem::Key key(idem_test::unique_name("seal"), "k-1");
    int runs = 0;
    const auto charge = [&](idem::IdempotencyStore& s) {
        return idem::execute_once(s, key, idem::fingerprint("POST /charges"s, 1999), [&] {
            ++runs;
            return kBody;
        });
    };
    REQUIRE(charge(cached).outcome() == Outcome::executed);
    REQUIRE(charge(cached).outcome() == Outcome::replayed);  // fills the tier
    const std::string entry_key = "tier:c:" + std::to_string(key.scope().size()) + ":" + key.scope() + key.value();
    const std::string entry = bulk(server.command({"GET", entry_key}));
    REQUIRE(entry.starts_with("idem-c3g"));
    // A writer to the Redis moves the tier's sealed record into the store's result field.
    (void)server.command({"HSET", record_key(o.key_prefix, key), "r", entry.substr(8)});
    CHECK_THROWS_AS(store.read(key), idem::corrupt_record);
    CHECK_THROWS_AS(charge(store), idem::corrupt_record);
    CHECK(runs == 1);
}

TEST_CASE("sealed: RedisStore answers a repeated save of the same result alike, sealed or not", "[redis][sealing]") {
    // design.md: kSave answers saved for a completed record with this fence and these bytes. A
    // sealed save re-seals (new salt), so the same call is lease_lost only when sealing is on.
    RedisServer server;
    for (const bool sealed : {false, true}) {
        CAPTURE(sealed);
        idem::RedisOptions o = server.store_options();
        o.key_prefix = idem_test::unique_name("t") + ":";
        if (sealed) {
            auto ring = std::make_shared<idem::Keyring>();
            ring->add(1, std::string(32, 'k'));
            o.sealing.keyring = ring;
        }
        idem::RedisStore store(o);
        const idem::Key key(idem_test::unique_name("seal"), "k-1");
        const auto c = store.claim(key, idem::fingerprint("POST /charges"s, 1999));
        REQUIRE(c.status == idem::ClaimStatus::claimed);
        store.save(key, c.fence, kBody);
        CHECK_NOTHROW(store.save(key, c.fence, kBody));
    }
}
