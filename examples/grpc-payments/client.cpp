// examples/grpc-payments/client.cpp — a client that retries with the same idempotency key.
//
//   grpc-payments-client 127.0.0.1:PORT
//
// Its channel's service config retries ABORTED (the key is in flight) and UNAVAILABLE with
// exponential backoff; gRPC resends the call's metadata on every attempt, so each retry carries
// the same idempotency-key. It runs four scenarios against grpc-payments-server and exits 0 when
// each answer is the one expected:
//   1. a charge, then the same call again: the same charge, replayed (idempotent-replayed: true);
//   2. two concurrent calls with one key: one charge; the loser is ABORTED, retried, replayed;
//   3. the same key with another amount: FAILED_PRECONDITION, nothing charged;
//   4. a declined card: FAILED_PRECONDITION, and the same answer again on a retry.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <thread>

#include "payments.grpc.pb.h"

namespace {

// Retries of the Charge method: ABORTED and UNAVAILABLE, up to 5 attempts, backoff from 0.5 s.
constexpr const char* kServiceConfig = R"({
  "methodConfig": [{
    "name": [{"service": "payments.Payments", "method": "Charge"}],
    "retryPolicy": {
      "maxAttempts": 5,
      "initialBackoff": "0.5s",
      "maxBackoff": "4s",
      "backoffMultiplier": 2,
      "retryableStatusCodes": ["ABORTED", "UNAVAILABLE"]
    }
  }]
})";

// A new key for each logical operation (a UUID would do as well).
std::string new_key() {
    static std::mt19937_64 random{std::random_device{}()};
    char buf[40];
    std::snprintf(buf, sizeof buf, "charge-%016llx", static_cast<unsigned long long>(random()));
    return buf;
}

struct Answer {
    grpc::Status status;
    payments::ChargeReply reply;
    bool replayed = false;
};

Answer charge(payments::Payments::Stub& stub, const std::string& key, const std::string& card, long long amount) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    context.AddMetadata("idempotency-key", key);  // the same key on every attempt of this call
    context.AddMetadata("x-account", "acct_42");
    payments::ChargeRequest request;
    request.set_card(card);
    request.set_amount_cents(amount);
    request.set_currency("EUR");
    Answer answer;
    answer.status = stub.Charge(&context, request, &answer.reply);
    for (const auto& [name, value] : context.GetServerTrailingMetadata()) {
        if (name == "idempotent-replayed" && value == "true") answer.replayed = true;
    }
    return answer;
}

int failures = 0;
void expect(bool ok, const std::string& what) {
    std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
    if (!ok) ++failures;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::cerr << "usage: grpc-payments-client HOST:PORT\n";
        return 2;
    }
    grpc::ChannelArguments args;
    args.SetServiceConfigJSON(kServiceConfig);
    auto stub =
        payments::Payments::NewStub(grpc::CreateCustomChannel(argv[1], grpc::InsecureChannelCredentials(), args));
    const std::string card = "4242-4242-4242-4242";

    // 1. A charge and its repeat.
    const std::string k1 = new_key();
    const Answer first = charge(*stub, k1, card, 1250);
    expect(first.status.ok() && !first.replayed, "charge " + k1 + ": " + first.reply.charge_id());
    const Answer again = charge(*stub, k1, card, 1250);
    expect(again.status.ok() && again.replayed && again.reply.charge_id() == first.reply.charge_id(),
           "repeat of " + k1 + ": replayed " + again.reply.charge_id());

    // 2. Two at once with one key: one charge, both answered with it.
    const std::string k2 = new_key();
    Answer a, b;
    std::thread other([&] { b = charge(*stub, k2, card, 700); });
    a = charge(*stub, k2, card, 700);
    other.join();
    expect(a.status.ok() && b.status.ok() && a.reply.charge_id() == b.reply.charge_id() && (a.replayed != b.replayed),
           "two concurrent calls with " + k2 + ": one charge " + a.reply.charge_id() + ", one replay");

    // 3. The key reused for another amount.
    const Answer reused = charge(*stub, k1, card, 9999);
    expect(reused.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION,
           "same key, other amount: FAILED_PRECONDITION (" + reused.status.error_message() + ")");

    // 4. A declined card: the decline is stored like any answer.
    const std::string k3 = new_key();
    const Answer declined = charge(*stub, k3, "4000-0000-0000-0002", 500);
    const Answer declined_again = charge(*stub, k3, "4000-0000-0000-0002", 500);
    expect(declined.status.error_code() == grpc::StatusCode::FAILED_PRECONDITION && declined_again.replayed &&
               declined_again.status.error_message() == "card declined",
           "declined card " + k3 + ": FAILED_PRECONDITION, replayed on retry");

    std::printf("%s\n", failures == 0 ? "all scenarios as expected" : "some scenarios failed");
    return failures == 0 ? 0 : 1;
}
