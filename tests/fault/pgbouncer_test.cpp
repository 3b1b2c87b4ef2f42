// Fault scenario 5 — PgBouncer (Debian's 1.18) in transaction pooling mode between idem and
// PostgreSQL, on loopback, with fewer server connections than idem opens. Guarantee: with
// prepared_statements=false and session_options=false the whole contract holds (executed, replayed
// byte-identical, mismatch, in_progress, not_performed → released, 8 threads × 200 keys exactly
// once, reconciler). Misconfigured (prepared statements / startup options), it fails typed and
// loudly — and still never runs an effect twice. Needs /usr/sbin/pgbouncer (Debian package
// pgbouncer) and the cluster of scripts/with-postgres.sh (IDEM_PG_HOST/IDEM_PG_PORT); otherwise
// WARN and skip.
#include "fault.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <future>
#include <latch>

using namespace fault;

namespace {

const char* const kPgBouncer = "/usr/sbin/pgbouncer";

int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    socklen_t len = sizeof addr;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    ::close(fd);
    return ntohs(addr.sin_port);
}

bool accepts(int port) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    return ok;
}

/// A pgbouncer process of our own (pool_mode=transaction, auth_type=trust), stopped at destruction.
class PgBouncer {
public:
    PgBouncer(int server_pool_size) {
        char dir_template[] = "/tmp/idem-pgbouncer.XXXXXX";
        if (!::mkdtemp(dir_template)) throw std::runtime_error("mkdtemp failed");
        dir_ = dir_template;
        // pgbouncer refuses to run as root: as root, run it as the cluster's owner.
        const std::string user =
            ::geteuid() == 0 ? (env("IDEM_PG_CTL_USER").empty() ? "postgres" : env("IDEM_PG_CTL_USER")) : std::string();
        uid_t uid = ::geteuid();
        gid_t gid = ::getegid();
        if (!user.empty()) {
            const passwd* pw = ::getpwnam(user.c_str());
            if (!pw) throw std::runtime_error("no OS user " + user + " to run pgbouncer as");
            uid = pw->pw_uid, gid = pw->pw_gid;
        }
        for (int attempt = 0; attempt < 5 && pid_ <= 0; ++attempt) {
            port_ = free_port();
            write_files(server_pool_size);
            for (const auto* f : {"", "/pgbouncer.ini", "/userlist.txt"}) {
                if (::chown((dir_ + f).c_str(), uid, gid) != 0) throw std::runtime_error("chown failed");
            }
            const std::string ini = dir_ + "/pgbouncer.ini";
            const std::string out = dir_ + "/stdout.log";
            const int log_fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
            const pid_t pid = ::fork();
            if (pid == 0) {
                if (log_fd >= 0) ::dup2(log_fd, 1), ::dup2(log_fd, 2);
                if (!user.empty() && (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0))
                    _exit(126);
                ::execl(kPgBouncer, kPgBouncer, ini.c_str(), static_cast<char*>(nullptr));
                _exit(127);
            }
            if (log_fd >= 0) ::close(log_fd);
            if (pid < 0) throw std::runtime_error("fork failed");
            const auto until = Clock::now() + 15s;
            bool up = false;
            while (Clock::now() < until) {
                int status = 0;
                if (::waitpid(pid, &status, WNOHANG) == pid) break;  // exited: port taken? retry
                if (accepts(port_)) {
                    up = true;
                    break;
                }
                std::this_thread::sleep_for(50ms);
            }
            if (up) {
                pid_ = pid;
            } else {
                ::kill(pid, SIGKILL);
                ::waitpid(pid, nullptr, 0);
            }
        }
        if (pid_ <= 0) throw std::runtime_error("pgbouncer did not start; see " + dir_ + "/pgbouncer.log");
    }
    ~PgBouncer() {
        if (pid_ > 0) {
            ::kill(pid_, SIGTERM);
            int status = 0;
            const auto until = Clock::now() + 10s;
            while (::waitpid(pid_, &status, WNOHANG) == 0 && Clock::now() < until) std::this_thread::sleep_for(20ms);
            if (::waitpid(pid_, &status, WNOHANG) == 0) {
                ::kill(pid_, SIGKILL);
                ::waitpid(pid_, &status, 0);
            }
        }
        std::error_code ec;
        std::filesystem::remove_all(dir_, ec);
    }
    PgBouncer(const PgBouncer&) = delete;
    PgBouncer& operator=(const PgBouncer&) = delete;

    [[nodiscard]] std::string url() const {
        return "host=127.0.0.1 port=" + std::to_string(port_) +
               " dbname=postgres user=postgres sslmode=disable gssencmode=disable";
    }
    [[nodiscard]] std::string log() const {
        std::ifstream in(dir_ + "/pgbouncer.log");
        std::stringstream s;
        s << in.rdbuf();
        return s.str();
    }

private:
    void write_files(int server_pool_size) {
        std::ofstream ini(dir_ + "/pgbouncer.ini");
        // Session settings cannot travel in the startup packet through PgBouncer: set them on each
        // server connection with connect_query (or on the role: ALTER ROLE ... SET lock_timeout
        // ...).
        ini << "[databases]\n"
            << "postgres = host=" << env("IDEM_PG_HOST") << " port=" << env("IDEM_PG_PORT")
            << " dbname=postgres user=postgres"
            << " connect_query='SET statement_timeout = 5000; SET lock_timeout = 1000'\n"
            << "[pgbouncer]\n"
            << "listen_addr = 127.0.0.1\n"
            << "listen_port = " << port_ << "\n"
            << "unix_socket_dir =\n"
            << "auth_type = trust\n"
            << "auth_file = " << dir_ << "/userlist.txt\n"
            << "pool_mode = transaction\n"
            << "default_pool_size = " << server_pool_size << "\n"
            << "max_client_conn = 200\n"
            << "logfile = " << dir_ << "/pgbouncer.log\n"
            << "pidfile = " << dir_ << "/pgbouncer.pid\n"
            << "admin_users = postgres\n";
        std::ofstream users(dir_ + "/userlist.txt");
        users << "\"postgres\" \"\"\n";
    }

    std::string dir_;
    int port_ = 0;
    pid_t pid_ = -1;
};

idem::PostgresOptions bouncer_options(const IdemTable& table) {
    idem::PostgresOptions o;
    o.table = table.name();
    o.pool_size = 8;
    o.prepared_statements = false;  // PgBouncer < 1.21, transaction mode: no protocol-level prepared statements
    o.session_options = false;      // PgBouncer refuses the `options` startup parameter
    o.statement_timeout = 5s;
    o.lock_timeout = 1s;
    o.application_name = "idem_fault_pgbouncer";
    return o;
}

/// One ClaimOptions::wait round: caller A holds `key` (its effect blocked until let go), caller B
/// calls the same key with `wait`; once `b_waits()` says B waits, A's effect runs (one row in
/// `effects`, counted outside idem) and A saves — unless `complete` is false: then A is let go only
/// after B returned.
struct WaitRound {
    Call a{Key("-", "-"), true};
    Call b{Key("-", "-"), true};
    double b_after_save_ms = 0;  ///< B's return after A's execute_once returned (its save committed)
    bool b_waited = false;       ///< B had not returned when A was let go (or had waited, !complete)
};

WaitRound wait_round(idem::PostgresStore& store_a, idem::PostgresStore& store_b, Effects& effects, const Key& key,
                     std::chrono::milliseconds wait, bool complete, const std::function<bool()>& b_waits) {
    WaitRound w;
    w.a = Call(key, true);
    std::latch inside(1);
    std::promise<void> let_go;
    auto let_go_signal = let_go.get_future();
    Clock::time_point a_returned;
    std::thread a([&] {
        Effects::Writer writer(effects);
        const auto started = Clock::now();
        try {
            auto r = idem::execute_once(store_a, key, fp_for(key), [&] {
                w.a.fn_started = true;
                inside.count_down();
                let_go_signal.wait();
                w.a.effect_id = writer.run(key);
                return response_for(key, w.a.effect_id);
            });
            w.a.told = told_of(r.outcome());
            if (r.has_response()) w.a.bytes = idem::codec<Response>::encode(r.response());
        } catch (...) {
            classify(w.a, std::current_exception());
            inside.count_down();
        }
        a_returned = Clock::now();
        w.a.ms = ms_since(started);
    });
    inside.wait();
    std::atomic<bool> b_returned{false};
    Clock::time_point b_returned_at;
    std::thread b([&] {
        Effects::Writer writer(effects);
        idem::ClaimOptions options;
        options.wait = wait;
        w.b = run_call(store_b, writer, key, true, options);
        b_returned_at = Clock::now();
        b_returned = true;
    });
    if (complete) {
        // B cannot return before A saves, however slow the machine; A is let go once B waits
        // (bounded: if B never does, it replays at once, and the checks on its wait fail).
        const auto until = Clock::now() + 30s;
        while (!b_returned && !b_waits() && Clock::now() < until) std::this_thread::sleep_for(5ms);
        w.b_waited = !b_returned;
        let_go.set_value();
        a.join();
        b.join();
    } else {
        b.join();
        w.b_waited = true;
        let_go.set_value();
        a.join();
    }
    w.b_after_save_ms = std::chrono::duration<double, std::milli>(b_returned_at - a_returned).count();
    return w;
}

/// Effect rows recorded for `key`.
std::size_t effects_of(const Effects& effects, const Key& key) {
    const auto all = effects.all();
    const auto it = all.find({key.scope(), key.value()});
    return it == all.end() ? 0 : it->second.size();
}

bool skip_without_pgbouncer() {
    if (::access(kPgBouncer, X_OK) != 0) {
        WARN(kPgBouncer << " not found (Debian package pgbouncer; scripts/install-deps.sh): skipping");
        return true;
    }
    if (env("IDEM_PG_HOST").empty() || env("IDEM_PG_PORT").empty()) {
        WARN(
            "IDEM_PG_HOST/IDEM_PG_PORT not set (not started by scripts/with-postgres.sh): "
            "skipping");
        return true;
    }
    return false;
}

}  // namespace

TEST_CASE("scenario 5: PgBouncer 1.18 in transaction mode — the contract holds", "[fault][pgbouncer]") {
    const std::string url = require_db();
    if (skip_without_pgbouncer()) return;
    PgBouncer bouncer(3);  // 3 server connections for up to 8 of idem's
    IdemTable table(url);
    Effects effects(url);
    idem::PostgresStore store(bouncer.url(), bouncer_options(table));
    store.ensure_schema();  // one transaction through the pooler
    {
        PgConn through(bouncer.url());
        CHECK(through.exec("SHOW lock_timeout").text(0, 0) == "1s");  // connect_query applied
    }
    const std::string scope = idem_test::unique_name("bouncer");
    History history;
    Figures f;
    f.scenario = "pgbouncer_transaction_mode";
    Effects::Writer writer(effects);

    SECTION("executed, replayed byte-identical, mismatch, in_progress, not_performed") {
        const Key key(scope, "basic");
        Call first = run_call(store, writer, key);
        CHECK(first.told == Told::executed);
        Call again = run_call(store, writer, key);
        CHECK(again.told == Told::replayed);
        CHECK(again.bytes == first.bytes);
        CHECK_FALSE(again.fn_started);
        CHECK(run_call(store, writer, key, false).told == Told::mismatch);
        history.add(std::move(first));
        history.add(std::move(again));

        // in_progress: a second call while the first one's effect runs.
        const Key slow(scope, "slow");
        std::latch inside(1);
        std::atomic<bool> let_go{false};
        std::thread owner([&] {
            Effects::Writer w(effects);
            Call c(slow, true);
            auto r = idem::execute_once(store, slow, fp_for(slow), [&] {
                c.fn_started = true;
                inside.count_down();
                while (!let_go) std::this_thread::sleep_for(2ms);
                c.effect_id = w.run(slow);
                return response_for(slow, c.effect_id);
            });
            c.told = r.outcome() == idem::Outcome::executed ? Told::executed : Told::other_error;
            c.bytes = idem::codec<Response>::encode(r.response());
            history.add(std::move(c));
        });
        inside.wait();
        Call during = run_call(store, writer, slow);
        let_go = true;
        owner.join();
        CHECK(during.told == Told::in_progress);
        history.add(std::move(during));

        // not_performed: the claim is released, the next call runs.
        const Key refused(scope, "refused");
        CHECK_THROWS_AS(idem::execute_once(store, refused, fp_for(refused),
                                           []() -> Response { throw idem::not_performed("rate limited"); }),
                        idem::not_performed);
        Call later = run_call(store, writer, refused);
        CHECK(later.told == Told::executed);
        history.add(std::move(later));
        ++f.rounds;
    }

    SECTION("8 threads x the same 200 keys: exactly one effect each") {
        constexpr int kKeys = 200;
        std::vector<std::thread> threads;
        std::atomic<int> executed{0};
        for (int t = 0; t < 8; ++t) {
            threads.emplace_back([&, t] {
                Effects::Writer w(effects);
                std::vector<int> order(kKeys);
                for (int i = 0; i < kKeys; ++i) order[static_cast<std::size_t>(i)] = i;
                std::shuffle(order.begin(), order.end(), std::minstd_rand(static_cast<unsigned>(t + 1)));
                for (int i : order) {
                    const Key key(scope, "k" + std::to_string(i));
                    for (int attempt = 0; attempt < 200; ++attempt) {
                        Call c = run_call(store, w, key);
                        const Told told = c.told;
                        if (told == Told::executed) ++executed;
                        history.add(std::move(c));
                        if (is_answer(told)) break;
                        std::this_thread::sleep_for(5ms);
                    }
                }
            });
        }
        for (auto& th : threads) th.join();
        CHECK(executed.load() == kKeys);
        ++f.rounds;
    }

    check(store, effects, history, CheckOptions{scope, table.name()},
          f);  // reconciler through PgBouncer too
    f.notes.push_back("store: round_trips=" + std::to_string(store.stats().round_trips) +
                      " connections_opened=" + std::to_string(store.stats().connections_opened));
    f.print();
    CHECK(f.anomalies.empty());
}

TEST_CASE("scenario 5: PgBouncer misconfigured — fails typed, never twice", "[fault][pgbouncer]") {
    const std::string url = require_db();
    if (skip_without_pgbouncer()) return;
    PgBouncer bouncer(2);
    IdemTable table(url);
    Effects effects(url);
    idem::PostgresStore direct(url, idem::PostgresOptions{.table = table.name()});
    direct.ensure_schema();
    Effects::Writer writer(effects);
    Figures f;
    f.scenario = "pgbouncer_misconfigured";

    SECTION(
        "session_options=true: PgBouncer refuses the startup packet → store_unavailable, fn "
        "not run") {
        auto options = bouncer_options(table);
        options.session_options = true;
        idem::PostgresStore store(bouncer.url(), options);
        const std::string scope = idem_test::unique_name("bouncer_opts");
        Call c = run_call(store, writer, Key(scope, "k"));
        CAPTURE(c.detail);
        CHECK(c.told == Told::store_unavailable);
        CHECK_FALSE(c.fn_started);
        f.notes.push_back("session_options=true: " + std::string(name(c.told)) + ": " + c.detail.substr(0, 120));
        f.print();
    }

    SECTION(
        "prepared_statements=true: prepared statements clash across server connections → typed "
        "errors") {
        auto options = bouncer_options(table);
        options.prepared_statements = true;
        idem::PostgresStore store(bouncer.url(), options);
        const std::string scope = idem_test::unique_name("bouncer_prep");
        History history;
        LoadOptions lo;
        lo.scope = scope;
        lo.max_keys = 150;
        lo.claim.lease = 1s;
        {
            Load load(store, effects, history, lo);
            load.start();
            const auto until = Clock::now() + 60s;
            while (!load.finished() && Clock::now() < until) std::this_thread::sleep_for(50ms);
        }
        std::set<std::string> errors;
        std::size_t failed = 0;
        for (const auto& c : history.calls()) {
            if (c.told == Told::database_error || c.told == Told::store_unavailable ||
                c.told == Told::response_not_saved) {
                ++failed;
                errors.insert(std::string(name(c.told)) + " " + c.detail.substr(0, 100));
            }
        }
        for (const auto& e : errors) {
            if (f.notes.size() < 6) f.notes.push_back("prepared_statements=true: " + e);
        }
        f.notes.push_back("prepared_statements=true: " + std::to_string(failed) + " of " +
                          std::to_string(history.size()) + " calls failed typed");
        // Judged with a store connected directly (the misconfigured one cannot be trusted to
        // resolve).
        check(direct, effects, history, CheckOptions{scope, table.name()}, f);
        f.print();
        CHECK(failed > 0);
        CHECK(f.anomalies.empty());
    }
}

// ClaimOptions::wait behind PgBouncer in transaction mode. LISTEN runs in one transaction on one
// server connection, which PgBouncer then hands to other clients; the waiting client is linked to
// no server while it waits, so the saver's NOTIFY never reaches it.
//
// Found before waiting learned to poll (LISTEN/NOTIFY only, what wait_strategy notify still does):
// B's LISTEN and mark succeeded, no notification ever arrived, B slept the whole wait (30 s) and
// then answered in_progress — for a key A had saved 29.5 s earlier, 3 rounds out of 3: the replay
// was missed, because the wait's end did not read the key again. No error, no hang past the wait.
// Now: automatic sees the pooler (the server's backend pid is not the one PgBouncer gave libpq)
// and polls the key; poll always polls; notify reads the key at the wait's end (replays late).
// Each strategy also runs directly against PostgreSQL, where all three are prompt.
TEST_CASE("scenario 5: PgBouncer in transaction mode — ClaimOptions::wait replays the owner's save",
          "[fault][pgbouncer][wait]") {
    using Strategy = idem::PostgresOptions::WaitStrategy;
    const std::string url = require_db();
    if (skip_without_pgbouncer()) return;
    const Strategy strategy = GENERATE(Strategy::automatic, Strategy::poll, Strategy::notify);
    const bool through_bouncer = GENERATE(true, false);
    const char* const strategy_name = strategy == Strategy::automatic ? "automatic"
                                      : strategy == Strategy::poll    ? "poll"
                                                                      : "notify";
    CAPTURE(strategy_name, through_bouncer);
    PgBouncer bouncer(3);
    IdemTable table(url);
    Effects effects(url);
    auto options = bouncer_options(table);  // (fine directly too: unnamed statements, no startup options)
    options.wait_strategy = strategy;
    const std::string target = through_bouncer ? bouncer.url() : url;
    // Two stores, as two instances of a service would be, on the same path to the database.
    idem::PostgresStore store_a(target, options);
    idem::PostgresStore store_b(target, options);
    store_a.ensure_schema();
    const std::string scope = idem_test::unique_name("bouncer_wait");
    // notify through a transaction-mode pooler hears nothing: it replays at the wait's end.
    const bool late = through_bouncer && strategy == Strategy::notify;
    const bool listens = strategy == Strategy::notify || (strategy == Strategy::automatic && !through_bouncer);
    PgConn direct(url);

    SECTION("the waiter replays A's exact bytes soon after A's save, the effect ran once") {
        const auto wait = late ? 3s : 30s;
        Figures f;
        f.scenario = std::string("pgbouncer_wait_") + strategy_name + (through_bouncer ? "_bouncer" : "_direct");
        std::string delays;
        for (int i = 0; i < 3; ++i) {
            const Key key(scope, "k" + std::to_string(i));
            // B waits once it has flagged the row waited for (after its LISTEN), or, polling, once
            // it makes its first round trip after the claim that found A's key in progress.
            const auto trips = store_b.stats().round_trips;
            const auto b_waits = [&] {
                if (listens) {
                    return direct
                               .exec("SELECT waiters FROM " + table.name() + " WHERE scope = $1 AND key = $2",
                                     {key.scope(), key.value()})
                               .text(0, 0) == "t";
                }
                return store_b.stats().round_trips >= trips + 2;
            };
            const WaitRound w = wait_round(store_a, store_b, effects, key, wait, true, b_waits);
            INFO("round " << i << ": A " << name(w.a.told) << " " << w.a.detail << ", B " << name(w.b.told) << " "
                          << w.b.detail << " after " << w.b.ms << " ms, " << w.b_after_save_ms << " ms after A's save");
            CHECK(w.b_waited);
            CHECK(w.a.told == Told::executed);
            CHECK(w.b.told == Told::replayed);
            CHECK(w.b.bytes == w.a.bytes);
            CHECK_FALSE(w.b.fn_started);
            if (late) {
                CHECK(w.b.ms >= 3000.0);  // slept the whole wait, then read the key: replayed
            } else {
                CHECK(w.b_after_save_ms < 5000.0);  // well before the 30 s wait ends
            }
            CHECK(effects_of(effects, key) == 1);
            // Whether B LISTENed: it flags the row as waited for then (and only then), in the
            // transaction after its LISTEN. automatic must not through the pooler.
            CHECK(direct
                      .exec("SELECT waiters FROM " + table.name() + " WHERE scope = $1 AND key = $2",
                            {key.scope(), key.value()})
                      .text(0, 0) == (listens ? "t" : "f"));
            delays += " " + std::to_string(static_cast<long>(w.b_after_save_ms));
            ++f.rounds;
        }
        f.notes.push_back("B's return after A's save (ms):" + delays);
        f.print();
    }

    SECTION("a wait that runs out answers in_progress, and the effect still runs once") {
        const Key key(scope, "slow");
        const WaitRound w = wait_round(store_a, store_b, effects, key, 2s, false, {});
        INFO("B " << name(w.b.told) << " " << w.b.detail << " after " << w.b.ms << " ms");
        CHECK(w.b.told == Told::in_progress);
        CHECK_FALSE(w.b.fn_started);
        CHECK(w.b.ms >= 2000.0);
        CHECK(w.b.ms < 15000.0);
        CHECK(w.a.told == Told::executed);
        CHECK(effects_of(effects, key) == 1);
        // Saved now: a waiting call answers at once with A's bytes.
        Effects::Writer writer(effects);
        idem::ClaimOptions claim;
        claim.wait = 30s;
        Call again = run_call(store_b, writer, key, true, claim);
        CHECK(again.told == Told::replayed);
        CHECK(again.bytes == w.a.bytes);
        CHECK(again.ms < 5000.0);
        CHECK(effects_of(effects, key) == 1);
    }
}
