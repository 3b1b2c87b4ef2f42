// Route::key_header: the key read from a header the route names (X-Idempotency-Key,
// Cko-Idempotency-Key), over real HTTP on both adapters against real PostgreSQL; the problems name
// that header; a name that is not a token is refused at configuration (Route::validate) and, on
// a route nobody validated, with 500 before anything runs.
#include <catch2/catch.hpp>

#include <mutex>
#include <string>
#include <vector>

#include "idem/errors.hpp"
#include "route_harness.hpp"

namespace {

using route_test::Harness;
using route_test::is_problem;
using route_test::member;

std::string quoted(const std::string& key) { return "\"" + key + "\""; }

struct Log {
    std::mutex mutex;
    std::vector<std::string> lines;
};

std::map<std::string, idem::http::Route> header_routes(Log& log) {
    std::map<std::string, idem::http::Route> routes;
    routes["/x"].key_header = "X-Idempotency-Key";
    routes["/cko"].key_header = "Cko-Idempotency-Key";
    routes["/down"].key_header = "X-Idempotency-Key";
    idem::http::Route& bad = routes["/bad-name"];
    bad.key_header = "X Idempotency Key";
    bad.log = [&log](std::string_view line) {
        std::lock_guard lock(log.mutex);
        log.lines.emplace_back(line);
    };
    return routes;
}

}  // namespace

TEST_CASE("Route::validate: the key header must be a field name (a token)", "[http][key_header]") {
    for (const std::string good : {"Idempotency-Key", "X-Idempotency-Key", "Cko-Idempotency-Key", "x_key", "K"}) {
        INFO(good);
        CHECK_NOTHROW(idem::http::Route{.key_header = good}.validate());
    }
    for (const std::string bad :
         {"", "X Idempotency Key", "X-Key:", "Idempotency-Key\r\n", "Schl\xc3\xbcssel", "(k)"}) {
        INFO(bad);
        CHECK_THROWS_AS(idem::http::Route{.key_header = bad}.validate(), idem::config_error);
        CHECK_THROWS_WITH(
            idem::http::Route{.key_header = bad}.validate(),
            Catch::Matchers::Contains("Route::key_header") && Catch::Matchers::Contains("is not a header field name"));
    }
}

TEST_CASE("Route::key_header over HTTP: the configured header carries the key; problems name it",
          "[http][key_header]") {
    Log log;
    Harness h(header_routes(log));
    for (const auto& adapter : h.adapters()) {
        DYNAMIC_SECTION(adapter.name << ": X-Idempotency-Key runs once and replays, any case of its name") {
            const auto k = h.key("x", adapter);
            const auto first = h.post(adapter, "/x", {{"X-Idempotency-Key", quoted(k)}});
            CHECK(first.status == 201);
            CHECK(first.body == "made " + k + " #1");
            const auto again = h.post(adapter, "/x", {{"x-idempotency-key", quoted(k)}});
            CHECK((again.status == 201 && again.replayed() && again.body == first.body));
            CHECK(h.runs(k) == 1);
            CHECK(h.state("/x", k) == "completed");
        }
        DYNAMIC_SECTION(adapter.name << ": Cko-Idempotency-Key on its route") {
            const auto k = h.key("cko", adapter);
            CHECK(h.post(adapter, "/cko", {{"Cko-Idempotency-Key", quoted(k)}}).status == 201);
            CHECK(h.post(adapter, "/cko", {{"Cko-Idempotency-Key", quoted(k)}}).replayed());
            CHECK(h.runs(k) == 1);
        }
        DYNAMIC_SECTION(adapter.name << ": Idempotency-Key is not read on an X-Idempotency-Key route") {
            const auto k = h.key("other", adapter);
            const auto w = h.post(adapter, "/x", {{"Idempotency-Key", quoted(k)}});
            CHECK(is_problem(w, 400, "missing_idempotency_key"));
            CHECK(member(w.body, "title") == "X-Idempotency-Key is missing");
            CHECK(member(w.body, "detail").find("send the X-Idempotency-Key header") != std::string::npos);
            CHECK(h.runs(k) == 0);
            CHECK_FALSE(h.stored("/x", k));
            // Both sent: the route's header is the key, the other one is an ordinary header.
            const auto k2 = h.key("both", adapter);
            CHECK(h.post(adapter, "/x", {{"Idempotency-Key", quoted(k)}, {"X-Idempotency-Key", quoted(k2)}}).status ==
                  201);
            CHECK(h.runs(k2) == 1);
            CHECK(h.runs(k) == 0);
        }
        DYNAMIC_SECTION(adapter.name << ": malformed, duplicated and reused keys: problems name the header") {
            const auto k = h.key("problems", adapter);
            const auto malformed = h.post(adapter, "/x", {{"X-Idempotency-Key", "\"" + k}});
            CHECK(is_problem(malformed, 400, "invalid_idempotency_key"));
            CHECK(member(malformed.body, "title") == "X-Idempotency-Key is malformed");
            CHECK(member(malformed.body, "detail").find("X-Idempotency-Key: \"") != std::string::npos);
            const auto twice =
                h.post(adapter, "/x", {{"X-Idempotency-Key", quoted(k)}, {"X-Idempotency-Key", quoted(k)}});
            CHECK(is_problem(twice, 400, "invalid_idempotency_key"));
            CHECK(member(twice.body, "detail") == "Send exactly one X-Idempotency-Key header.");
            CHECK(h.runs(k) == 0);
            CHECK_FALSE(h.stored("/x", k));
            CHECK(h.post(adapter, "/x", {{"X-Idempotency-Key", quoted(k)}}, "{\"a\":1}").status == 201);
            const auto reused = h.post(adapter, "/x", {{"X-Idempotency-Key", quoted(k)}}, "{\"a\":2}");
            CHECK(is_problem(reused, 422, "idempotency_key_reused"));
            CHECK(member(reused.body, "title") == "X-Idempotency-Key is already used");
            CHECK(h.runs(k) == 1);
        }
        DYNAMIC_SECTION(adapter.name << ": a 503 tells the client to retry with the same X-Idempotency-Key") {
            const auto k = h.key("down", adapter);
            const auto w = h.post(adapter, "/down", {{"X-Idempotency-Key", quoted(k)}});
            CHECK(is_problem(w, 503, "store_unavailable"));
            CHECK(member(w.body, "detail") ==
                  "The idempotency store is unavailable; retry with the same X-Idempotency-Key.");
            CHECK(h.runs(k) == 0);
        }
        DYNAMIC_SECTION(adapter.name << ": a route whose header name is not a token: 500, nothing runs, logged") {
            const auto k = h.key("bad-name", adapter);
            const auto w = h.post(adapter, "/bad-name", {{"Idempotency-Key", quoted(k)}});
            CHECK(is_problem(w, 500, "internal_error"));
            CHECK(h.runs(k) == 0);
            CHECK_FALSE(h.stored("/bad-name", k));
            std::lock_guard lock(log.mutex);
            REQUIRE_FALSE(log.lines.empty());
            CHECK(log.lines.back().find("Route::key_header 'X Idempotency Key' is not a header field name") !=
                  std::string::npos);
        }
    }
}
