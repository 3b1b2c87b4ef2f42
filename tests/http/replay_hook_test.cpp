// Route::on_replay over real HTTP on both adapters against real PostgreSQL: the hook changes what a
// replay sends (201 → 200, a header added) and nothing else — the stored record's bytes are the
// same after every replay; it runs once per replay, never on the first execution, a 409 or a 422;
// a header it breaks (CR LF) is a 500 that sends nothing of it.
#include <catch2/catch.hpp>

#include <map>
#include <mutex>
#include <string>

#include "route_harness.hpp"

namespace {

using route_test::Harness;
using route_test::is_problem;

std::string quoted(const std::string& key) { return "\"" + key + "\""; }

/// The hook's runs, counted by the key header the request it was given carries.
struct HookRuns {
    std::mutex mutex;
    std::map<std::string, int> by_key;

    void count(const idem::http::Request& request) {
        std::lock_guard lock(mutex);
        ++by_key[std::string(request.header("Idempotency-Key").value_or("none"))];
    }
    int operator()(const std::string& key) {
        std::lock_guard lock(mutex);
        return by_key[quoted(key)];
    }
};

std::map<std::string, idem::http::Route> hook_routes(HookRuns& runs) {
    std::map<std::string, idem::http::Route> routes;
    const auto to_200 = [&runs](idem::Response& replayed, const idem::http::Request& request) {
        runs.count(request);
        if (replayed.status == 201) replayed.status = 200;
        replayed.headers.emplace_back("X-Replay-Hook", "1");
    };
    routes["/hooked"].on_replay = to_200;
    idem::http::Route& kept = routes["/hooked-kept"];  // every answer kept as outcome unknown: 409 after
    kept.on_replay = to_200;
    kept.storage.classify = [](const idem::Response&) { return idem::http::Disposition::unknown; };
    routes["/hooked-split"].on_replay = [&runs](idem::Response& replayed, const idem::http::Request& request) {
        runs.count(request);
        replayed.headers.emplace_back("X-Split", "a\r\nSet-Cookie: evil=1");
    };
    return routes;
}

}  // namespace

TEST_CASE("Route::on_replay over HTTP: changes each replay, never the stored record", "[http][on_replay]") {
    HookRuns hook_runs;
    Harness h(hook_routes(hook_runs));
    for (const auto& adapter : h.adapters()) {
        DYNAMIC_SECTION(adapter.name << ": 201 first (no hook), then 200 + X-Replay-Hook on each replay") {
            const auto k = h.key("hooked", adapter);
            const auto first = h.post(adapter, "/hooked", {{"Idempotency-Key", quoted(k)}});
            CHECK(first.status == 201);
            CHECK(first.header("X-Replay-Hook").empty());
            CHECK(hook_runs(k) == 0);
            const auto stored = h.stored("/hooked", k);
            REQUIRE(stored);
            CHECK(stored->state == "completed");
            for (int replay = 1; replay <= 3; ++replay) {
                INFO("replay " << replay);
                const auto again = h.post(adapter, "/hooked", {{"Idempotency-Key", quoted(k)}});
                CHECK(again.status == 200);
                CHECK(again.replayed());
                CHECK(again.header("X-Replay-Hook") == "1");
                CHECK(again.count("X-Replay-Hook") == 1);  // the hook's header is never stored
                CHECK(again.body == first.body);
                CHECK(again.header("X-Run") == "1");
                CHECK(hook_runs(k) == replay);
                const auto now = h.stored("/hooked", k);
                REQUIRE(now);
                CHECK(now->state == "completed");
                CHECK(now->result == stored->result);  // byte for byte: 201, no X-Replay-Hook
            }
            CHECK(h.runs(k) == 1);
        }
        DYNAMIC_SECTION(adapter.name << ": a 422 and a 409 are not replays: the hook does not run") {
            const auto k = h.key("reused", adapter);
            CHECK(h.post(adapter, "/hooked", {{"Idempotency-Key", quoted(k)}}, "{\"a\":1}").status == 201);
            CHECK(is_problem(h.post(adapter, "/hooked", {{"Idempotency-Key", quoted(k)}}, "{\"a\":2}"), 422,
                             "idempotency_key_reused"));
            CHECK(hook_runs(k) == 0);
            const auto kept = h.key("kept", adapter);
            const auto first = h.post(adapter, "/hooked-kept", {{"Idempotency-Key", quoted(kept)}});
            CHECK((first.status == 201 && first.header("X-Replay-Hook").empty()));
            CHECK(is_problem(h.post(adapter, "/hooked-kept", {{"Idempotency-Key", quoted(kept)}}), 409, "in_progress"));
            CHECK(hook_runs(kept) == 0);
            CHECK(h.state("/hooked-kept", kept) == "in_progress");
        }
        DYNAMIC_SECTION(adapter.name << ": a hook that leaves CR LF in a header: 500, nothing of it sent") {
            const auto k = h.key("split", adapter);
            CHECK(h.post(adapter, "/hooked-split", {{"Idempotency-Key", quoted(k)}}).status == 201);
            const auto stored = h.stored("/hooked-split", k);
            REQUIRE(stored);
            const auto w = h.post(adapter, "/hooked-split", {{"Idempotency-Key", quoted(k)}});
            CHECK(is_problem(w, 500, "internal_error"));
            CHECK(w.header("Set-Cookie").empty());
            CHECK(w.header("X-Split").empty());
            CHECK(hook_runs(k) == 1);
            CHECK(h.stored("/hooked-split", k)->result == stored->result);
            CHECK(h.runs(k) == 1);
        }
    }
}
