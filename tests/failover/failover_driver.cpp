// failover_driver — load generator and checker for the Patroni failover test.
//
// Run by scripts/failover-test.sh (which owns the cluster and the faults); see that script.
//
//   failover_driver --conninfo "host=127.0.0.1,127.0.0.1 port=P1,P2 ... target_session_attrs=read-write"
//                   --control DIR [--threads 8] [--max-seconds 240] [--label sync]
//
// Workers call execute_once on fresh keys, half of them in plain mode (claim, effect, save: the
// effect INSERTs into failover_effects through a separate libpq connection with the same multi-host
// conninfo) and half in in-transaction mode (the effect's INSERT commits with the claim and the
// saved response). A client that gets store_unavailable retries the same key, as a client would.
// Every call's outcome goes into a history.
//
// Control files in DIR (the script writes fault-N and stop; the driver writes the rest):
//   ready            setup done (schema, effects table), load running
//   fault-N          the script killed the leader; content: the kill time, ns since the epoch
//   recovered-N      first execute_once that started after fault N and succeeded; content: ms
//   stop             finish: stop the load, check the history against the database, report
//
// Checks on the database after the load (through the same store, i.e. on the new leader):
//   * every key told executed/replayed has its record completed with byte-identical result bytes,
//     and execute_once on it again replays exactly those bytes without running the effect;
//   * effects per key <= 1 (no duplicate effect); acknowledged keys have exactly 1;
//   * in-transaction keys: completed record <=> one effect (they commit together).
// Exit status: 0 no anomaly, 1 anomalies (printed), 2 setup failure.
#include <libpq-fe.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "idem/idem.hpp"
#include "idem/postgres_transaction.hpp"

namespace fs = std::filesystem;
using SysClock = std::chrono::system_clock;
using std::chrono::milliseconds;

namespace {

// ---- options ------------------------------------------------------------------------------------

struct Options {
    std::string conninfo;
    fs::path control;
    int threads = 8;
    int max_seconds = 240;
    std::string label = "run";
};

[[noreturn]] void usage(const char* why) {
    std::cerr << "failover_driver: " << why
              << "\nusage: failover_driver --conninfo CONNINFO --control DIR [--threads N] [--max-seconds S] "
                 "[--label NAME]\n";
    std::exit(2);
}

Options parse(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        const auto next = [&]() -> std::string {
            if (i + 1 >= argc) usage(("missing value for " + a).c_str());
            return argv[++i];
        };
        if (a == "--conninfo") o.conninfo = next();
        else if (a == "--control") o.control = next();
        else if (a == "--threads") o.threads = std::stoi(next());
        else if (a == "--max-seconds") o.max_seconds = std::stoi(next());
        else if (a == "--label") o.label = next();
        else usage(("unknown argument " + a).c_str());
    }
    if (o.conninfo.empty() || o.control.empty()) usage("--conninfo and --control are required");
    if (o.threads < 1 || o.threads > 64) usage("--threads must be 1..64");
    return o;
}

void write_file(const fs::path& path, const std::string& content) {
    const fs::path tmp = path.string() + ".tmp";
    {
        std::ofstream f(tmp);
        f << content << '\n';
    }
    fs::rename(tmp, path);
}

std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(SysClock::now().time_since_epoch()).count();
}

// ---- a plain libpq connection (the plain-mode effect, setup, counting) ----------------------------

struct PgConnDeleter {
    void operator()(PGconn* c) const noexcept { PQfinish(c); }
};
struct PgResultDeleter {
    void operator()(PGresult* r) const noexcept { PQclear(r); }
};
using PgConnPtr = std::unique_ptr<PGconn, PgConnDeleter>;
using PgResultPtr = std::unique_ptr<PGresult, PgResultDeleter>;

/// The effect certainly did not happen (refused before or by the server): safe to release.
struct effect_not_done : idem::not_performed {
    using idem::not_performed::not_performed;
};

class Sql {
public:
    explicit Sql(std::string conninfo) : conninfo_(std::move(conninfo)) {}

    /// Runs `sql`; nullopt with `error` set on failure. `certain_failure` tells whether the
    /// statement certainly did not commit (connect failure or a server error result), as opposed to
    /// a connection lost with the answer (outcome unknown).
    std::optional<PgResultPtr> exec(const std::string& sql, const std::vector<std::string>& params, std::string& error,
                                    bool& certain_failure) {
        certain_failure = true;
        if (!conn_ || PQstatus(conn_.get()) != CONNECTION_OK) {
            conn_.reset(PQconnectdb(conninfo_.c_str()));
            if (!conn_ || PQstatus(conn_.get()) != CONNECTION_OK) {
                error = conn_ ? PQerrorMessage(conn_.get()) : "out of memory";
                conn_.reset();
                return std::nullopt;
            }
        }
        std::vector<const char*> values;
        for (const auto& p : params) values.push_back(p.c_str());
        PgResultPtr r(PQexecParams(conn_.get(), sql.c_str(), static_cast<int>(values.size()), nullptr, values.data(),
                                   nullptr, nullptr, 0));
        const auto status = r ? PQresultStatus(r.get()) : PGRES_FATAL_ERROR;
        if (status == PGRES_COMMAND_OK || status == PGRES_TUPLES_OK) return r;
        const char* state = r ? PQresultErrorField(r.get(), PG_DIAG_SQLSTATE) : nullptr;
        error = std::string(state ? state : "-----") + " " + PQerrorMessage(conn_.get());
        // A server error result means the autocommit statement rolled back. No SQLSTATE means
        // the connection went away: the statement may or may not have committed.
        certain_failure = state != nullptr && std::string(state) != "57P01";  // 57P01 can race a commit
        if (PQstatus(conn_.get()) != CONNECTION_OK || !certain_failure) conn_.reset();
        return std::nullopt;
    }

    PgResultPtr must(const std::string& sql, const std::vector<std::string>& params = {}) {
        std::string error;
        bool certain = false;
        auto r = exec(sql, params, error, certain);
        if (!r) throw std::runtime_error("SQL failed: " + sql + ": " + error);
        return std::move(*r);
    }

private:
    std::string conninfo_;
    PgConnPtr conn_;
};

// ---- history --------------------------------------------------------------------------------------

enum class Mode { plain, tx };
enum class Final { executed, replayed, unknown, gave_up_in_progress, gave_up_unavailable, mismatch, other, stopped };

const char* name(Final f) {
    switch (f) {
        case Final::executed: return "executed";
        case Final::replayed: return "replayed";
        case Final::unknown: return "outcome_unknown";
        case Final::gave_up_in_progress: return "gave_up_in_progress";
        case Final::gave_up_unavailable: return "gave_up_unavailable";
        case Final::mismatch: return "mismatch";
        case Final::other: return "other_error";
        case Final::stopped: return "stopped";
    }
    return "?";
}

struct Entry {
    std::string value;  // key value (scope is fixed)
    Mode mode;
    Final final = Final::stopped;
    std::string told;  // encoded response the client was told (executed/replayed)
    int calls = 0;
};

struct Fault {
    std::int64_t killed_ns = 0;
    std::int64_t first_error_ns = 0;  // first failed call that started after the kill
    std::int64_t recovered_ns = 0;    // first successful call that started after the kill
    std::uint64_t errors_until_recovered = 0;
};

struct Shared {
    std::mutex mutex;
    std::vector<Fault> faults;  // index = fault number - 1
    std::atomic<bool> stop{false};
    std::atomic<std::uint64_t> calls{0}, acked{0};
    std::map<std::string, std::uint64_t> errors;  // by kind / sqlstate
    fs::path control;

    void error(const std::string& kind, std::int64_t started_ns) {
        std::lock_guard lock(mutex);
        ++errors[kind];
        for (auto& f : faults) {
            if (f.killed_ns != 0 && started_ns >= f.killed_ns && f.recovered_ns == 0) {
                ++f.errors_until_recovered;
                if (f.first_error_ns == 0) f.first_error_ns = now_ns();
            }
        }
    }
    void success(std::int64_t started_ns) {
        std::lock_guard lock(mutex);
        for (std::size_t i = 0; i < faults.size(); ++i) {
            Fault& f = faults[i];
            if (f.killed_ns != 0 && started_ns >= f.killed_ns && f.recovered_ns == 0) {
                f.recovered_ns = now_ns();
                const double ms = static_cast<double>(f.recovered_ns - f.killed_ns) / 1e6;
                char buf[64];
                std::snprintf(buf, sizeof buf, "%.0f", ms);
                write_file(control / ("recovered-" + std::to_string(i + 1)), buf);
            }
        }
    }
};

const idem::Key& scope_key() {
    static const idem::Key k("failover", "scope");
    return k;
}

std::string random_bytes(std::mt19937_64& rng, std::size_t n) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng() & 0xFF);
    return s;
}

// ---- the worker -------------------------------------------------------------------------------------

void worker(int id, const Options& opt, idem::PostgresStore& store, Shared& shared, const std::string& run,
            std::vector<Entry>& history) {
    std::mt19937_64 rng(std::random_device{}() ^ static_cast<std::uint64_t>(id));
    Sql effects_conn(opt.conninfo);
    const std::string scope = scope_key().scope();
    const std::string thread = std::to_string(id);
    for (std::uint64_t n = 0; !shared.stop.load(); ++n) {
        Entry e;
        e.value = run + "-t" + thread + "-" + std::to_string(n);
        e.mode = (id % 2 == 0) ? Mode::plain : Mode::tx;
        const idem::Key key(scope, e.value);
        const idem::Fingerprint fp = idem::fingerprint(std::string("failover"), e.value, std::int64_t{1999});
        const idem::Response response{
            201, "charge " + e.value + " " + random_bytes(rng, 16), {{"x-key", e.value}, {"x-thread", thread}}};
        const auto plain_effect = [&]() -> idem::Response {
            std::string error;
            bool certain = false;
            if (!effects_conn.exec(
                    "INSERT INTO failover_effects (scope, key, thread, mode) VALUES ($1, $2, $3, 'plain')",
                    {scope, e.value, thread}, error, certain)) {
                if (certain) throw effect_not_done("effect refused: " + error);
                throw std::runtime_error("effect outcome unknown: " + error);
            }
            return response;
        };
        const auto tx_effect = [&](idem::Transaction& tx) -> idem::Response {
            tx.exec("INSERT INTO failover_effects (scope, key, thread, mode) VALUES ($1, $2, $3, 'tx')",
                    {scope, e.value, thread});
            return response;
        };

        int unavailable = 0, in_progress = 0;
        const auto key_started = std::chrono::steady_clock::now();
        for (;;) {
            if (shared.stop.load()) break;
            // A client gives a key up after a while (it would surface the error to its user).
            if (std::chrono::steady_clock::now() - key_started > std::chrono::seconds(60)) {
                e.final = unavailable > 0 ? Final::gave_up_unavailable : Final::gave_up_in_progress;
                break;
            }
            const std::int64_t started = now_ns();
            ++e.calls;
            shared.calls.fetch_add(1);
            try {
                auto result = e.mode == Mode::plain ? idem::execute_once(store, key, fp, plain_effect)
                                                    : idem::execute_once_in_transaction(store, key, fp, tx_effect);
                switch (result.outcome()) {
                    case idem::Outcome::executed:
                    case idem::Outcome::replayed:
                        e.final = result.outcome() == idem::Outcome::executed ? Final::executed : Final::replayed;
                        e.told = idem::codec<idem::Response>::encode(result.response());
                        shared.acked.fetch_add(1);
                        shared.success(started);
                        break;
                    case idem::Outcome::in_progress:
                        // Someone (an earlier attempt of ours whose outcome is unknown) holds the key.
                        shared.error("answer in_progress", started);
                        if (++in_progress > 10) {
                            e.final = e.final == Final::unknown ? Final::unknown : Final::gave_up_in_progress;
                            break;
                        }
                        std::this_thread::sleep_for(std::min(result.retry_after(), milliseconds(300)));
                        continue;
                    case idem::Outcome::mismatch: e.final = Final::mismatch; break;
                }
                break;
            } catch (const idem::store_unavailable& x) {
                // Nothing was claimed by this call (plain mode) / the transaction rolled back or
                // never started: retry the same key.
                shared.error("store_unavailable " + (x.sqlstate().empty() ? std::string("-") : x.sqlstate()), started);
                ++unavailable;
                std::this_thread::sleep_for(milliseconds(50 + static_cast<int>(rng() % 100)));
            } catch (const effect_not_done&) {
                shared.error("effect refused (released)", started);
                std::this_thread::sleep_for(milliseconds(50 + static_cast<int>(rng() % 100)));
            } catch (const idem::outcome_unknown& x) {
                // The effect may have happened and its result is not stored (plain: key stays in
                // progress; tx: COMMIT answer lost). A client retries the same key to learn more.
                shared.error(std::string("outcome_unknown ") + (x.sqlstate().empty() ? "-" : x.sqlstate()), started);
                e.final = Final::unknown;
                std::this_thread::sleep_for(milliseconds(100));
            } catch (const idem::database_error& x) {
                shared.error("database_error " + x.sqlstate(), started);
                std::this_thread::sleep_for(milliseconds(100));
                if (++unavailable > 200) {
                    e.final = Final::other;
                    break;
                }
            } catch (const std::exception& x) {
                // The plain effect's unknown outcome (runtime_error) lands here: key stays in progress.
                const std::string what = x.what();
                shared.error(what.starts_with("effect outcome unknown") ? "effect outcome unknown"
                                                                        : "other: " + what.substr(0, 80),
                             started);
                e.final = Final::unknown;
                std::this_thread::sleep_for(milliseconds(100));
            }
        }
        history.push_back(std::move(e));
    }
}

// ---- verification -------------------------------------------------------------------------------------

template <class F>
auto with_retries(F&& f) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (;;) {
        try {
            return f();
        } catch (const idem::store_unavailable&) {
            if (std::chrono::steady_clock::now() > until) throw;
            std::this_thread::sleep_for(milliseconds(200));
        }
    }
}

}  // namespace

int main(int argc, char** argv) {
    const Options opt = parse(argc, argv);
    fs::create_directories(opt.control);
    idem::PostgresOptions po;
    po.pool_size = static_cast<std::size_t>(opt.threads) + 2;
    po.connect_timeout = std::chrono::seconds(2);
    po.statement_timeout = std::chrono::seconds(5);
    po.lock_timeout = std::chrono::seconds(1);
    po.pool_wait = std::chrono::seconds(5);
    po.application_name = "idem-failover-" + opt.label;
    idem::PostgresStore store(opt.conninfo, po);

    const auto t0 = std::chrono::steady_clock::now();
    const auto hard_stop = t0 + std::chrono::seconds(opt.max_seconds);
    // ---- setup (bounded) ----
    for (int attempt = 1;; ++attempt) {
        try {
            store.ensure_schema();
            Sql sql(opt.conninfo);
            sql.must(
                "CREATE TABLE IF NOT EXISTS failover_effects (id bigserial PRIMARY KEY, scope text NOT NULL, "
                "key text NOT NULL, thread int NOT NULL, mode text NOT NULL, at timestamptz DEFAULT now())");
            sql.must("CREATE INDEX IF NOT EXISTS failover_effects_key ON failover_effects (scope, key)");
            break;
        } catch (const std::exception& e) {
            if (attempt >= 30) {
                std::cerr << "failover_driver: setup failed: " << e.what() << '\n';
                return 2;
            }
            std::this_thread::sleep_for(std::chrono::seconds(1));
        }
    }
    std::mt19937_64 rng(std::random_device{}());
    char run[16];
    std::snprintf(run, sizeof run, "r%08llx", static_cast<unsigned long long>(rng() & 0xFFFFFFFF));

    Shared shared;
    shared.control = opt.control;
    std::vector<std::vector<Entry>> histories(static_cast<std::size_t>(opt.threads));
    std::vector<std::thread> threads;
    for (int i = 0; i < opt.threads; ++i) {
        threads.emplace_back(worker, i, std::cref(opt), std::ref(store), std::ref(shared), std::string(run),
                             std::ref(histories[static_cast<std::size_t>(i)]));
    }
    write_file(opt.control / "ready", run);
    std::cout << "failover_driver[" << opt.label << "]: load running (" << opt.threads << " threads, run " << run << ")"
              << std::endl;

    // ---- watch the control directory ----
    std::size_t faults_seen = 0;
    while (!fs::exists(opt.control / "stop") && std::chrono::steady_clock::now() < hard_stop) {
        const fs::path next = opt.control / ("fault-" + std::to_string(faults_seen + 1));
        if (fs::exists(next)) {
            std::ifstream f(next);
            std::int64_t ns = 0;
            f >> ns;
            if (ns > 0) {
                std::lock_guard lock(shared.mutex);
                shared.faults.push_back(Fault{ns, 0, 0, 0});
                ++faults_seen;
                std::cout << "failover_driver[" << opt.label << "]: fault " << faults_seen << " (leader killed), "
                          << shared.acked.load() << " acknowledged so far" << std::endl;
            }
        }
        std::this_thread::sleep_for(milliseconds(10));
    }
    const bool timed_out = !fs::exists(opt.control / "stop");
    shared.stop = true;
    for (auto& t : threads) t.join();
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    // ---- verify against the (new) leader ----
    std::vector<Entry> all;
    for (auto& h : histories) {
        for (auto& e : h) all.push_back(std::move(e));
    }
    std::map<std::string, long long> effects;
    try {
        with_retries([&] {
            Sql sql(opt.conninfo);
            auto r = sql.must("SELECT key, count(*) FROM failover_effects WHERE key LIKE $1 GROUP BY key",
                              {std::string(run) + "-%"});
            effects.clear();
            for (int i = 0; i < PQntuples(r.get()); ++i)
                effects[PQgetvalue(r.get(), i, 0)] = std::atoll(PQgetvalue(r.get(), i, 1));
            return 0;
        });
    } catch (const std::exception& e) {
        std::cerr << "failover_driver: cannot read the effects table: " << e.what() << '\n';
        return 2;
    }

    // Every key is checked, by `threads` checkers in parallel (each read/replay is a round trip).
    struct Tally {
        std::vector<std::string> anomalies;
        std::map<std::string, std::uint64_t> finals;
        std::uint64_t lost_acks = 0, duplicate_effects = 0, lost_effects = 0, wrong_bytes = 0, tx_split = 0,
                      replays_checked = 0, replay_failed = 0, unknown_completed = 0, unknown_in_progress = 0;
    };
    const auto check = [&](std::size_t begin, std::size_t end, Tally& t) {
        const auto anomaly = [&](std::string s) {
            if (t.anomalies.size() < 30) t.anomalies.push_back(std::move(s));
        };
        for (std::size_t i = begin; i < end; ++i) {
            const Entry& e = all[i];
            ++t.finals[std::string(e.mode == Mode::plain ? "plain " : "tx ") + name(e.final)];
            const idem::Key key(scope_key().scope(), e.value);
            const auto found = effects.find(e.value);
            const long long n = found == effects.end() ? 0 : found->second;
            const bool acked = e.final == Final::executed || e.final == Final::replayed;
            if (n > 1) {
                ++t.duplicate_effects;
                anomaly(e.value + ": " + std::to_string(n) + " effects (duplicate effect)");
            }
            const std::optional<idem::Record> rec = with_retries([&] { return store.read(key); });
            const bool completed = rec && rec->state == idem::RecordState::completed;
            if (e.mode == Mode::tx && completed != (n == 1)) {
                ++t.tx_split;
                anomaly(e.value + ": in-transaction key " + (completed ? "completed" : "not completed") + " with " +
                        std::to_string(n) + " effects");
            }
            if (!acked) {
                if (completed) ++t.unknown_completed;
                else if (rec) ++t.unknown_in_progress;
                continue;
            }
            if (n != 1) {
                ++t.lost_effects;
                anomaly(e.value + ": acknowledged (" + name(e.final) + ") but " + std::to_string(n) + " effects");
            }
            if (!completed) {
                ++t.lost_acks;
                anomaly(e.value + ": acknowledged (" + name(e.final) + ") but the record is " +
                        (rec ? "in progress" : "missing") + " on the new leader (lost save)");
                continue;
            }
            if (*rec->result != e.told) {
                ++t.wrong_bytes;
                anomaly(e.value + ": stored result differs from what the client was told");
                continue;
            }
            // Replay through execute_once: same bytes, and the effect must not run.
            ++t.replays_checked;
            bool ran = false;
            const idem::Fingerprint fp = idem::fingerprint(std::string("failover"), e.value, std::int64_t{1999});
            auto again = with_retries([&] {
                return idem::execute_once(store, key, fp, [&] {
                    ran = true;
                    return idem::Response{500, "must not run"};
                });
            });
            if (ran || !again.is_replay() || idem::codec<idem::Response>::encode(again.response()) != e.told) {
                ++t.replay_failed;
                anomaly(e.value + ": replay after failover was not byte-identical (or the effect ran again)");
            }
        }
    };
    const auto verify_started = std::chrono::steady_clock::now();
    std::vector<Tally> tallies(static_cast<std::size_t>(opt.threads));
    std::atomic<bool> verify_failed{false};
    {
        std::vector<std::thread> checkers;
        const std::size_t per = (all.size() + tallies.size() - 1) / tallies.size();
        for (std::size_t k = 0; k < tallies.size(); ++k) {
            checkers.emplace_back([&, k] {
                try {
                    check(std::min(all.size(), k * per), std::min(all.size(), (k + 1) * per), tallies[k]);
                } catch (const std::exception& e) {
                    std::cerr << "failover_driver: verification failed: " << e.what() << '\n';
                    verify_failed = true;
                }
            });
        }
        for (auto& c : checkers) c.join();
    }
    if (verify_failed) return 2;
    const double verify_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - verify_started).count();
    Tally sum;
    for (auto& t : tallies) {
        for (auto& a : t.anomalies) {
            if (sum.anomalies.size() < 30) sum.anomalies.push_back(std::move(a));
        }
        for (const auto& [k, v] : t.finals) sum.finals[k] += v;
        sum.lost_acks += t.lost_acks;
        sum.duplicate_effects += t.duplicate_effects;
        sum.lost_effects += t.lost_effects;
        sum.wrong_bytes += t.wrong_bytes;
        sum.tx_split += t.tx_split;
        sum.replays_checked += t.replays_checked;
        sum.replay_failed += t.replay_failed;
        sum.unknown_completed += t.unknown_completed;
        sum.unknown_in_progress += t.unknown_in_progress;
    }
    const auto& [anomalies, finals, lost_acks, duplicate_effects, lost_effects, wrong_bytes, tx_split, replays_checked,
                 replay_failed, unknown_completed, unknown_in_progress] = sum;

    // ---- report ----
    std::ostringstream out;
    out << "failover_driver[" << opt.label << "] report\n";
    out << "  load: " << load_s << " s, " << opt.threads << " threads, calls " << shared.calls.load() << ", keys "
        << all.size() << ", acknowledged " << shared.acked.load() << (timed_out ? "  (stopped by --max-seconds)" : "")
        << "\n";
    out << "  faults: " << shared.faults.size() << "\n";
    for (std::size_t i = 0; i < shared.faults.size(); ++i) {
        const Fault& f = shared.faults[i];
        out << "    fault " << i + 1 << ": ";
        if (f.recovered_ns) {
            out << "time to recover " << static_cast<double>(f.recovered_ns - f.killed_ns) / 1e9 << " s";
        } else {
            out << "NOT RECOVERED";
        }
        if (f.first_error_ns)
            out << ", first error after " << static_cast<double>(f.first_error_ns - f.killed_ns) / 1e9 << " s";
        out << ", " << f.errors_until_recovered << " failed calls until recovered\n";
    }
    out << "  outcomes per key:";
    for (const auto& [k, v] : finals) out << " [" << k << ": " << v << "]";
    out << "\n  errors seen by clients (retried):";
    for (const auto& [k, v] : shared.errors) out << " [" << k << ": " << v << "]";
    out << "\n  not acknowledged: " << unknown_completed << " completed anyway (answer lost), " << unknown_in_progress
        << " left in progress (outcome unknown, awaits reconciliation)\n";
    out << "  checks (" << verify_s << " s): replays " << replays_checked << " byte-identical "
        << replays_checked - replay_failed << "; lost acknowledged saves " << lost_acks << "; wrong bytes "
        << wrong_bytes << "; duplicate effects " << duplicate_effects << "; acknowledged without effect "
        << lost_effects << "; in-transaction split " << tx_split << "\n";
    const std::size_t total_anomalies =
        lost_acks + wrong_bytes + duplicate_effects + lost_effects + tx_split + replay_failed;
    out << "  anomalies: " << total_anomalies << "\n";
    for (const auto& a : anomalies) out << "    - " << a << "\n";
    bool unrecovered = false;
    for (const auto& f : shared.faults) unrecovered |= f.recovered_ns == 0;
    if (unrecovered) out << "  (a fault was not followed by a successful call)\n";
    std::cout << out.str();
    // Machine-readable summary for the script.
    std::string recover;
    for (const auto& f : shared.faults) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%s%.1fs", recover.empty() ? "" : ",",
                      f.recovered_ns ? static_cast<double>(f.recovered_ns - f.killed_ns) / 1e9 : -1.0);
        recover += buf;
    }
    std::ofstream(opt.control / "summary")
        << "calls=" << shared.calls.load() << " keys=" << all.size()
        << " time_to_recover=" << (recover.empty() ? "-" : recover) << " acked=" << shared.acked.load()
        << " faults=" << shared.faults.size() << " anomalies=" << total_anomalies << " lost_acks=" << lost_acks
        << " duplicate_effects=" << duplicate_effects << "\n";
    return total_anomalies == 0 && !unrecovered ? 0 : 1;
}
