// Which forms of the key a route accepts (Route::key_form), over real HTTP on both adapters against
// real PostgreSQL: by default a bare key (what Stripe-style clients send) and a quoted one (the
// draft's sf-string) are both accepted and are one key; a route that keeps to the draft refuses a
// bare key with a 400 whose detail is the exact header line to send instead — following it works.
#include <catch2/catch.hpp>

#include <string>

#include "route_harness.hpp"

namespace {

using route_test::Adapter;
using route_test::Harness;
using route_test::is_problem;
using route_test::member;

std::string quoted(const std::string& key) { return "\"" + key + "\""; }

std::map<std::string, idem::http::Route> form_routes() {
    std::map<std::string, idem::http::Route> routes;
    routes["/strict"].key_form = idem::http::KeyForm::sf_string;
    idem::http::Route& strict_x = routes["/strict-x"];
    strict_x.key_form = idem::http::KeyForm::sf_string;
    strict_x.key_header = "X-Idempotency-Key";
    return routes;
}

/// The header value a problem's detail tells the client to send: what follows "<header>: ".
std::string advised(const std::string& detail, const std::string& header) {
    const auto at = detail.find(header + ": ");
    if (at == std::string::npos) return {};
    return detail.substr(at + header.size() + 2);
}

/// Sends the line the 400's detail advises and checks that it is accepted as `key`.
void follow_advice(Harness& h, const Adapter& adapter, const std::string& path, const std::string& header,
                   const route_test::Wire& refusal, const std::string& key) {
    const std::string line = advised(member(refusal.body, "detail"), header);
    INFO("advised: " << header << ": " << line);
    REQUIRE_FALSE(line.empty());
    const auto w = h.post(adapter, path, {{header, line}});
    CHECK(w.status == 201);
    CHECK(h.runs(key) == 1);
    CHECK(h.state(path, key) == "completed");
}

}  // namespace

TEST_CASE("Key forms over HTTP: bare and quoted keys by default; the draft's form on request, with advice",
          "[http][key_form]") {
    Harness h(form_routes());
    for (const auto& adapter : h.adapters()) {
        DYNAMIC_SECTION(adapter.name << ": default route: a bare key is accepted; \"k\" and k are one key") {
            const auto k = h.key("bare", adapter);
            const auto first = h.post(adapter, "/default", {{"Idempotency-Key", k}});
            CHECK(first.status == 201);
            CHECK(h.post(adapter, "/default", {{"Idempotency-Key", quoted(k)}}).replayed());
            CHECK(h.post(adapter, "/default", {{"Idempotency-Key", k}}).replayed());
            CHECK(h.runs(k) == 1);
            CHECK(h.state("/default", k) == "completed");
        }
        DYNAMIC_SECTION(adapter.name << ": default route: a comma is refused; the detail says to quote the key") {
            const auto k = h.key("a,b", adapter);
            const auto w = h.post(adapter, "/default", {{"Idempotency-Key", k}});
            CHECK(is_problem(w, 400, "invalid_idempotency_key"));
            CHECK(member(w.body, "detail") ==
                  "A bare key cannot hold ',' (it separates the values of header lines joined into one); "
                  "to send one key holding ',', quote it: Idempotency-Key: " +
                      quoted(k));
            CHECK_FALSE(h.stored("/default", k));
            follow_advice(h, adapter, "/default", "Idempotency-Key", w, k);
        }
        DYNAMIC_SECTION(adapter.name << ": strict route: a bare key is 400 saying exactly what to send") {
            const auto k = h.key("strict", adapter);
            const auto w = h.post(adapter, "/strict", {{"Idempotency-Key", k}});
            CHECK(is_problem(w, 400, "invalid_idempotency_key"));
            CHECK(member(w.body, "detail") ==
                  "Send the key as a quoted string (an RFC 8941 sf-string): Idempotency-Key: " + quoted(k));
            CHECK(h.runs(k) == 0);
            CHECK_FALSE(h.stored("/strict", k));
            follow_advice(h, adapter, "/strict", "Idempotency-Key", w, k);
        }
        DYNAMIC_SECTION(adapter.name << ": strict route: the advice escapes what an sf-string escapes") {
            const auto k = h.key("q\"b\\s", adapter);
            const auto w = h.post(adapter, "/strict", {{"Idempotency-Key", k}});
            CHECK(is_problem(w, 400, "invalid_idempotency_key"));
            CHECK(advised(member(w.body, "detail"), "Idempotency-Key") == "\"" + h.key("q\\\"b\\\\s", adapter) + "\"");
            follow_advice(h, adapter, "/strict", "Idempotency-Key", w, k);
        }
        DYNAMIC_SECTION(adapter.name << ": strict route with X-Idempotency-Key: the advice names that header") {
            const auto k = h.key("strict-x", adapter);
            const auto w = h.post(adapter, "/strict-x", {{"X-Idempotency-Key", k}});
            CHECK(member(w.body, "detail") ==
                  "Send the key as a quoted string (an RFC 8941 sf-string): X-Idempotency-Key: " + quoted(k));
            follow_advice(h, adapter, "/strict-x", "X-Idempotency-Key", w, k);
        }
        DYNAMIC_SECTION(adapter.name << ": malformed quoted strings: the detail names the fault") {
            const auto k = h.key("sf", adapter);
            const auto detail = [&](const std::string& value) {
                const auto w = h.post(adapter, "/default", {{"Idempotency-Key", value}});
                CHECK(is_problem(w, 400, "invalid_idempotency_key"));
                return member(w.body, "detail");
            };
            CHECK(detail("\"" + k).find("has no closing quote") != std::string::npos);
            CHECK(detail("\"" + k + "\\n\"").find("only \\\" and \\\\ are escapes") != std::string::npos);
            CHECK(detail(quoted(k) + ", \"b\"").find("only one key") != std::string::npos);
            CHECK(detail("\"" + k + "\xc3\xa9\"").find("printable ASCII") != std::string::npos);
            CHECK(h.runs(k) == 0);
            CHECK_FALSE(h.stored("/default", k));
        }
    }
}
