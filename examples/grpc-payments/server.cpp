// examples/grpc-payments/server.cpp — an idempotent Charge RPC over PostgreSQL (docs/grpc.md).
//
//   grpc-payments-server "host=/run/postgresql dbname=app" [PORT]
//
// Prints "listening on 127.0.0.1:PORT" (PORT 0, the default: any free port), then one line
// "charged <account> <key> <amount>" each time the (simulated) gateway charges — once per key,
// whatever the client retries. A card "4000-0000-0000-0002" is declined: FAILED_PRECONDITION,
// stored and replayed like any answer.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>

#include "idem/grpc.hpp"
#include "idem/postgres_store.hpp"
#include "payments.grpc.pb.h"

namespace {

// The account the call is for: a real service takes it from its authentication.
std::string account_of(const grpc::ServerContextBase& context) {
    const auto& metadata = context.client_metadata();
    const auto found = metadata.find("x-account");
    return found == metadata.end() ? std::string("anonymous") : std::string(found->second.data(), found->second.size());
}

class Payments final : public payments::Payments::Service {
public:
    explicit Payments(idem::IdempotencyStore& store) : store_(store) {}

    grpc::Status Charge(grpc::ServerContext* context, const payments::ChargeRequest* request,
                        payments::ChargeReply* reply) override {
        return idem::grpc::serve(store_, *context, *request, *reply, method_, [&](idem::grpc::Call& call) {
            if (request->amount_cents() <= 0) {
                throw idem::grpc::not_performed(
                    grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "amount_cents must be positive"));
            }
            // The gateway call: slow enough that a concurrent retry finds the key in flight.
            std::this_thread::sleep_for(std::chrono::milliseconds(150));
            if (request->card() == "4000-0000-0000-0002") {
                call.add_trailing_metadata("decline-code", "insufficient_funds");
                return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "card declined");
            }
            const std::string id = "ch_" + std::to_string(++charges_);
            std::printf("charged %s %s %lld\n", account_of(*context).c_str(), call.key().value().c_str(),
                        static_cast<long long>(request->amount_cents()));
            std::fflush(stdout);
            reply->set_charge_id(id);
            reply->set_amount_cents(request->amount_cents());
            reply->set_currency(request->currency());
            return grpc::Status::OK;
        });
    }

private:
    idem::IdempotencyStore& store_;
    idem::grpc::Method method_{"payments.Payments.Charge",
                               {.tenant = account_of, .log = [](std::string_view line) { std::cerr << line << '\n'; }}};
    std::atomic<long> charges_{0};
};

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::cerr << "usage: grpc-payments-server CONNINFO [PORT]\n";
        return 2;
    }
    idem::PostgresStore store(argv[1]);
    store.ensure_schema();
    Payments service(store);
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:" + std::string(argc > 2 ? argv[2] : "0"), grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(&service);
    const std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (!server) {
        std::cerr << "grpc-payments-server: cannot listen\n";
        return 1;
    }
    std::printf("listening on 127.0.0.1:%d\n", port);
    std::fflush(stdout);
    server->Wait();
}
