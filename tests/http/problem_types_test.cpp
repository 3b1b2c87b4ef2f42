// The problems idem::http answers (RFC 9457), over real HTTP on both adapters against real
// PostgreSQL: each one's status, type and title exactly as docs/http.md's table of problems says —
// every problem the client can act on links to the route's problem_type; only a 500 is about:blank.
#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <vector>

#include "route_harness.hpp"

namespace {

using route_test::Adapter;
using route_test::Harness;
using route_test::member;
using route_test::Wire;

const std::string kDraft = "https://datatracker.ietf.org/doc/html/draft-ietf-httpapi-idempotency-key-header-07";
const std::string kDocs = "https://api.example.com/docs/idempotency";

std::string quoted(const std::string& key) { return "\"" + key + "\""; }

std::map<std::string, idem::http::Route> problem_routes() {
    std::map<std::string, idem::http::Route> routes;
    routes["/json"].fingerprint.body = idem::http::FingerprintPolicy::Body::canonical_json;
    // Every response kept as outcome unknown: the key stays in progress, the next request gets 409.
    routes["/kept"].storage.classify = [](const idem::Response&) { return idem::http::Disposition::unknown; };
    routes["/bad-name"].key_header = "Bad Name";
    idem::http::Route& documented = routes["/documented"];
    documented.problem_type = kDocs;
    documented.key_header = "X-Idempotency-Key";
    return routes;
}

/// One problem: how to provoke it, and what the table says it is.
struct Case {
    std::string code;
    int status;
    std::string type;  // "" : the route's problem_type (the draft's URL by default)
    std::string title;
    std::function<Wire(Harness&, const Adapter&, const std::string& key)> provoke;
};

std::vector<Case> cases() {
    const auto post = [](const std::string& path, const std::string& body = "{}") {
        return [path, body](Harness& h, const Adapter& a, const std::string& k) {
            return h.post(a, path, {{"Idempotency-Key", quoted(k)}}, body);
        };
    };
    return {
        {"missing_idempotency_key", 400, "", "Idempotency-Key is missing",
         [](Harness& h, const Adapter& a, const std::string&) { return h.post(a, "/plain", {}); }},
        {"invalid_idempotency_key", 400, "", "Idempotency-Key is malformed",
         [](Harness& h, const Adapter& a, const std::string& k) {
             return h.post(a, "/plain", {{"Idempotency-Key", "\"" + k}});
         }},
        {"invalid_json_body", 400, "", "The request body is not valid JSON", post("/json", "{'a':1}")},
        {"in_progress", 409, "", "A request is outstanding for this Idempotency-Key",
         [](Harness& h, const Adapter& a, const std::string& k) {
             (void)h.post(a, "/kept", {{"Idempotency-Key", quoted(k)}});
             return h.post(a, "/kept", {{"Idempotency-Key", quoted(k)}});
         }},
        {"idempotency_key_reused", 422, "", "Idempotency-Key is already used",
         [](Harness& h, const Adapter& a, const std::string& k) {
             (void)h.post(a, "/plain", {{"Idempotency-Key", quoted(k)}}, "{\"a\":1}");
             return h.post(a, "/plain", {{"Idempotency-Key", quoted(k)}}, "{\"a\":2}");
         }},
        {"store_unavailable", 503, "", "The idempotency store is unavailable", post("/down")},
        {"outcome_unknown", 503, "", "The outcome of the request is not known yet", post("/throw")},
        {"not_performed", 503, "", "The request was not performed", post("/not-performed")},
        {"internal_error", 500, "about:blank", "Internal Server Error", post("/bad-name")},
    };
}

}  // namespace

TEST_CASE("Problem types: every problem's status, type and title as docs/http.md's table says",
          "[http][problem_types]") {
    Harness h(problem_routes());
    for (const auto& adapter : h.adapters()) {
        for (const Case& c : cases()) {
            DYNAMIC_SECTION(adapter.name << ": " << c.code) {
                const Wire w = c.provoke(h, adapter, h.key("problem-" + c.code, adapter));
                CHECK(w.status == c.status);
                CHECK(w.header("Content-Type") == "application/problem+json");
                CHECK(member(w.body, "code") == c.code);
                CHECK(member(w.body, "type") == (c.type.empty() ? kDraft : c.type));
                CHECK(member(w.body, "title") == c.title);
                CHECK(w.body.find("\"status\":" + std::to_string(c.status) + ",") != std::string::npos);
            }
        }
        DYNAMIC_SECTION(adapter.name << ": a route's own problem_type types every problem but a 500") {
            const auto k = h.key("documented", adapter);
            const auto missing = h.post(adapter, "/documented", {});
            CHECK(member(missing.body, "type") == kDocs);
            CHECK(member(missing.body, "title") == "X-Idempotency-Key is missing");
            (void)h.post(adapter, "/documented", {{"X-Idempotency-Key", quoted(k)}}, "{\"a\":1}");
            const auto reused = h.post(adapter, "/documented", {{"X-Idempotency-Key", quoted(k)}}, "{\"a\":2}");
            CHECK(member(reused.body, "type") == kDocs);
            CHECK(member(reused.body, "title") == "X-Idempotency-Key is already used");
        }
    }
}
