// beast-http — an idempotent POST /payments on Boost.Beast: one event-loop thread, a coroutine per
// connection (HTTP/1.1 keep-alive), no thread ever waiting on the database. Every Idempotency-Key
// rule of docs/http.md (400 / 409 / 422 / 503, byte-identical replays with Idempotent-Replayed:
// true) comes from idem::http::async_respond; the service writes only its own effect: a charge at a
// simulated payment provider (a timer the handler awaits).
//
//   beast-http --db "host=/run/postgresql dbname=app" [--port N] [--provider-ms N]
//   curl -i -X POST localhost:PORT/payments -H 'Idempotency-Key: "pay-1"' -d '{"amount":1200}'
//   curl localhost:PORT/charges          # {"charges":N,"in_flight":M}: the provider's own count
//   curl localhost:PORT/metrics          # idem's Prometheus metrics, the connection pool's included
//
// --db defaults to $DATABASE_URL; --port 0 (the default) picks a free port; --provider-ms is the
// provider's latency (default 100). The one line written to stdout is "listening on
// http://127.0.0.1:PORT"; idem's log lines go to stderr.
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <idem/asio/store.hpp>
#include <idem/http/asio.hpp>
#include <idem/http/beast.hpp>
#include <idem/prometheus.hpp>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

namespace asio = boost::asio;
namespace http = boost::beast::http;
using asio::use_awaitable;
using namespace std::chrono_literals;

struct Service {
    idem::asio::AsyncPostgresStore& store;
    std::chrono::milliseconds provider_latency;
    std::shared_ptr<idem::PrometheusObserver> metrics;  // the store's observer
    // JSON member order and whitespace do not make another request; errors logged to stderr.
    idem::http::Route payments{.fingerprint = {.body = idem::http::FingerprintPolicy::Body::canonical_json},
                               .log = [](std::string_view line) { std::cerr << line << '\n'; }};
    int charges = 0;  // the provider's ledger (one thread runs everything: no lock needed)
    int in_flight = 0;
};

// POST /payments: the handler runs at most once per key; repeats get its stored response.
asio::awaitable<idem::Response> pay(Service& service, const idem::http::beast::request_type& req) {
    const idem::http::Request request = idem::http::beast::view(req);  // views into req
    co_return co_await idem::http::async_respond(
        service.store, request, "beast-http:POST /payments", service.payments,
        [&]() -> asio::awaitable<idem::Response> {
            if (req.body().empty())  // certainly not performed: the key is released, the 400 not stored
                throw idem::http::not_performed(idem::Response{400, "{\"error\":\"empty payment\"}"});
            ++service.in_flight;
            asio::steady_timer provider(co_await asio::this_coro::executor, service.provider_latency);
            co_await provider.async_wait(use_awaitable);  // the provider's call: awaited, not blocking
            --service.in_flight;
            const int id = ++service.charges;
            co_return idem::Response{201,
                                     "{\"payment\":" + std::to_string(id) + ",\"status\":\"captured\"}",
                                     {{"Content-Type", "application/json"}}};
        },
        use_awaitable);
}

asio::awaitable<idem::Response> route(Service& service, const idem::http::beast::request_type& req) {
    if (req.target() == "/payments" && req.method() == http::verb::post) co_return co_await pay(service, req);
    if (req.target() == "/charges" && req.method() == http::verb::get) {
        co_return idem::Response{200,
                                 "{\"charges\":" + std::to_string(service.charges) +
                                     ",\"in_flight\":" + std::to_string(service.in_flight) + "}",
                                 {{"Content-Type", "application/json"}}};
    }
    if (req.target() == "/metrics" && req.method() == http::verb::get) {
        // Rendered on the event loop's thread: pool_stats() reads atomics, it never waits for the
        // store's strand (which this thread runs).
        co_return idem::Response{
            200, service.metrics->render(), {{"Content-Type", std::string(idem::PrometheusObserver::content_type)}}};
    }
    co_return idem::Response{404, "not found"};
}

// One connection: requests one after another (keep-alive) until the client closes or says so.
asio::awaitable<void> session(asio::ip::tcp::socket socket, Service& service) {
    boost::beast::tcp_stream stream(std::move(socket));
    boost::beast::flat_buffer buffer;
    for (;;) {
        http::request_parser<http::string_body> parser;
        parser.body_limit(64 * 1024);
        stream.expires_after(60s);
        auto [ec, n] = co_await http::async_read(stream, buffer, parser, asio::as_tuple(use_awaitable));
        if (ec == http::error::end_of_stream || ec == boost::beast::error::timeout) break;
        if (ec) {  // unreadable request: say so and close
            const int status = ec == http::error::body_limit ? 413 : ec == http::error::header_limit ? 431 : 400;
            co_await http::async_write(stream, idem::http::beast::to_beast({status, ec.message()}, 11, false),
                                       asio::as_tuple(use_awaitable));
            break;
        }
        const http::request<http::string_body> req = parser.release();
        http::response<http::string_body> res = idem::http::beast::to_beast(co_await route(service, req), req);
        stream.expires_never();
        auto [write_ec, written] = co_await http::async_write(stream, res, asio::as_tuple(use_awaitable));
        if (write_ec || !res.keep_alive()) break;
    }
    boost::system::error_code ignored;
    stream.socket().shutdown(asio::ip::tcp::socket::shutdown_send, ignored);
}

asio::awaitable<void> listen(asio::ip::tcp::acceptor& acceptor, Service& service) {
    for (;;) {
        asio::ip::tcp::socket socket = co_await acceptor.async_accept(use_awaitable);
        asio::co_spawn(acceptor.get_executor(), session(std::move(socket), service), asio::detached);
    }
}

int main(int argc, char** argv) {
    const char* env = std::getenv("DATABASE_URL");
    std::string db = env ? env : "dbname=app";
    unsigned short port = 0;
    long provider_ms = 100;
    for (int i = 1; i < argc; i += 2) {
        const std::string flag = argv[i], value = i + 1 < argc ? argv[i + 1] : "";
        if (flag == "--db" && !value.empty()) db = value;
        else if (flag == "--port" && !value.empty()) port = static_cast<unsigned short>(std::stoi(value));
        else if (flag == "--provider-ms" && !value.empty()) provider_ms = std::stol(value);
        else return std::cerr << "usage: beast-http [--db CONNINFO] [--port N] [--provider-ms N]\n", 2;
    }

    asio::io_context io;  // one thread: this one
    idem::asio::AsyncPostgresStore store(io.get_executor(), db);
    store.blocking().ensure_schema();  // once, before the loop (a blocking call)
    // Every call's outcome and duration, and the connections' figures, as for a PostgresStore.
    auto metrics = std::make_shared<idem::PrometheusObserver>();
    metrics->set_pool_source([&store] { return store.pool_stats(); });
    metrics->set_store_source([&store] { return store.stats(); });
    store.set_observer(metrics);
    Service service{.store = store, .provider_latency = std::chrono::milliseconds(provider_ms), .metrics = metrics};

    asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), port});
    std::cout << "listening on http://127.0.0.1:" << acceptor.local_endpoint().port() << std::endl;
    asio::co_spawn(io, listen(acceptor, service), [](std::exception_ptr e) {
        if (e) std::rethrow_exception(e);
    });
    io.run();
}
