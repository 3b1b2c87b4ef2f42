// tests/http/route_harness.hpp — one set of routes served over real HTTP on 127.0.0.1 by both
// adapters, against real PostgreSQL: cpp-httplib (idem::http::httplib::serve over a PostgresStore)
// and, with the idem::asio component (IDEM_TEST_BEAST), Boost.Beast (idem::http::async_respond over
// an AsyncPostgresStore). Both serve the same routes under the same scopes, on the same table, so
// a request sent to one and then to the other is a retry of the same key. The handler counts its
// runs per key outside the library and answers 201 with the key and its run number; under "/throw"
// it throws (outcome unknown), under "/not-performed" it throws idem::not_performed. Paths under
// "/down" use a store whose server does not exist (every claim: store_unavailable).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "http_support.hpp"
#include "idem/http.hpp"
#include "idem/http/httplib.hpp"
#include "idem/postgres_store.hpp"
#include "pg.hpp"
#include "test_env.hpp"

#ifdef IDEM_TEST_BEAST
#include "beast_support.hpp"
#include "idem/asio/store.hpp"
#include "idem/http/asio.hpp"
#endif

namespace route_test {

using http_test::Raw;
using http_test::Wire;
using Headers = std::vector<std::pair<std::string, std::string>>;

/// One adapter's server: its name ("httplib", "beast") and port.
struct Adapter {
    std::string name;
    int port = 0;
};

/// A stored record as the table holds it.
struct Stored {
    std::string state;   // "in_progress" or "completed"
    std::string result;  // the encoded response, byte for byte ("" while in progress)
};

class Harness {
public:
    /// Serves `routes` (path → Route; any other path gets a default Route) on both adapters.
    explicit Harness(std::map<std::string, idem::http::Route> routes)
        : url_(require_db()),
          db(url_),
          routes_(std::move(routes)),
          store_(url_, options()),
          down_(kNowhere, down_options()) {
        store_.ensure_schema();
        run_id = std::to_string(::getpid()) + "-" +
                 std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000);
        httplib_ = std::make_unique<http_test::Server>([this](const httplib::Request& req, httplib::Response& res) {
            const std::string path = req.path;
            idem::http::httplib::serve(
                path.starts_with("/down") ? down_ : store_, req, res, scope(path), route(path),
                [this, path](idem::Context& context) { return handle(context.key().value(), path); });
        });
#ifdef IDEM_TEST_BEAST
        async_store_ = std::make_unique<idem::asio::AsyncPostgresStore>(io_.get_executor(), url_, options());
        async_down_ = std::make_unique<idem::asio::AsyncPostgresStore>(io_.get_executor(), kNowhere, down_options());
        beast_ = std::make_unique<http_test::BeastServer>(
            io_, [this](const idem::http::Request& request) { return dispatch_async(request); });
#endif
    }
    Harness(const Harness&) = delete;
    Harness& operator=(const Harness&) = delete;

    /// Every adapter built here: cpp-httplib, and Beast where the idem::asio component is.
    [[nodiscard]] std::vector<Adapter> adapters() const {
        std::vector<Adapter> out{{"httplib", httplib_->port()}};
#ifdef IDEM_TEST_BEAST
        out.push_back({"beast", beast_->port()});
#endif
        return out;
    }

    /// A key no other test or adapter uses.
    [[nodiscard]] std::string key(const std::string& what, const Adapter& adapter) const {
        return "k-" + run_id + "-" + adapter.name + "-" + what;
    }

    /// POSTs `body` to `path` with these header lines, as raw bytes.
    [[nodiscard]] Wire post(const Adapter& adapter, const std::string& path, Headers headers,
                            const std::string& body = "{}") const {
        return http_test::exchange(adapter.port, Raw{"POST", path, std::move(headers), body});
    }

    /// How many times the handler ran for `key`.
    [[nodiscard]] int runs(const std::string& key) {
        std::lock_guard lock(mutex_);
        return runs_[key];
    }

    /// The record of `key` under `path`'s scope, if there is one.
    [[nodiscard]] std::optional<Stored> stored(const std::string& path, const std::string& key) {
        auto r =
            db.exec("SELECT state, coalesce(encode(result, 'hex'), '') FROM idem_keys WHERE scope = $1 AND key = $2",
                    {scope(path), key});
        if (r.rows() == 0) return std::nullopt;
        return Stored{r.text(0, 0), r.text(0, 1)};
    }

    /// The state of `key` under `path`'s scope: "in_progress", "completed", or "" (no record).
    [[nodiscard]] std::string state(const std::string& path, const std::string& key) {
        const auto record = stored(path, key);
        return record ? record->state : std::string();
    }

    /// Every key stored under `path`'s scope.
    [[nodiscard]] std::vector<std::string> keys(const std::string& path) {
        auto r = db.exec("SELECT key FROM idem_keys WHERE scope = $1 ORDER BY key", {scope(path)});
        std::vector<std::string> out;
        for (int i = 0; i < r.rows(); ++i) out.push_back(r.text(i, 0));
        return out;
    }

    /// The scope requests to `path` run under (the same on both adapters).
    [[nodiscard]] static std::string scope(const std::string& path) { return "routes:" + path; }

    std::string run_id;

private:
    static std::string require_db() {
        auto url = idem_test::database_url();
        if (url.empty()) throw std::runtime_error(idem_test::kNoDatabaseMessage);
        return url;
    }
    static constexpr const char* kNowhere = "host=127.0.0.1 port=1 dbname=none connect_timeout=1";
    static idem::PostgresOptions options() {
        idem::PostgresOptions o;
        o.pool_size = 8;
        return o;
    }
    static idem::PostgresOptions down_options() {
        idem::PostgresOptions o;
        o.connect_timeout = std::chrono::milliseconds(500);
        o.claim_attempts = 1;
        return o;
    }

    const idem::http::Route& route(const std::string& path) const {
        static const idem::http::Route plain;
        const auto found = routes_.find(path);
        return found == routes_.end() ? plain : found->second;
    }

    idem::Response handle(const std::string& key, const std::string& path) {
        int n = 0;
        {
            std::lock_guard lock(mutex_);
            n = ++runs_[key];
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
        const std::string scoped = scope(path);
        auto handler = [this, path](idem::asio::AsyncContext& context) { return handle(context.key().value(), path); };
        idem::asio::AsyncPostgresStore& store = path.starts_with("/down") ? *async_down_ : *async_store_;
        idem::Response answer = co_await idem::http::async_respond(store, request, scoped, route(path),
                                                                   std::move(handler), boost::asio::use_awaitable);
        co_return answer;
    }
#endif

    std::string url_;

public:
    idem_test::PgConn db;  ///< the test's own look at the table

private:
    const std::map<std::string, idem::http::Route> routes_;  // read-only while the servers run
    idem::PostgresStore store_;
    idem::PostgresStore down_;
    std::mutex mutex_;
    std::map<std::string, int> runs_;
#ifdef IDEM_TEST_BEAST
    boost::asio::io_context io_;
    std::unique_ptr<idem::asio::AsyncPostgresStore> async_store_;
    std::unique_ptr<idem::asio::AsyncPostgresStore> async_down_;
#endif
    // Declared last: the servers stop (destroyed first) before what they use.
    std::unique_ptr<http_test::Server> httplib_;
#ifdef IDEM_TEST_BEAST
    std::unique_ptr<http_test::BeastServer> beast_;
#endif
};

/// Whether `w` is a problem+json answer with this status and code.
inline bool is_problem(const Wire& w, int status, const std::string& code) {
    return w.status == status && w.header("Content-Type") == "application/problem+json" &&
           w.body.find("\"status\":" + std::to_string(status)) != std::string::npos &&
           w.body.find("\"code\":\"" + code + "\"") != std::string::npos;
}

/// The JSON string member `name` of a flat problem body, unescaped (\" and \\ only), or "".
inline std::string member(const std::string& body, const std::string& name) {
    const std::string open = "\"" + name + "\":\"";
    auto at = body.find(open);
    if (at == std::string::npos) return {};
    std::string out;
    for (at += open.size(); at < body.size() && body[at] != '"'; ++at) {
        if (body[at] == '\\' && at + 1 < body.size()) ++at;
        out += body[at];
    }
    return out;
}

}  // namespace route_test
