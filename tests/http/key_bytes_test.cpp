// Which key each adapter reads from the same header bytes, over real HTTP against real PostgreSQL.
// cpp-httplib 0.11 percent-decodes every header value while parsing; Beast keeps the bytes as sent.
// The first test pins both behaviours down; the second shows that Route::key_decoding =
// KeyDecoding::percent makes them agree: the same raw bytes sent to either adapter (the same
// table, the same scope) are one key, so a service moved from one adapter to the other never runs
// a retried key twice. The third compares idem::http::percent_decode_header_value with
// cpp-httplib's own decoder on many generated values.
#include <catch2/catch.hpp>

#include <random>
#include <string>
#include <vector>

#include "idem/http/httplib.hpp"
#include "route_harness.hpp"

namespace {

using namespace std::string_literals;
using route_test::Adapter;
using route_test::Harness;
using route_test::is_problem;
using route_test::member;

/// What one adapter makes of a header value: the stored key, or a refusal (400).
struct Read {
    std::string suffix;   // the raw bytes after the key's unique prefix
    std::string httplib;  // the key cpp-httplib's route stores (prefix + this), or "400"
    std::string beast;    // the key Beast's route stores, or "400"
};

// clang-format off
const std::vector<Read> kReads = {
    // suffix          cpp-httplib 0.11          Beast (as sent)
    {"plain",          "plain",                  "plain"},
    {"k%41",           "kA",                     "k%41"},      // %XX decoded
    {"k%4a%4A",        "kJJ",                    "k%4a%4A"},   // either case of hex digit
    {"50%off",         "400",                    "50%off"},    // not a triplet: '%' kept, then refused
    {"k%2541",         "400",                    "k%2541"},    // decoded once to %41: refused
    {"k%u0041",        "kA",                     "k%u0041"},   // %uXXXX decoded to UTF-8
    {"k%u00e9",        "k\xc3\xa9",              "k%u00e9"},
    {"k%uD800x",       "kx",                     "k%uD800x"},  // a surrogate: the sequence vanishes
    {"k%C3%A9",        "k\xc3\xa9",              "k%C3%A9"},
    {"k%e9",           "400",                    "k%e9"},      // a lone 0xE9: not UTF-8
    {"k%00x",          "400",                    "k%00x"},     // NUL
    {"k%0D%0Ax",       "400",                    "k%0D%0Ax"},  // CR LF
    {"k%2Cx",          "400",                    "k%2Cx"},     // ',' in a bare key
    {"k+1",            "k+1",                    "k+1"},       // '+' is not a space in a header
    {"k%",             "400",                    "k%"},
    {"k%4",            "400",                    "k%4"},
    {"k%u004",         "400",                    "k%u004"},
};
// clang-format on

std::map<std::string, idem::http::Route> byte_routes() {
    std::map<std::string, idem::http::Route> routes;
    routes["/decoded"].key_decoding = idem::http::KeyDecoding::percent;
    idem::http::Route& tenant = routes["/decoded-tenant"];
    tenant.key_decoding = idem::http::KeyDecoding::percent;
    tenant.fingerprint.headers = {"X-Tenant"};
    return routes;
}

/// The key `adapter` stored for `value` on `path`, or "400" when it refused the request.
std::string read_by(Harness& h, const Adapter& adapter, const std::string& path, const std::string& value,
                    const std::string& prefix) {
    const auto w = h.post(adapter, path, {{"Idempotency-Key", value}});
    if (w.status == 400) return "400";
    if (w.status != 201 || w.replayed()) return "unexpected " + std::to_string(w.status) + ": " + w.body;
    const std::string body = w.body;  // "made <key> #1"
    if (body.rfind("made ", 0) != 0 || body.size() < 8) return "unexpected body: " + body;
    const std::string key = body.substr(5, body.size() - 5 - 3);
    if (h.state(path, key) != "completed") return "not stored: " + key;
    return key.rfind(prefix, 0) == 0 ? key.substr(prefix.size()) : "other prefix: " + key;
}

}  // namespace

TEST_CASE("Key bytes: cpp-httplib 0.11 reads percent-decoded keys, Beast the bytes as sent", "[http][key_bytes]") {
    Harness h(byte_routes());
    for (const auto& adapter : h.adapters()) {
        for (std::size_t i = 0; i < kReads.size(); ++i) {
            const Read& read = kReads[i];
            DYNAMIC_SECTION(adapter.name << ": " << read.suffix) {
                const std::string prefix = h.key("as-sent-" + std::to_string(i), adapter) + "-";
                const std::string expected = adapter.name == "httplib" ? read.httplib : read.beast;
                CHECK(read_by(h, adapter, "/as-sent", prefix + read.suffix, prefix) == expected);
            }
        }
    }
}

TEST_CASE("Key bytes: with KeyDecoding::percent, the same bytes are one key on cpp-httplib and Beast",
          "[http][key_bytes]") {
    Harness h(byte_routes());
    const auto adapters = h.adapters();
    REQUIRE(adapters.size() == 2);  // this test needs the idem::asio component (Beast)
    const Adapter& httplib = adapters[0];
    const Adapter& beast = adapters[1];

    // Generated values beside the fixed ones: printable ASCII, heavy in '%', 'u' and hex digits.
    std::vector<std::string> suffixes;
    for (const Read& read : kReads) suffixes.push_back(read.suffix);
    std::mt19937 random(20240611);
    const std::string alphabet = "%%%%uu0a9AfFgD8+ ,\"xz";
    for (int n = 0; n < 60; ++n) {
        std::string suffix;
        const auto length = 1 + random() % 10;
        for (unsigned i = 0; i < length; ++i) suffix += alphabet[random() % alphabet.size()];
        suffixes.push_back(suffix);
    }

    for (std::size_t i = 0; i < suffixes.size(); ++i) {
        const std::string value = "k-" + h.run_id + "-decoded-" + std::to_string(i) + "-" + suffixes[i];
        INFO("Idempotency-Key: " << value);
        // A client's first attempt reaches the cpp-httplib service; its retry, the same bytes, reaches
        // the Beast service that replaced it, on the same table and scope.
        const auto first = h.post(httplib, "/decoded", {{"Idempotency-Key", value}});
        const auto retry = h.post(beast, "/decoded", {{"Idempotency-Key", value}});
        CHECK(retry.status == first.status);
        if (first.status == 201) {
            CHECK(retry.replayed());
            CHECK(retry.body == first.body);  // "made <key> #1": one run, one key
            CHECK(first.body.ends_with(" #1"));
        } else {
            CHECK(first.status == 400);
            CHECK(is_problem(retry, 400, member(first.body, "code")));
            CHECK(member(retry.body, "detail") == member(first.body, "detail"));
        }
    }
    // k%41 and kA are one key on both: the retry as kA on Beast replays cpp-httplib's k%41.
    const std::string k = "k-" + h.run_id + "-decoded-";
    CHECK(h.post(httplib, "/decoded", {{"Idempotency-Key", k + "%41"}}).status == 201);
    CHECK(h.post(beast, "/decoded", {{"Idempotency-Key", k + "A"}}).replayed());
    CHECK(h.runs(k + "A") == 1);
    CHECK(h.state("/decoded", k + "A") == "completed");
    CHECK(h.state("/decoded", k + "%41").empty());
    // Fingerprinted header values are read decoded too: a%41 and aA are the same tenant on both.
    CHECK(h.post(httplib, "/decoded-tenant", {{"Idempotency-Key", k + "t"}, {"X-Tenant", "a%41"}}).status == 201);
    CHECK(h.post(beast, "/decoded-tenant", {{"Idempotency-Key", k + "t"}, {"X-Tenant", "a%41"}}).replayed());
    CHECK(h.post(beast, "/decoded-tenant", {{"Idempotency-Key", k + "t"}, {"X-Tenant", "aA"}}).replayed());
    CHECK(h.runs(k + "t") == 1);
}

TEST_CASE("percent_decode_header_value is cpp-httplib 0.11's decode of a header value", "[http][key_bytes]") {
    std::vector<std::string> values = {
        "",       "%",      "%%",  "%4",     "%41", "%u",  "%u004", "%u0041", "%uD800", "%uDFFF%41", "%uE000",
        "%uFFFF", "%u0000", "%00", "%ff%FF", "+",   "%2B", "%%41",  "%u%41",  "a%g1",   "%U0041",    "\xff%41\x80"};
    std::mt19937 random(7);
    const std::string alphabet = "%%%%%uuU0123456789abcdefABCDEFgG+ \x00\x7f\x80\xff"s;
    for (int n = 0; n < 20000; ++n) {
        std::string value;
        const auto length = random() % 16;
        for (unsigned i = 0; i < length; ++i) value += alphabet[random() % alphabet.size()];
        values.push_back(value);
    }
    for (const auto& value : values) {
        INFO("value bytes: " << value.size());
        CHECK(idem::http::percent_decode_header_value(value) == httplib::detail::decode_url(value, false));
    }
}
