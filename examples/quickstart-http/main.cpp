// quickstart-http — an idempotent POST /orders over cpp-httplib: every Idempotency-Key rule of
// docs/http.md (400 / 409 / 422 / 503, byte-identical replays with Idempotent-Replayed: true,
// problem+json errors) comes from idem::http::serve; the service writes only its own effect.
//
//   quickstart-http "host=/run/postgresql dbname=app" [port]      (port 0 or none: any free port)
//   curl -i -X POST localhost:PORT/orders -H 'Idempotency-Key: "order-1"' -d '{"sku":"A1","qty":2}'
#include <httplib.h>
#include <idem/http/httplib.hpp>
#include <idem/idem.hpp>

#include <atomic>
#include <cstdlib>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
    const char* db = argc > 1 ? argv[1] : std::getenv("DATABASE_URL");
    idem::PostgresStore store{db ? db : "dbname=app"};
    store.ensure_schema();

    // JSON member order and whitespace do not make a different request; retention advertised.
    idem::http::Route orders{.fingerprint = {.body = idem::http::FingerprintPolicy::Body::canonical_json},
                             .retention_header = "Idempotency-Retention"};
    std::atomic<int> next_order{1};

    httplib::Server server;
    server.Post("/orders", [&](const httplib::Request& req, httplib::Response& res) {
        idem::http::httplib::serve(store, req, res, "quickstart:POST /orders", orders, [&] {
            if (req.body.empty())  // certainly not performed: the key is released, the 400 not stored
                throw idem::http::not_performed(idem::Response{400, "{\"error\":\"empty order\"}"});
            const int id = next_order++;  // the side effect: create the order
            return idem::Response{
                201, "{\"order\":" + std::to_string(id) + "}", {{"Content-Type", "application/json"}}};
        });
    });
    const int port = argc > 2 ? std::atoi(argv[2]) : 0;
    const int bound =
        port > 0 ? (server.bind_to_port("127.0.0.1", port) ? port : -1) : server.bind_to_any_port("127.0.0.1");
    if (bound <= 0) return 1;
    std::cout << "listening on http://127.0.0.1:" << bound << std::endl;
    return server.listen_after_bind() ? 0 : 1;
}
