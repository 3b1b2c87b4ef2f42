// examples/beast-http as a user runs it: started as its own process on a real database, then driven
// over HTTP — a payment (201, charged once), its byte-identical replay (Idempotent-Replayed: true),
// several requests on one keep-alive connection, the same key with another body (422), a missing
// key (400), an empty body (400, key released), duplicates while the first is at the provider
// (409 + Retry-After), and the charges counted by the server's provider, outside idem, plus the
// rows in the table; then GET /metrics: the outcomes counted and AsyncPostgresStore's pool figures.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "http_support.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "test_env.hpp"
#include "threads.hpp"

extern char** environ;

namespace {

using namespace std::chrono_literals;
using http_test::Raw;
using http_test::Wire;
namespace beast_http = boost::beast::http;

constexpr const char* kScope = "beast-http:POST /payments";

/// The example, started with the test database; killed when the test ends.
class Example {
public:
    Example(const std::string& db, const std::string& provider_ms) {
        int fds[2];
        REQUIRE(pipe2(fds, O_CLOEXEC) == 0);
        posix_spawn_file_actions_t actions;
        posix_spawn_file_actions_init(&actions);
        posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
        std::string exe = IDEM_BEAST_HTTP, db_flag = "--db", conninfo = db, port_flag = "--port", port = "0",
                    latency_flag = "--provider-ms", latency = provider_ms;
        char* args[] = {exe.data(),  db_flag.data(),      conninfo.data(), port_flag.data(),
                        port.data(), latency_flag.data(), latency.data(),  nullptr};
        REQUIRE(posix_spawn(&pid_, exe.c_str(), &actions, nullptr, args, environ) == 0);
        posix_spawn_file_actions_destroy(&actions);
        close(fds[1]);
        std::string line;
        while (line.find('\n') == std::string::npos) {
            pollfd p{fds[0], POLLIN, 0};
            if (poll(&p, 1, 30000) <= 0) break;
            char buf[256];
            const ssize_t n = read(fds[0], buf, sizeof buf);
            if (n <= 0) break;
            line.append(buf, static_cast<std::size_t>(n));
        }
        close(fds[0]);
        REQUIRE(line.starts_with("listening on http://127.0.0.1:"));
        port_ = std::stoi(line.substr(line.rfind(':') + 1));
    }
    ~Example() {
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
    }
    Example(const Example&) = delete;
    Example& operator=(const Example&) = delete;

    [[nodiscard]] int port() const noexcept { return port_; }

    /// POST /payments on a new connection; `key` empty: no Idempotency-Key header.
    [[nodiscard]] Wire pay(const std::string& key, const std::string& body) const {
        Raw raw{"POST", "/payments", {}, body};
        if (!key.empty()) raw.headers.emplace_back("Idempotency-Key", "\"" + key + "\"");
        return http_test::exchange(port_, raw);
    }
    /// GET /metrics.
    [[nodiscard]] Wire metrics() const { return http_test::exchange(port_, Raw{"GET", "/metrics", {}, ""}); }
    /// The provider's own ledger: {"charges":N,"in_flight":M}.
    [[nodiscard]] std::string charges() const {
        return http_test::exchange(port_, Raw{"GET", "/charges", {}, ""}).body;
    }

private:
    pid_t pid_ = -1;
    int port_ = -1;
};

std::string ledger(int charges, int in_flight) {
    return "{\"charges\":" + std::to_string(charges) + ",\"in_flight\":" + std::to_string(in_flight) + "}";
}

/// The value of the sample `series` (name and labels, as written) in a Prometheus text, or -1.
long long sample(const std::string& text, const std::string& series) {
    const std::string start = "\n" + series + " ";
    const auto at = text.find(start);
    if (at == std::string::npos) return -1;
    return std::stoll(text.substr(at + start.size()));
}

}  // namespace

TEST_CASE("beast-http: the Beast example end to end over real HTTP", "[http][example][beast]") {
    const auto db = idem_test::require_db();
    // The provider takes 2 s: long enough for duplicates to arrive while a payment is in flight.
    const Example example(db, "2000");
    idem_test::PgConn pg(db);
    const std::string k = "beast-" + std::to_string(getpid()) + "-";
    const auto state = [&](const std::string& key) {
        auto r = pg.exec("SELECT state FROM idem_keys WHERE scope = $1 AND key = $2", {kScope, key});
        return r.rows() == 0 ? std::string() : r.text(0, 0);
    };
    CHECK(example.charges() == ledger(0, 0));

    // 1. A payment, then its replay: the same status, headers and body, byte for byte, charged once.
    const Wire first = example.pay(k + "1", R"({"amount":1200,"currency":"EUR"})");
    REQUIRE(first.status == 201);
    CHECK(first.body == R"({"payment":1,"status":"captured"})");
    CHECK(first.header("Content-Type") == "application/json");
    CHECK_FALSE(first.replayed());
    CHECK(state(k + "1") == "completed");
    const Wire again = example.pay(k + "1", " { \"currency\" : \"EUR\", \"amount\": 1200 } ");
    CHECK(again.status == 201);
    CHECK(again.body == first.body);
    CHECK(again.header("Content-Type") == "application/json");
    CHECK(again.count("Content-Type") == 1);
    CHECK(again.header("Idempotent-Replayed") == "true");
    CHECK(example.charges() == ledger(1, 0));

    // 2. One keep-alive connection serves several requests.
    {
        boost::asio::io_context io;
        boost::beast::tcp_stream stream(io);
        stream.connect(boost::asio::ip::tcp::endpoint(boost::asio::ip::make_address("127.0.0.1"),
                                                      static_cast<unsigned short>(example.port())));
        boost::beast::flat_buffer buffer;
        const auto exchange = [&](beast_http::request<beast_http::string_body> req) {
            req.set(beast_http::field::host, "127.0.0.1");
            req.prepare_payload();
            beast_http::write(stream, req);
            beast_http::response<beast_http::string_body> res;
            beast_http::read(stream, buffer, res);
            return res;
        };
        const auto send = [&](beast_http::verb verb, const std::string& target, const std::string& key,
                              const std::string& body) {
            beast_http::request<beast_http::string_body> req{verb, target, 11};
            if (!key.empty()) req.set("Idempotency-Key", "\"" + key + "\"");
            req.body() = body;
            return exchange(std::move(req));
        };
        for (int round = 0; round < 3; ++round) {
            INFO("round " << round);
            const auto replay =
                send(beast_http::verb::post, "/payments", k + "1", R"({"amount":1200,"currency":"EUR"})");
            CHECK(replay.result_int() == 201);
            CHECK(replay.body() == first.body);
            CHECK(replay["Idempotent-Replayed"] == "true");
            CHECK(replay.keep_alive());
            const auto count = send(beast_http::verb::get, "/charges", "", "");
            CHECK(count.result_int() == 200);
            CHECK(count.body() == ledger(1, 0));
            CHECK(count.keep_alive());
        }
        // Two Idempotency-Key lines reach idem as two headers: 400, nothing claimed.
        beast_http::request<beast_http::string_body> twice{beast_http::verb::post, "/payments", 11};
        twice.insert("Idempotency-Key", "\"" + k + "twice\"");
        twice.insert("Idempotency-Key", "\"" + k + "twice\"");
        twice.body() = "{}";
        const auto refused = exchange(std::move(twice));
        CHECK(refused.result_int() == 400);
        CHECK(refused.body().find("\"code\":\"invalid_idempotency_key\"") != std::string::npos);
        CHECK(state(k + "twice").empty());
        // Header values are read as sent (Beast does not percent-decode): k%41 is not kA.
        const auto encoded = send(beast_http::verb::post, "/payments", k + "%41", "{}");
        CHECK((encoded.result_int() == 201 && encoded.body() == R"({"payment":2,"status":"captured"})"));
        const auto plain = send(beast_http::verb::post, "/payments", k + "A", "{}");
        CHECK((plain.result_int() == 201 && plain.body() == R"({"payment":3,"status":"captured"})"));
        CHECK(plain["Idempotent-Replayed"].empty());
        CHECK(state(k + "%41") == "completed");
        CHECK(state(k + "A") == "completed");
    }
    CHECK(example.charges() == ledger(3, 0));

    // 3. The same key with another body: 422, not charged.
    const Wire other = example.pay(k + "1", R"({"amount":9900,"currency":"EUR"})");
    CHECK(other.status == 422);
    CHECK(other.header("Content-Type") == "application/problem+json");
    CHECK(other.body.find("\"code\":\"idempotency_key_reused\"") != std::string::npos);
    CHECK(example.charges() == ledger(3, 0));

    // 4. A missing key: 400. An empty body: 400 (not performed), the key released and usable.
    const Wire missing = example.pay("", R"({"amount":1})");
    CHECK(missing.status == 400);
    CHECK(missing.header("Content-Type") == "application/problem+json");
    CHECK(missing.body.find("\"code\":\"missing_idempotency_key\"") != std::string::npos);
    const Wire empty = example.pay(k + "2", "");
    CHECK((empty.status == 400 && empty.body == "{\"error\":\"empty payment\"}"));
    CHECK_FALSE(empty.replayed());
    CHECK(state(k + "2").empty());  // released: nothing stored
    const Wire paid = example.pay(k + "2", R"({"amount":5})");
    CHECK((paid.status == 201 && paid.body == R"({"payment":4,"status":"captured"})"));
    CHECK(example.charges() == ledger(4, 0));

    // 5. Duplicates while the first is at the provider: 409 + Retry-After (or, had the provider
    // answered meanwhile, the replay), charged once.
    Wire original;
    std::thread first_request([&] { original = example.pay(k + "3", R"({"amount":7})"); });
    // No deadline of its own: the test's TIMEOUT bounds this wait for the first to reach the provider.
    while (example.charges() != ledger(4, 1)) std::this_thread::sleep_for(5ms);
    std::vector<Wire> dups(8);
    idem_test::run_threads(8,
                           [&](int t) { dups[static_cast<std::size_t>(t)] = example.pay(k + "3", R"({"amount":7})"); });
    first_request.join();
    REQUIRE(original.status == 201);
    CHECK(original.body == R"({"payment":5,"status":"captured"})");
    int conflicts = 0;
    for (const Wire& dup : dups) {
        if (dup.status == 409) {
            ++conflicts;
            const std::string retry_after = dup.header("Retry-After");
            CHECK((!retry_after.empty() && retry_after.find_first_not_of("0123456789") == std::string::npos &&
                   std::stoll(retry_after) >= 1));
            CHECK(dup.header("Content-Type") == "application/problem+json");
            CHECK(dup.body.find("\"code\":\"in_progress\"") != std::string::npos);
        } else {
            CHECK((dup.status == 201 && dup.body == original.body && dup.replayed()));
        }
    }
    INFO("409s: " << conflicts << " of 8 (the rest came after the provider's 2 s)");
    CHECK(conflicts >= 1);
    const Wire settled = example.pay(k + "3", R"({"amount":7})");
    CHECK((settled.status == 201 && settled.body == original.body && settled.replayed()));
    CHECK(state(k + "3") == "completed");

    // Counted outside idem: five charges at the provider, five completed rows, one per key.
    CHECK(example.charges() == ledger(5, 0));
    CHECK(pg.scalar("SELECT count(*) FROM idem_keys WHERE scope = $1 AND key LIKE $2 AND state = 'completed'",
                    {kScope, k + "%"}) == 5);

    // 6. GET /metrics, answered on the event loop's own thread: the calls by outcome, and the pool
    // now — every request answered, so every open connection is idle and nobody waits.
    const Wire metrics = example.metrics();
    REQUIRE(metrics.status == 200);
    CHECK(metrics.header("Content-Type") == "text/plain; version=0.0.4; charset=utf-8");
    CAPTURE(metrics.body);
    CHECK(sample(metrics.body, "idem_calls_total{outcome=\"executed\"}") == 5);
    CHECK(sample(metrics.body, "idem_calls_total{outcome=\"released\"}") == 1);  // the empty body
    CHECK(sample(metrics.body, "idem_calls_total{outcome=\"mismatch\"}") == 1);
    CHECK(sample(metrics.body, "idem_calls_total{outcome=\"in_progress\"}") == conflicts);
    CHECK(sample(metrics.body, "idem_pool_connections_max") == 8);
    const long long open = sample(metrics.body, "idem_pool_connections_open");
    CHECK(open >= 1);
    CHECK(open <= 8);
    CHECK(sample(metrics.body, "idem_pool_connections_idle") == open);
    CHECK(sample(metrics.body, "idem_pool_waiters") == 0);
    CHECK(sample(metrics.body, "idem_pool_acquires_total") >= 5);
    CHECK(sample(metrics.body, "idem_store_connections_opened_total") >= open);
}
