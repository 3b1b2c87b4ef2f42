// idem::grpc over real gRPC and real PostgreSQL: every outcome of docs/grpc.md's "Outcome →
// status" table, on the synchronous API and, where a case loops over apis(), on the callback API
// (serve_on) and async_serve too. Each case counts the
// handler's runs outside the library and reads the table behind idem's back.
#include <catch2/catch.hpp>

#include <atomic>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "grpc_harness.hpp"
#include "threads.hpp"

using grpc_test::Answer;
using grpc_test::Api;
using grpc_test::charge;
using grpc_test::Harness;
using Code = ::grpc::StatusCode;

namespace {

grpc_test::Metadata with_key(const std::string& tenant, const std::string& key) {
    return {{"x-tenant", tenant}, {"idempotency-key", key}};
}

}  // namespace

TEST_CASE("grpc: the first call runs the handler; a repeat replays status, reply and trailers", "[grpc]") {
    Harness h;
    for (const Api api : grpc_test::apis()) {
        INFO("API " << grpc_test::name(api));
        const std::string tenant = Harness::tenant("replay");
        const std::string key = "order-" + grpc_test::name(api);
        const Answer first = h.call("Charge", with_key(tenant, key), charge(1250), api);
        REQUIRE(first.status.ok());
        CHECK(first.reply.charge_id() == "ch_" + key);
        CHECK(first.reply.run() == 1);
        CHECK(first.trailer("charge-run") == "1");
        CHECK(first.trailer("receipt-bin") == std::string("\0\xff\x01", 3));
        CHECK_FALSE(first.replayed());
        CHECK(h.state(tenant, "Charge", key) == "completed");

        for (const Api other_api : grpc_test::apis()) {
            const Answer again = h.call("Charge", with_key(tenant, key), charge(1250), other_api);
            REQUIRE(again.status.ok());
            CHECK(again.reply.SerializeAsString() == first.reply.SerializeAsString());
            CHECK(again.trailer("charge-run") == "1");
            CHECK(again.trailer("receipt-bin") == std::string("\0\xff\x01", 3));
            CHECK(again.replayed());
        }
        CHECK(h.effects.runs(key) == 1);
    }
}

TEST_CASE("grpc: no key is INVALID_ARGUMENT; nothing stored, handler not called", "[grpc]") {
    Harness h;
    const std::string tenant = Harness::tenant("nokey");
    for (const Api api : grpc_test::apis()) {
        const Answer a = h.call("Charge", {{"x-tenant", tenant}}, charge(100), api);
        CHECK(a.status.error_code() == Code::INVALID_ARGUMENT);
        CHECK_THAT(a.status.error_message(), Catch::Contains("idempotency-key"));
    }
    // ChargeById: neither the metadata nor the request_id field.
    const Answer by_id = h.call("ChargeById", {{"x-tenant", tenant}}, charge(100));
    CHECK(by_id.status.error_code() == Code::INVALID_ARGUMENT);
    CHECK_THAT(by_id.status.error_message(), Catch::Contains("request_id"));
    CHECK(h.rows(tenant) == 0);
}

TEST_CASE("grpc: the same key with another request is FAILED_PRECONDITION", "[grpc]") {
    Harness h;
    for (const Api api : grpc_test::apis()) {
        INFO("API " << grpc_test::name(api));
        const std::string tenant = Harness::tenant("mismatch");
        const std::string key = "k-" + grpc_test::name(api);
        REQUIRE(h.call("Charge", with_key(tenant, key), charge(100), api).status.ok());
        const Answer other = h.call("Charge", with_key(tenant, key), charge(101), api);
        CHECK(other.status.error_code() == Code::FAILED_PRECONDITION);
        CHECK_FALSE(other.replayed());
        CHECK(h.effects.runs(key) == 1);
    }
}

TEST_CASE("grpc: the fingerprint ignores field and map order on the wire", "[grpc]") {
    Harness h;
    const std::string tenant = Harness::tenant("order");
    auto a = charge(100);
    (*a.mutable_labels())["a"] = "1";
    (*a.mutable_labels())["b"] = "2";
    (*a.mutable_labels())["c"] = "3";
    auto b = charge(100);
    (*b.mutable_labels())["c"] = "3";
    (*b.mutable_labels())["a"] = "1";
    (*b.mutable_labels())["b"] = "2";
    REQUIRE(h.call("Charge", with_key(tenant, "k"), a).status.ok());
    const Answer again = h.call("Charge", with_key(tenant, "k"), b);
    REQUIRE(again.status.ok());
    CHECK(again.replayed());
    auto c = b;
    (*c.mutable_labels())["b"] = "changed";
    CHECK(h.call("Charge", with_key(tenant, "k"), c).status.error_code() == Code::FAILED_PRECONDITION);
    CHECK(h.effects.runs("k") == 1);
}

TEST_CASE("grpc: a repeat while the first call runs is ABORTED with RetryInfo", "[grpc]") {
    Harness h;
    for (const Api api : grpc_test::apis()) {
        INFO("API " << grpc_test::name(api));
        const std::string tenant = Harness::tenant("busy");
        h.effects.close();
        std::optional<Answer> first;
        std::thread runner([&] { first = h.call("Charge", with_key(tenant, "k"), charge(100, "hold"), api); });
        REQUIRE(h.effects.wait_held());
        const Answer busy = h.call("Charge", with_key(tenant, "k"), charge(100, "hold"), api);
        h.effects.open();
        runner.join();
        CHECK(busy.status.error_code() == Code::ABORTED);
        const auto delay = busy.retry_delay();
        REQUIRE(delay.has_value());
        CHECK(delay->count() > 0);
        REQUIRE(first.has_value());
        CHECK(first->status.ok());
        const Answer after = h.call("Charge", with_key(tenant, "k"), charge(100, "hold"), api);
        CHECK(after.status.ok());
        CHECK(after.replayed());
    }
    CHECK(h.effects.runs("k") == static_cast<int>(grpc_test::apis().size()));  // once per tenant
}

TEST_CASE("grpc: an unreachable store is UNAVAILABLE with RetryInfo; handler not called", "[grpc]") {
    Harness h;
    const Answer a = h.call("ChargeDown", with_key(Harness::tenant("down"), "k"), charge(100));
    CHECK(a.status.error_code() == Code::UNAVAILABLE);
    CHECK_THAT(a.status.error_message(), Catch::Contains("store is unavailable"));
    CHECK(a.retry_delay() == std::chrono::milliseconds(1500));
    CHECK(h.effects.runs("k") == 0);
}

TEST_CASE("grpc: a handler that throws leaves the key in progress (outcome unknown)", "[grpc]") {
    Harness h;
    for (const Api api : grpc_test::apis()) {
        for (const std::string behaviour : {"throw", "outcome-unknown", "bad-trailer"}) {
            INFO("API " << grpc_test::name(api) << ", " << behaviour);
            const std::string tenant = Harness::tenant("unknown");
            const std::string key = "k-" + grpc_test::name(api) + "-" + behaviour;
            const Answer a = h.call("Charge", with_key(tenant, key), charge(100, behaviour), api);
            CHECK(a.status.error_code() == Code::UNAVAILABLE);
            CHECK_THAT(a.status.error_message(), Catch::Contains("not known"));
            CHECK(a.retry_delay() == std::chrono::milliseconds(2500));
            CHECK(h.state(tenant, "Charge", key) == "in_progress");
            // A retry is told to wait: the handler never runs a second time for the key.
            const Answer retry = h.call("Charge", with_key(tenant, key), charge(100, behaviour), api);
            CHECK(retry.status.error_code() == Code::ABORTED);
            CHECK(h.effects.runs(key) == 1);
        }
    }
}

// Another attempt takes the key over while the handler runs (the record's fence changes behind
// idem's back), so the save is lease_lost; the record it leaves does not read (a fingerprint of the
// wrong length), so there is no stored answer to send: the call is answered in progress and the
// failed read is in the method's log.
TEST_CASE("grpc: lease_lost whose read of the record fails is ABORTED and logged", "[grpc]") {
    Harness h;
    std::mutex mutex;
    std::vector<std::string> logged;
    auto options = grpc_test::Methods::base();
    options.log = [&](std::string_view line) {
        std::lock_guard lock(mutex);
        logged.emplace_back(line);
    };
    h.methods.charge = idem::grpc::Method("idemtest.Payments.Charge", options);
    h.effects.meanwhile = [&h](const idem::Key& key) {
        h.db.exec("UPDATE idem_keys SET fence = fence + 1, fingerprint = $3::bytea WHERE scope = $1 AND key = $2",
                  {key.scope(), key.value(), "\\x00"});
    };
    for (const Api api : grpc_test::apis()) {
        INFO("API " << grpc_test::name(api));
        const std::string tenant = Harness::tenant("lostread");
        const std::string key = "k-" + grpc_test::name(api);
        const Answer a = h.call("Charge", with_key(tenant, key), charge(100, "meanwhile"), api);
        INFO(a.status.error_code() << " " << a.status.error_message());
        CHECK(a.status.error_code() == Code::ABORTED);
        CHECK(a.retry_delay() == std::chrono::milliseconds(1500));
        CHECK_FALSE(a.replayed());
        CHECK(h.effects.runs(key) == 1);
        CHECK(h.state(tenant, "Charge", key) == "in_progress");
        std::lock_guard lock(mutex);
        std::string log;
        bool told = false;
        for (const auto& line : logged) {
            log += line + "\n";
            told = told || (line.find("idem::grpc: read after lease_lost: ") != std::string::npos &&
                            line.find("key '" + key + "'") != std::string::npos);
        }
        INFO("the method's log:\n" << log);
        CHECK(told);
    }
}

TEST_CASE("grpc: storage policy: a declined card is stored; success_only releases it", "[grpc]") {
    Harness h;
    const std::string tenant = Harness::tenant("policy");
    // Default (store_all): FAILED_PRECONDITION from the handler is stored and replayed, trailers too.
    for (const Api api : grpc_test::apis()) {
        INFO("API " << grpc_test::name(api));
        const std::string key = "d-" + grpc_test::name(api);
        const Answer declined = h.call("Charge", with_key(tenant, key), charge(100, "decline"), api);
        CHECK(declined.status.error_code() == Code::FAILED_PRECONDITION);
        CHECK(declined.status.error_message() == "card declined");
        CHECK(declined.trailer("decline-code") == "insufficient_funds");
        const Answer again = h.call("Charge", with_key(tenant, key), charge(100, "decline"), api);
        CHECK(again.status.error_code() == Code::FAILED_PRECONDITION);
        CHECK(again.status.error_message() == "card declined");
        CHECK(again.trailer("decline-code") == "insufficient_funds");
        CHECK(again.replayed());
        CHECK(h.effects.runs(key) == 1);
        CHECK(h.state(tenant, "Charge", key) == "completed");
    }

    // success_only: the same status releases the key; the next call runs the handler again.
    const Answer strict = h.call("ChargeStrict", with_key(tenant, "s"), charge(100, "decline"));
    CHECK(strict.status.error_code() == Code::FAILED_PRECONDITION);
    CHECK(h.state(tenant, "ChargeStrict", "s").empty());
    const Answer strict_again = h.call("ChargeStrict", with_key(tenant, "s"), charge(100, "decline"));
    CHECK(strict_again.status.error_code() == Code::FAILED_PRECONDITION);
    CHECK_FALSE(strict_again.replayed());
    CHECK(h.effects.runs("s") == 2);
    CHECK(h.call("ChargeStrict", with_key(tenant, "s"), charge(100)).status.ok());
    CHECK(h.state(tenant, "ChargeStrict", "s") == "completed");
}

TEST_CASE("grpc: not_performed sends its status and releases the key", "[grpc]") {
    Harness h;
    for (const Api api : grpc_test::apis()) {
        INFO("API " << grpc_test::name(api));
        const std::string tenant = Harness::tenant("np");
        const std::string key = "k-" + grpc_test::name(api);
        const Answer a = h.call("Charge", with_key(tenant, key), charge(100, "not-performed"), api);
        CHECK(a.status.error_code() == Code::RESOURCE_EXHAUSTED);
        CHECK(a.status.error_message() == "rate limited");
        CHECK(h.state(tenant, "Charge", key).empty());
        const Answer retry = h.call("Charge", with_key(tenant, key), charge(100), api);
        CHECK(retry.status.ok());
        CHECK_FALSE(retry.replayed());
        CHECK(h.effects.runs(key) == 2);
    }
}

TEST_CASE("grpc: the key from the request_id field; the metadata entry wins when sent", "[grpc]") {
    Harness h;
    const std::string tenant = Harness::tenant("field");
    auto request = charge(100);
    request.set_request_id("req-1");
    const Answer first = h.call("ChargeById", {{"x-tenant", tenant}}, request);
    REQUIRE(first.status.ok());
    CHECK(first.reply.charge_id() == "ch_req-1");
    const Answer again = h.call("ChargeById", {{"x-tenant", tenant}}, request);
    CHECK(again.replayed());
    CHECK(h.effects.runs("req-1") == 1);
    CHECK(h.state(tenant, "ChargeById", "req-1") == "completed");

    const Answer by_metadata = h.call("ChargeById", with_key(tenant, "meta-1"), request);
    REQUIRE(by_metadata.status.ok());
    CHECK(by_metadata.reply.charge_id() == "ch_meta-1");
    CHECK(h.state(tenant, "ChargeById", "meta-1") == "completed");
}

TEST_CASE("grpc: a stored record that does not decode is INTERNAL; the handler never runs again", "[grpc]") {
    Harness h;
    const std::string tenant = Harness::tenant("corrupt");
    REQUIRE(h.call("Charge", with_key(tenant, "k"), charge(100)).status.ok());
    for (const std::string bytes : {"\\x00", "\\x49444702", "\\x494447010000"}) {  // garbage, version 2, truncated
        h.db.exec("UPDATE idem_keys SET result = $1::bytea WHERE scope = $2 AND key = 'k'",
                  {bytes, tenant + ":/idemtest.Payments/Charge"});
        const Answer a = h.call("Charge", with_key(tenant, "k"), charge(100));
        CHECK(a.status.error_code() == Code::INTERNAL);
    }
    CHECK(h.effects.runs("k") == 1);
}

TEST_CASE("grpc: 32 concurrent calls with one key run the effect once, with byte-identical replies", "[grpc]") {
    Harness h;
    const std::string tenant = Harness::tenant("race");
    constexpr int kCalls = 32;
    std::vector<Answer> answers(kCalls);
    idem_test::run_threads(kCalls, [&](int t) {
        auto request = charge(700);
        request.set_sleep_ms(300);  // the others arrive while it runs and wait (ClaimOptions::wait)
        const auto apis = grpc_test::apis();
        const Api api = apis[static_cast<std::size_t>(t) % apis.size()];
        answers[static_cast<std::size_t>(t)] = h.call("ChargeWait", with_key(tenant, "k"), request, api);
    });
    std::set<std::string> bodies;
    int replayed = 0;
    for (const Answer& a : answers) {
        REQUIRE(a.status.ok());
        bodies.insert(a.reply.SerializeAsString());
        replayed += a.replayed() ? 1 : 0;
    }
    CHECK(h.effects.runs("k") == 1);
    CHECK(bodies.size() == 1);
    CHECK(replayed == kCalls - 1);
}

TEST_CASE("grpc: a client whose deadline passes retries with the same key and gets the replay", "[grpc]") {
    Harness h;
    for (const Api api : grpc_test::apis()) {
        INFO("API " << grpc_test::name(api));
        const std::string tenant = Harness::tenant("deadline");
        auto request = charge(100);
        request.set_sleep_ms(1500);
        const Answer late = h.call("Charge", with_key(tenant, "k"), request, api, std::chrono::milliseconds(300));
        CHECK(late.status.error_code() == Code::DEADLINE_EXCEEDED);
        // The server completes anyway; the record becomes completed (generous bound: a busy machine).
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        while (h.state(tenant, "Charge", "k") != "completed" && std::chrono::steady_clock::now() < until) {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        REQUIRE(h.state(tenant, "Charge", "k") == "completed");
        const Answer retry = h.call("Charge", with_key(tenant, "k"), request, api);
        REQUIRE(retry.status.ok());
        CHECK(retry.replayed());
        CHECK(retry.reply.run() == h.effects.runs("k"));  // this tenant's run: the handler ran once
    }
    CHECK(h.effects.runs("k") == static_cast<int>(grpc_test::apis().size()));
}

TEST_CASE("grpc: streaming methods and bad options are refused when the Method is made", "[grpc]") {
    using idem::grpc::Method;
    using idem::grpc::MethodOptions;
    auto refused = [](const std::string& name, MethodOptions options = {}) -> std::string {
        try {
            Method method(name, std::move(options));
        } catch (const idem::config_error& e) {
            return e.what();
        }
        return "accepted";
    };
    CHECK_THAT(refused("idemtest.Payments.Watch"),
               Catch::Contains("/idemtest.Payments/Watch is a server streaming method"));
    CHECK_THAT(refused("/idemtest.Payments/Upload"),
               Catch::Contains("/idemtest.Payments/Upload is a client streaming method"));
    CHECK_THAT(refused("idemtest.Payments.Nope"), Catch::Contains("no method 'idemtest.Payments.Nope'"));
    CHECK_THAT(refused("idemtest.Payments.Charge", {.key_metadata = "Idempotency-Key"}),
               Catch::Contains("not a lowercase gRPC ASCII header name"));
    CHECK_THAT(refused("idemtest.Payments.Charge", {.key_metadata = "idempotency-key-bin"}),
               Catch::Contains("not a lowercase gRPC ASCII header name"));
    CHECK_THAT(refused("idemtest.Payments.Charge", {.key_field = "amount_cents"}),
               Catch::Contains("not a singular string field"));
    CHECK(refused("idemtest.Payments.Charge", {.key_field = "request_id"}) == "accepted");
}
