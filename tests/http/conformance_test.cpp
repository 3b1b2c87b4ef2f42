// The Idempotency-Key conformance table (docs/http.md lists each row with its rule and the draft's
// section): every row runs twice, through the neutral API (idem::http::respond on a Request built
// by hand) and over real HTTP through the cpp-httplib adapter, against real PostgreSQL. Rows marked
// http-only exercise what only a wire can carry (a 10 MB header, cpp-httplib's percent-decoding).
// With the idem::asio component (IDEM_TEST_BEAST), every row but the in-transaction ones (no
// asynchronous counterpart) and cpp-httplib's own (H*) runs a third time, over real HTTP through a
// Boost.Beast server and idem::http::async_respond on an AsyncPostgresStore; rows B* are Beast's own.
// Every row counts the handler's runs itself and, for a request that was not performed, checks
// that the table holds no stored response for its key.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "http_support.hpp"
#include "idem/http.hpp"
#include "idem/http/httplib.hpp"
#include "idem/http/transaction.hpp"
#include "idem/postgres_store.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "test_env.hpp"
#include "threads.hpp"

#ifdef IDEM_TEST_BEAST
#include "beast_support.hpp"
#include "idem/asio/store.hpp"
#include "idem/http/asio.hpp"
#endif

namespace {

using namespace std::chrono_literals;
using namespace std::string_literals;
using http_test::Raw;
using http_test::Wire;
namespace http = idem::http;

constexpr std::size_t kMaxResult = 64 * 1024;  // the store's max_result_bytes in this test

std::string quoted(const std::string& key) { return "\"" + key + "\""; }

// ------------------------------------------------------------------------------ the service

/// The routes under test. Each counts its handler's runs per key (or per body without a key).
class Service {
public:
    Service(idem::PostgresStore& store, idem::PostgresStore& down, idem::PostgresStore& misconfigured,
            std::string effects_table, idem_test::PgConn& db)
        : effects(std::move(effects_table)), store_(store), down_(down), misconfigured_(misconfigured), db_(db) {
        routes_["/tx"].key_required = false;  // ignored: in-transaction mode always needs the key
        tx_options_["/tx-slow"].lock_wait = 1ms;
        tx_options_["/tx-lockwait"].lock_wait = 5s;  // = the store's statement_timeout
        http::Route& token = routes_["/token"];
        token.key_form = http::KeyForm::sf_string_or_token;
        routes_["/strict"].key_form = http::KeyForm::sf_string;
        routes_["/optional"].key_required = false;
        routes_["/optional-phase"].key_required = false;
        routes_["/policy-throws"].storage.classify = [](const idem::Response&) -> http::Disposition {
            throw std::logic_error("policy bug");
        };
        routes_["/json"].fingerprint.body = http::FingerprintPolicy::Body::canonical_json;
        routes_["/headers"].fingerprint.headers = {"X-Tenant"};
        routes_["/custom"].fingerprint.custom = [](const http::Request& r) {
            if (r.body == "reject") throw http::not_performed(idem::Response{400, "unreadable body"});
            return idem::fingerprint(r.body);
        };
        routes_["/unknown5xx"].storage = http::StoragePolicy::server_errors_unknown();
        routes_["/success-only"].storage = http::StoragePolicy::success_only();
        http::Route& retention = routes_["/retention"];
        retention.claim.retention = 3600s;
        retention.retention_header = "Idempotency-Retention";
        http::Route& rendered = routes_["/rendered"];
        rendered.render_problem = [](const http::Problem& p) {
            return idem::Response{p.status, "{\"error\":\"" + p.code + "\"}", {{"Content-Type", "application/json"}}};
        };
        routes_["/down"].unavailable_retry_after = 3s;
        routes_["/lease-lost"].claim.lease = 50ms;  // passed by the time the "reconciler" looks
        routes_["/throw"].unknown_retry_after = 2s;
        routes_["/throw-db"].unknown_retry_after = 0s;  // answered as 1
        for (const char* logging : {"/throw", "/throw-db", "/throw-down", "/bad-header", "/lease-lost-unread"}) {
            routes_[logging].log = [this](std::string_view line) {
                std::lock_guard lock(mutex_);
                logged_.emplace_back(line);
            };
        }
    }

    idem::Response dispatch(const http::Request& request) {
        const std::string path(request.target.substr(0, request.target.find('?')));
        static const http::Route plain;  // the routes not configured in the constructor
        const auto found = routes_.find(path);
        const http::Route& route = found == routes_.end() ? plain : found->second;
        idem::PostgresStore& store = path == "/down" ? down_ : path == "/misconfigured" ? misconfigured_ : store_;
        const std::string scope = "conformance:" + path;
        if (path.starts_with("/tx")) {
            const auto tx_options = tx_options_.find(path);
            return http::respond_in_transaction(
                store_, request, scope, route,
                [&](idem::Transaction& tx) {
                    const int n = count(tx.key().value());
                    tx.exec("INSERT INTO " + effects + " (key) VALUES ($1)", {tx.key().value()});
                    if (path == "/tx-throw") throw std::runtime_error("the effect failed");
                    if (path == "/tx-slow") wait_at_gate();
                    return idem::Response{201, "tx " + std::to_string(n), {{"X-Tx", "1"}}};
                },
                tx_options == tx_options_.end() ? idem::TransactionOptions{} : tx_options->second);
        }
        return http::respond(store, request, scope, route, [&](idem::Context& context) {
            const std::string who = path.starts_with("/optional") ? std::string(request.body) : context.key().value();
            const int n = count(who);
            return handle(path, n, context);
        });
    }

#ifdef IDEM_TEST_BEAST
    /// dispatch() through async_respond: the same routes and handlers. The handler counts its run
    /// and awaits record_phase itself (/optional-phase); its blocking rest (gates, sleeps, the
    /// "reconciler") runs on `pool`, awaited, so the store's strand never waits.
    boost::asio::awaitable<idem::Response> dispatch_async(idem::asio::AsyncPostgresStore& store,
                                                          idem::asio::AsyncPostgresStore& down,
                                                          idem::asio::AsyncPostgresStore& misconfigured,
                                                          boost::asio::thread_pool& pool,
                                                          const http::Request& request) {
        const std::string path(request.target.substr(0, request.target.find('?')));
        static const http::Route plain;
        const auto found = routes_.find(path);
        const http::Route& route = found == routes_.end() ? plain : found->second;
        idem::asio::AsyncPostgresStore& chosen = path == "/down"            ? down
                                                 : path == "/misconfigured" ? misconfigured
                                                                            : store;
        // Named, not temporaries of the co_await expression: GCC 12 may destroy a non-trivial
        // temporary there after its storage is gone.
        const std::string scope = "conformance:" + path;
        auto handler = [&, path](idem::asio::AsyncContext& context) -> boost::asio::awaitable<idem::Response> {
            const std::string who = path.starts_with("/optional") ? std::string(request.body) : context.key().value();
            const int n = count(who);
            if (path == "/optional-phase") co_await context.record_phase("charged");
            auto blocking_part = [&, key = context.key(),
                                  fence = context.fence()]() -> boost::asio::awaitable<idem::Response> {
                idem::Context blocking(store_, key, fence, nullptr);
                co_return handle(path, n, blocking);
            };
            idem::Response produced =
                co_await boost::asio::co_spawn(pool, std::move(blocking_part), boost::asio::use_awaitable);
            co_return produced;
        };
        idem::Response answer =
            co_await http::async_respond(chosen, request, scope, route, std::move(handler), boost::asio::use_awaitable);
        co_return answer;
    }
#endif

    [[nodiscard]] int runs(const std::string& key) {
        std::lock_guard lock(mutex_);
        return runs_[key];
    }
    /// Opens the gate of /slow (its handlers wait for it).
    void open_gate() {
        {
            std::lock_guard lock(mutex_);
            gate_open_ = true;
        }
        gate_.notify_all();
    }
    void close_gate() {
        std::lock_guard lock(mutex_);
        gate_open_ = false;
    }
    /// Handlers of /slow currently waiting at the gate.
    [[nodiscard]] int waiting() {
        std::lock_guard lock(mutex_);
        return waiting_;
    }
    /// Whether a logged line names `key` and holds `text`.
    [[nodiscard]] bool told(const std::string& key, const std::string& text = "") {
        std::lock_guard lock(mutex_);
        return std::any_of(logged_.begin(), logged_.end(), [&](const std::string& line) {
            return line.find(key) != std::string::npos && line.find(text) != std::string::npos;
        });
    }

private:
    int count(const std::string& who) {
        std::lock_guard lock(mutex_);
        return ++runs_[who];
    }

    idem::Response handle(const std::string& path, int n, idem::Context& context) {
        const std::string body = "{\"order\":" + std::to_string(n) + "}\0\xff"s;  // NUL, non-UTF-8
        if (path == "/decline") return {402, "{\"error\":\"card_declined\"}", {{"Content-Type", "application/json"}}};
        if (path == "/error500") return {500, "upstream said no", {}};
        if (path == "/unknown5xx") return {502, "bad gateway", {}};
        if (path == "/success-only") return {400, "rejected", {}};
        if (path == "/ratelimit") throw http::not_performed(idem::Response{429, "slow down", {{"Retry-After", "7"}}});
        if (path == "/notperformed") throw idem::not_performed("provider refused the connection");
        if (path == "/throw") throw std::runtime_error("provider timed out");
        // idem errors from the handler's own store calls, after its effect may have happened
        if (path == "/throw-db") throw idem::database_error("idem: record_phase: statement timeout", "57014");
        if (path == "/throw-down") throw idem::store_unavailable("idem: extend_lease: cannot connect");
        if (path == "/optional-phase") context.record_phase("charged");
        if (path == "/bad-header") return {201, "made", {{"X-Split", "a\r\nSet-Cookie: evil=1"}}};
        if (path == "/bad-header-nul") return {201, "made", {{"X-\0Nul"s, "v"}}};
        if (path == "/big") return {201, std::string(kMaxResult + 1, 'x'), {}};
        if (path == "/lease-lost") {
            // A reconciler takes the key over and saves its own answer while this attempt runs.
            std::this_thread::sleep_for(200ms);
            const auto fence = store_.take_over(context.key(), context.fence(), 30s, false);
            store_.save(context.key(), fence.value(),
                        idem::codec<idem::Response>::encode({201, "from the reconciler"}));
            return {201, "from the handler", {}};
        }
        if (path == "/lease-lost-unread") {
            // Another attempt takes the key over (a new fence) and leaves a record that does not read
            // (a fingerprint of the wrong length): this attempt's save is lease_lost, its read fails.
            db_.exec("UPDATE idem_keys SET fence = fence + 1, fingerprint = $3::bytea WHERE scope = $1 AND key = $2",
                     {context.key().scope(), context.key().value(), "\\x00"});
            return {201, "from the handler", {}};
        }
        if (path == "/slow") wait_at_gate();
        return {201, body, {{"Content-Type", "application/json"}, {"X-Order", std::to_string(n)}}};
    }

    void wait_at_gate() {
        std::unique_lock lock(mutex_);
        ++waiting_;
        gate_.wait(lock, [&] { return gate_open_; });
        --waiting_;
    }

public:
    const std::string effects;  // the in-transaction routes' table of effects

private:
    idem::PostgresStore& store_;
    idem::PostgresStore& down_;
    idem::PostgresStore& misconfigured_;
    idem_test::PgConn& db_;  // the test's connection, used by /lease-lost-unread while its request waits
    std::map<std::string, http::Route> routes_;                   // filled before the server starts: read-only after
    std::map<std::string, idem::TransactionOptions> tx_options_;  // the in-transaction routes' (as routes_)
    std::mutex mutex_;
    std::condition_variable gate_;
    bool gate_open_ = true;
    int waiting_ = 0;
    std::map<std::string, int> runs_;
    std::vector<std::string> logged_;
};

// ------------------------------------------------------------------------------- transports

struct Env {
    std::string name;  // "neutral", "httplib" or "beast"
    bool over_http = false;
    std::function<Wire(const Raw&)> send;
    Service* service = nullptr;
    idem_test::PgConn* db = nullptr;
    std::string run_id;

    /// A key no other row or transport uses.
    [[nodiscard]] std::string key(const std::string& row) const { return "k-" + run_id + "-" + name + "-" + row; }

    Wire post(const std::string& target, const std::optional<std::string>& header, const std::string& body = "{}",
              std::vector<std::pair<std::string, std::string>> extra = {}) const {
        Raw raw{"POST", target, std::move(extra), body};
        if (header) raw.headers.emplace_back("Idempotency-Key", *header);
        return send(raw);
    }
    /// The stored state of a key ("in_progress", "completed") or "" when there is no row.
    [[nodiscard]] std::string state(const std::string& path, const std::string& key) const {
        auto r = db->exec("SELECT state FROM idem_keys WHERE scope = $1 AND key = $2", {"conformance:" + path, key});
        return r.rows() == 0 ? std::string() : r.text(0, 0);
    }
    [[nodiscard]] long long effects(const std::string& key) const {
        return db->scalar("SELECT count(*) FROM " + service->effects + " WHERE key = $1", {key});
    }
    [[nodiscard]] long long rows_with_prefix(const std::string& prefix) const {
        return db->scalar("SELECT count(*) FROM idem_keys WHERE key LIKE $1", {prefix + "%"});
    }
};

Wire neutral(Service& service, const Raw& raw) {
    http::Request request;
    request.method = raw.method;
    request.target = raw.target;
    for (const auto& [name, value] : raw.headers) request.headers.push_back({name, value});
    request.body = raw.body;
    const idem::Response r = service.dispatch(request);
    return Wire{r.status, r.headers, r.body};
}

bool is_problem(const Wire& w, int status, const std::string& code) {
    return w.status == status && w.header("Content-Type") == "application/problem+json" &&
           w.body.find("\"status\":" + std::to_string(status)) != std::string::npos &&
           w.body.find("\"code\":\"" + code + "\"") != std::string::npos &&
           w.body.find("\"type\":\"") != std::string::npos && w.body.find("\"title\":\"") != std::string::npos;
}

/// A request refused before anything was claimed: the handler did not run, nothing is stored.
void refused(const Env& env, const Wire& w, int status, const std::string& code, const std::string& path,
             const std::string& key) {
    CHECK(is_problem(w, status, code));
    CHECK(env.service->runs(key) == 0);
    CHECK(env.state(path, key).empty());
}

// ---------------------------------------------------------------------------------- the table

struct Row {
    const char* id;
    const char* rule;
    bool http_only;
    std::function<void(Env&)> run;
};

const std::vector<Row>& table() {
    static const std::vector<Row> rows = {
        {"R01", "first request runs the handler once and answers its response", false,
         [](Env& e) {
             const auto k = e.key("R01");
             const Wire w = e.post("/orders", quoted(k));
             CHECK(w.status == 201);
             CHECK(w.body == "{\"order\":1}\0\xff"s);
             CHECK(w.header("X-Order") == "1");
             CHECK_FALSE(w.replayed());
             CHECK(e.service->runs(k) == 1);
             CHECK(e.state("/orders", k) == "completed");
         }},
        {"R02", "a repeat replays status, headers and body byte for byte with Idempotent-Replayed: true", false,
         [](Env& e) {
             const auto k = e.key("R02");
             const Wire first = e.post("/orders", quoted(k));
             const Wire again = e.post("/orders", quoted(k));
             const Wire third = e.post("/orders", quoted(k));
             CHECK(again.status == first.status);
             CHECK(again.body == first.body);
             CHECK(again.header("X-Order") == "1");
             CHECK(again.header("Content-Type") == "application/json");
             CHECK(again.replayed());
             CHECK(third.body == first.body);
             CHECK(e.service->runs(k) == 1);
         }},
        {"R03", "missing key on a route that requires one: 400 problem, nothing stored", false,
         [](Env& e) {
             const Wire w = e.post("/orders", std::nullopt, "missing-R03-" + e.name);
             CHECK(is_problem(w, 400, "missing_idempotency_key"));
             CHECK(w.body.find("draft-ietf-httpapi-idempotency-key-header") != std::string::npos);
         }},
        {"R04", "missing key on a route that does not require one: the handler runs without idempotency", false,
         [](Env& e) {
             const std::string body = "optional-" + e.run_id + e.name;
             CHECK(e.post("/optional", std::nullopt, body).status == 201);
             CHECK(e.post("/optional", std::nullopt, body).status == 201);
             CHECK(e.service->runs(body) == 2);
         }},
        {"R05", "the key is a Structured Field String: a bare token is 400 on an sf-string route", false,
         [](Env& e) {
             const auto k = e.key("R05");
             refused(e, e.post("/strict", k), 400, "invalid_idempotency_key", "/strict", k);
             CHECK(e.post("/strict", quoted(k)).status == 201);
         }},
        {"R06", "malformed sf-strings are 400: no closing quote, bad escape, trailing garbage, a list", false,
         [](Env& e) {
             const auto k = e.key("R06");
             for (const std::string& bad :
                  std::vector<std::string>{"\"" + k, "\"" + k + "\\n\"", quoted(k) + " x", quoted(k) + ", \"b\"",
                                           "\"\"", quoted(k) + ";", quoted(k) + ";A=1"}) {
                 INFO("Idempotency-Key: " << bad);
                 const Wire w = e.post("/orders", bad);
                 CHECK(is_problem(w, 400, "invalid_idempotency_key"));
             }
             // blank: cpp-httplib drops the line (missing), the neutral API sees it (malformed); 400 both
             CHECK(e.post("/orders", "  ").status == 400);
             CHECK(e.service->runs(k) == 0);
             CHECK(e.rows_with_prefix(k) == 0);
         }},
        {"R07", "sf-string escapes and parameters: \"a\\\"b\" is the key a\"b; ;p=1 parameters are ignored", false,
         [](Env& e) {
             const auto k = e.key("R07");
             CHECK(e.post("/orders", "\"" + k + "\\\"q\\\\\"").status == 201);
             CHECK(e.service->runs(k + "\"q\\") == 1);
             const Wire again = e.post("/orders", "\"" + k + "\\\"q\\\\\"" + ";p=1;v=\"x\";t=?1");
             CHECK(again.replayed());
             CHECK(e.service->runs(k + "\"q\\") == 1);
         }},
        {"R08", "bare token form (option): abc and \"abc\" are the same key; a comma is 400", false,
         [](Env& e) {
             const auto k = e.key("R08");
             CHECK(e.post("/token", k).status == 201);
             CHECK(e.post("/token", quoted(k)).replayed());
             CHECK(e.service->runs(k) == 1);
             refused(e, e.post("/token", k + ",x"), 400, "invalid_idempotency_key", "/token", k + ",x");
         }},
        {"R09", "two Idempotency-Key lines: 400, nothing stored", false,
         [](Env& e) {
             const auto k = e.key("R09");
             const Wire w = e.post("/orders", quoted(k), "{}", {{"Idempotency-Key", quoted(k)}});
             refused(e, w, 400, "invalid_idempotency_key", "/orders", k);
         }},
        {"R10", "a key over 255 bytes, or empty: 400", false,
         [](Env& e) {
             const auto k = e.key("R10") + std::string(255, 'x');
             refused(e, e.post("/orders", quoted(k)), 400, "invalid_idempotency_key", "/orders", k);
             refused(e, e.post("/token", k), 400, "invalid_idempotency_key", "/token", k);
         }},
        {"R11", "NUL and control bytes in the key: 400 (never truncated to a shorter key)", false,
         [](Env& e) {
             const auto k = e.key("R11");
             CHECK(e.post("/token", k).status == 201);  // "k" exists: "k\0x" must not replay it
             const Wire nul = e.post("/token", k + "\0x"s);
             CHECK(is_problem(nul, 400, "invalid_idempotency_key"));
             CHECK_FALSE(nul.replayed());
             refused(e, e.post("/token", k + "\x01y"), 400, "invalid_idempotency_key", "/token", k + "\x01y");
             refused(e, e.post("/orders", "\"" + k + "\x1b\""), 400, "invalid_idempotency_key", "/orders", k + "\x1b");
             CHECK(e.service->runs(k) == 1);
             CHECK(e.rows_with_prefix(k) == 1);
         }},
        {"R12", "non-UTF-8 key bytes: 400 in both forms", false,
         [](Env& e) {
             const auto k = e.key("R12") + "\xff\xfe";
             CHECK(is_problem(e.post("/token", k), 400, "invalid_idempotency_key"));
             CHECK(is_problem(e.post("/orders", quoted(k)), 400, "invalid_idempotency_key"));
             CHECK(e.service->runs(k) == 0);
             CHECK(e.rows_with_prefix(e.key("R12")) == 0);
         }},
        {"R13", "UTF-8 bare keys are kept as sent", false,
         [](Env& e) {
             const auto k = e.key("R13") + "-\xc3\xa9t\xc3\xa9";
             CHECK(e.post("/token", k).status == 201);
             CHECK(e.service->runs(k) == 1);
             CHECK(e.state("/token", k) == "completed");
         }},
        {"R14", "same key, another body: 422 problem, the handler does not run", false,
         [](Env& e) {
             const auto k = e.key("R14");
             CHECK(e.post("/orders", quoted(k), "{\"a\":1}").status == 201);
             CHECK(is_problem(e.post("/orders", quoted(k), "{\"a\":2}"), 422, "idempotency_key_reused"));
             CHECK(e.service->runs(k) == 1);
         }},
        {"R15", "same key, another method or target: 422 (default fingerprint: method, target, body)", false,
         [](Env& e) {
             const auto k = e.key("R15");
             CHECK(e.post("/orders?x=1", quoted(k)).status == 201);
             CHECK(is_problem(e.post("/orders?x=2", quoted(k)), 422, "idempotency_key_reused"));
             Raw put{"PUT", "/orders?x=1", {{"Idempotency-Key", quoted(k)}}, "{}"};
             CHECK(is_problem(e.send(put), 422, "idempotency_key_reused"));
             CHECK(e.service->runs(k) == 1);
         }},
        {"R16", "canonical JSON fingerprint: member order and whitespace do not matter, values do", false,
         [](Env& e) {
             const auto k = e.key("R16");
             CHECK(e.post("/json", quoted(k), R"({"a":1,"b":[true,null,"x\u00e9"]})").status == 201);
             CHECK(e.post("/json", quoted(k), " {\n\"b\" : [ true , null , \"x\xc3\xa9\" ] ,\"a\": 1 }\t").replayed());
             CHECK(is_problem(e.post("/json", quoted(k), R"({"a":1.0,"b":[true,null,"x\u00e9"]})"), 422,
                              "idempotency_key_reused"));
             CHECK(e.service->runs(k) == 1);
         }},
        {"R17", "canonical JSON fingerprint: a body that is not strict JSON is 400, key not consumed", false,
         [](Env& e) {
             const auto k = e.key("R17");
             for (const std::string& bad :
                  std::vector<std::string>{"{\"a\":1,\"a\":2}", "{'a':1}", "[1,]", "{\"a\":01}", "\"\xff\"",
                                           "[\"\\ud800\"]", std::string(100, '['), "{} x"}) {
                 refused(e, e.post("/json", quoted(k), bad), 400, "invalid_json_body", "/json", k);
             }
             CHECK(e.post("/json", quoted(k), "{}").status == 201);  // the key was never consumed
         }},
        {"R18", "selected headers are fingerprinted: another X-Tenant is 422", false,
         [](Env& e) {
             const auto k = e.key("R18");
             CHECK(e.post("/headers", quoted(k), "{}", {{"X-Tenant", "a"}}).status == 201);
             CHECK(e.post("/headers", quoted(k), "{}", {{"X-Tenant", "a"}}).replayed());
             CHECK(is_problem(e.post("/headers", quoted(k), "{}", {{"X-Tenant", "b"}}), 422, "idempotency_key_reused"));
             CHECK(is_problem(e.post("/headers", quoted(k), "{}"), 422, "idempotency_key_reused"));
             CHECK(e.service->runs(k) == 1);
         }},
        {"R19", "a user fingerprint function replaces the default (here: body only)", false,
         [](Env& e) {
             const auto k = e.key("R19");
             CHECK(e.post("/custom?v=1", quoted(k)).status == 201);
             CHECK(e.post("/custom?v=2", quoted(k)).replayed());
             CHECK(e.service->runs(k) == 1);
         }},
        {"R20", "concurrent duplicate while in flight: 409 problem + Retry-After in whole seconds", false,
         [](Env& e) {
             const auto k = e.key("R20");
             e.service->close_gate();
             std::thread first([&] { (void)e.post("/slow", quoted(k)); });
             while (e.service->waiting() == 0) std::this_thread::sleep_for(1ms);
             const Wire dup = e.post("/slow", quoted(k));
             e.service->open_gate();
             first.join();
             CHECK(is_problem(dup, 409, "in_progress"));
             const std::string ra = dup.header("Retry-After");
             CHECK(!ra.empty());
             CHECK(ra.find_first_not_of("0123456789") == std::string::npos);
             CHECK(std::stoi(ra) >= 1);
             CHECK(e.service->runs(k) == 1);
             CHECK(e.post("/slow", quoted(k)).replayed());
         }},
        {"R21", "8 concurrent requests with one key: the handler runs once; every 2xx is the same bytes", false,
         [](Env& e) {
             const auto k = e.key("R21");
             std::vector<Wire> got(8);
             idem_test::run_threads(8, [&](int t) { got[static_cast<std::size_t>(t)] = e.post("/orders", quoted(k)); });
             const Wire last = e.post("/orders", quoted(k));
             CHECK(e.service->runs(k) == 1);
             for (const Wire& w : got) {
                 CHECK((w.status == 201 || w.status == 409));
                 if (w.status == 201) CHECK(w.body == last.body);
                 if (w.status == 409) CHECK(!w.header("Retry-After").empty());
             }
             CHECK(last.replayed());
         }},
        {"R22", "business errors (402) are stored and replayed (Stripe's rule, the default)", false,
         [](Env& e) {
             const auto k = e.key("R22");
             const Wire first = e.post("/decline", quoted(k));
             CHECK(first.status == 402);
             const Wire again = e.post("/decline", quoted(k));
             CHECK((again.status == 402 && again.replayed() && again.body == first.body));
             CHECK(e.service->runs(k) == 1);
         }},
        {"R23", "a 5xx the handler returns is stored and replayed under the default policy", false,
         [](Env& e) {
             const auto k = e.key("R23");
             CHECK(e.post("/error500", quoted(k)).status == 500);
             CHECK(e.post("/error500", quoted(k)).replayed());
             CHECK(e.service->runs(k) == 1);
         }},
        {"R24", "policy server_errors_unknown: a 5xx is sent, the key stays in progress (409 after)", false,
         [](Env& e) {
             const auto k = e.key("R24");
             const Wire w = e.post("/unknown5xx", quoted(k));
             CHECK((w.status == 502 && w.body == "bad gateway" && !w.replayed()));
             CHECK(e.state("/unknown5xx", k) == "in_progress");
             CHECK(is_problem(e.post("/unknown5xx", quoted(k)), 409, "in_progress"));
             CHECK(e.service->runs(k) == 1);
         }},
        {"R25", "policy success_only: a non-2xx releases the key; the retry runs again", false,
         [](Env& e) {
             const auto k = e.key("R25");
             CHECK(e.post("/success-only", quoted(k)).status == 400);
             CHECK(e.state("/success-only", k).empty());
             CHECK(e.post("/success-only", quoted(k)).status == 400);
             CHECK(e.service->runs(k) == 2);
         }},
        {"R26", "handler throws http::not_performed (429): its response is sent, the key released", false,
         [](Env& e) {
             const auto k = e.key("R26");
             const Wire w = e.post("/ratelimit", quoted(k));
             CHECK((w.status == 429 && w.body == "slow down" && w.header("Retry-After") == "7"));
             CHECK(e.state("/ratelimit", k).empty());
             CHECK(e.post("/ratelimit", quoted(k)).status == 429);
             CHECK(e.service->runs(k) == 2);
         }},
        {"R27", "handler throws idem::not_performed: 503 + Retry-After, key released", false,
         [](Env& e) {
             const auto k = e.key("R27");
             const Wire w = e.post("/notperformed", quoted(k));
             CHECK(is_problem(w, 503, "not_performed"));
             CHECK(w.header("Retry-After") == "1");
             CHECK(e.state("/notperformed", k).empty());
         }},
        {"R28", "handler throws anything else: 503 outcome_unknown + Retry-After, key kept in progress", false,
         [](Env& e) {
             const auto k = e.key("R28");
             const Wire w = e.post("/throw", quoted(k));
             CHECK(is_problem(w, 503, "outcome_unknown"));
             CHECK(w.header("Retry-After") == "2");
             CHECK(e.state("/throw", k) == "in_progress");
             CHECK(is_problem(e.post("/throw", quoted(k)), 409, "in_progress"));
             CHECK(e.service->runs(k) == 1);
             CHECK(e.service->told(k));
         }},
        {"R29", "store unavailable: 503 store_unavailable + Retry-After, handler not called", false,
         [](Env& e) {
             const auto k = e.key("R29");
             const Wire w = e.post("/down", quoted(k));
             CHECK(is_problem(w, 503, "store_unavailable"));
             CHECK(w.header("Retry-After") == "3");
             CHECK(e.service->runs(k) == 0);
         }},
        {"R30", "configuration error (no such table): 500, handler not called", false,
         [](Env& e) {
             const auto k = e.key("R30");
             CHECK(is_problem(e.post("/misconfigured", quoted(k)), 500, "internal_error"));
             CHECK(e.service->runs(k) == 0);
         }},
        {"R31", "lease lost (a reconciler saved meanwhile): its stored answer is replayed", false,
         [](Env& e) {
             const auto k = e.key("R31");
             const Wire w = e.post("/lease-lost", quoted(k));
             CHECK((w.status == 201 && w.body == "from the reconciler" && w.replayed()));
             CHECK(e.post("/lease-lost", quoted(k)).body == "from the reconciler");
             CHECK(e.service->runs(k) == 1);
         }},
        {"R43", "lease lost and the record does not read: 409 in_progress, the failed read logged", false,
         [](Env& e) {
             const auto k = e.key("R43");
             const Wire w = e.post("/lease-lost-unread", quoted(k));
             CHECK(is_problem(w, 409, "in_progress"));
             CHECK(w.header("Retry-After") == "1");
             CHECK(e.service->runs(k) == 1);
             CHECK(e.service->told(k, "idem::http: read after lease_lost: "));
         }},
        {"R32",
         "response larger than the store's limit (response_not_saved): sent as produced, not stored, "
         "key kept in progress",
         false,
         [](Env& e) {
             const auto k = e.key("R32");
             const Wire w = e.post("/big", quoted(k));
             CHECK((w.status == 201 && w.body.size() == kMaxResult + 1 && !w.replayed()));
             CHECK(e.state("/big", k) == "in_progress");
             CHECK(is_problem(e.post("/big", quoted(k)), 409, "in_progress"));
             CHECK(e.service->runs(k) == 1);
         }},
        {"R33", "corrupt stored record: 500, the handler does not run", false,
         [](Env& e) {
             const auto k = e.key("R33");
             CHECK(e.post("/orders", quoted(k)).status == 201);
             e.db->exec("UPDATE idem_keys SET result = '\\x00ff'::bytea WHERE scope = $1 AND key = $2",
                        {"conformance:/orders", k});
             CHECK(is_problem(e.post("/orders", quoted(k)), 500, "internal_error"));
             CHECK(e.service->runs(k) == 1);
         }},
        {"R34", "retention per route, advertised in a response header (executed and replayed)", false,
         [](Env& e) {
             const auto k = e.key("R34");
             CHECK(e.post("/retention", quoted(k)).header("Idempotency-Retention") == "3600");
             CHECK(e.post("/retention", quoted(k)).header("Idempotency-Retention") == "3600");
             const auto left = e.db->scalar(
                 "SELECT extract(epoch FROM expires_at - created_at)::bigint FROM idem_keys WHERE scope = $1 AND key = "
                 "$2",
                 {"conformance:/retention", k});
             CHECK(left == 3600);
         }},
        {"R35", "a route renders its own problem bodies (Route::render_problem); Retry-After still added", false,
         [](Env& e) {
             const Wire w = e.post("/rendered", std::nullopt);
             CHECK((w.status == 400 && w.body == "{\"error\":\"missing_idempotency_key\"}"));
             CHECK(w.header("Content-Type") == "application/json");
         }},
        {"R36", "empty body: an ordinary request (fingerprinted as empty), replayed", false,
         [](Env& e) {
             const auto k = e.key("R36");
             CHECK(e.post("/json", quoted(k), "").status == 201);
             CHECK(e.post("/json", quoted(k), "").replayed());
             CHECK(is_problem(e.post("/json", quoted(k), "{}"), 422, "idempotency_key_reused"));
             CHECK(e.service->runs(k) == 1);
         }},
        {"R37", "request body larger than the stored-response limit: fingerprinted, runs once", false,
         [](Env& e) {
             const auto k = e.key("R37");
             const std::string body(kMaxResult * 2, 'b');
             CHECK(e.post("/orders", quoted(k), body).status == 201);
             CHECK(e.post("/orders", quoted(k), body).replayed());
             CHECK(e.service->runs(k) == 1);
         }},
        {"R39",
         "handler throws an idem error (database_error, store_unavailable from its Context calls): "
         "503 outcome_unknown, key kept, Retry-After at least 1",
         false,
         [](Env& e) {
             for (const std::string path : {"/throw-db", "/throw-down"}) {
                 INFO(path);
                 const auto k = e.key("R39") + path;
                 const Wire w = e.post(path, quoted(k));
                 CHECK(is_problem(w, 503, "outcome_unknown"));
                 CHECK(w.header("Retry-After") == "1");
                 CHECK(e.state(path, k) == "in_progress");
                 CHECK(is_problem(e.post(path, quoted(k)), 409, "in_progress"));
                 CHECK(e.service->runs(k) == 1);
                 CHECK(e.service->told(k, "outcome unknown"));
             }
         }},
        {"R40", "a storage policy that throws: 503 outcome_unknown, key kept (the effect ran)", false,
         [](Env& e) {
             const auto k = e.key("R40");
             CHECK(is_problem(e.post("/policy-throws", quoted(k)), 503, "outcome_unknown"));
             CHECK(e.state("/policy-throws", k) == "in_progress");
             CHECK(e.service->runs(k) == 1);
         }},
        {"R41", "a response header with CR, LF or NUL: 500, neither stored nor sent, key kept in progress", false,
         [](Env& e) {
             for (const std::string path : {"/bad-header", "/bad-header-nul"}) {
                 INFO(path);
                 const auto k = e.key("R41") + path;
                 const Wire w = e.post(path, quoted(k));
                 CHECK(is_problem(w, 500, "internal_error"));
                 CHECK(w.header("Set-Cookie").empty());
                 CHECK(w.header("X-Split").empty());
                 CHECK(e.state(path, k) == "in_progress");
                 CHECK(is_problem(e.post(path, quoted(k)), 409, "in_progress"));
                 CHECK(e.service->runs(k) == 1);
             }
         }},
        {"R42", "no key on an optional-key route, and the handler uses its Context: 500 (no claim behind it)", false,
         [](Env& e) {
             const std::string body = "optional-phase-" + e.run_id + e.name;
             CHECK(is_problem(e.post("/optional-phase", std::nullopt, body), 500, "internal_error"));
             CHECK(e.service->runs(body) == 1);
         }},
        {"R38", "a custom fingerprint may refuse the request (400) before anything is claimed", false,
         [](Env& e) {
             const auto k = e.key("R38");
             const Wire w = e.post("/custom", quoted(k), "reject");
             CHECK((w.status == 400 && w.body == "unreadable body"));
             CHECK(e.state("/custom", k).empty());
             CHECK(e.post("/custom", quoted(k), "fine").status == 201);
             CHECK(e.service->runs(k) == 1);
         }},
        // --- in-transaction mode (idem/http/transaction.hpp) ------------------------------------
        {"T01", "in-transaction: the effect and the stored response commit together; replayed byte for byte", false,
         [](Env& e) {
             const auto k = e.key("T01");
             const Wire first = e.post("/tx", quoted(k));
             CHECK((first.status == 201 && first.body == "tx 1" && first.header("X-Tx") == "1"));
             const Wire again = e.post("/tx", quoted(k));
             CHECK((again.status == 201 && again.body == first.body && again.replayed()));
             CHECK(e.effects(k) == 1);
             CHECK(e.service->runs(k) == 1);
         }},
        {"T02",
         "in-transaction with TransactionOptions::lock_wait: a duplicate while the transaction is open gets 409 "
         "+ Retry-After at once",
         false,
         [](Env& e) {
             const auto k = e.key("T02");
             e.service->close_gate();
             std::thread first([&] { (void)e.post("/tx-slow", quoted(k)); });
             while (e.service->waiting() == 0) std::this_thread::sleep_for(1ms);
             const auto t0 = std::chrono::steady_clock::now();
             const Wire dup = e.post("/tx-slow", quoted(k));
             const auto took = std::chrono::steady_clock::now() - t0;
             e.service->open_gate();
             first.join();
             CHECK(is_problem(dup, 409, "in_progress"));
             CHECK(!dup.header("Retry-After").empty());
             CHECK(took < 2s);  // the store's lock_timeout (1 s) x claim_attempts (3) is what waiting costs
             CHECK(e.service->runs(k) == 1);
             CHECK(e.effects(k) == 1);
             CHECK(e.post("/tx-slow", quoted(k)).replayed());
         }},
        {"T03", "in-transaction: a handler that throws rolls everything back (500), the key is free again", false,
         [](Env& e) {
             const auto k = e.key("T03");
             CHECK(is_problem(e.post("/tx-throw", quoted(k)), 500, "internal_error"));
             CHECK(e.state("/tx-throw", k).empty());
             CHECK(e.effects(k) == 0);
             CHECK(is_problem(e.post("/tx-throw", quoted(k)), 500, "internal_error"));
             CHECK(e.service->runs(k) == 2);
         }},
        {"T05",
         "in-transaction: TransactionOptions::lock_wait not below statement_timeout is refused (500), nothing runs",
         false,
         [](Env& e) {
             const auto k = e.key("T05");
             refused(e, e.post("/tx-lockwait", quoted(k)), 500, "internal_error", "/tx-lockwait", k);
             CHECK(e.effects(k) == 0);
         }},
        {"T04", "in-transaction: the key is always required (400)", false,
         [](Env& e) {
             CHECK(is_problem(e.post("/tx", std::nullopt, "T04" + e.name), 400, "missing_idempotency_key"));
         }},
        // --- over the wire only -------------------------------------------------------------------
        {"H01", "a 10 MB Idempotency-Key header: cpp-httplib answers 400 itself, nothing runs", true,
         [](Env& e) {
             const std::string k = e.key("H01") + std::string(10u << 20, 'a');
             const Wire w = e.post("/orders", quoted(k));
             CHECK(w.status == 400);
             CHECK(e.rows_with_prefix(e.key("H01")) == 0);
         }},
        {"H02", "a body over the server's payload limit: 413 from cpp-httplib, nothing runs", true,
         [](Env& e) {
             const auto k = e.key("H02");
             CHECK(e.post("/orders", quoted(k), std::string(2u << 20, 'b')).status == 413);
             CHECK(e.service->runs(k) == 0);
             CHECK(e.state("/orders", k).empty());
         }},
        {"H03", "cpp-httplib 0.11 percent-decodes header values: a key still holding '%' is 400", true,
         [](Env& e) {
             const auto k = e.key("H03");
             refused(e, e.post("/token", k + "50%off"), 400, "invalid_idempotency_key", "/token", k + "50%off");
             refused(e, e.post("/token", k + "%2541"), 400, "invalid_idempotency_key", "/token", k + "%41");
             // a quote decoded from %22 breaks the sf-string: refused, not misread
             refused(e, e.post("/orders", "\"" + k + "%22x\""), 400, "invalid_idempotency_key", "/orders", k);
         }},
        {"H04", "cpp-httplib 0.11 limitation (documented): k%41 reaches idem as kA", true,
         [](Env& e) {
             const auto k = e.key("H04");
             CHECK(e.post("/token", k + "A").status == 201);
             CHECK(e.post("/token", k + "%41").replayed());  // the limitation docs/http.md states
             CHECK(e.service->runs(k + "A") == 1);
         }},
        // --- Boost.Beast's own (the beast transport only) -----------------------------------------
        {"B01", "Beast refuses a header value with NUL or control bytes itself (400): nothing runs", true,
         [](Env& e) {
             const auto k = e.key("B01");
             for (const std::string& bad : {k + "\0x"s, k + "\x01y", "\"" + k + "\x1b\""}) {
                 const Wire w = e.post("/token", bad);
                 CHECK(w.status == 400);
                 CHECK(w.header("Content-Type").empty());  // Beast's parser error, not a problem body
             }
             CHECK(e.rows_with_prefix(k) == 0);
         }},
        {"B02", "Beast keeps header values as sent: k%41 and kA are two keys", true,
         [](Env& e) {
             const auto k = e.key("B02");
             CHECK(e.post("/token", k + "A").status == 201);
             const Wire encoded = e.post("/token", k + "%41");
             CHECK((encoded.status == 201 && !encoded.replayed()));
             CHECK(e.service->runs(k + "A") == 1);
             CHECK(e.service->runs(k + "%41") == 1);
         }},
        {"B03", "a body over the Beast server's limit (1 MB): 413 from the server, nothing runs", true,
         [](Env& e) {
             const auto k = e.key("B03");
             CHECK(e.post("/orders", quoted(k), std::string(2u << 20, 'b')).status == 413);
             CHECK(e.service->runs(k) == 0);
             CHECK(e.state("/orders", k).empty());
         }},
    };
    return rows;
}

/// Whether `env` runs `row`: in-transaction rows (T*) have no asynchronous counterpart; H* rows are
/// cpp-httplib's, B* rows Beast's; R11's control bytes never pass Beast's parser (B01 instead).
bool runs_on(const Env& env, const Row& row) {
    const std::string id = row.id;
    if (env.name == "beast") return id[0] == 'B' || (id[0] == 'R' && id != "R11");
    if (id[0] == 'B') return false;
    return !row.http_only || env.over_http;
}

using idem_test::require_db;

}  // namespace

TEST_CASE("Idempotency-Key conformance: every row, through the neutral API and over HTTP (cpp-httplib)",
          "[http][conformance]") {
    const std::string url = require_db();
    idem::PostgresOptions options;
    options.max_result_bytes = kMaxResult;
    options.pool_size = 12;
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    idem::PostgresOptions down_options;
    down_options.connect_timeout = 500ms;
    down_options.claim_attempts = 1;
    idem::PostgresStore down("host=127.0.0.1 port=1 dbname=none connect_timeout=1", down_options);
    idem::PostgresOptions missing_options;
    missing_options.table = "idem_no_such_table";
    idem::PostgresStore misconfigured(url, missing_options);
    idem_test::PgConn db(url);

    const std::string effects = idem_test::unique_name("http_tx_effects");
    db.exec("CREATE TABLE " + effects + " (key text NOT NULL)");
    idem_test::DropTable drop_effects(url, effects);
    Service service(store, down, misconfigured, effects, db);
    http_test::Server server([&](const httplib::Request& req, httplib::Response& res) {
        http::httplib::send(service.dispatch(http::httplib::view(req)), res);
    });
    const std::string run_id = std::to_string(::getpid()) + "-" +
                               std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000);

    Env neutral_env{"neutral", false, [&](const Raw& raw) { return neutral(service, raw); }, &service, &db, run_id};
    Env http_env{"httplib", true, [&](const Raw& raw) { return http_test::exchange(server.port(), raw); },
                 &service,  &db,  run_id};
    std::vector<Env*> envs{&neutral_env, &http_env};

#ifdef IDEM_TEST_BEAST
    // The same service over Beast + async_respond: stores like the blocking ones, on one event loop.
    boost::asio::io_context io;
    boost::asio::thread_pool pool(16);  // the handlers' blocking parts (gates, sleeps)
    idem::asio::AsyncPostgresStore async_store(io.get_executor(), url, options);
    idem::asio::AsyncPostgresStore async_down(io.get_executor(), "host=127.0.0.1 port=1 dbname=none connect_timeout=1",
                                              down_options);
    idem::asio::AsyncPostgresStore async_misconfigured(io.get_executor(), url, missing_options);
    http_test::BeastServer beast(io, [&](const http::Request& request) {
        return service.dispatch_async(async_store, async_down, async_misconfigured, pool, request);
    });
    Env beast_env{"beast",  true, [&](const Raw& raw) { return http_test::exchange(beast.port(), raw); },
                  &service, &db,  run_id};
    envs.push_back(&beast_env);
#endif

    for (Env* env : envs) {
        for (const Row& row : table()) {
            if (!runs_on(*env, row)) continue;
            DYNAMIC_SECTION(env->name << " " << row.id << ": " << row.rule) { row.run(*env); }
        }
    }
}

TEST_CASE("Idempotency-Key parsing and JSON canonical form (no database)", "[http][unit]") {
    using http::KeyForm;
    CHECK(http::parse_key("\"abc\"", KeyForm::sf_string) == "abc");
    CHECK(http::parse_key("  \"a b\"  ", KeyForm::sf_string) == "a b");
    CHECK(http::parse_key("\"a\\\\b\\\"c\"", KeyForm::sf_string) == "a\\b\"c");
    CHECK(http::parse_key("\"k\";a=1;b;c=?0;d=tok/x:y;e=:aGk=:;f=-1.5", KeyForm::sf_string) == "k");
    CHECK_FALSE(http::parse_key("abc", KeyForm::sf_string));
    CHECK(http::parse_key("abc", KeyForm::sf_string_or_token) == "abc");
    CHECK_FALSE(http::parse_key("\"k\";a=1.2345", KeyForm::sf_string));
    CHECK_FALSE(http::parse_key("\"k\";=1", KeyForm::sf_string));
    CHECK_FALSE(http::parse_key("\"k\" ;a", KeyForm::sf_string));
    CHECK_FALSE(http::parse_key("\"\xc3\xa9\"", KeyForm::sf_string));
    CHECK_FALSE(http::parse_key("a,b", KeyForm::sf_string_or_token));
    CHECK_FALSE(http::parse_key("", KeyForm::sf_string_or_token));

    CHECK(http::canonical_json(R"( {"b":1, "a":{"d":[1,2], "c":"\u0041\n\/"}} )") ==
          R"({"a":{"c":"A\n/","d":[1,2]},"b":1})");
    CHECK(http::canonical_json(R"("\ud83d\ude00")") == "\"\xf0\x9f\x98\x80\"");
    CHECK(http::canonical_json("-0.5e+10") == "-0.5e+10");
    CHECK(http::canonical_json("[\"\\u0001\"]") == "[\"\\u0001\"]");
    CHECK_FALSE(http::canonical_json(""));
    CHECK_FALSE(http::canonical_json("1."));
    CHECK_FALSE(http::canonical_json("[\"\\udc00\"]"));
    CHECK_FALSE(http::canonical_json("\"a\x01\""));
    CHECK_FALSE(http::canonical_json("tru"));
    CHECK(http::canonical_json(std::string(64, '[') + std::string(64, ']')));
    CHECK_FALSE(http::canonical_json(std::string(65, '[') + std::string(65, ']')));

    CHECK(http::retry_after_seconds(0ms).count() == 1);
    CHECK(http::retry_after_seconds(1000ms).count() == 1);
    CHECK(http::retry_after_seconds(1001ms).count() == 2);
    CHECK(http::retry_after_seconds(-5ms).count() == 1);
    CHECK(http::retry_after_seconds(std::chrono::milliseconds::max()).count() ==
          std::chrono::milliseconds::max().count() / 1000 + 1);
    const http::Route route;
    for (const auto wait : {0s, -3s}) CHECK(http::problem_response(route, {}, wait).headers.back().second == "1");
}
