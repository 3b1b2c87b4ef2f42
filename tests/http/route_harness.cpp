// tests/http/route_harness.cpp — the servers behind route_harness.hpp: cpp-httplib over a
// PostgresStore and, with IDEM_TEST_BEAST, Boost.Beast over an AsyncPostgresStore, one handler.
#include "route_harness.hpp"

#include <unistd.h>

#include <chrono>
#include <mutex>
#include <stdexcept>

#include "http_support.hpp"
#include "idem/http/httplib.hpp"
#include "idem/postgres_store.hpp"
#include "require_db.hpp"
#include "test_env.hpp"

#ifdef IDEM_TEST_BEAST
#include "beast_support.hpp"
#include "idem/asio/store.hpp"
#include "idem/http/asio.hpp"
#endif

namespace route_test {

namespace {

constexpr const char* kNowhere = "host=127.0.0.1 port=1 dbname=none connect_timeout=1";

idem::PostgresOptions options() {
    idem::PostgresOptions o;
    o.pool_size = 8;
    return o;
}

idem::PostgresOptions down_options() {
    idem::PostgresOptions o;
    o.connect_timeout = std::chrono::milliseconds(500);
    o.claim_attempts = 1;
    return o;
}

}  // namespace

struct Harness::Servers {
    Servers(const std::string& url, std::map<std::string, idem::http::Route> routes_in)
        : routes(std::move(routes_in)), store(url, options()), down(kNowhere, down_options()) {
        store.ensure_schema();
        httplib_server =
            std::make_unique<http_test::Server>([this](const httplib::Request& req, httplib::Response& res) {
                const std::string path = req.path;
                idem::http::httplib::serve(
                    path.starts_with("/down") ? down : store, req, res, Harness::scope(path), route(path),
                    [this, path](idem::Context& context) { return handle(context.key().value(), path); });
            });
#ifdef IDEM_TEST_BEAST
        async_store = std::make_unique<idem::asio::AsyncPostgresStore>(io.get_executor(), url, options());
        async_down = std::make_unique<idem::asio::AsyncPostgresStore>(io.get_executor(), kNowhere, down_options());
        beast_server = std::make_unique<http_test::BeastServer>(
            io, [this](const idem::http::Request& request) { return dispatch_async(request); });
#endif
    }

    const idem::http::Route& route(const std::string& path) const {
        static const idem::http::Route plain;
        const auto found = routes.find(path);
        return found == routes.end() ? plain : found->second;
    }

    idem::Response handle(const std::string& key, const std::string& path) {
        int n = 0;
        {
            std::lock_guard lock(mutex);
            n = ++runs[key];
        }
        if (path.starts_with("/throw")) throw std::runtime_error("the provider timed out");
        if (path.starts_with("/not-performed")) throw idem::not_performed("the provider refused the connection");
        return {201,
                "made " + key + " #" + std::to_string(n),
                {{"Content-Type", "text/plain"}, {"X-Run", std::to_string(n)}}};
    }

#ifdef IDEM_TEST_BEAST
    boost::asio::awaitable<idem::Response> dispatch_async(const idem::http::Request& request) {
        const std::string path(request.target.substr(0, request.target.find('?')));
        // Named, not temporaries of the co_await expression (GCC 12, see conformance_test.cpp).
        const std::string scoped = Harness::scope(path);
        auto handler = [this, path](idem::asio::AsyncContext& context) { return handle(context.key().value(), path); };
        idem::asio::AsyncPostgresStore& to = path.starts_with("/down") ? *async_down : *async_store;
        idem::Response answer = co_await idem::http::async_respond(to, request, scoped, route(path), std::move(handler),
                                                                   boost::asio::use_awaitable);
        co_return answer;
    }
#endif

    const std::map<std::string, idem::http::Route> routes;  // read-only while the servers run
    idem::PostgresStore store;
    idem::PostgresStore down;
    std::mutex mutex;
    std::map<std::string, int> runs;
#ifdef IDEM_TEST_BEAST
    boost::asio::io_context io;
    std::unique_ptr<idem::asio::AsyncPostgresStore> async_store;
    std::unique_ptr<idem::asio::AsyncPostgresStore> async_down;
#endif
    // Declared last: the servers stop (destroyed first) before what they use.
    std::unique_ptr<http_test::Server> httplib_server;
#ifdef IDEM_TEST_BEAST
    std::unique_ptr<http_test::BeastServer> beast_server;
#endif
};

Harness::Harness(std::map<std::string, idem::http::Route> routes)
    : url_(idem_test::require_db()),
      run_id(std::to_string(::getpid()) + "-" +
             std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000)),
      db(url_),
      servers_(std::make_unique<Servers>(url_, std::move(routes))) {}

Harness::~Harness() = default;

std::vector<Adapter> Harness::adapters() const {
    std::vector<Adapter> out{{"httplib", servers_->httplib_server->port()}};
#ifdef IDEM_TEST_BEAST
    out.push_back({"beast", servers_->beast_server->port()});
#endif
    return out;
}

std::string Harness::key(const std::string& what, const Adapter& adapter) const {
    return "k-" + run_id + "-" + adapter.name + "-" + what;
}

Wire Harness::post(const Adapter& adapter, const std::string& path, Headers headers, const std::string& body) const {
    return http_test::exchange(adapter.port, Raw{"POST", path, std::move(headers), body});
}

int Harness::runs(const std::string& key) {
    std::lock_guard lock(servers_->mutex);
    return servers_->runs[key];
}

std::optional<Stored> Harness::stored(const std::string& path, const std::string& key) {
    auto r = db.exec("SELECT state, coalesce(encode(result, 'hex'), '') FROM idem_keys WHERE scope = $1 AND key = $2",
                     {scope(path), key});
    if (r.rows() == 0) return std::nullopt;
    return Stored{r.text(0, 0), r.text(0, 1)};
}

std::string Harness::state(const std::string& path, const std::string& key) {
    const auto record = stored(path, key);
    return record ? record->state : std::string();
}

std::vector<std::string> Harness::keys(const std::string& path) {
    auto r = db.exec("SELECT key FROM idem_keys WHERE scope = $1 ORDER BY key", {scope(path)});
    std::vector<std::string> out;
    for (int i = 0; i < r.rows(); ++i) out.push_back(r.text(i, 0));
    return out;
}

std::string Harness::scope(const std::string& path) { return "routes:" + path; }

}  // namespace route_test
