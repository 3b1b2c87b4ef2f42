// payments-server — the reference article's payments endpoint, in C++ over idem: Boost.Beast and
// idem::asio on one event-loop thread, the fake gateway's ledger on asynchronous connections of
// its own.
//
//   payments-server --listen 127.0.0.1:8080 --db "host=/run/postgresql dbname=app"
//                   [--gateway-latency-ms N] [--lease-ms N] [--reconcile-every-ms N]
//                   [--rate-limit-per-second N] [--threads N] [--db-pool N]
//
// Several instances may share one database; any request may land on any of them. Each instance:
//   POST /payments           the idempotent payment endpoint (see README.md for every status code)
//   GET  /gateway/charges    the fake gateway's ledger for ?idempotency_key=K[&account=A]
//   GET  /healthz            200 once the server accepts requests
//   GET  /metrics            idem's Prometheus metrics for this instance (idem::PrometheusObserver)
// and runs a reconciler thread that settles keys left in progress (a gateway timeout, a crash)
// by asking the gateway what happened. SIGTERM / SIGINT stop it cleanly (exit status 0).
// --listen must be a loopback address; port 0 picks a free port. The one line written to stdout is
// "listening on http://HOST:PORT"; everything else goes to stderr.
//
// Threads: one runs the event loop — every HTTP connection, every idem call
// (AsyncPostgresStore), every gateway and rate-limit statement (AsyncPgPool) — so nothing on it
// needs a lock and no thread waits for the database. The reconciler has a thread of its own with
// blocking connections (store.blocking(), a FakeGateway on a PgPool of two).
#include "async_gateway.hpp"
#include "gateway.hpp"
#include "http_listener.hpp"
#include "idem/asio/store.hpp"
#include "idem/http/asio.hpp"
#include "idem/http/beast.hpp"
#include "idem/idem.hpp"
#include "lease_keeper.hpp"
#include "payment.hpp"
#include "reconciler_thread.hpp"
#include "server_log.hpp"

#include <arpa/inet.h>
#include <signal.h>
#include <sys/socket.h>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

using payments::log;

// -------------------------------------------------------------------------------------------
// options

struct Options {
    std::string host;
    int port = -1;
    std::string db;
    milliseconds gateway_latency{0};
    milliseconds lease{30'000};
    milliseconds reconcile_every{1'000};
    std::int64_t rate_limit_per_second = 0;  // 0: off
    std::size_t threads = 128;
    std::size_t db_pool = 2;
    std::size_t gateway_pool = 32;
    std::size_t replay_cache_mb = 64;  // 0: off
    bool group_commit = true;
};

[[noreturn]] void usage(int status) {
    (status == 0 ? std::cout : std::cerr)
        << "usage: payments-server --listen 127.0.0.1:PORT --db CONNINFO [--gateway-latency-ms N]\n"
           "                       [--lease-ms N] [--reconcile-every-ms N] "
           "[--rate-limit-per-second N]\n"
           "                       [--threads N] [--db-pool N] [--gateway-pool N] [--replay-cache-mb N]\n"
           "                       [--group-commit on|off]\n"
           "  --listen              loopback address and port (port 0: any free port)\n"
           "  --db                  libpq connection string shared by every instance\n"
           "  --gateway-latency-ms  simulated card-gateway latency, 0..4000 (default 0)\n"
           "  --lease-ms            how long a claim owns its key before the reconciler may settle "
           "it (30000)\n"
           "  --reconcile-every-ms  reconciler period (1000)\n"
           "  --rate-limit-per-second  per-account limit across all instances (default 0: off)\n"
           "  --threads             HTTP connections served at once (128)\n"
           "  --db-pool             database connections for idem (2; group commit fills them)\n"
           "  --gateway-pool        database connections for the fake gateway and the rate limit (32)\n"
           "  --replay-cache-mb     in-process replay cache for completed keys, MiB (64; 0: off)\n"
           "  --group-commit        claims and saves that find every idem connection busy share "
           "transactions (on)\n";
    std::exit(status);
}

[[noreturn]] void bad_option(const std::string& message) {
    std::cerr << "payments-server: " << message << "\n";
    usage(2);
}

std::int64_t parse_int(std::string_view name, std::string_view text, std::int64_t min, std::int64_t max) {
    std::int64_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size() || value < min || value > max) {
        bad_option(std::string(name) + ": expected an integer in [" + std::to_string(min) + ", " + std::to_string(max) +
                   "], got '" + std::string(text) + "'");
    }
    return value;
}

bool is_loopback(const std::string& host) {
    in_addr v4{};
    if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
    in6_addr v6{};
    if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
    return false;
}

Options parse_options(int argc, char** argv) {
    Options o;
    std::string listen;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        if (arg == "-h" || arg == "--help") usage(0);
        std::string value;
        if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string::npos) {
            value = arg.substr(eq + 1);
            arg.resize(eq);
        } else if (i + 1 < argc) {
            value = argv[++i];
        } else {
            bad_option(arg + " needs a value");
        }
        if (arg == "--listen") listen = value;
        else if (arg == "--db") o.db = value;
        else if (arg == "--gateway-latency-ms") o.gateway_latency = milliseconds(parse_int(arg, value, 0, 4000));
        else if (arg == "--lease-ms") o.lease = milliseconds(parse_int(arg, value, 50, 86'400'000));
        else if (arg == "--reconcile-every-ms") o.reconcile_every = milliseconds(parse_int(arg, value, 10, 3'600'000));
        else if (arg == "--rate-limit-per-second") o.rate_limit_per_second = parse_int(arg, value, 0, 1'000'000'000);
        else if (arg == "--threads") o.threads = static_cast<std::size_t>(parse_int(arg, value, 1, 1024));
        else if (arg == "--db-pool") o.db_pool = static_cast<std::size_t>(parse_int(arg, value, 1, 256));
        else if (arg == "--gateway-pool") o.gateway_pool = static_cast<std::size_t>(parse_int(arg, value, 1, 256));
        else if (arg == "--replay-cache-mb")
            o.replay_cache_mb = static_cast<std::size_t>(parse_int(arg, value, 0, 1 << 20));
        else if (arg == "--group-commit") {
            if (value != "on" && value != "off") bad_option("--group-commit: expected on or off, got '" + value + "'");
            o.group_commit = value == "on";
        } else bad_option("unknown option " + arg);
    }
    if (listen.empty()) bad_option("--listen is required");
    if (o.db.empty()) bad_option("--db is required");
    const auto colon = listen.rfind(':');
    if (colon == std::string::npos) bad_option("--listen: expected HOST:PORT");
    o.host = listen.substr(0, colon);
    if (o.host.size() >= 2 && o.host.front() == '[' && o.host.back() == ']')
        o.host = o.host.substr(1, o.host.size() - 2);
    if (o.host == "localhost") o.host = "127.0.0.1";
    o.port = static_cast<int>(parse_int("--listen port", std::string_view(listen).substr(colon + 1), 0, 65535));
    if (!is_loopback(o.host))
        bad_option("--listen: '" + o.host + "' is not a loopback address; this example only listens on loopback");
    return o;
}

// ------------------------------------------------------------------------------------------
// helpers

namespace asio = boost::asio;
namespace http = boost::beast::http;

const std::string kJson = "application/json";

// A request starts its gateway call within this budget or not at all (503, key released) ...
constexpr milliseconds kChargeStartBudget = 5s;
// ... and the gateway answers within this (its statement_timeout), or the outcome is unknown.
constexpr milliseconds kGatewayTimeout = 2s;
// So a key in progress with no charge this long after its claim will never get one: release it.
constexpr milliseconds kReleaseAfter = kChargeStartBudget + kGatewayTimeout + 1s;

idem::Response reply(int status, std::string body) {
    return idem::Response{status, std::move(body), {{"Content-Type", kJson}}};
}

idem::Response reply_retry(int status, std::string body, milliseconds after) {
    idem::Response response = reply(status, std::move(body));
    const auto seconds = std::max<std::int64_t>(1, (after.count() + 999) / 1000);
    response.headers.emplace_back("Retry-After", std::to_string(seconds));
    return response;
}

std::string_view sv(boost::beast::string_view s) { return {s.data(), s.size()}; }

// The value of `name` in a query string ("a=1&b=x%20y"), percent-decoded ('+' is a space), or
// nullopt when it is absent.
std::optional<std::string> query_param(std::string_view query, std::string_view name) {
    const auto hex = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        return -1;
    };
    while (!query.empty()) {
        const auto amp = query.find('&');
        const std::string_view pair = query.substr(0, amp);
        query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
        const auto eq = pair.find('=');
        if (pair.substr(0, eq) != name) continue;
        const std::string_view raw = eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1);
        std::string value;
        for (std::size_t i = 0; i < raw.size(); ++i) {
            if (raw[i] == '+') {
                value += ' ';
            } else if (raw[i] == '%' && i + 2 < raw.size() + 0 && hex(raw[i + 1]) >= 0 && hex(raw[i + 2]) >= 0) {
                value += static_cast<char>(hex(raw[i + 1]) * 16 + hex(raw[i + 2]));
                i += 2;
            } else {
                value += raw[i];
            }
        }
        return value;
    }
    return std::nullopt;
}

// What group commit did, in the Prometheus text format, after the observer's metrics: the shared
// transactions it sent for claims and for saves, the calls they carried, and the save calls. A claim
// or save outside a group is a transaction of its own, so idem's transactions are claims - grouped
// claims + claim groups, and the same for saves: scrapes before and after a load tell how many
// commits each request cost.
std::string group_commit_metrics(const idem::asio::AsyncPostgresStore& store) {
    const idem::StoreStats calls = store.stats();
    const idem::GroupCommitStats groups = store.group_commit_stats();
    std::string out;
    const auto counter = [&out](std::string_view name, std::string_view help, std::uint64_t value) {
        out.append("# HELP ").append(name).append(" ").append(help).append("\n");
        out.append("# TYPE ").append(name).append(" counter\n");
        out.append(name).append(" ").append(std::to_string(value)).append("\n");
    };
    counter("payments_store_saves_total", "save() calls of idem's store.", calls.saves);
    counter("payments_group_commit_claim_groups_total", "Shared transactions group commit sent for claims.",
            groups.claim_groups);
    counter("payments_group_commit_grouped_claims_total", "Claims sent in those shared transactions.",
            groups.grouped_claims);
    counter("payments_group_commit_save_groups_total", "Shared transactions group commit sent for saves.",
            groups.save_groups);
    counter("payments_group_commit_grouped_saves_total", "Saves sent in those shared transactions.",
            groups.grouped_saves);
    return out;
}

// ------------------------------------------------------------------------------------- the service

struct Service {
    idem::asio::AsyncPostgresStore& store;
    payments::AsyncGateway& gateway;
    payments::AsyncRateLimiter* limiter;  // null: no rate limit
    idem::http::Route route;              // the Idempotency-Key rules (make_route)
    milliseconds charge_start_budget;
    milliseconds lease;  // a claim's; kept from the gateway call until the save (LeaseKeeper)
    std::shared_ptr<idem::PrometheusObserver> metrics;

    asio::awaitable<idem::Response> handle(const payments::HttpRequest& req) const;
    asio::awaitable<idem::Response> post_payment(const payments::HttpRequest& req) const;
    asio::awaitable<idem::Response> get_charges(std::string_view query) const;
};

// What idem::http does for POST /payments: keys as the draft's "…" or bare (clients send UUIDs),
// the body validated (400, nothing claimed) and fingerprinted by the fields it says, so JSON member
// order and whitespace do not matter; errors as this API's {"error": code} bodies.
idem::http::Route make_route(const idem::ClaimOptions& claim, milliseconds lease) {
    idem::http::Route route;
    route.key_form = idem::http::KeyForm::sf_string_or_token;
    route.claim = claim;
    route.fingerprint.custom = [](const idem::http::Request& request) {
        std::string problem;
        const auto payment = payments::parse_payment_request(request.body, problem);
        if (!payment) {
            throw idem::http::not_performed(
                idem::Response{400, payments::error_body("invalid_request", problem), {{"Content-Type", kJson}}});
        }
        return payments::payment_fingerprint(*payment);
    };
    route.unknown_retry_after = idem::http::retry_after_seconds(lease);
    route.render_problem = [](const idem::http::Problem& p) {
        const std::string detail = p.status < 500 ? p.detail : std::string();
        return idem::Response{p.status, payments::error_body(p.code, detail), {{"Content-Type", kJson}}};
    };
    route.log = [](std::string_view line) { log(line); };
    return route;
}

asio::awaitable<idem::Response> Service::handle(const payments::HttpRequest& req) const {
    const std::string_view target = sv(req.target());
    const auto question = target.find('?');
    const std::string_view path = target.substr(0, question);
    const std::string_view query =
        question == std::string_view::npos ? std::string_view() : target.substr(question + 1);
    const bool get = req.method() == http::verb::get;
    if (path == "/payments" && req.method() == http::verb::post) co_return co_await post_payment(req);
    if (path == "/gateway/charges" && get) co_return co_await get_charges(query);
    if (path == "/healthz" && get) co_return reply(200, "{\"status\":\"ok\"}");
    if (path == "/metrics" && get) {
        // On the event loop's thread: the observer and the store's figures are read from atomics
        // and locks never held across a wait.
        co_return idem::Response{200,
                                 metrics->render() + group_commit_metrics(store),
                                 {{"Content-Type", std::string(idem::PrometheusObserver::content_type)}}};
    }
    co_return reply(404, payments::error_body("not_found"));
}

asio::awaitable<idem::Response> Service::post_payment(const payments::HttpRequest& req) const {
    // 1. Who is paying. The account scopes every key: one account never sees another's keys.
    const auto account = payments::bearer_account(sv(req[http::field::authorization]));
    if (!account) {
        idem::Response unauthorized =
            reply(401, payments::error_body("unauthorized", "send Authorization: Bearer <account>"));
        unauthorized.headers.emplace_back("WWW-Authenticate", "Bearer");
        co_return unauthorized;
    }
    // 2. Rate limit, before anything is claimed: a 429 never consumes the key.
    if (limiter != nullptr) {
        std::optional<bool> allowed;
        try {
            auto asking = limiter->allow(*account);  // (no temporary in a co_await expression: GCC 12)
            allowed = co_await std::move(asking);
        } catch (const payments::DbError& e) {
            log("rate limiter: ", e.what());
        }
        if (!allowed) co_return reply_retry(503, payments::error_body("store_unavailable"), 1s);
        if (!*allowed) co_return reply_retry(429, payments::error_body("rate_limited"), 1s);
    }
    // 3.-5. The key (400), the body (400; the route's fingerprint validates it), then at most once
    //    per key. The effect never starts a charge later than charge_start_budget after the request
    //    arrived, so the reconciler knows when "no charge yet" means "never".
    const auto deadline = Clock::now() + charge_start_budget;
    const idem::http::Request request = idem::http::beast::view(req);  // views into req
    const std::string scope = payments::payment_scope(*account);
    const auto executor = co_await asio::this_coro::executor;
    // The gateway call and the save may outlast a short lease: the key is kept from the effect
    // until async_respond has saved (this frame's end), or until the gateway call has certainly
    // ended — by then a request still busy is treated as gone (lease_keeper.hpp).
    std::optional<payments::LeaseKeeper> keeping;
    co_return co_await idem::http::async_respond(
        store, request, scope, route,
        [&](idem::asio::AsyncContext& ctx) -> asio::awaitable<idem::Response> {
            std::string problem;
            const auto payment = payments::parse_payment_request(req.body(), problem);  // valid: fingerprinted
            std::string not_charged;
            keeping.emplace(executor, store, ctx.key(), ctx.fence(), lease, deadline + kGatewayTimeout,
                            [](std::string_view line) { log(line); });
            try {
                auto charging = gateway.charge({.account = *account,
                                                .idempotency_key = ctx.key().value(),
                                                .payment = &*payment,
                                                .deadline = deadline});
                co_return payments::charge_response(co_await std::move(charging));
            } catch (const payments::GatewayNotCharged& e) {
                not_charged = e.what();
            }
            // Nothing charged: the key is released and the client may retry with the same key.
            // (GatewayTimeout is not caught: the charge may exist, the key stays in progress for
            // the reconciler and the client gets 503 outcome_unknown.)
            log("key '", ctx.key().value(), "' of account ", *account, ": not charged (key released): ", not_charged);
            idem::Response unavailable = reply(503, payments::error_body("gateway_unavailable"));
            unavailable.headers.emplace_back("Retry-After", "1");
            throw idem::http::not_performed(std::move(unavailable));
        },
        asio::use_awaitable);
}

asio::awaitable<idem::Response> Service::get_charges(std::string_view query) const {
    const auto key = query_param(query, "idempotency_key");
    if (!key) co_return reply(400, payments::error_body("missing_parameter", "idempotency_key"));
    const auto account = query_param(query, "account");
    // (the database would refuse such a value on every retry: a 503 would never end)
    if (!payments::storable_text(*key)) {
        co_return reply(400, payments::error_body("invalid_parameter", "idempotency_key"));
    }
    if (account && !payments::storable_text(*account)) {
        co_return reply(400, payments::error_body("invalid_parameter", "account"));
    }
    std::optional<std::vector<payments::Charge>> charges;
    try {
        auto finding = gateway.find(*key, account);
        charges = co_await std::move(finding);
    } catch (const payments::DbError& e) {
        log("ledger: ", e.what());
    }
    if (!charges) co_return reply_retry(503, payments::error_body("store_unavailable"), 1s);
    nlohmann::ordered_json out;
    out["count"] = charges->size();
    out["charges"] = nlohmann::ordered_json::array();
    for (const auto& c : *charges) {
        out["charges"].push_back({{"id", c.id},
                                  {"payment_id", "pay_" + std::to_string(c.id)},
                                  {"account", c.account},
                                  {"idempotency_key", c.idempotency_key},
                                  {"order_id", c.order_id},
                                  {"amount_cents", c.amount_cents},
                                  {"currency", c.currency},
                                  {"card", c.card},
                                  {"status", c.status},
                                  {"created_at", c.created_at}});
    }
    co_return reply(200, out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

}  // namespace

int main(int argc, char** argv) {
    const Options options = parse_options(argc, argv);
    signal(SIGPIPE, SIG_IGN);

    try {
        asio::io_context io(1);  // one thread runs it: this one
        idem::PostgresOptions store_options;
        store_options.pool_size = options.db_pool;
        store_options.group_commit = options.group_commit;
        store_options.default_lease = options.lease;
        store_options.application_name = "payments-server";
        idem::asio::AsyncPostgresStore store(io.get_executor(), options.db, store_options);
        store.blocking().ensure_schema();
        // Every call, reconciler sweep and purge of this instance, with its pool's figures: GET /metrics.
        const auto metrics = std::make_shared<idem::PrometheusObserver>();
        metrics->set_pool_source([&store] { return store.pool_stats(); });
        metrics->set_store_source([&store] { return store.stats(); });
        store.set_observer(metrics);
        store.blocking().set_observer(metrics);  // the reconciler's store
        // Replays of completed keys from this process's memory: a completed record never changes
        // until its retention passes, which the cache never outlives (idem/replay_cache.hpp).
        if (options.replay_cache_mb > 0) {
            idem::ReplayCacheOptions cache_options;
            cache_options.max_bytes = options.replay_cache_mb << 20;
            store.set_replay_cache(std::make_shared<idem::ReplayCache>(cache_options));
        }

        // The reconciler's blocking connections (and the schema); requests use the asynchronous pool.
        payments::PgPool reconciler_pool(options.db, 2, kGatewayTimeout);
        payments::ensure_app_schema(reconciler_pool);
        // Charges state their deadline on the database's clock (gateway_charge refuses one past
        // it): read it now, and again from the reconciler thread every few seconds.
        payments::DatabaseClock database_clock;
        payments::FakeGateway reconciler_gateway(reconciler_pool, options.gateway_latency, database_clock);
        (void)reconciler_gateway.sample_clock(database_clock);
        std::optional<payments::RateLimiter> purger;
        if (options.rate_limit_per_second > 0) purger.emplace(reconciler_pool, options.rate_limit_per_second);

        payments::AsyncPgPool pool(io.get_executor(), options.db, options.gateway_pool, kGatewayTimeout);
        payments::AsyncGateway gateway(pool, options.gateway_latency, database_clock);
        std::optional<payments::AsyncRateLimiter> limiter;
        if (options.rate_limit_per_second > 0) limiter.emplace(pool, options.rate_limit_per_second);

        idem::ClaimOptions claim_options;
        claim_options.lease = options.lease;
        const Service service{store,
                              gateway,
                              limiter ? &*limiter : nullptr,
                              make_route(claim_options, options.lease),
                              kChargeStartBudget,
                              options.lease,
                              metrics};

        payments::HttpListener listener(io.get_executor(), options.host, static_cast<unsigned short>(options.port),
                                        payments::HttpListenerOptions{.max_connections = options.threads,
                                                                      .body_limit = 64 * 1024,
                                                                      .keep_alive = std::chrono::seconds(5),
                                                                      .write_timeout = std::chrono::seconds(5),
                                                                      .log = [](std::string_view line) { log(line); }},
                                        [&service](const payments::HttpRequest& req) { return service.handle(req); });
        // Before the address line: from then on a SIGTERM stops the server cleanly (one that arrives
        // before io.run() waits in the signal set until then).
        asio::signal_set stop_signals(io, SIGTERM, SIGINT);
        stop_signals.async_wait([&](const boost::system::error_code& ec, int sig) {
            if (ec) return;
            log("signal ", sig, ": stopping");
            listener.stop();
        });
        const int port = listener.port();
        payments::set_log_prefix("payments-server[" + std::to_string(port) + "]");
        const std::string url_host =
            options.host.find(':') != std::string::npos ? "[" + options.host + "]" : options.host;
        std::cout << "listening on http://" << url_host << ":" << port << std::endl;

        payments::ReconcilerThread reconciler(store.blocking(), reconciler_gateway, database_clock,
                                              purger ? &*purger : nullptr, options.reconcile_every, options.lease,
                                              kReleaseAfter);
        reconciler.start();

        listener.start();
        io.run();  // returns once the listener has stopped and every request has been answered
        reconciler.stop();
        log("stopped");
        return 0;
    } catch (const std::exception& e) {
        log("fatal: ", e.what());
        return 1;
    }
}
