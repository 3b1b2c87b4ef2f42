// RedisStore with sealed responses (idem/sealing.hpp): what is in Redis (read with the test's own
// connection), and a result altered, truncated or copied from another key answered with
// corrupt_record, the effect never run again. The record format itself is tests/store/sealing_test.cpp's.
#include "idem/sealing.hpp"
#include "idem/idem.hpp"
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
    CHECK(idem::open_sealed(*ring, a, stored).find(kBody) != std::string::npos);

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
