// idem::grpc, adversarial cases: what a replay sends must be what the first call sent, and a stored
// record gRPC cannot send must be INTERNAL (docs/grpc.md, "Record format"), never a crash.
#include <catch2/catch.hpp>

#include <string>

#include "grpc_harness.hpp"
#include "idem/grpc/record.hpp"
#include "idem/reconciler.hpp"

using grpc_test::Answer;
using grpc_test::charge;
using grpc_test::Harness;
using Code = ::grpc::StatusCode;

namespace {

grpc_test::Metadata with_key(const std::string& tenant, const std::string& key) {
    return {{"x-tenant", tenant}, {"idempotency-key", key}};
}

std::string bytea_hex(const std::string& bytes) {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string out = "\\x";
    for (const char c : bytes) {
        const auto b = static_cast<unsigned char>(c);
        out += kDigits[b >> 4];
        out += kDigits[b & 15];
    }
    return out;
}

// Replaces the record of `key` with a well-formed version-1 record of `call`.
void store_record(Harness& h, const std::string& tenant, const std::string& key,
                  const idem::grpc::detail::StoredCall& call) {
    h.db.exec("UPDATE idem_keys SET result = $1::bytea WHERE scope = $2 AND key = $3",
              {bytea_hex(idem::codec<idem::grpc::detail::StoredCall>::encode(call)),
               tenant + ":/idemtest.Payments/Charge", key});
}

}  // namespace

TEST_CASE("grpc: a handler's status code outside gRPC's is replayed as first sent", "[grpc]") {
    Harness h;
    for (const grpc_test::Api api : grpc_test::apis()) {
        INFO("API " << grpc_test::name(api));
        const std::string tenant = Harness::tenant("code20");
        const std::string key = "k-" + grpc_test::name(api);
        const Answer first = h.call("Charge", with_key(tenant, key), charge(100, "code-20"), api);
        const Answer again = h.call("Charge", with_key(tenant, key), charge(100, "code-20"), api);
        INFO("first: " << first.status.error_code() << " " << first.status.error_message());
        INFO("again: " << again.status.error_code() << " " << again.status.error_message());
        CHECK(again.status.error_code() == first.status.error_code());
        CHECK(again.status.error_message() == first.status.error_message());
        CHECK(h.effects.runs(key) == 1);
    }
}

// A record written by another build, or altered in the table, whose trailer name gRPC refuses:
// AddTrailingMetadata accepts it and gRPC asserts when the status is sent ("API misuse").
TEST_CASE("grpc: a stored trailer with a name gRPC refuses is INTERNAL, not a crash", "[grpc]") {
    Harness h;
    const std::string tenant = Harness::tenant("badtrailer");
    REQUIRE(h.call("Charge", with_key(tenant, "k"), charge(100)).status.ok());
    store_record(h, tenant, "k", {0, "", "", "", {{"Bad Name", "x"}}});
    const Answer a = h.call("Charge", with_key(tenant, "k"), charge(100));
    CHECK(a.status.error_code() == Code::INTERNAL);
    CHECK(h.effects.runs("k") == 1);
}

TEST_CASE("grpc: a stored ASCII trailer with a control byte is INTERNAL, not a crash", "[grpc]") {
    Harness h;
    const std::string tenant = Harness::tenant("badvalue");
    REQUIRE(h.call("Charge", with_key(tenant, "k"), charge(100)).status.ok());
    store_record(h, tenant, "k", {0, "", "", "", {{"charge-run", std::string("1\n2")}}});
    const Answer a = h.call("Charge", with_key(tenant, "k"), charge(100));
    CHECK(a.status.error_code() == Code::INTERNAL);
    CHECK(h.effects.runs("k") == 1);
}

// MethodOptions::log is the application's callback: a logger that throws (a closed stream, a
// formatting error) must not take the server down nor leave the call unanswered.
TEST_CASE("grpc: a log callback that throws still answers UNAVAILABLE", "[grpc]") {
    Harness h;
    auto options = grpc_test::Methods::base();
    options.log = [](std::string_view) { throw std::runtime_error("the log sink is closed"); };
    h.methods.charge = idem::grpc::Method("idemtest.Payments.Charge", options);
    for (const grpc_test::Api api : grpc_test::apis()) {
        INFO("API " << grpc_test::name(api));
        const std::string tenant = Harness::tenant("badlog");
        const std::string key = "k-" + grpc_test::name(api);
        const Answer a =
            h.call("Charge", with_key(tenant, key), charge(100, "throw"), api, std::chrono::milliseconds(10000));
        INFO(a.status.error_code() << " " << a.status.error_message());
        CHECK(a.status.error_code() == Code::UNAVAILABLE);
        CHECK(h.effects.runs(key) == 1);
    }
}

// not_performed says the call was not done; OK would tell the client it was, while the released
// key lets a retry run the handler again.
TEST_CASE("grpc: not_performed with an OK status is answered UNAVAILABLE, never OK", "[grpc]") {
    Harness h;
    for (const grpc_test::Api api : grpc_test::apis()) {
        INFO("API " << grpc_test::name(api));
        const std::string tenant = Harness::tenant("npok");
        const std::string key = "k-" + grpc_test::name(api);
        const Answer a = h.call("Charge", with_key(tenant, key), charge(100, "not-performed-ok"), api);
        CHECK(a.status.error_code() == Code::UNAVAILABLE);
        CHECK(h.effects.runs(key) == 1);
    }
}

// An unknown outcome waits for a Reconciler; what it saves with stored_call() is what the retry
// gets: the reply and trailers, marked as a replay, and the handler never runs again.
TEST_CASE("grpc: a Reconciler settles a gRPC key with stored_call(), and the retry replays it", "[grpc]") {
    Harness h;
    const std::string tenant = Harness::tenant("reconcile");
    const Answer unknown = h.call("Charge", with_key(tenant, "k"), charge(100, "outcome-unknown"));
    REQUIRE(unknown.status.error_code() == Code::UNAVAILABLE);
    h.db.exec("UPDATE idem_keys SET lease_until = now() - interval '1 minute' WHERE scope = $1 AND key = 'k'",
              {tenant + ":/idemtest.Payments/Charge"});
    idemtest::ChargeReply settled;
    settled.set_charge_id("ch_found_by_reconciler");
    settled.set_amount_cents(100);
    idem::ReconcilerOptions options;
    options.scopes = idem::ScopeFilter::exact(tenant + ":/idemtest.Payments/Charge");
    idem::Reconciler reconciler(
        h.store,
        [&](idem::Reconciliation& r) {
            r.save(idem::grpc::stored_call(::grpc::Status::OK, settled, {{"settled-by", "reconciler"}}));
        },
        options);
    const auto sweep = reconciler.run_once();
    CHECK(sweep.saved == 1);
    const Answer retry = h.call("Charge", with_key(tenant, "k"), charge(100, "outcome-unknown"));  // the same request
    CHECK(retry.status.ok());
    CHECK(retry.reply.charge_id() == "ch_found_by_reconciler");
    CHECK(retry.trailer("settled-by") == "reconciler");
    CHECK(retry.replayed());
    CHECK(h.effects.runs("k") == 1);

    CHECK_THROWS_AS(idem::grpc::stored_call(::grpc::Status(static_cast<::grpc::StatusCode>(17), "x"), settled),
                    std::invalid_argument);
    CHECK_THROWS_AS(idem::grpc::stored_call(::grpc::Status::OK, settled, {{"Bad Name", "x"}}), std::invalid_argument);
}
