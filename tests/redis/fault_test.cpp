// RedisStore under faults (labels redis, fault), each test against its own throwaway redis-server
// (tests/support/redis_server.hpp):
//
// * The power-loss shim itself (tests/redis/power_loss.c), with raw commands: kill -9 under
//   appendfsync everysec loses acknowledged writes, under always none.
// * kill -9 mid-load with appendfsync always (+ the shim: a machine crash): every acknowledged claim
//   and save is there after the restart; running the load again over the same keys runs no effect
//   twice. Negative control, everysec (+ the shim): the same check DETECTS the loss — acknowledged
//   saves missing, effects that a retry runs a second time — so the check above can fail.
// * A stopped or killed server: store_unavailable, fn never called, within a bound.
// * A paused owner (its effect blocks past its 300 ms lease): a reconciler or a resume-mode retry
//   takes the key over, the late owner's save gets lease_lost, the record holds the new owner's
//   result, the effect count is exact. A paused server (SIGSTOP): store_unavailable within the
//   command timeout, fn not called; after SIGCONT calls work again.
// * Persistence the durability asked for cannot have (no AOF, everysec, appendfsync no):
//   config_error, not store_unavailable, fn not called; with a weaker durability it works.
// * WAIT on a replica (wait_replicas = 1): writes succeed; with the replica paused a save throws
//   store_unavailable within wait_replicas_timeout + margin, and a claim does so before fn runs.
// * The server away between the claim and the save (save_retry_window): back within the window,
//   save and save_batch land (the effect ran once, a replay returns the bytes); away past it,
//   response_not_saved after about the window and the keys stay in progress; a claim still hears
//   store_unavailable at once. The server restarted slow to load its dataset (-LOADING): the save
//   keeps trying through the loading and lands; a claim meanwhile is store_unavailable.
//
// Verdicts never depend on a sleep: the tests wait for conditions (acknowledged counts, Redis's own
// lease clock, the AOF's size on disk) with generous bounds, and time only upper bounds (and the
// lower bound a retry window guarantees).
#include "redis_server.hpp"

#include "idem/batch.hpp"
#include "idem/errors.hpp"
#include "idem/execute_once.hpp"
#include "idem/reconciler.hpp"
#include "idem/redis/store.hpp"

#include <netinet/in.h>
#include <atomic>
#include <filesystem>
#include <functional>
#include <iostream>
#include <latch>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using idem_test::RedisServer;
using idem_test::RedisServerOptions;
using Clock = std::chrono::steady_clock;

namespace {

// ---- helpers ------------------------------------------------------------------------------------

/// Waits until `done()` holds, checking every 5 ms, at most `bound`; false when it did not.
bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds bound) {
    const auto deadline = Clock::now() + bound;
    while (!done()) {
        if (Clock::now() >= deadline) return false;
        std::this_thread::sleep_for(5ms);
    }
    return true;
}

std::chrono::milliseconds since(Clock::time_point t0) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
}

/// Bytes of the AOF files on disk (appendonlydir/). With the power-loss shim they grow only when
/// Redis fsyncs.
std::uintmax_t aof_bytes(const RedisServer& server) {
    std::uintmax_t total = 0;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(server.dir() + "/appendonlydir", ec)) {
        if (entry.is_regular_file(ec)) total += entry.file_size(ec);
    }
    return total;
}

/// A number field of INFO persistence ("aof_current_size").
long long info_persistence(const RedisServer& server, const std::string& field) {
    const std::string info = server.command({"INFO", "persistence"});
    const auto at = info.find("\n" + field + ":");
    if (at == std::string::npos) throw std::runtime_error("INFO persistence has no " + field);
    return std::stoll(info.substr(at + field.size() + 2));
}

/// Everything Redis wrote to its incr AOF files is on disk: their size there is the size Redis
/// counts (aof_current_size - aof_base_size). With the power-loss shim, only after an fsync.
bool aof_all_synced(const RedisServer& server) {
    std::uintmax_t incr = 0;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(server.dir() + "/appendonlydir", ec)) {
        if (entry.path().filename().string().find(".incr.aof") != std::string::npos) incr += entry.file_size(ec);
    }
    const long long written = info_persistence(server, "aof_current_size") - info_persistence(server, "aof_base_size");
    return written > 0 && static_cast<long long>(incr) == written;
}

/// Sends `count` SETs (key prefix+i, value i) pipelined in one write and counts the +OK answers.
std::size_t pipelined_sets(const std::string& socket, const std::string& prefix, std::size_t count) {
    const idem_test::UnixConnection conn(socket);
    const int fd = conn.fd();
    std::string out;
    for (std::size_t i = 0; i < count; ++i) {
        const std::string k = prefix + std::to_string(i);
        const std::string v = std::to_string(i);
        out += "*3\r\n$3\r\nSET\r\n$" + std::to_string(k.size()) + "\r\n" + k + "\r\n$" + std::to_string(v.size()) +
               "\r\n" + v + "\r\n";
    }
    std::size_t sent = 0;
    std::size_t oks = 0;
    std::string in;
    // Write and read interleaved (the server's answers must not fill the socket while we write).
    while (oks < count) {
        pollfd p{fd, static_cast<short>(POLLIN | (sent < out.size() ? POLLOUT : 0)), 0};
        if (::poll(&p, 1, 10000) <= 0) throw std::runtime_error("pipelined SETs: no answer within 10 s");
        if ((p.revents & POLLOUT) != 0 && sent < out.size()) {
            const ssize_t n = ::send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
            if (n <= 0) throw std::runtime_error("pipelined SETs: send failed");
            sent += static_cast<std::size_t>(n);
        }
        if ((p.revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
            char buf[65536];
            const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
            if (n <= 0) throw std::runtime_error("pipelined SETs: connection closed");
            in.append(buf, static_cast<std::size_t>(n));
            std::size_t pos = 0;
            while (true) {
                const auto eol = in.find("\r\n", pos);
                if (eol == std::string::npos) break;
                if (in.compare(pos, eol - pos, "+OK") != 0)
                    throw std::runtime_error("pipelined SET answered " + in.substr(pos, eol - pos));
                ++oks;
                pos = eol + 2;
            }
            in.erase(0, pos);
        }
    }
    return oks;
}

long long dbsize(const RedisServer& server) {
    const std::string answer = server.command({"DBSIZE"});
    REQUIRE(answer.size() > 1);
    REQUIRE(answer[0] == ':');
    return std::stoll(answer.substr(1));
}

/// The effects, counted outside the store: how often each key's effect ran.
class Effects {
public:
    void ran(const std::string& key) {
        const std::lock_guard lock(mutex_);
        ++runs_[key];
    }
    [[nodiscard]] int runs(const std::string& key) const {
        const std::lock_guard lock(mutex_);
        const auto it = runs_.find(key);
        return it == runs_.end() ? 0 : it->second;
    }
    /// Keys whose effect ran more than once.
    [[nodiscard]] std::vector<std::string> twice() const {
        const std::lock_guard lock(mutex_);
        std::vector<std::string> out;
        for (const auto& [k, n] : runs_)
            if (n > 1) out.push_back(k);
        return out;
    }

private:
    mutable std::mutex mutex_;
    std::map<std::string, int> runs_;
};

/// One call of the load and what the caller was told.
struct Call {
    std::string key;
    bool fn_started = false;  // the claim was acknowledged: fn runs only after a won claim
    bool saved = false;       // told executed: the save was acknowledged
    std::string bytes;        // the result saved (executed) or replayed
    std::string told;         // executed, store_unavailable, response_not_saved, ...
};

std::string result_for(const std::string& key) { return "result-of-" + key; }

/// One execute_once on `key`, classified.
Call run_call(idem::IdempotencyStore& store, Effects& effects, const std::string& scope, const std::string& k) {
    Call c;
    c.key = k;
    const idem::Key key(scope, k);
    try {
        auto r = idem::execute_once(store, key, idem::fingerprint(k), [&] {
            c.fn_started = true;
            effects.ran(k);
            return result_for(k);
        });
        c.told = std::string(idem::to_string(r.outcome()));
        if (r.has_response()) c.bytes = r.response();
        c.saved = r.outcome() == idem::Outcome::executed;
    } catch (const idem::response_not_saved&) {
        c.told = "response_not_saved";
    } catch (const idem::store_unavailable&) {
        c.told = "store_unavailable";
    } catch (const idem::lease_lost&) {
        c.told = "lease_lost";
    } catch (const idem::config_error& e) {
        c.told = std::string("config_error: ") + e.what();
    } catch (const std::exception& e) {
        c.told = std::string("other: ") + e.what();
    }
    return c;
}

/// Client threads running execute_once on fresh keys ("t<thread>-<n>") until stopped.
class Load {
public:
    Load(idem::IdempotencyStore& store, Effects& effects, std::string scope, int threads)
        : store_(store), effects_(effects), scope_(std::move(scope)), calls_(static_cast<std::size_t>(threads)) {
        for (int t = 0; t < threads; ++t) {
            threads_.emplace_back([this, t] {
                auto& mine = calls_[static_cast<std::size_t>(t)];
                for (int n = 0; !stop_.load(); ++n) {
                    Call c = run_call(store_, effects_, scope_, "t" + std::to_string(t) + "-" + std::to_string(n));
                    if (c.fn_started) fn_started_.fetch_add(1);
                    if (c.saved) saved_.fetch_add(1);
                    mine.push_back(std::move(c));
                }
            });
        }
    }
    ~Load() { stop(); }
    Load(const Load&) = delete;
    Load& operator=(const Load&) = delete;

    [[nodiscard]] std::size_t saved() const { return saved_.load(); }
    [[nodiscard]] std::size_t fn_started() const { return fn_started_.load(); }
    void stop() {
        stop_ = true;
        for (auto& th : threads_)
            if (th.joinable()) th.join();
    }
    /// Every call made (after stop()).
    [[nodiscard]] std::vector<Call> calls() const {
        std::vector<Call> all;
        for (const auto& mine : calls_) all.insert(all.end(), mine.begin(), mine.end());
        return all;
    }

private:
    idem::IdempotencyStore& store_;
    Effects& effects_;
    std::string scope_;
    std::vector<std::vector<Call>> calls_;
    std::vector<std::thread> threads_;
    std::atomic<bool> stop_{false};
    std::atomic<std::size_t> saved_{0}, fn_started_{0};
};

struct Loss {
    std::size_t calls = 0, acked_saves = 0, lost_saves = 0, acked_claims = 0, lost_claims = 0;
    [[nodiscard]] std::string note() const {
        return "calls=" + std::to_string(calls) + " acknowledged saves=" + std::to_string(acked_saves) +
               " lost=" + std::to_string(lost_saves) + "; acknowledged claims=" + std::to_string(acked_claims) +
               " lost=" + std::to_string(lost_claims);
    }
};

/// After the restart, through a fresh store: is every acknowledged save (completed, same bytes) and
/// every acknowledged claim (a record of any state) still there?
Loss durability(const RedisServer& server, const std::string& scope, const std::vector<Call>& calls) {
    auto options = server.store_options();
    options.durability = idem::RedisDurability::unchecked;
    idem::RedisStore checker(options);
    Loss loss;
    loss.calls = calls.size();
    for (const Call& c : calls) {
        if (!c.fn_started) continue;
        const auto record = checker.read(idem::Key(scope, c.key));
        ++loss.acked_claims;
        if (!record) ++loss.lost_claims;
        if (c.saved) {
            ++loss.acked_saves;
            if (!record || record->state != idem::RecordState::completed || record->result != c.bytes)
                ++loss.lost_saves;
        }
    }
    return loss;
}

/// The load again, after the restart, over every key it tried (one call each, on `store`, which
/// lived through the crash): an acknowledged save must replay its bytes (else wrong_replays), a
/// claim whose effect ran answers in_progress or replays (its save may have landed unacknowledged);
/// a key whose effect ran before and runs again counts in `twice`.
struct Rerun {
    std::size_t replayed = 0, in_progress = 0, executed = 0, wrong_replays = 0, failed = 0;
    std::vector<std::string> twice;
    std::vector<std::string> failures;
};

Rerun rerun(idem::IdempotencyStore& store, Effects& effects, const std::string& scope, const std::vector<Call>& calls) {
    Rerun r;
    for (const Call& c : calls) {
        const int before = effects.runs(c.key);
        Call again = run_call(store, effects, scope, c.key);
        if (again.told == "replayed") {
            ++r.replayed;
        } else if (again.told == "in_progress") {
            ++r.in_progress;
        } else if (again.told == "executed") {
            ++r.executed;
        } else {
            ++r.failed;
            if (r.failures.size() < 5) r.failures.push_back(c.key + ": " + again.told);
        }
        if (before > 0 && effects.runs(c.key) > before) r.twice.push_back(c.key);
        if (c.saved && (again.told != "replayed" || again.bytes != c.bytes)) ++r.wrong_replays;
    }
    return r;
}

/// execute_once on Key(scope, k) with an effect that counts its runs and returns "r-" + k.
struct CountedCalls {
    std::string scope;
    std::atomic<int> runs{0};
    idem::Result<std::string> operator()(idem::IdempotencyStore& store, const std::string& k) {
        return idem::execute_once(store, idem::Key(scope, k), idem::fingerprint(k), [this, &k] {
            ++runs;
            return "r-" + k;
        });
    }
    /// One call on "warm" that must execute (the store's first connection), then runs = 0.
    void warm_up(idem::IdempotencyStore& store) {
        REQUIRE((*this)(store, "warm").outcome() == idem::Outcome::executed);
        runs = 0;
    }
};

/// The server's store options with connect_timeout and command_timeout both `timeout`.
idem::RedisOptions with_timeouts(const RedisServer& server, std::chrono::milliseconds timeout) {
    auto o = server.store_options();
    o.connect_timeout = timeout;
    o.command_timeout = timeout;
    return o;
}

idem::RedisOptions load_options(const RedisServer& server) {
    auto o = server.store_options();
    o.pool_size = 8;
    o.connect_timeout = 2s;
    o.command_timeout = 2s;
    // The server comes back only after the load has stopped: a save cut by the crash gives up at
    // once (response_not_saved, its key in progress) instead of trying for the whole window.
    o.save_retry_window = 0ms;
    return o;
}

constexpr int kLoadThreads = 4;

}  // namespace

// ---- the shim, with raw commands ---------------------------------------------------------------

TEST_CASE("power-loss shim: kill -9 under appendfsync always loses no acknowledged write", "[redis][fault][shim]") {
    RedisServer server({.appendfsync = "always", .power_loss = true});
    const std::size_t acked = pipelined_sets(server.socket(), "k", 20000);
    REQUIRE(acked == 20000);
    server.kill9();
    server.start();
    std::cout << "REDIS-FAULT-FIGURES shim_always: acknowledged=" << acked << " after restart=" << dbsize(server)
              << "\n";
    CHECK(dbsize(server) == 20000);
}

TEST_CASE("power-loss shim: kill -9 under appendfsync everysec loses acknowledged writes (negative control)",
          "[redis][fault][shim]") {
    RedisServer server({.appendfsync = "everysec", .power_loss = true});
    // A first burst, all of it passed on by fsyncs (everysec: within a second or two).
    REQUIRE(pipelined_sets(server.socket(), "a-", 5000) == 5000);
    REQUIRE(wait_until([&] { return aof_all_synced(server); }, 30s));
    // Then the machine's last moments: its fsyncs reach nothing (the shim holds them), a burst is
    // acknowledged, kill -9. Everything of the burst was acknowledged and is in no file.
    server.hold_fsyncs();
    const std::size_t before_burst = static_cast<std::size_t>(dbsize(server));
    const std::size_t acked = pipelined_sets(server.socket(), "b-", 5000);
    REQUIRE(acked == 5000);
    REQUIRE(dbsize(server) == static_cast<long long>(before_burst + acked));
    server.kill9();
    server.release_fsyncs();
    server.start();
    const auto after = dbsize(server);
    std::cout << "REDIS-FAULT-FIGURES shim_everysec: acknowledged before the last burst=" << before_burst
              << " + burst=" << acked << ", after restart=" << after << " (lost "
              << static_cast<long long>(before_burst + acked) - after << ")\n";
    CHECK(after >= 5000);                                  // the first burst, fsynced, survived
    CHECK(after <= static_cast<long long>(before_burst));  // the last burst is lost, all of it
}

// ---- kill -9 mid-load ----------------------------------------------------------------------------

namespace {

struct CrashRound {
    Loss loss;
    Rerun again;
    std::size_t effects_twice = 0;  // keys whose effect ran more than once, in the whole round

    [[nodiscard]] std::string note() const {
        return loss.note() + "; rerun replayed=" + std::to_string(again.replayed) +
               " in_progress=" + std::to_string(again.in_progress) + " executed=" + std::to_string(again.executed) +
               " failed=" + std::to_string(again.failed) + " effects run twice=" + std::to_string(effects_twice);
    }
};

/// A load on a server with `appendfsync` and the power-loss shim; `crash(server, load)` decides the
/// moment and kills the server (kill9) mid-load; then the restart, the durability check through a
/// fresh store and the rerun through the store that lived through the crash.
CrashRound crash_round(const std::string& appendfsync, const std::string& scope,
                       const std::function<void(RedisServer&, const Load&)>& crash) {
    RedisServer server({.appendfsync = appendfsync, .power_loss = true});
    idem::RedisStore store(load_options(server));
    Effects effects;
    std::vector<Call> calls;
    {
        Load load(store, effects, scope, kLoadThreads);
        crash(server, load);
        server.kill9();  // (done already, unless crash() failed a REQUIRE)
        load.stop();
        calls = load.calls();
    }
    server.start();
    CrashRound round;
    round.loss = durability(server, scope, calls);
    round.again = rerun(store, effects, scope, calls);
    round.effects_twice = effects.twice().size();
    for (const auto& f : round.again.failures) WARN("rerun failure: " << f);
    return round;
}

}  // namespace

TEST_CASE(
    "kill -9 mid-load with appendfsync always (+ power loss): nothing acknowledged is lost and no effect runs twice",
    "[redis][fault][crash]") {
    const CrashRound round = crash_round("always", "crash", [](RedisServer& server, const Load& load) {
        REQUIRE(wait_until([&] { return load.saved() >= 400; }, 120s));
        server.kill9();  // mid-load: calls are in flight
    });
    std::cout << "REDIS-FAULT-FIGURES crash_always: " << round.note() << "\n";
    CHECK(round.loss.acked_saves >= 400);
    CHECK(round.loss.acked_claims >= round.loss.acked_saves);
    CHECK(round.loss.lost_saves == 0);
    CHECK(round.loss.lost_claims == 0);
    CHECK(round.again.replayed >= round.loss.acked_saves);  // plus saves that landed, their answer cut
    CHECK(round.again.wrong_replays == 0);
    CHECK(round.again.failed == 0);
    CHECK(round.again.twice.empty());
    CHECK(round.effects_twice == 0);
}

TEST_CASE("kill -9 mid-load with appendfsync everysec (+ power loss): the check DETECTS the loss (negative control)",
          "[redis][fault][crash]") {
    std::size_t unsynced_saves = 0;
    const CrashRound round = crash_round("everysec", "crash-everysec", [&](RedisServer& server, const Load& load) {
        // First an fsync that passed some of the load on (the loss is then a part, not all).
        const auto initial = aof_bytes(server);
        REQUIRE(wait_until([&] { return load.saved() >= 200 && aof_bytes(server) > initial; }, 60s));
        // Then the machine's last moments: its fsyncs reach nothing (the shim holds them) while at
        // least 200 more saves are acknowledged; kill -9. Those saves, bar the one in flight per
        // thread when the hold began, are in no file, so kill -9 loses them for certain.
        server.hold_fsyncs();
        const std::size_t saved = load.saved();
        REQUIRE(wait_until([&] { return load.saved() >= saved + 200; }, 60s));
        server.pause();
        unsynced_saves = load.saved() - saved;
        server.kill9();
        server.release_fsyncs();
    });
    std::cout << "REDIS-FAULT-FIGURES crash_everysec_negative_control: " << round.note()
              << "; saves acknowledged while no fsync ran=" << unsynced_saves << " - NEGATIVE CONTROL: loss "
              << (round.loss.lost_saves > 0 ? "DETECTED" : "not detected") << "\n";
    CHECK(unsynced_saves >= 200);
    CHECK(round.loss.lost_saves > 0);
    CHECK(round.loss.lost_saves + kLoadThreads >= unsynced_saves);  // all of them, bar one per thread
    CHECK(round.loss.lost_claims > 0);
    CHECK(!round.again.twice.empty());  // what the loss does: a retry runs a lost claim's effect again
    CHECK(round.effects_twice > 0);
}

// ---- the server gone -----------------------------------------------------------------------------

TEST_CASE("Redis stopped or killed: store_unavailable and fn never called within a bound", "[redis][fault]") {
    RedisServer server;
    const auto options = with_timeouts(server, 1s);
    idem::RedisStore store(options);
    CountedCalls call{"gone"};
    call.warm_up(store);

    SECTION("stop(): clean shutdown") { server.stop(); }
    SECTION("kill9(): the socket file stays, nobody listens") { server.kill9(); }

    for (int i = 0; i < 3; ++i) {
        const auto t0 = Clock::now();
        CHECK_THROWS_AS(call(store, "k" + std::to_string(i)), idem::store_unavailable);
        CHECK(since(t0) < 10s);
    }
    idem::RedisStore fresh(options);
    const auto t0 = Clock::now();
    CHECK_THROWS_AS(call(fresh, "fresh"), idem::store_unavailable);
    CHECK(since(t0) < 10s);
    CHECK_THROWS_AS(fresh.read(idem::Key("gone", "warm")), idem::store_unavailable);
    CHECK(call.runs == 0);
}

// ---- paused owner, paused server -----------------------------------------------------------------

TEST_CASE("a paused owner past its lease is taken over: its save gets lease_lost and the effect count is exact",
          "[redis][fault][lease]") {
    RedisServer server;
    idem::RedisStore store(server.store_options());
    const std::string scope = "paused-owner";
    const idem::Key key(scope, "k");
    const auto fp = idem::fingerprint("k");
    std::atomic<int> effects{0};
    std::atomic<bool> a_inside{false};
    std::latch release_a(1);
    std::string a_told;
    std::thread a([&] {
        try {
            auto r = idem::execute_once(
                store, key, fp,
                [&] {
                    ++effects;
                    a_inside = true;
                    release_a.wait();  // paused (GC, SIGSTOP) past its lease
                    return std::string("A");
                },
                idem::ClaimOptions{.lease = 300ms});
            a_told = std::string(idem::to_string(r.outcome()));
        } catch (const idem::lease_lost&) {
            a_told = "lease_lost";
        } catch (const std::exception& e) {
            a_told = std::string("other: ") + e.what();
        }
    });
    struct Join {
        std::latch& l;
        std::thread& t;
        ~Join() {
            if (t.joinable()) {
                l.count_down();
                t.join();
            }
        }
    } join{release_a, a};
    REQUIRE(wait_until([&] { return a_inside.load(); }, 30s));
    // The lease passes by Redis's clock (TIME in the scripts), whatever this machine's load.
    REQUIRE(wait_until(
        [&] {
            const auto r = store.read(key);
            return r && r->state == idem::RecordState::in_progress && r->lease_expired;
        },
        30s));
    // A wakes up: its save must be refused, the record must hold the new owner's result only.
    const auto wake_a = [&](const std::string& new_result) {
        release_a.count_down();
        a.join();
        CHECK(a_told == "lease_lost");
        auto record = store.read(key);
        REQUIRE(record);
        CHECK(record->state == idem::RecordState::completed);
        CHECK(record->result == std::optional<std::string>(new_result));
        return *record;
    };

    SECTION("a reconciler takes it and saves the provider's answer") {
        idem::ReconcilerOptions ro;
        ro.scopes = idem::ScopeFilter::exact(scope);
        idem::Reconciler reconciler(
            store, [](idem::Reconciliation& r) { r.save(std::string("reconciled")); }, ro);
        const auto sweep = reconciler.run_once();
        CHECK(sweep.listed == 1);
        CHECK(sweep.taken == 1);
        CHECK(sweep.saved == 1);
        CHECK(sweep.failed == 0);
        (void)wake_a("reconciled");
        CHECK(effects == 1);
        auto replay = idem::execute_once(store, key, fp, [&] {
            ++effects;
            return std::string("C");
        });
        CHECK(replay.outcome() == idem::Outcome::replayed);
        CHECK(replay.response() == "reconciled");
        CHECK(effects == 1);
    }
    SECTION("a resume-mode retry takes it over and runs the effect as attempt 2") {
        int attempt = 0;
        auto b = idem::execute_once(
            store, key, fp,
            [&](idem::Context& c) {
                ++effects;
                attempt = c.attempt();
                return std::string("B");
            },
            idem::ClaimOptions{.lease = 30s, .resume_stale = true});
        CHECK(b.outcome() == idem::Outcome::executed);
        CHECK(attempt == 2);
        CHECK(wake_a("B").attempt == 2);
        CHECK(effects == 2);  // A's and B's, each once
    }
}

TEST_CASE("a paused server (SIGSTOP): store_unavailable within command_timeout and fn not called; SIGCONT heals",
          "[redis][fault]") {
    RedisServer server;
    // Long enough that the calls before and after the pause (each an fsync'd write) answer in time
    // on a busy machine.
    idem::RedisStore store(with_timeouts(server, 1s));
    CountedCalls call{"paused"};
    call.warm_up(store);

    server.pause();
    for (int i = 0; i < 2; ++i) {
        const auto t0 = Clock::now();
        CHECK_THROWS_AS(call(store, "during-" + std::to_string(i)), idem::store_unavailable);
        const auto took = since(t0);
        CHECK(took >= 1s);  // it waited for the answer...
        CHECK(took < 8s);   // ...and no longer than a bound (timeout, one resend, a reconnect)
    }
    CHECK(call.runs == 0);
    server.resume();

    auto after = call(store, "after");
    CHECK(after.outcome() == idem::Outcome::executed);
    CHECK(call.runs == 1);
    // Late answers to the timed-out commands must not be taken for answers to new ones.
    const auto saved = store.read(idem::Key("paused", "after"));
    REQUIRE(saved);
    CHECK(saved->state == idem::RecordState::completed);
    CHECK(saved->result == std::optional<std::string>("r-after"));
    auto replay = call(store, "warm");
    CHECK(replay.outcome() == idem::Outcome::replayed);
    CHECK(replay.response() == "r-warm");
    // A claim sent while paused may have run once the server went on: its key is then in progress
    // (the reconciler's), never completed.
    for (int i = 0; i < 2; ++i) {
        const auto record = store.read(idem::Key("paused", "during-" + std::to_string(i)));
        if (record) CHECK(record->state == idem::RecordState::in_progress);
    }
}

// ---- persistence the durability needs -----------------------------------------------------------

namespace {

/// On a server started with `server_options`: a store asking for any of `refused` gets config_error
/// (not store_unavailable) and fn never runs; a store asking for `accepted` works.
void check_durability(RedisServerOptions server_options, std::initializer_list<idem::RedisDurability> refused,
                      idem::RedisDurability accepted) {
    RedisServer server(std::move(server_options));
    CountedCalls call{"durability"};
    auto options = server.store_options();
    for (const auto d : refused) {
        options.durability = d;
        idem::RedisStore store(options);
        CHECK_THROWS_AS(call(store, "k"), idem::config_error);
    }
    CHECK(call.runs == 0);
    options.durability = accepted;
    idem::RedisStore store(options);
    CHECK(call(store, "k").outcome() == idem::Outcome::executed);
    CHECK(call.runs == 1);
}

}  // namespace

TEST_CASE("a server whose persistence cannot keep the durability asked for: config_error and fn not called",
          "[redis][fault][durability]") {
    using D = idem::RedisDurability;
    SECTION("--appendonly no") {
        check_durability({.appendonly = false}, {D::fsync_always, D::fsync_everysec}, D::unchecked);
    }
    SECTION("--appendfsync everysec") {
        check_durability({.appendfsync = "everysec"}, {D::fsync_always}, D::fsync_everysec);
    }
    SECTION("--appendfsync no") {
        check_durability({.appendfsync = "no"}, {D::fsync_always, D::fsync_everysec}, D::unchecked);
    }
}

// ---- WAIT on a replica ---------------------------------------------------------------------------

TEST_CASE("wait_replicas = 1: writes succeed; with the replica paused store_unavailable within the WAIT bound",
          "[redis][fault][replica]") {
    idem_test::ReplicatedRedis pair;
    RedisServer& primary = pair.primary;
    RedisServer& replica = pair.replica;

    // Writes that must succeed go through `patient`: on a loaded machine the replica's
    // acknowledgement can take longer than the 500 ms bound that `store`, the store under test
    // with the replica paused, must keep.
    auto options = primary.store_options();
    options.wait_replicas = 1;
    options.wait_replicas_timeout = 60s;
    options.command_timeout = 70s;
    idem::RedisStore patient(options);
    options.wait_replicas_timeout = 500ms;
    options.command_timeout = 2s;
    idem::RedisStore store(options);
    CountedCalls call{"wait"};
    call.warm_up(patient);
    // The record reached the replica before the answer.
    CHECK(replica.command({"EXISTS", "idem:r:4:waitwarm"}) == ":1");
    REQUIRE(store.read(idem::Key("wait", "warm")).has_value());  // its connection (a read does not WAIT)

    SECTION("the replica paused between the claim and the save: the save is store_unavailable") {
        const idem::Key key("wait", "b");
        const auto claim = patient.claim(key, idem::fingerprint("b"));
        REQUIRE(claim.status == idem::ClaimStatus::claimed);
        replica.pause();
        const auto t0 = Clock::now();
        CHECK_THROWS_AS(store.save(key, claim.fence, "r-b"), idem::store_unavailable);
        const auto took = since(t0);
        CHECK(took >= 500ms);  // WAIT waited its bound...
        CHECK(took < 5s);      // ...and not much more (a resend at most)
        replica.resume();
    }
    SECTION("the replica paused: a claim is store_unavailable and fn never runs") {
        replica.pause();
        const auto t0 = Clock::now();
        CHECK_THROWS_AS(call(store, "c"), idem::store_unavailable);
        CHECK(since(t0) < 5s);
        CHECK(call.runs == 0);
        replica.resume();
    }
    SECTION("without wait_replicas the replica is reported in warnings()") {
        auto plain = primary.store_options();
        idem::RedisStore unwaited(plain);
        CHECK(unwaited.read(idem::Key("wait", "warm")).has_value());
        CHECK_FALSE(unwaited.warnings().empty());
    }
}

// ---- the server away while a save is sent ----------------------------------------------------------

namespace {

/// A call whose effect runs on its own thread and then waits, as if Redis went away between the
/// claim and the save: the test stops the server once effect_ran(), then lets the effect return
/// with go(); told() joins and says what the call ended with. `work` gets the function its effect
/// calls after counting itself.
class CallOnThread {
public:
    explicit CallOnThread(std::function<std::string(const std::function<void()>&)> work)
        : thread_([this, work = std::move(work)] {
              try {
                  told_ = work([this] {
                      phase_ = 1;
                      while (phase_.load() < 2) std::this_thread::sleep_for(1ms);
                  });
              } catch (const idem::response_not_saved&) {
                  told_ = "response_not_saved";
              } catch (const std::exception& e) {
                  told_ = std::string("other: ") + e.what();
              }
              phase_ = 3;
          }) {}
    ~CallOnThread() {
        go();
        if (thread_.joinable()) thread_.join();
    }
    CallOnThread(const CallOnThread&) = delete;
    CallOnThread& operator=(const CallOnThread&) = delete;

    [[nodiscard]] bool effect_ran() const { return phase_.load() >= 1; }
    [[nodiscard]] bool done() const { return phase_.load() == 3; }
    void go() {
        int waiting = 1;
        phase_.compare_exchange_strong(waiting, 2);
    }
    std::string told() {
        go();
        thread_.join();
        return told_;
    }

private:
    std::atomic<int> phase_{0};
    std::string told_;
    std::thread thread_;
};

/// What execute_batch answered: "executed <bytes>;" or "failed <error>;" (else "other;") per message.
std::string batch_told(const std::vector<idem::BatchEntry<std::string>>& entries) {
    std::string told;
    for (const auto& e : entries) {
        if (e.outcome == idem::BatchOutcome::executed) {
            told += "executed " + e.response.value_or("");
        } else if (e.outcome == idem::BatchOutcome::failed && e.error) {
            try {
                std::rethrow_exception(e.error);
            } catch (const idem::response_not_saved&) {
                told += "failed response_not_saved";
            } catch (const std::exception& x) {
                told += std::string("failed ") + x.what();
            }
        } else {
            told += "other";
        }
        told += ";";
    }
    return told;
}

/// Stops `server` while `call`'s effect waits, lets the call go on, waits until its save has failed
/// twice (it is trying; or the call ended), keeps the server away `away` longer, starts it again.
void outage_during_save(RedisServer& server, idem::RedisStore& store, CallOnThread& call,
                        std::chrono::milliseconds away) {
    REQUIRE(wait_until([&] { return call.effect_ran(); }, 30s));
    const auto retries = store.stats().retries;
    server.stop();
    call.go();
    CHECK(wait_until([&] { return store.stats().retries >= retries + 2 || call.done(); }, 30s));
    std::this_thread::sleep_for(away);
    server.start();
}

}  // namespace

TEST_CASE("Redis away for ~1 s between the claim and the save: the save keeps trying and lands once",
          "[redis][fault][save_retry]") {
    RedisServer server;
    idem::RedisStore store(server.store_options());  // save_retry_window: the default (15 s)
    Effects effects;
    const std::string scope = "outage";
    REQUIRE(run_call(store, effects, scope, "warm").told == "executed");

    CallOnThread saver([&](const std::function<void()>& then_away) {
        auto r = idem::execute_once(store, idem::Key(scope, "k"), idem::fingerprint("k"), [&] {
            effects.ran("k");
            then_away();
            return result_for("k");
        });
        return std::string(idem::to_string(r.outcome())) + " " + r.response();
    });
    outage_during_save(server, store, saver, 1s);
    CHECK(saver.told() == "executed " + result_for("k"));
    CHECK(effects.runs("k") == 1);

    const Call replay = run_call(store, effects, scope, "k");
    CHECK(replay.told == "replayed");
    CHECK(replay.bytes == result_for("k"));
    CHECK(effects.runs("k") == 1);
}

TEST_CASE("Redis away for ~1 s between claim_batch and save_batch: the batch save keeps trying and lands once",
          "[redis][fault][save_retry]") {
    RedisServer server;
    idem::RedisStore store(server.store_options());
    Effects effects;
    const std::string scope = "outage-batch";
    REQUIRE(run_call(store, effects, scope, "warm").told == "executed");
    const std::vector<std::string> names{"a", "b", "c"};
    std::vector<idem::Message> batch;
    for (const auto& n : names) batch.push_back({idem::Key(scope, n), idem::fingerprint(n)});

    CallOnThread saver([&](const std::function<void()>& then_away) {
        auto entries = idem::execute_batch(store, batch, [&](std::size_t i) {
            effects.ran(names[i]);
            if (i + 1 == names.size()) then_away();
            return result_for(names[i]);
        });
        return batch_told(entries);
    });
    outage_during_save(server, store, saver, 1s);
    CHECK(saver.told() == "executed result-of-a;executed result-of-b;executed result-of-c;");
    for (const auto& n : names) {
        CHECK(effects.runs(n) == 1);
        const Call replay = run_call(store, effects, scope, n);
        CHECK(replay.told == "replayed");
        CHECK(replay.bytes == result_for(n));
        CHECK(effects.runs(n) == 1);
    }
}

TEST_CASE("Redis away longer than save_retry_window: response_not_saved after about the window, key in progress",
          "[redis][fault][save_retry]") {
    RedisServer server;
    auto options = server.store_options();
    options.save_retry_window = 1s;
    idem::RedisStore store(options);
    Effects effects;
    const std::string scope = "outage-long";
    REQUIRE(run_call(store, effects, scope, "warm").told == "executed");
    const idem::Key key(scope, "k");

    Clock::time_point stopped{};
    std::string told;
    std::string bytes;
    try {
        (void)idem::execute_once(store, key, idem::fingerprint("k"), [&] {
            effects.ran("k");
            server.stop();  // until after the call
            stopped = Clock::now();
            return result_for("k");
        });
        told = "executed";
    } catch (const idem::response_not_saved& e) {
        told = "response_not_saved";
        bytes = e.encoded_result();
    }
    const auto took = since(stopped);
    CHECK(told == "response_not_saved");
    CHECK(bytes == result_for("k"));  // the caller can still answer its client
    CHECK(took >= 1s);                // it kept trying for the window...
    CHECK(took < 10s);                // ...and then gave up (a backoff of at most 1 s, a connect)
    CHECK(store.stats().retries >= 3);

    server.start();
    const auto record = store.read(key);
    REQUIRE(record);
    CHECK(record->state == idem::RecordState::in_progress);  // for the reconciler: never completed
    CHECK_FALSE(record->result);
    CHECK(run_call(store, effects, scope, "k").told == "in_progress");
    CHECK(effects.runs("k") == 1);
}

TEST_CASE("Redis away longer than save_retry_window during save_batch: each save response_not_saved, keys in progress",
          "[redis][fault][save_retry]") {
    RedisServer server;
    auto options = server.store_options();
    options.save_retry_window = 1s;
    idem::RedisStore store(options);
    Effects effects;
    const std::string scope = "outage-batch-long";
    REQUIRE(run_call(store, effects, scope, "warm").told == "executed");
    const std::vector<std::string> names{"a", "b", "c"};
    std::vector<idem::Message> batch;
    for (const auto& n : names) batch.push_back({idem::Key(scope, n), idem::fingerprint(n)});

    Clock::time_point stopped{};
    const auto entries = idem::execute_batch(store, batch, [&](std::size_t i) {
        effects.ran(names[i]);
        if (i + 1 == names.size()) {
            server.stop();
            stopped = Clock::now();
        }
        return result_for(names[i]);
    });
    const auto took = since(stopped);
    CHECK(batch_told(entries) == "failed response_not_saved;failed response_not_saved;failed response_not_saved;");
    CHECK(took >= 1s);
    CHECK(took < 10s);

    server.start();
    for (const auto& n : names) {
        const auto record = store.read(idem::Key(scope, n));
        REQUIRE(record);
        CHECK(record->state == idem::RecordState::in_progress);
        CHECK(run_call(store, effects, scope, n).told == "in_progress");
        CHECK(effects.runs(n) == 1);
    }
}

TEST_CASE("Redis away: a claim still hears store_unavailable at once, whatever save_retry_window",
          "[redis][fault][save_retry]") {
    RedisServer server;
    idem::RedisStore store(with_timeouts(server, 1s));
    CHECK(store.options().save_retry_window == 15s);  // the default
    CountedCalls call{"outage-claim"};
    call.warm_up(store);
    server.stop();
    const auto t0 = Clock::now();
    CHECK_THROWS_AS(call(store, "k"), idem::store_unavailable);
    CHECK(since(t0) < 5s);  // well inside the window: not retried
    CHECK(call.runs == 0);
}

// ---- the server loading its dataset after a restart --------------------------------------------------

namespace {

/// A server slow to load its dataset: 2,000 keys in its AOF's RDB base (BGREWRITEAOF) at 2 ms
/// each (--key-load-delay, in microseconds): about 4 s of `-LOADING` after each start, clients
/// served every KiB loaded. The keys are written before the store's; the server is ready.
RedisServer slow_loading_server() {
    return RedisServer(RedisServerOptions{
        .extra_args = {"--key-load-delay", "2000", "--loading-process-events-interval-bytes", "1024"}});
}

void fill_and_rewrite(RedisServer& server) {
    REQUIRE(server.command({"EVAL", "for i = 1, 2000 do redis.call('SET', 'fill:' .. i, 'x') end return 1", "0"}) ==
            ":1");
    REQUIRE(server.command({"BGREWRITEAOF"}).rfind("+", 0) == 0);
    REQUIRE(wait_until(
        [&] {
            return info_persistence(server, "aof_rewrite_in_progress") == 0 &&
                   info_persistence(server, "aof_rewrite_scheduled") == 0 &&
                   server.command({"INFO", "persistence"}).find("aof_last_bgrewrite_status:ok") != std::string::npos;
        },
        30s));
}

/// The server's answer to PING from a new connection ("+PONG", "-LOADING ..."), or "" when it
/// cannot be reached.
std::string ping(const RedisServer& server) {
    try {
        return server.command({"PING"}, 2s);
    } catch (const std::runtime_error&) {
        return "";
    }
}

}  // namespace

TEST_CASE("Redis restarted and loading its dataset: a save keeps trying and lands; a claim is store_unavailable",
          "[redis][fault][save_retry]") {
    RedisServer server = slow_loading_server();
    fill_and_rewrite(server);
    auto options = server.store_options();
    options.save_retry_window = 60s;  // far past the loading: the save must not give up on its own
    idem::RedisStore store(options);
    Effects effects;
    const std::string scope = "loading";
    REQUIRE(run_call(store, effects, scope, "warm").told == "executed");

    CallOnThread saver([&](const std::function<void()>& then_away) {
        auto r = idem::execute_once(store, idem::Key(scope, "k"), idem::fingerprint("k"), [&] {
            effects.ran("k");
            then_away();
            return result_for("k");
        });
        return std::string(idem::to_string(r.outcome())) + " " + r.response();
    });
    REQUIRE(wait_until([&] { return saver.effect_ran(); }, 30s));
    const auto retries = store.stats().retries;
    server.stop();
    saver.go();
    CHECK(wait_until([&] { return store.stats().retries >= retries + 2 || saver.done(); }, 30s));

    // While the server loads (start() below returns once it answers PING), a claim through a store
    // with no connection yet: the server's passing state, not a configuration to fix.
    std::string claim_told;
    bool loading_after_claim = false;
    std::thread prober([&] {
        if (!wait_until([&] { return ping(server).rfind("-LOADING", 0) == 0; }, 30s)) {
            claim_told = "the server was never seen loading";
            return;
        }
        idem::RedisStore fresh(options);
        try {
            (void)fresh.claim(idem::Key(scope, "during-loading"), idem::fingerprint("d"));
            claim_told = "claimed";
        } catch (const idem::store_unavailable& e) {
            claim_told = std::string("store_unavailable: ") + e.what();
        } catch (const idem::config_error& e) {
            claim_told = std::string("config_error: ") + e.what();
        } catch (const std::exception& e) {
            claim_told = std::string("other: ") + e.what();
        }
        loading_after_claim = ping(server).rfind("-LOADING", 0) == 0;
    });
    server.start();
    prober.join();
    INFO("the claim during loading: " << claim_told);
    CHECK(claim_told.rfind("store_unavailable: ", 0) == 0);
    CHECK_THAT(claim_told, Catch::Contains("LOADING"));
    CHECK(loading_after_claim);  // the claim was answered while the server was still loading

    CHECK(saver.told() == "executed " + result_for("k"));
    CHECK(effects.runs("k") == 1);
    const Call replay = run_call(store, effects, scope, "k");
    CHECK(replay.told == "replayed");
    CHECK(replay.bytes == result_for("k"));
    CHECK(effects.runs("k") == 1);
}
