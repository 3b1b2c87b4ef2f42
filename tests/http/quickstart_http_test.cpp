// examples/quickstart-http as a newcomer runs it: started as its own process on a real database,
// then driven over HTTP — a new order, its byte-identical replay, the same key with another order
// (422), JSON member order not mattering, a missing key (400), an empty body (400, key released),
// and eight concurrent requests with one key creating one order.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <set>
#include <string>
#include <vector>

#include "http_support.hpp"
#include "require_db.hpp"
#include "test_env.hpp"
#include "threads.hpp"

extern char** environ;

namespace {

using http_test::Raw;
using http_test::Wire;

/// The example, started with the test database; killed when the test ends.
class Example {
public:
    explicit Example(const std::string& db) {
        int fds[2];
        REQUIRE(pipe2(fds, O_CLOEXEC) == 0);
        posix_spawn_file_actions_t actions;
        posix_spawn_file_actions_init(&actions);
        posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
        std::string exe = IDEM_QUICKSTART_HTTP, port = "0", conninfo = db;
        char* argv[] = {exe.data(), conninfo.data(), port.data(), nullptr};
        REQUIRE(posix_spawn(&pid_, exe.c_str(), &actions, nullptr, argv, environ) == 0);
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
        const auto colon = line.rfind(':');
        REQUIRE(line.starts_with("listening on http://127.0.0.1:"));
        port_ = std::stoi(line.substr(colon + 1));
    }
    ~Example() {
        kill(pid_, SIGKILL);
        waitpid(pid_, nullptr, 0);
    }
    Example(const Example&) = delete;
    Example& operator=(const Example&) = delete;

    Wire post(const std::string& key, const std::string& body) const {
        Raw raw{"POST", "/orders", {}, body};
        if (!key.empty()) raw.headers.emplace_back("Idempotency-Key", "\"" + key + "\"");
        return http_test::exchange(port_, raw);
    }

private:
    pid_t pid_ = -1;
    int port_ = -1;
};

}  // namespace

TEST_CASE("quickstart-http: every rule, with the example's ~20 lines of user code", "[http][example]") {
    const auto db = idem_test::require_db();
    const Example example(db);
    const std::string k = "qs-" + std::to_string(getpid());

    const Wire first = example.post(k + "-1", R"({"sku":"A1","qty":2})");
    REQUIRE(first.status == 201);
    CHECK(first.header("Idempotency-Retention") == "86400");
    const Wire again = example.post(k + "-1", " { \"qty\": 2, \"sku\": \"A1\" } ");
    CHECK((again.status == 201 && again.body == first.body && again.replayed()));
    const Wire other = example.post(k + "-1", R"({"sku":"A1","qty":3})");
    CHECK(other.status == 422);
    CHECK(other.header("Content-Type") == "application/problem+json");
    CHECK(example.post("", "{}").status == 400);
    CHECK(example.post(k + "-2", "").status == 400);
    const Wire released = example.post(k + "-2", R"({"sku":"B"})");
    CHECK((released.status == 201 && released.body != first.body));

    std::vector<Wire> got(8);
    idem_test::run_threads(8, [&](int t) { got[static_cast<std::size_t>(t)] = example.post(k + "-3", "{}"); });
    std::set<std::string> orders;
    for (const Wire& w : got) {
        CHECK((w.status == 201 || w.status == 409));
        if (w.status == 201) orders.insert(w.body);
        if (w.status == 409) CHECK(!w.header("Retry-After").empty());
    }
    CHECK(orders.size() <= 1);
    const Wire settled = example.post(k + "-3", "{}");
    CHECK((settled.status == 201 && settled.replayed()));
    if (!orders.empty()) CHECK(*orders.begin() == settled.body);
}
