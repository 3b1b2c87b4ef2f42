// RedisStore beyond the shared contract: round trips, what lives in Redis (TTLs, the index of
// in-progress keys), the persistence check, authentication, scripts flushed behind its back,
// batches, bad options and bad data; and RedisReplayCache as a tier of CachedStore in front of
// PostgreSQL: shared replays, TTLs bounded by the retention left, fingerprints checked, in-progress
// never cached, a stopped Redis falling back to PostgreSQL, entries altered, copied between keys
// or from a tier of another key prefix, truncated, of the old format or sealed under another
// secret answered by PostgreSQL instead of replayed. Each test case starts its own redis-server(s); the tier's cases
// need IDEM_TEST_DATABASE_URL (scripts/with-postgres.sh).
#include "idem/idem.hpp"
#include "idem/redis/replay_cache.hpp"
#include "idem/redis/store.hpp"
#include "pg.hpp"
#include "redis_server.hpp"
#include "require_db.hpp"
#include "test_env.hpp"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Outcome;
using idem_test::redis_command;
using idem_test::RedisServer;
using idem_test::RedisServerOptions;

namespace {

idem::Fingerprint fp_of(const std::string& body) { return idem::fingerprint("POST /charges"s, body); }

/// The Redis key of a record / cache entry of `key` under `prefix` (redis_store.hpp's layout).
std::string record_key(const std::string& prefix, const idem::Key& key) {
    return prefix + "r:" + std::to_string(key.scope().size()) + ":" + key.scope() + key.value();
}
std::string entry_key(const std::string& prefix, const idem::Key& key) {
    return prefix + "c:" + std::to_string(key.scope().size()) + ":" + key.scope() + key.value();
}

/// ":123" → 123 (an integer answer of redis_command).
long long integer_answer(const std::string& answer) {
    REQUIRE(!answer.empty());
    REQUIRE(answer[0] == ':');
    return std::stoll(answer.substr(1));
}

/// execute_once on `store` throws config_error naming each of `words`, and fn does not run.
void refused_with_config_error(idem::RedisStore& store, std::initializer_list<const char*> words) {
    bool ran = false;
    try {
        (void)idem::execute_once(store, idem::Key("s", "k"), fp_of("a"), [&] {
            ran = true;
            return "x"s;
        });
        FAIL("no config_error");
    } catch (const idem::config_error& e) {
        for (const char* word : words) CHECK_THAT(e.what(), Catch::Contains(word));
    }
    CHECK_FALSE(ran);
}

idem::RedisOptions store_options(const RedisServer& server) {
    idem::RedisOptions o = server.store_options();
    o.key_prefix = idem_test::unique_name("t") + ":";
    return o;
}

}  // namespace

TEST_CASE("RedisStore: a new key costs 2 round trips, a replay, a conflict and a mismatch 1 each", "[redis]") {
    RedisServer server;
    idem::RedisStore store(store_options(server));
    const idem::Key key("tenant", "k1");
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return "charged"s;
    };
    (void)store.read(key);  // opens the connection (set-up is not counted)
    const auto before = store.stats().round_trips;
    CHECK(idem::execute_once(store, key, fp_of("a"), effect).outcome() == Outcome::executed);
    CHECK(store.stats().round_trips - before == 2);
    const auto r = idem::execute_once(store, key, fp_of("a"), effect);
    CHECK(r.outcome() == Outcome::replayed);
    CHECK(r.response() == "charged");
    CHECK(store.stats().round_trips - before == 3);
    CHECK(idem::execute_once(store, key, fp_of("b"), effect).outcome() == Outcome::mismatch);
    CHECK(store.stats().round_trips - before == 4);
    CHECK(runs == 1);
}

TEST_CASE("RedisStore: a completed record expires with its retention; an in-progress one never does", "[redis]") {
    RedisServer server;
    const auto options = store_options(server);
    idem::RedisStore store(options);
    const idem::Key done("tenant", "done"), running("tenant", "running");
    idem::ClaimOptions claim;
    claim.retention = 3600s;
    auto c = store.claim(done, fp_of("a"), claim);
    REQUIRE(c.status == idem::ClaimStatus::claimed);
    CHECK(integer_answer(redis_command(server.socket(), {"PTTL", record_key(options.key_prefix, done)})) == -1);
    store.save(done, c.fence, "result");
    const auto ttl = integer_answer(redis_command(server.socket(), {"PTTL", record_key(options.key_prefix, done)}));
    CHECK(ttl > 3500 * 1000);
    CHECK(ttl <= 3600 * 1000);
    // The index of in-progress keys holds exactly the one still running.
    auto r = store.claim(running, fp_of("a"));
    REQUIRE(r.status == idem::ClaimStatus::claimed);
    CHECK(integer_answer(redis_command(server.socket(), {"PTTL", record_key(options.key_prefix, running)})) == -1);
    CHECK(integer_answer(redis_command(server.socket(), {"ZCARD", options.key_prefix + "in_progress"})) == 1);

    // A retention that passes: the key is gone, and a claim starts afresh.
    const idem::Key brief("tenant", "brief");
    idem::ClaimOptions short_claim;
    short_claim.retention = 1s;
    auto b = store.claim(brief, fp_of("a"), short_claim);
    REQUIRE(b.status == idem::ClaimStatus::claimed);
    store.save(brief, b.fence, "first");
    CHECK(store.claim(brief, fp_of("a"), short_claim).status == idem::ClaimStatus::completed);
    std::this_thread::sleep_for(1500ms);  // past the retention by Redis's clock, whatever the load
    CHECK_FALSE(store.read(brief).has_value());
    CHECK(store.claim(brief, fp_of("a"), short_claim).status == idem::ClaimStatus::claimed);
    CHECK(store.purge_expired() == 0);
}

TEST_CASE("RedisStore: release and save take the key out of the index; list_stale reads it by lease end", "[redis]") {
    RedisServer server;
    const auto options = store_options(server);
    idem::RedisStore store(options);
    idem::ClaimOptions brief;
    brief.lease = 1ms;
    const idem::Key a("s", "a"), b("s", "b"), c("s", "c");
    auto ca = store.claim(a, fp_of("x"), brief);
    std::this_thread::sleep_for(5ms);
    auto cb = store.claim(b, fp_of("x"), brief);
    auto cc = store.claim(c, fp_of("x"));  // a 30 s lease: not stale
    std::this_thread::sleep_for(20ms);
    const auto stale = store.list_stale(10);
    REQUIRE(stale.size() == 2);
    CHECK(stale[0].key.value() == "a");
    CHECK(stale[1].key.value() == "b");
    CHECK(stale[0].record.lease_expired);
    store.save(a, ca.fence, "done");
    store.release(b, cb.fence);
    CHECK(store.list_stale(10).empty());
    CHECK(integer_answer(redis_command(server.socket(), {"ZCARD", options.key_prefix + "in_progress"})) == 1);
    store.release(c, cc.fence);
    CHECK(integer_answer(redis_command(server.socket(), {"ZCARD", options.key_prefix + "in_progress"})) == 0);
}

TEST_CASE("RedisStore: the persistence check refuses what cannot keep the promise, with config_error", "[redis]") {
    SECTION("everysec against the default fsync_always: refused, and the message says what to do") {
        RedisServer server(RedisServerOptions{.appendfsync = "everysec"});
        idem::RedisOptions o = store_options(server);
        o.durability = idem::RedisDurability::fsync_always;
        idem::RedisStore store(o);
        refused_with_config_error(store, {"appendfsync=everysec", "fsync_everysec"});
        o.durability = idem::RedisDurability::fsync_everysec;  // accepted knowingly
        idem::RedisStore accepting(o);
        CHECK(idem::execute_once(accepting, idem::Key("s", "k"), fp_of("a"), [] { return "x"s; }).outcome() ==
              Outcome::executed);
    }
    SECTION("a server that may evict keys: refused, since an evicted claim runs the effect again") {
        RedisServer server(RedisServerOptions{.extra_args = {"--maxmemory-policy", "allkeys-lru"}});
        idem::RedisStore store(store_options(server));
        refused_with_config_error(store, {"maxmemory-policy=allkeys-lru", "noeviction"});
    }
    SECTION("CONFIG forbidden by an ACL: refused unless durability is unchecked") {
        RedisServer server;
        REQUIRE(redis_command(server.socket(), {"ACL", "SETUSER", "app", "on", ">secret", "~*", "+@all", "-config"}) ==
                "+OK");
        idem::RedisOptions o = store_options(server);
        o.username = "app";
        o.password = "secret";
        idem::RedisStore store(o);
        CHECK_THROWS_AS(store.read(idem::Key("s", "k")), idem::config_error);
        o.durability = idem::RedisDurability::unchecked;
        idem::RedisStore trusting(o);
        CHECK_FALSE(trusting.read(idem::Key("s", "k")).has_value());
    }
    SECTION("INFO forbidden by an ACL: refused whatever durability says, since a replica would go unseen") {
        RedisServer server;
        // CONFIG allowed (the persistence check passes), INFO not.
        REQUIRE(redis_command(server.socket(), {"ACL", "SETUSER", "app", "on", ">secret", "~*", "+@all", "-info"}) ==
                "+OK");
        idem::RedisOptions o = store_options(server);
        o.username = "app";
        o.password = "secret";
        const auto durability = GENERATE(idem::RedisDurability::fsync_always, idem::RedisDurability::fsync_everysec,
                                         idem::RedisDurability::unchecked);
        o.durability = durability;
        INFO("durability " << static_cast<int>(durability));
        idem::RedisStore store(o);
        refused_with_config_error(store, {"INFO replication", "NOPERM", "+info"});
        CHECK(integer_answer(redis_command(server.socket(), {"DBSIZE"})) == 0);
    }
}

TEST_CASE("RedisStore: a username without a password connects as that ACL user", "[redis]") {
    RedisServer server;
    // A `nopass` user confined to keys under app: (and without CONFIG, so durability is unchecked).
    REQUIRE(redis_command(server.socket(), {"ACL", "SETUSER", "app", "on", "nopass", "~app:*", "+@all", "-config"}) ==
            "+OK");
    idem::RedisOptions o = store_options(server);
    o.username = "app";
    o.durability = idem::RedisDurability::unchecked;
    SECTION("keys outside the user's pattern are refused at first use with config_error naming the prefix") {
        o.key_prefix = "idem:";
        idem::RedisStore store(o);
        // execute_once (the claim script), a read, a batch and list_stale: each refused, the
        // message naming the prefix to grant, nothing written anywhere.
        refused_with_config_error(store, {"NOPERM", "key_prefix \"idem:\"", "~idem:*"});
        const std::initializer_list<const char*> names{"NOPERM", "~idem:*"};
        auto names_prefix = [&](auto&& call) {
            try {
                call();
                FAIL_CHECK("no config_error");
            } catch (const idem::config_error& e) {
                for (const char* word : names) CHECK_THAT(e.what(), Catch::Contains(word));
            }
        };
        names_prefix([&] { (void)store.read(idem::Key("s", "k")); });
        const std::vector<idem::Key> keys{idem::Key("s", "a")};
        const std::vector<idem::Fingerprint> fps{fp_of("a")};
        names_prefix([&] { (void)store.claim_batch(keys, fps); });
        names_prefix([&] { (void)store.list_stale(10); });
        CHECK(integer_answer(redis_command(server.socket(), {"DBSIZE"})) == 0);
    }
    SECTION("keys inside it: the store works as that user") {
        o.key_prefix = "app:idem:";
        idem::RedisStore store(o);
        CHECK(idem::execute_once(store, idem::Key("s", "k"), fp_of("a"), [] { return "x"s; }).outcome() ==
              Outcome::executed);
        CHECK(idem::execute_once(store, idem::Key("s", "k"), fp_of("a"), [] { return "y"s; }).response() == "x");
    }
    SECTION("the durability check runs as that user: without CONFIG it is refused") {
        o.key_prefix = "app:idem:";
        o.durability = idem::RedisDurability::fsync_always;
        idem::RedisStore store(o);
        CHECK_THROWS_AS(store.read(idem::Key("s", "k")), idem::config_error);
    }
}

TEST_CASE("RedisStore: each grant its ACL user lacks is config_error before anything is written", "[redis]") {
    // An ACL user missing any one command the store runs — the scripts' own calls, or WAIT after
    // writes when wait_replicas > 0 — is refused at connect: Redis holds no key afterwards, so a
    // correctly configured store then claims the same key at once (no claim stranded until its
    // lease passes).
    RedisServer server;
    const char* command =
        GENERATE("wait", "hset", "zadd", "pexpireat", "del", "hmget", "hget", "zrem", "zrange", "time", "evalsha");
    CAPTURE(command);
    const std::string user = std::string("u_") + command;
    REQUIRE(redis_command(server.socket(),
                          {"ACL", "SETUSER", user, "on", ">pw", "~*", "+@all", std::string("-") + command}) == "+OK");
    idem::RedisOptions o = store_options(server);
    o.username = user;
    o.password = "pw";
    o.durability = idem::RedisDurability::unchecked;
    if (std::string_view(command) == "wait") {
        o.wait_replicas = 1;
        o.wait_replicas_timeout = 100ms;
    }
    idem::RedisStore store(o);
    refused_with_config_error(store, {"NOPERM"});
    CHECK(integer_answer(redis_command(server.socket(), {"DBSIZE"})) == 0);
    idem::RedisOptions good = store_options(server);
    good.key_prefix = o.key_prefix;
    idem::RedisStore configured(good);
    CHECK(configured.claim(idem::Key("s", "k"), fp_of("a")).status == idem::ClaimStatus::claimed);
}

TEST_CASE("RedisStore: a wrong password is config_error and never shows the password", "[redis]") {
    RedisServer server;
    REQUIRE(redis_command(server.socket(), {"CONFIG", "SET", "requirepass", "right-password"}) == "+OK");
    idem::RedisOptions o = store_options(server);
    o.password = "wrong-password-xyz";
    idem::RedisStore store(o);
    try {
        (void)store.read(idem::Key("s", "k"));
        FAIL("no config_error");
    } catch (const idem::config_error& e) {
        CHECK_THAT(e.what(), !Catch::Contains("wrong-password-xyz"));
    }
    o.password = "right-password";
    idem::RedisStore good(o);
    CHECK_FALSE(good.read(idem::Key("s", "k")).has_value());
}

TEST_CASE("RedisStore: no server is store_unavailable and fn is not called", "[redis]") {
    idem::RedisOptions o;
    o.unix_socket = "/nonexistent/idem-redis.sock";
    idem::RedisStore store(o);
    bool ran = false;
    CHECK_THROWS_AS(idem::execute_once(store, idem::Key("s", "k"), fp_of("a"),
                                       [&] {
                                           ran = true;
                                           return "x"s;
                                       }),
                    idem::store_unavailable);
    CHECK_FALSE(ran);
}

TEST_CASE("RedisStore: scripts flushed behind its back are loaded again", "[redis]") {
    RedisServer server;
    idem::RedisStore store(store_options(server));
    const idem::Key key("s", "k");
    CHECK(idem::execute_once(store, key, fp_of("a"), [] { return "v"s; }).outcome() == Outcome::executed);
    REQUIRE(redis_command(server.socket(), {"SCRIPT", "FLUSH"}) == "+OK");
    const auto r = idem::execute_once(store, key, fp_of("a"), [] { return "other"s; });
    CHECK(r.outcome() == Outcome::replayed);
    CHECK(r.response() == "v");
}

TEST_CASE("RedisStore: a key holding something else is corrupt_record, not a claim", "[redis]") {
    RedisServer server;
    const auto options = store_options(server);
    idem::RedisStore store(options);
    const idem::Key key("s", "k");
    REQUIRE(redis_command(server.socket(), {"SET", record_key(options.key_prefix, key), "not a hash"}) == "+OK");
    bool ran = false;
    CHECK_THROWS_AS(idem::execute_once(store, key, fp_of("a"),
                                       [&] {
                                           ran = true;
                                           return "x"s;
                                       }),
                    idem::corrupt_record);
    CHECK_FALSE(ran);
    // A hash with a state idem never writes.
    const idem::Key odd("s", "odd");
    REQUIRE(integer_answer(redis_command(server.socket(), {"HSET", record_key(options.key_prefix, odd), "s", "z"})) ==
            1);
    CHECK_THROWS_AS(store.read(odd), idem::corrupt_record);
}

TEST_CASE("RedisStore: batches are one round trip; each key answers as claim and save would", "[redis]") {
    RedisServer server;
    idem::RedisOptions o = store_options(server);
    o.max_result_bytes = 16;
    idem::RedisStore store(o);
    const std::vector<idem::Key> keys{{"s", "a"}, {"s", "b"}, {"s", "c"}};
    const std::vector<idem::Fingerprint> fps{fp_of("1"), fp_of("1"), fp_of("1")};
    (void)store.read(keys[0]);
    const auto before = store.stats().round_trips;
    const auto claims = store.claim_batch(keys, fps);
    CHECK(store.stats().round_trips - before == 1);
    REQUIRE(claims.size() == 3);
    for (const auto& c : claims) CHECK(c.status == idem::ClaimStatus::claimed);
    const std::string big(17, 'x');
    const std::vector<idem::SaveRequest> saves{
        {keys[0], claims[0].fence, "ok"}, {keys[1], claims[1].fence + 1, "stolen"}, {keys[2], claims[2].fence, big}};
    const auto statuses = store.save_batch(saves);
    CHECK(store.stats().round_trips - before == 2);
    CHECK(statuses == std::vector<idem::SaveStatus>{idem::SaveStatus::saved, idem::SaveStatus::lease_lost,
                                                    idem::SaveStatus::too_large});
    CHECK(store.read(keys[0])->result == "ok");
    CHECK(store.read(keys[1])->state == idem::RecordState::in_progress);
    const auto again = store.claim_batch(keys, std::vector<idem::Fingerprint>{fp_of("1"), fp_of("2"), fp_of("1")});
    CHECK(again[0].status == idem::ClaimStatus::completed);
    CHECK(again[1].status == idem::ClaimStatus::mismatch);
    CHECK(again[2].status == idem::ClaimStatus::in_progress);
}

TEST_CASE("RedisStore: bad options are config_error at construction", "[redis]") {
    auto bad = [](auto change) {
        idem::RedisOptions o;
        change(o);
        CHECK_THROWS_AS(idem::RedisStore(o), idem::config_error);
    };
    bad([](idem::RedisOptions& o) { o.pool_size = 0; });
    bad([](idem::RedisOptions& o) { o.key_prefix.clear(); });
    bad([](idem::RedisOptions& o) { o.port = 0; });
    bad([](idem::RedisOptions& o) { o.command_timeout = 0ms; });
    bad([](idem::RedisOptions& o) { o.max_result_bytes = 0; });
    bad([](idem::RedisOptions& o) { o.wait_replicas = -1; });
    bad([](idem::RedisOptions& o) { o.save_retry_window = -1ms; });
}

// --- RedisReplayCache: the tier -------------------------------------------------------------------

namespace {

/// A tier's entry secret (32 bytes and more).
const std::string kEntrySecret = "tier-secret-0123456789abcdefghijklmnop";

/// The primary (a PostgresStore on a private table, whose claims are counted), a Redis tier on
/// `server`, and CachedStores over them: instances of a service sharing one database and one Redis.
struct Tiered {
    static idem::PostgresOptions primary_options(const std::string& table) {
        idem::PostgresOptions o;
        o.table = table;
        o.pool_size = 4;
        return o;
    }
    /// `secret`: the tier's entry_secret ("" for none).
    explicit Tiered(const RedisServer& server, const std::string& secret = kEntrySecret)
        : url(idem_test::require_db()),
          table(idem_test::unique_name("idem_tier")),
          drop(url, table),
          primary(url, primary_options(table)) {
        primary.ensure_schema();
        cache_options.connection.unix_socket = server.socket();
        cache_options.connection.key_prefix = idem_test::unique_name("c") + ":";
        cache_options.connection.command_timeout = 2s;  // a busy machine: no spurious misses
        cache_options.entry_secret = secret;
    }
    std::unique_ptr<idem::CachedStore> instance() {
        return std::make_unique<idem::CachedStore>(
            primary,
            std::vector<std::shared_ptr<idem::ReplayTier>>{std::make_shared<idem::RedisReplayCache>(cache_options)});
    }
    std::string url;
    std::string table;
    idem_test::DropTable drop;  // after the primary has closed its connections
    idem::PostgresStore primary;
    idem::RedisReplayCacheOptions cache_options;
};

}  // namespace

TEST_CASE("RedisReplayCache: a replay in another instance comes from Redis, with the same bytes", "[redis][cache]") {
    const std::string secret = GENERATE(Catch::Generators::as<std::string>{}, kEntrySecret, "");
    RedisServer server(RedisServerOptions{.appendonly = false});
    Tiered t(server, secret);
    auto one = t.instance();
    auto two = t.instance();
    const idem::Key key("s", "k");
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return "charged"s;
    };
    CHECK(idem::execute_once(*one, key, fp_of("a"), effect).outcome() == Outcome::executed);
    // The first replay reaches the primary (a save does not fill the cache) and fills Redis.
    CHECK(idem::execute_once(*one, key, fp_of("a"), effect).outcome() == Outcome::replayed);
    const auto claims = t.primary.stats().claims;
    const auto r = idem::execute_once(*two, key, fp_of("a"), effect);
    CHECK(r.outcome() == Outcome::replayed);
    CHECK(r.response() == "charged");
    CHECK(t.primary.stats().claims == claims);  // answered by Redis
    CHECK(idem::execute_once(*two, key, fp_of("b"), effect).outcome() == Outcome::mismatch);
    CHECK(t.primary.stats().claims == claims + 1);  // a hit that does not match asks the primary
    CHECK(runs == 1);
    auto& tier = dynamic_cast<idem::RedisReplayCache&>(*two->tiers()[0]);
    CHECK(tier.stats().hits == 2);
    CHECK(tier.stats().errors == 0);
}

TEST_CASE("RedisReplayCache: an entry lives no longer than the retention the primary stated; in-progress never",
          "[redis][cache]") {
    RedisServer server(RedisServerOptions{.appendonly = false});
    Tiered t(server);
    auto store = t.instance();
    const idem::Key key("s", "k");
    idem::ClaimOptions claim;
    claim.retention = 100s;
    auto c = store->claim(key, fp_of("a"), claim);
    REQUIRE(c.status == idem::ClaimStatus::claimed);
    CHECK(store->claim(key, fp_of("a"), claim).status == idem::ClaimStatus::in_progress);
    CHECK(redis_command(server.socket(), {"EXISTS", entry_key(t.cache_options.connection.key_prefix, key)}) == ":0");
    store->save(key, c.fence, "done");
    CHECK(store->claim(key, fp_of("a"), claim).status == idem::ClaimStatus::completed);
    const auto ttl =
        integer_answer(redis_command(server.socket(), {"PTTL", entry_key(t.cache_options.connection.key_prefix, key)}));
    CHECK(ttl > 0);
    CHECK(ttl <= 100 * 1000);
    // A local tier in front is filled from the Redis hit, for no longer than Redis keeps it.
    auto local = std::make_shared<idem::ReplayCache>();
    idem::CachedStore front(t.primary, {local, std::make_shared<idem::RedisReplayCache>(t.cache_options)});
    CHECK(front.claim(key, fp_of("a")).status == idem::ClaimStatus::completed);
    CHECK(local->stats().entries == 1);
    CHECK(front.claim(key, fp_of("a")).status == idem::ClaimStatus::completed);
    CHECK(local->stats().hits == 1);
}

TEST_CASE("RedisReplayCache: Redis stopped — replays keep coming from the primary, no error", "[redis][cache][fault]") {
    RedisServer server(RedisServerOptions{.appendonly = false});
    Tiered t(server);
    t.cache_options.connection.command_timeout = 200ms;
    t.cache_options.pause_after_error = 60s;  // one error, then the tier is skipped
    auto store = t.instance();
    const idem::Key key("s", "k");
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return "charged"s;
    };
    CHECK(idem::execute_once(*store, key, fp_of("a"), effect).outcome() == Outcome::executed);
    server.kill9();
    for (int i = 0; i < 20; ++i) {
        const auto r = idem::execute_once(*store, key, fp_of("a"), effect);
        CHECK(r.outcome() == Outcome::replayed);
        CHECK(r.response() == "charged");
    }
    CHECK(runs == 1);
    auto& tier = dynamic_cast<idem::RedisReplayCache&>(*store->tiers()[0]);
    CHECK(tier.stats().hits == 0);
    CHECK(tier.stats().errors == 1);
    CHECK(tier.stats().skipped >= 19);
}

TEST_CASE("RedisReplayCache: an entry that is not idem's is a miss, answered by the primary", "[redis][cache]") {
    RedisServer server(RedisServerOptions{.appendonly = false});
    Tiered t(server);
    t.cache_options.pause_after_error = 0ms;
    auto store = t.instance();
    const idem::Key key("s", "k");
    CHECK(idem::execute_once(*store, key, fp_of("a"), [] { return "real"s; }).outcome() == Outcome::executed);
    REQUIRE(redis_command(server.socket(), {"SET", entry_key(t.cache_options.connection.key_prefix, key), "garbage",
                                            "PX", "60000"}) == "+OK");
    const auto r = idem::execute_once(*store, key, fp_of("a"), [] { return "other"s; });
    CHECK(r.outcome() == Outcome::replayed);
    CHECK(r.response() == "real");
    auto& tier = dynamic_cast<idem::RedisReplayCache&>(*store->tiers()[0]);
    CHECK(tier.stats().untrusted == 1);
    CHECK(tier.stats().errors == 0);
}

// --- RedisReplayCache: entries are authenticated ---------------------------------------------------
// Whoever can write to the tier's Redis writes these entries here, with a connection of its own.

namespace {

/// The bytes of `key`'s entry (REQUIREs that there is one).
std::string entry_bytes(const RedisServer& server, const Tiered& t, const idem::Key& key) {
    const std::string got =
        redis_command(server.socket(), {"GET", entry_key(t.cache_options.connection.key_prefix, key)});
    REQUIRE(got.rfind("$", 0) == 0);
    REQUIRE(got != "$-1");
    return got.substr(got.find('\n') + 1);
}

/// Puts `bytes` in `key`'s slot for 10 minutes.
void put_entry(const RedisServer& server, const Tiered& t, const idem::Key& key, const std::string& bytes) {
    REQUIRE(redis_command(server.socket(), {"SET", entry_key(t.cache_options.connection.key_prefix, key), bytes, "PX",
                                            "600000"}) == "+OK");
}

/// A completed key whose entry is in Redis: executed once with `result`, replayed once (which fills
/// the tier).
void fill(idem::CachedStore& store, const idem::Key& key, const idem::Fingerprint& fp, const std::string& result,
          int& runs) {
    auto effect = [&] {
        ++runs;
        return result;
    };
    REQUIRE(idem::execute_once(store, key, fp, effect).outcome() == Outcome::executed);
    REQUIRE(idem::execute_once(store, key, fp, effect).outcome() == Outcome::replayed);
}

/// A replay of `key` with `fp` through a new instance: answered `expected` by the primary (one claim
/// reaches it), never by the entry in Redis, and fn does not run.
void replayed_from_primary(Tiered& t, const idem::Key& key, const idem::Fingerprint& fp, const std::string& expected) {
    auto store = t.instance();
    const auto claims = t.primary.stats().claims;
    bool ran = false;
    const auto r = idem::execute_once(*store, key, fp, [&] {
        ran = true;
        return "ran again"s;
    });
    CHECK(r.outcome() == Outcome::replayed);
    CHECK(r.response() == expected);
    CHECK_FALSE(ran);
    CHECK(t.primary.stats().claims == claims + 1);
    const auto& tier = dynamic_cast<idem::RedisReplayCache&>(*store->tiers()[0]);
    CHECK(tier.stats().hits == 0);
    CHECK(tier.stats().untrusted == 1);
    CHECK(tier.stats().errors == 0);
}

/// An entry of the format idem wrote before entries were authenticated ("idem-c1": the record's
/// fields, integers little-endian, strings with a 64-bit length, no key, no MAC).
std::string old_format_entry(const idem::Fingerprint& fp, const std::string& result) {
    std::string out = "idem-c1";
    auto integer = [&](std::int64_t v) {
        for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((static_cast<std::uint64_t>(v) >> (8 * i)) & 0xff));
    };
    auto text = [&](std::string_view s) {
        integer(static_cast<std::int64_t>(s.size()));
        out.append(s);
    };
    const auto now_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    integer(static_cast<std::int64_t>(fp.algorithm()));
    text(fp.bytes());
    integer(1);  // fence
    integer(1);  // attempt
    text(result);
    out.push_back('\0');            // no phase
    out.push_back('\0');            // no phase data
    integer(now_ms);                // created_at
    integer(now_ms);                // lease_until
    integer(now_ms + 3600 * 1000);  // expires_at
    return out;
}

}  // namespace

TEST_CASE("RedisReplayCache: an entry with one byte of its result flipped is a miss, answered by the primary",
          "[redis][cache][integrity]") {
    const std::string secret = GENERATE(Catch::Generators::as<std::string>{}, kEntrySecret, "");
    RedisServer server(RedisServerOptions{.appendonly = false});
    Tiered t(server, secret);
    const idem::Key key("s", "k");
    int runs = 0;
    fill(*t.instance(), key, fp_of("a"), "charged 100 EUR", runs);
    std::string bytes = entry_bytes(server, t, key);
    const auto at = bytes.find("charged 100 EUR");
    REQUIRE(at != std::string::npos);
    bytes[at + 8] = static_cast<char>(bytes[at + 8] ^ 0x01);  // "charged 000 EUR"
    put_entry(server, t, key, bytes);
    replayed_from_primary(t, key, fp_of("a"), "charged 100 EUR");
    CHECK(runs == 1);
    // The primary's answer replaced the entry: the next replay is a hit again, with the true bytes.
    CHECK(entry_bytes(server, t, key).find("charged 100 EUR") != std::string::npos);
}

TEST_CASE("RedisReplayCache: another key's entry copied into a key's slot is a miss, not that entry's answer",
          "[redis][cache][integrity]") {
    const std::string secret = GENERATE(Catch::Generators::as<std::string>{}, kEntrySecret, "");
    RedisServer server(RedisServerOptions{.appendonly = false});
    Tiered t(server, secret);
    const idem::Key a("s", "a");
    const idem::Key b("s", "b");      // another request
    const idem::Key c("s", "c");      // the same request as a's
    const idem::Key other("t", "a");  // a's value in another scope
    int runs = 0;
    auto store = t.instance();
    fill(*store, a, fp_of("same"), "for a", runs);
    fill(*store, b, fp_of("b"), "for b", runs);
    fill(*store, c, fp_of("same"), "for c", runs);
    fill(*store, other, fp_of("same"), "for t/a", runs);
    const std::string a_entry = entry_bytes(server, t, a);
    put_entry(server, t, b, a_entry);
    put_entry(server, t, c, a_entry);
    put_entry(server, t, other, a_entry);
    replayed_from_primary(t, b, fp_of("b"), "for b");  // not mismatch
    replayed_from_primary(t, c, fp_of("same"), "for c");
    replayed_from_primary(t, other, fp_of("same"), "for t/a");
    CHECK(runs == 4);
}

TEST_CASE("RedisReplayCache: an entry copied from a tier of another key_prefix, same secret, is a miss",
          "[redis][cache][integrity]") {
    const std::string secret = GENERATE(Catch::Generators::as<std::string>{}, kEntrySecret, "");
    RedisServer server(RedisServerOptions{.appendonly = false});
    // Two deployments sharing a Redis and a secret, told apart by their prefixes (and primaries).
    Tiered a(server, secret);
    Tiered b(server, secret);
    REQUIRE(a.cache_options.connection.key_prefix != b.cache_options.connection.key_prefix);
    const idem::Key key("s", "k");  // the same key and request in both
    int runs_a = 0;
    int runs_b = 0;
    fill(*a.instance(), key, fp_of("same"), "answered by A", runs_a);
    fill(*b.instance(), key, fp_of("same"), "answered by B", runs_b);
    put_entry(server, b, key, entry_bytes(server, a, key));
    replayed_from_primary(b, key, fp_of("same"), "answered by B");
    CHECK(runs_a == 1);
    CHECK(runs_b == 1);
}

TEST_CASE("RedisReplayCache: a truncated entry is a miss, answered by the primary", "[redis][cache][integrity]") {
    const std::string secret = GENERATE(Catch::Generators::as<std::string>{}, kEntrySecret, "");
    RedisServer server(RedisServerOptions{.appendonly = false});
    Tiered t(server, secret);
    const idem::Key key("s", "k");
    int runs = 0;
    fill(*t.instance(), key, fp_of("a"), "real", runs);
    const std::string whole = entry_bytes(server, t, key);
    for (const std::size_t size :
         {whole.size() - 1, whole.size() - 32, whole.size() / 2, std::size_t{8}, std::size_t{0}}) {
        INFO("the entry's first " << size << " of " << whole.size() << " bytes");
        put_entry(server, t, key, whole.substr(0, size));
        replayed_from_primary(t, key, fp_of("a"), "real");
    }
    CHECK(runs == 1);
}

TEST_CASE("RedisReplayCache: an entry of the format before authentication is a miss, answered by the primary",
          "[redis][cache][integrity]") {
    const std::string secret = GENERATE(Catch::Generators::as<std::string>{}, kEntrySecret, "");
    RedisServer server(RedisServerOptions{.appendonly = false});
    Tiered t(server, secret);
    const idem::Key key("s", "k");
    int runs = 0;
    fill(*t.instance(), key, fp_of("a"), "real", runs);
    put_entry(server, t, key, old_format_entry(fp_of("a"), "forged"));
    replayed_from_primary(t, key, fp_of("a"), "real");
    CHECK(runs == 1);
}

TEST_CASE("RedisReplayCache: an entry written under another secret, or none, is a miss", "[redis][cache][integrity]") {
    const std::string other_secret = "another-secret-0123456789abcdefghijklm";
    const auto [written_with, read_with] =
        GENERATE_COPY(std::pair{other_secret, kEntrySecret}, std::pair{std::string(), kEntrySecret},
                      std::pair{kEntrySecret, std::string()});
    INFO("written with a secret of " << written_with.size() << " bytes, read with one of " << read_with.size());
    RedisServer server(RedisServerOptions{.appendonly = false});
    Tiered t(server, written_with);
    const idem::Key key("s", "k");
    int runs = 0;
    fill(*t.instance(), key, fp_of("a"), "real", runs);
    const std::string written = entry_bytes(server, t, key);
    t.cache_options.entry_secret = read_with;
    replayed_from_primary(t, key, fp_of("a"), "real");
    CHECK(runs == 1);
    CHECK(entry_bytes(server, t, key) != written);  // refilled under the reader's secret
}

TEST_CASE("RedisReplayCacheOptions: an entry secret shorter than 32 bytes is a config_error that does not show it",
          "[redis][cache][integrity]") {
    idem::RedisReplayCacheOptions o;
    o.connection.unix_socket = "/nonexistent/redis.sock";
    o.entry_secret = "short-secret-31-bytes-long-abcd";
    REQUIRE(o.entry_secret.size() == 31);
    try {
        idem::RedisReplayCache cache(o);
        FAIL("no config_error");
    } catch (const idem::config_error& e) {
        CHECK_THAT(e.what(), Catch::Contains("entry_secret"));
        CHECK_THAT(e.what(), !Catch::Contains("short-secret"));
    }
    o.entry_secret = std::string(32, 'x');
    CHECK_NOTHROW(idem::RedisReplayCache(o));
    o.entry_secret.clear();
    CHECK_NOTHROW(idem::RedisReplayCache(o));
}
