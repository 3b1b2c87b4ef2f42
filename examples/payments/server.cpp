// payments-server — the reference article's payments endpoint, in C++ over idem.
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
#include "gateway.hpp"
#include "idem/http/httplib.hpp"
#include "idem/idem.hpp"
#include "payment.hpp"

#include <arpa/inet.h>
#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::mutex g_log_mutex;
std::string g_log_prefix = "payments-server";

template <class... Parts>
void log(const Parts&... parts) {
    std::lock_guard lock(g_log_mutex);
    std::cerr << g_log_prefix << ": ";
    (std::cerr << ... << parts);
    std::cerr << std::endl;
}

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
    std::size_t db_pool = 8;
    std::size_t replay_cache_mb = 64;  // 0: off
    bool group_commit = true;
};

[[noreturn]] void usage(int status) {
    (status == 0 ? std::cout : std::cerr)
        << "usage: payments-server --listen 127.0.0.1:PORT --db CONNINFO [--gateway-latency-ms N]\n"
           "                       [--lease-ms N] [--reconcile-every-ms N] "
           "[--rate-limit-per-second N]\n"
           "                       [--threads N] [--db-pool N] [--replay-cache-mb N] "
           "[--group-commit on|off]\n"
           "  --listen              loopback address and port (port 0: any free port)\n"
           "  --db                  libpq connection string shared by every instance\n"
           "  --gateway-latency-ms  simulated card-gateway latency, 0..4000 (default 0)\n"
           "  --lease-ms            how long a claim owns its key before the reconciler may settle "
           "it (30000)\n"
           "  --reconcile-every-ms  reconciler period (1000)\n"
           "  --rate-limit-per-second  per-account limit across all instances (default 0: off)\n"
           "  --threads             HTTP worker threads, one per open connection (128)\n"
           "  --db-pool             database connections for idem, and as many for the gateway "
           "(8)\n"
           "  --replay-cache-mb     in-process replay cache for completed keys, MiB (64; 0: off)\n"
           "  --group-commit        claims and saves that find no connection free share "
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

// cpp-httplib 0.11 listens with a backlog of 5 (compiled into Debian's shared library): a burst of
// simultaneous connections then overflows the accept queue and some clients see their connection
// dropped. Linux lets listen() be called again on a bound socket to raise the backlog.
class HttpServer : public httplib::Server {
public:
    bool raise_backlog(int backlog) { return ::listen(svr_sock_, backlog) == 0; }
};

const std::string kJson = "application/json";

// A request starts its gateway call within this budget or not at all (503, key released) ...
constexpr milliseconds kChargeStartBudget = 5s;
// ... and the gateway answers within this (its statement_timeout), or the outcome is unknown.
constexpr milliseconds kGatewayTimeout = 2s;
// So a key in progress with no charge this long after its claim will never get one: release it.
constexpr milliseconds kReleaseAfter = kChargeStartBudget + kGatewayTimeout + 1s;

void reply(httplib::Response& res, int status, const std::string& body) {
    res.status = status;
    res.set_content(body, kJson);
}

void reply_retry(httplib::Response& res, int status, const std::string& body, milliseconds after) {
    const auto seconds = std::max<std::int64_t>(1, (after.count() + 999) / 1000);
    res.set_header("Retry-After", std::to_string(seconds));
    reply(res, status, body);
}

// What group commit did, in the Prometheus text format, after the observer's metrics: the shared
// transactions it sent for claims and for saves, the calls they carried, and the save calls. A claim
// or save outside a group is a transaction of its own, so idem's transactions are claims - grouped
// claims + claim groups, and the same for saves: scrapes before and after a load tell how many
// commits each request cost.
std::string group_commit_metrics(const idem::PostgresStore& store) {
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
    idem::IdempotencyStore& store;  // PostgresStore, or a CachedStore in front of it
    payments::FakeGateway& gateway;
    payments::RateLimiter* limiter;  // null: no rate limit
    idem::http::Route route;         // the Idempotency-Key rules (make_route)
    milliseconds charge_start_budget;

    void post_payment(const httplib::Request& req, httplib::Response& res) const;
    void get_charges(const httplib::Request& req, httplib::Response& res) const;
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

void Service::post_payment(const httplib::Request& req, httplib::Response& res) const {
    // 1. Who is paying. The account scopes every key: one account never sees another's keys.
    const auto account = payments::bearer_account(req.get_header_value("Authorization"));
    if (!account) {
        res.set_header("WWW-Authenticate", "Bearer");
        return reply(res, 401, payments::error_body("unauthorized", "send Authorization: Bearer <account>"));
    }
    // 2. Rate limit, before anything is claimed: a 429 never consumes the key.
    if (limiter != nullptr) {
        try {
            if (!limiter->allow(*account)) {
                return reply_retry(res, 429, payments::error_body("rate_limited"), 1s);
            }
        } catch (const payments::DbError& e) {
            log("rate limiter: ", e.what());
            return reply_retry(res, 503, payments::error_body("store_unavailable"), 1s);
        }
    }
    // 3.-5. The key (400), the body (400; the route's fingerprint validates it), then at most once
    //    per key. The effect never starts a charge later than charge_start_budget after the request
    //    arrived, so the reconciler knows when "no charge yet" means "never".
    const auto deadline = Clock::now() + charge_start_budget;
    idem::http::httplib::serve(store, req, res, payments::payment_scope(*account), route, [&](idem::Context& ctx) {
        std::string problem;
        const auto payment = payments::parse_payment_request(req.body, problem);  // valid: fingerprinted
        try {
            return payments::charge_response(gateway.charge({.account = *account,
                                                             .idempotency_key = ctx.key().value(),
                                                             .payment = &*payment,
                                                             .deadline = deadline}));
        } catch (const payments::GatewayNotCharged& e) {
            // Nothing charged: the key is released and the client may retry with the same key.
            // (GatewayTimeout is not caught: the charge may exist, the key stays in progress for the
            // reconciler and the client gets 503 outcome_unknown.)
            log("key '", ctx.key().value(), "' of account ", *account, ": not charged (key released): ", e.what());
            idem::Response unavailable{503, payments::error_body("gateway_unavailable"), {{"Content-Type", kJson}}};
            unavailable.headers.emplace_back("Retry-After", "1");
            throw idem::http::not_performed(std::move(unavailable));
        }
    });
}

void Service::get_charges(const httplib::Request& req, httplib::Response& res) const {
    if (!req.has_param("idempotency_key")) {
        return reply(res, 400, payments::error_body("missing_parameter", "idempotency_key"));
    }
    const std::string key = req.get_param_value("idempotency_key");
    std::optional<std::string> account;
    if (req.has_param("account")) account = req.get_param_value("account");
    try {
        const auto charges = gateway.find(key, account);
        nlohmann::ordered_json out;
        out["count"] = charges.size();
        out["charges"] = nlohmann::ordered_json::array();
        for (const auto& c : charges) {
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
        reply(res, 200, out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    } catch (const payments::DbError& e) {
        log("ledger: ", e.what());
        reply_retry(res, 503, payments::error_body("store_unavailable"), 1s);
    }
}

// ----------------------------------------------------------------------------------------
// reconciler

// Settles keys left in progress: a claim whose lease passed belongs to a request that crashed, hung
// or met an unknown gateway outcome. idem::Reconciler lists them (this service's scope prefix only)
// and takes each one over with a fence of its own, so several instances never settle the same key
// at once and a late original attempt gets lease_lost. The gateway's ledger says what happened:
//   a charge for (account, key)  → save the response that charge deserves (201 or 402) — the same
//     bytes the request itself would have saved;
//   no charge, and too late for one to still appear (a request never starts a charge later than
//     kChargeStartBudget after it arrived, and the gateway answers within kGatewayTimeout)
//     → release the key: the client's retry runs the payment;
//   no charge yet, but one could still be on its way → leave it; it is listed again later.
class ReconcilerThread {
public:
    ReconcilerThread(idem::IdempotencyStore& store, payments::FakeGateway& gateway, payments::RateLimiter* limiter,
                     milliseconds every, milliseconds lease)
        : reconciler_(
              store, [&gateway](idem::Reconciliation& r) { resolve(gateway, r); }, make_options(lease)),
          limiter_(limiter),
          every_(every) {}

    void start() {
        thread_ = std::jthread([this](std::stop_token stop) { run(stop); });
    }
    void stop() {
        thread_.request_stop();
        if (thread_.joinable()) thread_.join();
    }

private:
    static idem::ReconcilerOptions make_options(milliseconds lease) {
        idem::ReconcilerOptions options;
        options.scopes = idem::ScopeFilter::prefix(std::string(payments::payment_scope_prefix()));
        options.lease = lease;  // a key left undecided is looked at again after this
        return options;
    }

    static void resolve(payments::FakeGateway& gateway, idem::Reconciliation& r) {
        const auto account = payments::account_of_scope(r.key().scope());
        if (!account) return;
        const auto charges = gateway.find(r.key().value(), *account);  // throws: left for later
        if (!charges.empty()) {
            if (charges.size() > 1) {
                log("reconciler: ALERT: ", charges.size(), " gateway charges for key '", r.key().value(),
                    "' of account ", *account);
            }
            const idem::Response response = payments::charge_response(charges.front());
            log("reconciler: key '", r.key().value(), "' of account ", *account, " was charged: saving ",
                response.status, " (pay_", charges.front().id, ")");
            r.save(response);
        } else if (gateway.age_by_database_clock(r.record().created_at) > kReleaseAfter) {
            // (aged by the database's clock, which stamped created_at: a server whose clock runs
            // ahead would release a key whose charge may still be in flight — a double charge)
            log("reconciler: key '", r.key().value(), "' of account ", *account, " was never charged: releasing");
            r.release();
        }
    }

    void run(const std::stop_token& stop) {
        std::mutex mutex;
        std::condition_variable_any wake;
        auto next_purge = Clock::now();
        while (!stop.stop_requested()) {
            try {
                const auto sweep = reconciler_.run_once();
                if (sweep.failed > 0) log("reconciler: ", sweep.failed, " key(s) could not be settled this time");
            } catch (const std::exception& e) {
                log("reconciler: ", e.what());
            }
            if (limiter_ != nullptr && Clock::now() >= next_purge) {
                next_purge = Clock::now() + 10s;
                try {
                    limiter_->purge();
                } catch (const std::exception& e) {
                    log("reconciler: rate-limit purge: ", e.what());
                }
            }
            std::unique_lock lock(mutex);
            wake.wait_for(lock, stop, every_, [] { return false; });
        }
    }

    idem::Reconciler reconciler_;
    payments::RateLimiter* limiter_;
    milliseconds every_;
    std::jthread thread_;
};

}  // namespace

int main(int argc, char** argv) {
    const Options options = parse_options(argc, argv);

    // SIGTERM / SIGINT are taken by one thread with sigwait: block them before any thread starts.
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGTERM);
    sigaddset(&stop_signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    signal(SIGPIPE, SIG_IGN);

    try {
        idem::PostgresOptions store_options;
        store_options.pool_size = options.db_pool;
        store_options.group_commit = options.group_commit;
        store_options.default_lease = options.lease;
        store_options.application_name = "payments-server";
        idem::PostgresStore store(options.db, store_options);
        store.ensure_schema();
        // Every call, reconciler sweep and purge of this instance, with its pool's figures: GET /metrics.
        const auto metrics = std::make_shared<idem::PrometheusObserver>();
        metrics->set_pool_source([&store] { return store.pool_stats(); });
        metrics->set_store_source([&store] { return store.stats(); });
        store.set_observer(metrics);

        payments::PgPool pool(options.db, options.db_pool, kGatewayTimeout);
        payments::ensure_app_schema(pool);
        payments::FakeGateway gateway(pool, options.gateway_latency);
        std::optional<payments::RateLimiter> limiter;
        if (options.rate_limit_per_second > 0) limiter.emplace(pool, options.rate_limit_per_second);

        idem::ClaimOptions claim_options;
        claim_options.lease = options.lease;
        // Replays of completed keys from this process's memory: a completed record never changes
        // until its retention passes, which the cache never outlives (idem/cached_store.hpp).
        std::optional<idem::CachedStore> cached;
        if (options.replay_cache_mb > 0) {
            idem::ReplayCacheOptions cache_options;
            cache_options.max_bytes = options.replay_cache_mb << 20;
            cached.emplace(store, cache_options);
            cached->set_observer(metrics);  // the calls it answers; the store reports its own events
        }
        idem::IdempotencyStore& serving = cached ? static_cast<idem::IdempotencyStore&>(*cached) : store;
        const Service service{serving, gateway, limiter ? &*limiter : nullptr, make_route(claim_options, options.lease),
                              kChargeStartBudget};

        HttpServer server;
        const std::size_t threads = options.threads;
        server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
        server.set_keep_alive_max_count(1'000'000);
        server.set_keep_alive_timeout(5);
        server.set_tcp_nodelay(true);
        server.set_payload_max_length(64 * 1024);
        server.Post("/payments", [&service](const httplib::Request& req, httplib::Response& res) {
            service.post_payment(req, res);
        });
        server.Get("/gateway/charges",
                   [&service](const httplib::Request& req, httplib::Response& res) { service.get_charges(req, res); });
        server.Get("/healthz",
                   [](const httplib::Request&, httplib::Response& res) { reply(res, 200, "{\"status\":\"ok\"}"); });
        server.Get("/metrics", [&metrics, &store](const httplib::Request&, httplib::Response& res) {
            res.status = 200;
            res.set_content(metrics->render() + group_commit_metrics(store),
                            std::string(idem::PrometheusObserver::content_type));
        });
        server.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
            try {
                if (ep) std::rethrow_exception(ep);
            } catch (const std::exception& e) {
                log("unhandled: ", e.what());
            } catch (...) {
                log("unhandled non-standard exception");
            }
            reply(res, 500, payments::error_body("internal_error"));
        });

        int port = options.port;
        if (port == 0) {
            port = server.bind_to_any_port(options.host);
            if (port <= 0) throw std::runtime_error("cannot bind " + options.host);
        } else if (!server.bind_to_port(options.host, port)) {
            throw std::runtime_error("cannot bind " + options.host + ":" + std::to_string(port));
        }
        if (!server.raise_backlog(SOMAXCONN)) log("warning: cannot raise the listen backlog");
        g_log_prefix = "payments-server[" + std::to_string(port) + "]";
        const std::string url_host =
            options.host.find(':') != std::string::npos ? "[" + options.host + "]" : options.host;
        std::cout << "listening on http://" << url_host << ":" << port << std::endl;

        ReconcilerThread reconciler(store, gateway, limiter ? &*limiter : nullptr, options.reconcile_every,
                                    options.lease);
        reconciler.start();

        std::atomic<bool> stopping{false};
        std::atomic<bool> listen_done{false};
        std::thread signal_thread([&] {
            int sig = 0;
            sigwait(&stop_signals, &sig);
            if (listen_done) return;
            stopping = true;
            log("signal ", sig, ": stopping");
            // listen_after_bind may not have started yet; stop() only acts on a running server.
            while (!listen_done && !server.is_running()) std::this_thread::sleep_for(5ms);
            if (!listen_done) server.stop();
        });

        const bool listened = server.listen_after_bind();
        listen_done = true;
        if (!stopping) pthread_kill(signal_thread.native_handle(), SIGTERM);  // wake sigwait
        signal_thread.join();
        reconciler.stop();
        if (!stopping && !listened) {
            log("the HTTP server stopped unexpectedly");
            return 1;
        }
        log("stopped");
        return 0;
    } catch (const std::exception& e) {
        log("fatal: ", e.what());
        return 1;
    }
}
