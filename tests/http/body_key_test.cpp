// Route::body_key: the key read from a member of the JSON body (a JSON Pointer) when the request
// has no key header, over real HTTP on both adapters against real PostgreSQL. The member's string
// is the stored key; a header, when sent, is the key instead; a body that is not JSON, a member that
// is missing or not a string → 400 with nothing stored and the handler not run.
#include <catch2/catch.hpp>

#include <string>

#include "idem/errors.hpp"
#include "route_harness.hpp"

namespace {

using route_test::Adapter;
using route_test::Harness;
using route_test::is_problem;
using route_test::member;

std::map<std::string, idem::http::Route> body_routes() {
    std::map<std::string, idem::http::Route> routes;
    idem::http::Route& orders = routes["/orders"];
    orders.body_key = "/order_id";
    orders.fingerprint.body = idem::http::FingerprintPolicy::Body::canonical_json;
    routes["/nested"].body_key = "/payment/ids/1";
    routes["/escaped"].body_key = "/a~1b/~0c";
    idem::http::Route& optional = routes["/optional"];
    optional.body_key = "/order_id";
    optional.key_required = false;
    idem::http::Route& x = routes["/x"];
    x.body_key = "/order_id";
    x.key_header = "X-Idempotency-Key";
    routes["/bad-pointer"].body_key = "order_id";
    return routes;
}

std::string order(const std::string& id, int amount = 5) {
    return "{\"order_id\":\"" + id + "\",\"amount\":" + std::to_string(amount) + "}";
}

/// A request refused with 400 before anything was claimed: nothing stored under `path`.
void refused(Harness& h, const Adapter& adapter, const std::string& path, const std::string& body, const char* code,
             const std::string& detail_part) {
    INFO(path << " " << body);
    const auto before = h.keys(path);
    const auto w = h.post(adapter, path, {}, body);
    CHECK(is_problem(w, 400, code));
    CHECK(member(w.body, "detail").find(detail_part) != std::string::npos);
    CHECK(h.keys(path) == before);
}

}  // namespace

TEST_CASE("Route::validate: body_key must be a JSON Pointer", "[http][body_key]") {
    for (const std::string good : {"/order_id", "/a/0", "/a~1b/~0c", "/"}) {
        CHECK_NOTHROW(idem::http::Route{.body_key = good}.validate());
    }
    for (const std::string bad : {"order_id", "/a~2", "/a~"}) {
        INFO(bad);
        CHECK_THROWS_AS(idem::http::Route{.body_key = bad}.validate(), idem::config_error);
        CHECK_THROWS_WITH(
            idem::http::Route{.body_key = bad}.validate(),
            Catch::Matchers::Contains("Route::body_key") && Catch::Matchers::Contains("is not a JSON Pointer"));
    }
}

TEST_CASE("Route::body_key over HTTP: the key from the JSON body when no header is sent", "[http][body_key]") {
    Harness h(body_routes());
    for (const auto& adapter : h.adapters()) {
        DYNAMIC_SECTION(adapter.name << ": the member's string is the key: runs once, replays, 422 on another body") {
            const auto k = h.key("order", adapter);
            const auto first = h.post(adapter, "/orders", {}, order(k));
            CHECK(first.status == 201);
            CHECK(first.body == "made " + k + " #1");
            CHECK(h.state("/orders", k) == "completed");
            const auto again = h.post(adapter, "/orders", {}, " {\"amount\": 5, \"order_id\" : \"" + k + "\"} ");
            CHECK((again.replayed() && again.body == first.body));
            CHECK(is_problem(h.post(adapter, "/orders", {}, order(k, 6)), 422, "idempotency_key_reused"));
            CHECK(h.runs(k) == 1);
        }
        DYNAMIC_SECTION(adapter.name << ": a header, when sent, is the key; the body's member is not") {
            const auto header_key = h.key("header", adapter);
            const auto body_key = h.key("in-body", adapter);
            CHECK(h.post(adapter, "/orders", {{"Idempotency-Key", header_key}}, order(body_key)).status == 201);
            CHECK(h.runs(header_key) == 1);
            CHECK(h.runs(body_key) == 0);
            CHECK(h.state("/orders", body_key).empty());
            // ... and the body is not read for a key then: not JSON is no error on a bytes fingerprint
            CHECK(h.post(adapter, "/nested", {{"Idempotency-Key", header_key}}, "not json").status == 201);
        }
        DYNAMIC_SECTION(adapter.name << ": JSON escapes resolved; nested members, array indices, ~0 ~1") {
            const auto k = h.key("esc", adapter);
            CHECK(h.post(adapter, "/orders", {}, "{\"order_id\":\"" + k + "-\\u00e9\\/\"}").status == 201);
            CHECK(h.state("/orders", k + "-\xc3\xa9/") == "completed");
            CHECK(h.post(adapter, "/nested", {}, "{\"payment\":{\"ids\":[\"x\",\"" + k + "-n\"]}}").status == 201);
            CHECK(h.runs(k + "-n") == 1);
            CHECK(h.post(adapter, "/escaped", {}, "{\"a/b\":{\"~c\":\"" + k + "-e\"}}").status == 201);
            CHECK(h.runs(k + "-e") == 1);
        }
        DYNAMIC_SECTION(adapter.name << ": missing member, empty body: 400 missing, naming header and member") {
            const std::string both = "send the Idempotency-Key header, or the key as the string member /order_id";
            refused(h, adapter, "/orders", "{\"amount\":5}", "missing_idempotency_key", both);
            refused(h, adapter, "/orders", "", "missing_idempotency_key", both);
            refused(h, adapter, "/nested", "{\"payment\":{\"ids\":[\"only one\"]}}", "missing_idempotency_key",
                    "/payment/ids/1");
            refused(h, adapter, "/x", "{}", "missing_idempotency_key",
                    "send the X-Idempotency-Key header, or the key as the string member /order_id");
        }
        DYNAMIC_SECTION(adapter.name << ": a member that is not a string: 400 saying what it is") {
            refused(h, adapter, "/orders", "{\"order_id\":42}", "invalid_idempotency_key",
                    "the key is the member /order_id of the JSON body: it must be a string, and it is a number.");
            refused(h, adapter, "/orders", "{\"order_id\":null}", "invalid_idempotency_key", "and it is null.");
            refused(h, adapter, "/orders", "{\"order_id\":{\"id\":\"x\"}}", "invalid_idempotency_key",
                    "and it is an object.");
            refused(h, adapter, "/orders", "{\"order_id\":[\"x\"]}", "invalid_idempotency_key", "and it is an array.");
            refused(h, adapter, "/orders", "{\"order_id\":true}", "invalid_idempotency_key", "and it is a boolean.");
        }
        DYNAMIC_SECTION(adapter.name << ": a string that cannot be a key: 400 naming the member") {
            const std::string rule = "the member /order_id of the JSON body: it must be 1 to 255 bytes";
            refused(h, adapter, "/orders", order(""), "invalid_idempotency_key", rule);
            refused(h, adapter, "/orders", order(h.key("nul", adapter) + "\\u0000x"), "invalid_idempotency_key", rule);
            refused(h, adapter, "/orders", order(std::string(256, 'k')), "invalid_idempotency_key", rule);
        }
        DYNAMIC_SECTION(adapter.name << ": a body that is not JSON: 400 invalid_json_body") {
            for (const std::string bad : {"{'order_id':'x'}", "{\"order_id\":\"x\",\"order_id\":\"y\"}", "[1,]",
                                          "{\"order_id\":\"x\"} trailing"}) {
                refused(h, adapter, "/orders", bad, "invalid_json_body",
                        "With no Idempotency-Key header the key is the member /order_id of the JSON body, and the "
                        "request body is not valid JSON");
            }
        }
        DYNAMIC_SECTION(adapter.name << ": key not required, no member: the handler runs plainly, nothing stored") {
            const auto before = h.keys("/optional");
            const int runs = h.runs("-");
            CHECK(h.post(adapter, "/optional", {}, "{\"amount\":5}").status == 201);
            CHECK(h.post(adapter, "/optional", {}, "{\"amount\":5}").status == 201);
            CHECK(h.runs("-") == runs + 2);
            CHECK(h.keys("/optional") == before);
            const auto k = h.key("optional", adapter);
            CHECK(h.post(adapter, "/optional", {}, order(k)).status == 201);
            CHECK(h.post(adapter, "/optional", {}, order(k)).replayed());
            CHECK(h.runs(k) == 1);
        }
        DYNAMIC_SECTION(adapter.name << ": a route whose body_key is not a JSON Pointer: 500, nothing runs") {
            const auto k = h.key("bad-pointer", adapter);
            const auto w = h.post(adapter, "/bad-pointer", {}, order(k));
            CHECK(is_problem(w, 500, "internal_error"));
            CHECK(h.runs(k) == 0);
            CHECK(h.keys("/bad-pointer").empty());
        }
    }
}
