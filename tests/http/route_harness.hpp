// tests/http/route_harness.hpp — one set of routes served over real HTTP on 127.0.0.1 by both
// adapters, against real PostgreSQL: cpp-httplib (idem::http::httplib::serve over a PostgresStore)
// and, with the idem::asio component (IDEM_TEST_BEAST), Boost.Beast (idem::http::async_respond over
// an AsyncPostgresStore). Both serve the same routes under the same scopes, on the same table, so
// a request sent to one and then to the other is a retry of the same key. The handler counts its
// runs per key outside the library and answers 201 with the key and its run number; under "/throw"
// it throws (outcome unknown), under "/not-performed" it throws idem::not_performed. Paths under
// "/down" use a store whose server does not exist (every claim: store_unavailable).
//
// The servers live in route_harness.cpp, compiled once: a test includes no HTTP library here.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "idem/http.hpp"
#include "pg.hpp"
#include "raw_http.hpp"

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
    /// Throws std::runtime_error when the tests have no database.
    explicit Harness(std::map<std::string, idem::http::Route> routes);
    ~Harness();
    Harness(const Harness&) = delete;
    Harness& operator=(const Harness&) = delete;

    /// Every adapter built here: cpp-httplib, and Beast where the idem::asio component is.
    [[nodiscard]] std::vector<Adapter> adapters() const;

    /// A key no other test or adapter uses.
    [[nodiscard]] std::string key(const std::string& what, const Adapter& adapter) const;

    /// POSTs `body` to `path` with these header lines, as raw bytes.
    [[nodiscard]] Wire post(const Adapter& adapter, const std::string& path, Headers headers,
                            const std::string& body = "{}") const;

    /// How many times the handler ran for `key`.
    [[nodiscard]] int runs(const std::string& key);

    /// The record of `key` under `path`'s scope, if there is one.
    [[nodiscard]] std::optional<Stored> stored(const std::string& path, const std::string& key);

    /// The state of `key` under `path`'s scope: "in_progress", "completed", or "" (no record).
    [[nodiscard]] std::string state(const std::string& path, const std::string& key);

    /// Every key stored under `path`'s scope.
    [[nodiscard]] std::vector<std::string> keys(const std::string& path);

    /// The scope requests to `path` run under (the same on both adapters).
    [[nodiscard]] static std::string scope(const std::string& path);

private:
    std::string url_;

public:
    std::string run_id;
    idem_test::PgConn db;  ///< the test's own look at the table

private:
    struct Servers;  // the stores, the handler's counts and both servers (route_harness.cpp)
    std::unique_ptr<Servers> servers_;
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
