// Keyed fingerprints at rest in RedisStore (RedisOptions::fingerprint_secret), against a real
// redis-server: the hash's fp field is the HMAC, not the plain SHA-256 (read with the test's own
// connection); same request replays, another mismatches; records written without a secret still
// replay once it is set, single and batch, and resume mode takes over a stale plain record for the
// same request (compared by the client: Redis is never sent the plain digest, which its SLOWLOG
// would show); a keyed record met without the secret is config_error with the effect not run; one
// keyed with another secret is a mismatch.
#include "idem/fingerprint_secret.hpp"
#include "idem/idem.hpp"
#include "idem/redis/store.hpp"
#include "redis_server.hpp"
#include "test_env.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::ClaimStatus;
using idem::Outcome;
using idem_test::redis_command;
using idem_test::RedisServer;

namespace {

idem::Fingerprint fp_of(std::int64_t cents) { return idem::fingerprint("POST /charges"s, cents, "BRL"s); }

const idem::FingerprintSecret kSecretA("redis secret A, at least 32 bytes long"s);
const idem::FingerprintSecret kSecretB("redis secret B, at least 32 bytes long"s);

std::string record_key(const std::string& prefix, const idem::Key& key) {
    return prefix + "r:" + std::to_string(key.scope().size()) + ":" + key.scope() + key.value();
}

/// A bulk answer of redis_command: "$<n>\n<bytes>".
std::string bulk(std::string_view bytes) { return "$" + std::to_string(bytes.size()) + "\n" + std::string(bytes); }

struct Setup {
    RedisServer server;
    std::string prefix = idem_test::unique_name("fpk") + ":";

    [[nodiscard]] idem::RedisOptions options(std::optional<idem::FingerprintSecret> secret = std::nullopt) const {
        idem::RedisOptions o = server.store_options();
        o.key_prefix = prefix;
        o.fingerprint_secret = std::move(secret);
        return o;
    }
    [[nodiscard]] std::string field(const idem::Key& key, const std::string& name) const {
        return redis_command(server.socket(), {"HGET", record_key(prefix, key), name});
    }
};

/// Everything Redis answers to SLOWLOG GET, raw (the arguments of each command it logged, verbatim).
std::string slowlog(const std::string& socket) {
    const idem_test::UnixConnection conn(socket);
    const std::string command = "*3\r\n$7\r\nSLOWLOG\r\n$3\r\nGET\r\n$4\r\n1000\r\n";
    REQUIRE(::send(conn.fd(), command.data(), command.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(command.size()));
    std::string in;
    for (;;) {  // until the server has said all (a pause of 200 ms after the first bytes)
        pollfd p{conn.fd(), POLLIN, 0};
        if (::poll(&p, 1, in.empty() ? 5000 : 200) <= 0) break;
        char buf[65536];
        const ssize_t n = ::recv(conn.fd(), buf, sizeof buf, 0);
        if (n <= 0) break;
        in.append(buf, static_cast<std::size_t>(n));
    }
    REQUIRE_FALSE(in.empty());
    return in;
}

}  // namespace

TEST_CASE("RedisStore keyed: Redis's SLOWLOG never holds the plain digest", "[redis][fingerprint_secret]") {
    // A reader of Redis — SLOWLOG, MONITOR, a replica's stream — sees every command's arguments:
    // with a secret only the keyed digest may be among them, or a guess of the request (12345
    // BRL) is confirmed from its plain SHA-256. Also when resume mode takes over a stale record
    // written before the secret.
    Setup s;
    const idem::Key stale("tenant", "stale"), fresh("tenant", "fresh");
    {
        idem::RedisStore plain(s.options());
        idem::ClaimOptions short_lease;
        short_lease.lease = 1ms;
        REQUIRE(plain.claim(stale, fp_of(12345), short_lease).status == ClaimStatus::claimed);
    }
    std::this_thread::sleep_for(20ms);  // the 1 ms lease has passed by Redis's clock
    REQUIRE(redis_command(s.server.socket(), {"CONFIG", "SET", "slowlog-log-slower-than", "0"}) == "+OK");
    REQUIRE(redis_command(s.server.socket(), {"CONFIG", "SET", "slowlog-max-len", "1000"}) == "+OK");
    REQUIRE(redis_command(s.server.socket(), {"SLOWLOG", "RESET"}) == "+OK");
    idem::RedisStore store(s.options(kSecretA));
    int runs = 0;
    REQUIRE(idem::execute_once(store, fresh, fp_of(12345), [&] { return ++runs, "paid"s; }).outcome() ==
            Outcome::executed);
    idem::ClaimOptions resume;
    resume.resume_stale = true;
    const auto taken = store.claim(stale, fp_of(12345), resume);
    CHECK(taken.status == ClaimStatus::claimed);  // the same request: taken over
    CHECK(taken.existing->attempt == 2);
    const std::string log = slowlog(s.server.socket());
    CHECK(log.find(kSecretA.key(fp_of(12345)).bytes()) != std::string::npos);  // the log holds the arguments
    CHECK(log.find(fp_of(12345).bytes()) == std::string::npos);                // before: in every claim's arguments
}

TEST_CASE("RedisStore keyed: fp at rest is the HMAC; same request replays, another mismatches",
          "[redis][fingerprint_secret]") {
    Setup s;
    idem::RedisStore store(s.options(kSecretA));
    const idem::Key key("tenant", "charge");
    int runs = 0;
    auto effect = [&] { return ++runs, "charged"s; };
    (void)store.read(key);
    const auto before = store.stats().round_trips;
    REQUIRE(idem::execute_once(store, key, fp_of(100), effect).outcome() == Outcome::executed);
    CHECK(store.stats().round_trips - before == 2);
    CHECK(s.field(key, "fa") == bulk("2"));
    CHECK(s.field(key, "fp") == bulk(kSecretA.key(fp_of(100)).bytes()));
    CHECK(s.field(key, "fp") != bulk(fp_of(100).bytes()));
    CHECK(idem::execute_once(store, key, fp_of(100), effect).outcome() == Outcome::replayed);
    CHECK(idem::execute_once(store, key, fp_of(101), effect).outcome() == Outcome::mismatch);
    CHECK(runs == 1);
}

TEST_CASE("RedisStore keyed: records written without a secret replay under it, single, batch and resume",
          "[redis][fingerprint_secret]") {
    Setup s;
    const idem::Key done("t", "done"), other("t", "other"), stale("t", "stale"), fresh("t", "fresh");
    int runs = 0;
    auto effect = [&] { return ++runs, "paid"s; };
    idem::Claim stale_claim;
    {
        idem::RedisStore plain(s.options());
        REQUIRE(idem::execute_once(plain, done, fp_of(100), effect).outcome() == Outcome::executed);
        REQUIRE(idem::execute_once(plain, other, fp_of(200), effect).outcome() == Outcome::executed);
        idem::ClaimOptions short_lease;
        short_lease.lease = 1ms;
        stale_claim = plain.claim(stale, fp_of(300), short_lease);
        REQUIRE(stale_claim.status == ClaimStatus::claimed);
    }
    CHECK(s.field(done, "fa") == bulk("1"));
    idem::RedisStore store(s.options(kSecretA));
    CHECK(idem::execute_once(store, done, fp_of(100), effect).outcome() == Outcome::replayed);
    CHECK(idem::execute_once(store, done, fp_of(101), effect).outcome() == Outcome::mismatch);

    const std::vector<idem::Key> keys{done, other, fresh};
    const std::vector<idem::Fingerprint> fps{fp_of(100), fp_of(201), fp_of(400)};
    const auto claims = store.claim_batch(keys, fps);
    CHECK(claims[0].status == ClaimStatus::completed);
    CHECK(claims[1].status == ClaimStatus::mismatch);
    REQUIRE(claims[2].status == ClaimStatus::claimed);
    CHECK(s.field(fresh, "fa") == bulk("2"));
    CHECK(s.field(fresh, "fp") == bulk(kSecretA.key(fp_of(400)).bytes()));

    // Resume mode: the claim script compares a stale plain record with the plain digest.
    std::this_thread::sleep_for(20ms);  // the 1 ms lease has passed by Redis's clock
    idem::ClaimOptions resume;
    resume.resume_stale = true;
    CHECK(store.claim(stale, fp_of(301), resume).status == ClaimStatus::mismatch);
    const auto taken = store.claim(stale, fp_of(300), resume);
    CHECK(taken.status == ClaimStatus::claimed);
    REQUIRE(taken.existing);
    CHECK(taken.existing->attempt == 2);
    CHECK(taken.taken_over_fence == stale_claim.fence);
    CHECK(runs == 2);
}

TEST_CASE("RedisStore keyed: a keyed record without the secret is config_error; another secret is a mismatch",
          "[redis][fingerprint_secret]") {
    Setup s;
    const idem::Key key("t", "keyed");
    int runs = 0;
    auto effect = [&] { return ++runs, "charged"s; };
    {
        idem::RedisStore keyed(s.options(kSecretA));
        REQUIRE(idem::execute_once(keyed, key, fp_of(100), effect).outcome() == Outcome::executed);
    }
    const std::string at_rest = s.field(key, "fp");
    idem::RedisStore plain(s.options());
    CHECK_THROWS_WITH(idem::execute_once(plain, key, fp_of(100), effect),
                      Catch::Contains("rows were keyed; configure fingerprint_secret"));
    const std::vector<idem::Key> keys{key, idem::Key("t", "new")};
    const std::vector<idem::Fingerprint> fps{fp_of(100), fp_of(1)};
    CHECK_THROWS_AS(plain.claim_batch(keys, fps), idem::config_error);
    CHECK(redis_command(s.server.socket(), {"EXISTS", record_key(s.prefix, idem::Key("t", "new"))}) == ":0");
    idem::ClaimOptions resume;
    resume.resume_stale = true;
    CHECK_THROWS_AS(plain.claim(key, fp_of(100), resume), idem::config_error);

    idem::RedisStore other(s.options(kSecretB));
    CHECK(idem::execute_once(other, key, fp_of(100), effect).outcome() == Outcome::mismatch);
    CHECK(runs == 1);
    CHECK(s.field(key, "fp") == at_rest);
}
