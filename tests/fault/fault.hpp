// tests/fault/fault.hpp — the fault suite's shared machinery (not part of idem).
//
//   Effects   the ground truth: every run of the effect INSERTs a row over its own autocommit
//             connection (synchronous_commit=on), so duplicates are counted by the database.
//   History   per call: the key, what the caller was told (executed + bytes, replayed + bytes,
//             in_progress, mismatch, or the error type), whether fn ran and which effect it made.
//   Load      N client threads racing on shared keys, retrying like real clients do.
//   check()   after a scenario: one reconciler sweep past the lease, then per key ≤ 1 effect, every
//             answer given byte-identical to the stored response, acknowledged executions have
//             exactly one effect, nothing left in progress, and a final retry of every key
//             converges.
//   Server    kill -9 / restart of the throwaway cluster of scripts/with-postgres.sh.
#pragma once

#include "idem/idem.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "shell.hpp"

#include <dirent.h>
#include <libpq-fe.h>
#include <signal.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace idem_test {
/// No libpq notices on stderr ("FATAL: terminating connection ..." when the server is killed).
inline void quiet(PGconn* conn) {
    PQsetNoticeProcessor(
        conn, [](void*, const char*) {}, nullptr);
}
}  // namespace idem_test

namespace fault {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using idem::Key;
using idem::Response;
using idem_test::PgConn;

inline std::string env(const char* name) {
    const char* v = std::getenv(name);
    return v ? std::string(v) : std::string();
}

using idem_test::require_db;

inline double ms_since(Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

using idem_test::shell_quote;

/// A libpq connection opened with extra keywords over the test conninfo (application_name,
/// options...). Returns null (with `error` set) if it cannot connect.
inline std::unique_ptr<PGconn, decltype(&PQfinish)> connect_with(
    const std::string& url, const std::vector<std::pair<std::string, std::string>>& extra,
    std::string* error = nullptr) {
    std::vector<const char*> keys{"dbname"};
    std::vector<const char*> values{url.c_str()};
    for (const auto& [k, v] : extra) {
        keys.push_back(k.c_str());
        values.push_back(v.c_str());
    }
    keys.push_back(nullptr);
    values.push_back(nullptr);
    std::unique_ptr<PGconn, decltype(&PQfinish)> conn(PQconnectdbParams(keys.data(), values.data(), 1), &PQfinish);
    if (!conn || PQstatus(conn.get()) != CONNECTION_OK) {
        if (error) *error = conn ? PQerrorMessage(conn.get()) : "out of memory";
        conn.reset();
    }
    return conn;
}

// ---- the effect and its ground truth
// ---------------------------------------------------------------

/// The response an effect with row id `id` produced for `key`: a deterministic function of the
/// effect row (so a reconciler can store exactly it), with binary bytes, so byte-identity is
/// meaningful.
inline Response response_for(const Key& key, long long id) {
    std::string body = "charged:" + key.scope() + "/" + key.value() + ":" + std::to_string(id);
    body += std::string("\0\xff\xfe\x01", 4);
    return Response{
        201, std::move(body), {{"X-Effect-Id", std::to_string(id)}, {"Content-Type", "application/octet-stream"}}};
}

inline std::string encoded_for(const Key& key, long long id) {
    return idem::codec<Response>::encode(response_for(key, id));
}

inline idem::Fingerprint fp_for(const Key& key) { return idem::fingerprint(std::string("POST /charges"), key.value()); }
inline idem::Fingerprint other_fp_for(const Key& key) {
    return idem::fingerprint(std::string("POST /charges"), key.value() + "#other");
}

/// The effect could not even reach its database: it certainly did nothing.
struct EffectNotPerformed : idem::not_performed {
    using idem::not_performed::not_performed;
};
/// The effect's INSERT was sent but its answer lost: it may have happened.
struct EffectUnknown : std::runtime_error {
    using std::runtime_error::runtime_error;
};

/// The effects table (no unique constraint: a second run of an effect is a second row).
/// Or, with Effects::outside, a provider outside PostgreSQL (this process's memory): its effects
/// do not depend on the database's durability at all (and do not flush its WAL).
class Effects {
public:
    enum Where { table_in_database, outside };

    explicit Effects(std::string url, Where where = table_in_database)
        : direct_(std::move(url)), outside_(where == outside), table_(idem_test::unique_name("idem_fault_effects")) {
        if (outside_) return;
        PgConn(direct_).exec("CREATE TABLE " + table_ +
                             " (id bigserial PRIMARY KEY, scope text NOT NULL, key text NOT NULL, "
                             "at timestamptz NOT NULL DEFAULT clock_timestamp())");
    }
    ~Effects() {
        if (outside_) return;
        try {
            PgConn(direct_).exec("DROP TABLE IF EXISTS " + table_);
        } catch (...) {
        }
    }
    Effects(const Effects&) = delete;
    Effects& operator=(const Effects&) = delete;

    [[nodiscard]] const std::string& table() const { return table_; }

    /// One client's own autocommit connection for its effects (application_name idem_fault_effect,
    /// never a target of the faults aimed at idem's connections; synchronous_commit=on always).
    class Writer {
    public:
        explicit Writer(const Effects& effects) : effects_(effects) {}
        /// Runs the effect: returns the new effect row id. Throws EffectNotPerformed when the
        /// database cannot be reached (certainly nothing done), EffectUnknown when the answer was
        /// lost.
        long long run(const Key& key) {
            if (effects_.outside_) {
                std::lock_guard lock(effects_.mutex_);
                const long long id = ++effects_.next_id_;
                effects_.memory_[{key.scope(), key.value()}].push_back(id);
                return id;
            }
            if (!conn_) {
                std::string err;
                conn_ = connect_with(effects_.direct_,
                                     {{"application_name", "idem_fault_effect"},
                                      {"options", "-c synchronous_commit=on"},
                                      {"connect_timeout", "3"}},
                                     &err);
                if (!conn_) throw EffectNotPerformed("effect database unreachable: " + err);
                idem_test::quiet(conn_.get());
            }
            const std::string sql = "INSERT INTO " + effects_.table_ + " (scope, key) VALUES ($1, $2) RETURNING id";
            const char* values[] = {key.scope().c_str(), key.value().c_str()};
            idem_test::PgResult r(PQexecParams(conn_.get(), sql.c_str(), 2, nullptr, values, nullptr, nullptr, 0));
            if (PQresultStatus(r.get()) != PGRES_TUPLES_OK || r.rows() != 1) {
                const std::string err = PQerrorMessage(conn_.get());
                conn_.reset();
                throw EffectUnknown("effect outcome unknown: " + err);
            }
            return r.integer(0, 0);
        }

    private:
        const Effects& effects_;
        std::unique_ptr<PGconn, decltype(&PQfinish)> conn_{nullptr, &PQfinish};
    };

    /// Effect row ids per (scope, key).
    [[nodiscard]] std::map<std::pair<std::string, std::string>, std::vector<long long>> all() const {
        if (outside_) {
            std::lock_guard lock(mutex_);
            return memory_;
        }
        PgConn conn(direct_);
        auto r = conn.exec("SELECT scope, key, id FROM " + table_ + " ORDER BY id");
        std::map<std::pair<std::string, std::string>, std::vector<long long>> out;
        for (int i = 0; i < r.rows(); ++i) out[{r.text(i, 0), r.text(i, 1)}].push_back(r.integer(i, 2));
        return out;
    }

    [[nodiscard]] std::vector<long long> of(PgConn& conn, const Key& key) const {
        if (outside_) {
            std::lock_guard lock(mutex_);
            const auto it = memory_.find({key.scope(), key.value()});
            return it == memory_.end() ? std::vector<long long>{} : it->second;
        }
        auto r = conn.exec("SELECT id FROM " + table_ + " WHERE scope = $1 AND key = $2 ORDER BY id",
                           {key.scope(), key.value()});
        std::vector<long long> ids;
        for (int i = 0; i < r.rows(); ++i) ids.push_back(r.integer(i, 0));
        return ids;
    }

    [[nodiscard]] const std::string& direct_url() const { return direct_; }

private:
    std::string direct_;
    bool outside_;
    std::string table_;
    mutable std::mutex mutex_;  // outside: the provider's own record of what it did
    mutable std::map<std::pair<std::string, std::string>, std::vector<long long>> memory_;
    mutable long long next_id_ = 0;
};

// ---- an idem table of its own
// --------------------------------------------------------------------

class IdemTable {
public:
    explicit IdemTable(std::string direct_url)
        : url_(std::move(direct_url)), name_(idem_test::unique_name("idem_fault")) {}
    ~IdemTable() { idem_test::drop_idem_table(url_, name_); }
    IdemTable(const IdemTable&) = delete;
    IdemTable& operator=(const IdemTable&) = delete;
    [[nodiscard]] const std::string& name() const { return name_; }

private:
    std::string url_;
    std::string name_;
};

/// A stored row, read behind idem's back (binary, so the result bytes are exact).
struct Row {
    std::string state;
    std::optional<std::string> result;
    long long fence = 0;
};

inline std::optional<Row> read_row(PgConn& conn, const std::string& table, const Key& key) {
    const std::string sql = "SELECT state::bytea, result, fence FROM " + table + " WHERE scope = $1 AND key = $2";
    const char* values[] = {key.scope().c_str(), key.value().c_str()};
    idem_test::PgResult r(PQexecParams(conn.get(), sql.c_str(), 2, nullptr, values, nullptr, nullptr, 1));
    if (PQresultStatus(r.get()) != PGRES_TUPLES_OK) {
        throw std::runtime_error("read_row failed: " + std::string(PQerrorMessage(conn.get())));
    }
    if (r.rows() == 0) return std::nullopt;
    Row row;
    row.state = r.text(0, 0);
    if (!r.is_null(0, 1)) row.result = r.text(0, 1);
    const auto* p = reinterpret_cast<const unsigned char*>(PQgetvalue(r.get(), 0, 2));
    unsigned long long v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
    row.fence = static_cast<long long>(v);
    return row;
}

// ---- the history
// -----------------------------------------------------------------------------------

enum class Told {
    executed,
    replayed,
    in_progress,
    mismatch,
    not_performed,       // fn said so; the claim was released
    response_too_large,  // outcome_unknown: effect ran, result over max_result_bytes
    response_not_saved,  // outcome_unknown: effect ran, save failed (bytes = encoded_result)
    effect_unknown,      // fn threw: outcome unknown
    lease_lost,
    pool_timeout,
    store_unavailable,
    database_error,
    corrupt_record,
    other_error,
};

inline const char* name(Told t) {
    constexpr const char* names[] = {"executed",       "replayed",           "in_progress",        "mismatch",
                                     "not_performed",  "response_too_large", "response_not_saved", "effect_unknown",
                                     "lease_lost",     "pool_timeout",       "store_unavailable",  "database_error",
                                     "corrupt_record", "other_error"};
    return names[static_cast<int>(t)];
}

inline bool is_answer(Told t) { return t == Told::executed || t == Told::replayed; }

struct Call {
    Call(Key k, bool right) : key(std::move(k)), right_fp(right) {}
    Key key;
    bool right_fp = true;  // false: the same key with another request (must be mismatch)
    Told told = Told::other_error;
    std::string bytes;  // executed/replayed: the encoded response; response_not_saved: encoded_result
    bool fn_started = false;
    long long effect_id = -1;  // the effect this call made and saw acknowledged
    std::string detail;        // error text / sqlstate
    double ms = 0;
};

class History {
public:
    void add(Call c) {
        std::lock_guard lock(mutex_);
        calls_.push_back(std::move(c));
    }
    [[nodiscard]] std::vector<Call> calls() const {
        std::lock_guard lock(mutex_);
        return calls_;
    }
    [[nodiscard]] std::size_t size() const {
        std::lock_guard lock(mutex_);
        return calls_.size();
    }
    [[nodiscard]] std::map<std::string, std::size_t> tally() const {
        std::lock_guard lock(mutex_);
        std::map<std::string, std::size_t> t;
        for (const auto& c : calls_) ++t[name(c.told)];
        return t;
    }

private:
    mutable std::mutex mutex_;
    std::vector<Call> calls_;
};

/// What the caller was told by an outcome.
inline Told told_of(idem::Outcome outcome) {
    switch (outcome) {
        case idem::Outcome::executed: return Told::executed;
        case idem::Outcome::replayed: return Told::replayed;
        case idem::Outcome::in_progress: return Told::in_progress;
        case idem::Outcome::mismatch: return Told::mismatch;
    }
    return Told::other_error;
}

/// What the caller of one call was told, from the exception the call ended by.
inline void classify(Call& c, const std::exception_ptr& failure) {
    try {
        std::rethrow_exception(failure);
    } catch (const idem::not_performed& e) {
        c.told = Told::not_performed, c.detail = e.what();
    } catch (const idem::response_too_large& e) {
        c.told = Told::response_too_large, c.bytes = e.encoded_result(), c.detail = e.what();
    } catch (const idem::response_not_saved& e) {
        c.told = Told::response_not_saved, c.bytes = e.encoded_result(), c.detail = e.what();
    } catch (const EffectUnknown& e) {
        c.told = Told::effect_unknown, c.detail = e.what();
    } catch (const idem::lease_lost& e) {
        c.told = Told::lease_lost, c.detail = e.what();
    } catch (const idem::pool_timeout& e) {
        c.told = Told::pool_timeout, c.detail = e.what();
    } catch (const idem::store_unavailable& e) {
        c.told = Told::store_unavailable, c.detail = e.sqlstate() + " " + e.what();
    } catch (const idem::database_error& e) {
        c.told = Told::database_error, c.detail = e.sqlstate() + " " + e.what();
    } catch (const idem::corrupt_record& e) {
        c.told = Told::corrupt_record, c.detail = e.what();
    } catch (const std::exception& e) {
        c.told = Told::other_error, c.detail = e.what();
    }
}

/// One execute_once call, classified for the history. The effect inserts an effect row.
inline Call run_call(idem::IdempotencyStore& store, Effects::Writer& writer, const Key& key, bool right_fp = true,
                     const idem::ClaimOptions& options = {}) {
    Call c(key, right_fp);
    const auto started = Clock::now();
    try {
        auto r = idem::execute_once(
            store, key, right_fp ? fp_for(key) : other_fp_for(key),
            [&] {
                c.fn_started = true;
                c.effect_id = writer.run(key);
                return response_for(key, c.effect_id);
            },
            options);
        c.told = told_of(r.outcome());
        if (r.has_response()) c.bytes = idem::codec<Response>::encode(r.response());
    } catch (...) {
        classify(c, std::current_exception());
    }
    c.ms = ms_since(started);
    return c;
}

// ---- the load: client threads racing on shared keys
// ------------------------------------------------

struct LoadOptions {
    int threads = 8;
    std::string scope;
    std::size_t max_keys = 1'000'000;  // stop after this many keys (or when stopped)
    int attempts_per_key = 6;          // a client retries a key this often before giving up
    double replay_p = 0.15;            // after an answer: one more call (a replay)
    double mismatch_p = 0.03;          // after an answer: the same key with another request
    idem::ClaimOptions claim;
    std::chrono::milliseconds backoff{10};
};

/// A load of clients racing on shared keys (Load: threads; tests/asio: coroutines).
class LoadDriver {
public:
    LoadDriver() = default;
    LoadDriver(const LoadDriver&) = delete;
    LoadDriver& operator=(const LoadDriver&) = delete;
    virtual ~LoadDriver() = default;
    virtual void start() = 0;
    /// Clients finish the call they are in, start no other.
    virtual void request_stop() = 0;
    /// Waits for every client.
    virtual void stop() = 0;
    [[nodiscard]] virtual bool finished() const = 0;
};

class Load final : public LoadDriver {
public:
    Load(idem::IdempotencyStore& store, const Effects& effects, History& history, LoadOptions options)
        : store_(store), effects_(effects), history_(history), options_(std::move(options)) {}
    ~Load() override { Load::stop(); }
    Load(const Load&) = delete;
    Load& operator=(const Load&) = delete;

    void start() override {
        for (int t = 0; t < options_.threads; ++t) threads_.emplace_back([this, t] { client(t); });
    }
    void request_stop() override { stop_ = true; }
    void stop() override {
        stop_ = true;
        for (auto& th : threads_) {
            if (th.joinable()) th.join();
        }
    }
    [[nodiscard]] std::size_t keys_started() const {
        return std::min<std::size_t>(next_.load() / 2, options_.max_keys);
    }
    [[nodiscard]] std::size_t answered() const { return answered_.load(); }
    [[nodiscard]] bool finished() const override { return done_.load() == options_.threads; }

private:
    void client(int t) {
        Effects::Writer writer(effects_);
        std::minstd_rand rng(static_cast<unsigned>(t) * 7919u + static_cast<unsigned>(::getpid()));
        std::uniform_real_distribution<double> u(0, 1);
        while (!stop_) {
            const std::size_t n = next_.fetch_add(1);
            const std::size_t index = n / 2;  // two clients on every key, at about the same time
            if (index >= options_.max_keys) break;
            const Key key(options_.scope, "k" + std::to_string(index));
            for (int attempt = 0; attempt < options_.attempts_per_key && !stop_; ++attempt) {
                Call c = run_call(store_, writer, key, true, options_.claim);
                const Told told = c.told;
                history_.add(std::move(c));
                if (is_answer(told)) {
                    ++answered_;
                    if (u(rng) < options_.replay_p) history_.add(run_call(store_, writer, key, true, options_.claim));
                    if (u(rng) < options_.mismatch_p)
                        history_.add(run_call(store_, writer, key, false, options_.claim));
                    break;
                }
                if (told == Told::mismatch) break;
                std::this_thread::sleep_for(options_.backoff);
            }
        }
        ++done_;
    }

    idem::IdempotencyStore& store_;
    const Effects& effects_;
    History& history_;
    LoadOptions options_;
    std::atomic<bool> stop_{false};
    std::atomic<std::size_t> next_{0};
    std::atomic<std::size_t> answered_{0};
    std::atomic<int> done_{0};
    std::vector<std::thread> threads_;
};

// ---- the checker
// -----------------------------------------------------------------------------------

struct Figures {
    std::string scenario;
    long rounds = 0;
    long faults = 0;
    std::size_t calls = 0;
    std::size_t keys = 0;
    std::size_t in_doubt = 0;          // in progress when the load stopped
    std::size_t reconciled_saved = 0;  // resolved by the reconciler: the effect had happened
    std::size_t reconciled_released = 0;
    std::size_t final_executed = 0;  // released keys run (once) by the final retry
    long detected = -1;              // negative controls: violations the checks found (expected > 0)
    std::map<std::string, std::size_t> told;
    std::vector<std::string> anomalies;
    std::vector<std::string> notes;

    void anomaly(std::string what) {
        if (anomalies.size() < 50) {
            anomalies.push_back(std::move(what));
        } else {
            anomalies.back() = "... (more anomalies)";
        }
    }

    void print() const {
        std::ostringstream out;
        out << "FAULT-FIGURES scenario=" << scenario << " rounds=" << rounds << " faults=" << faults
            << " calls=" << calls << " keys=" << keys << " in_doubt=" << in_doubt
            << " reconciled_saved=" << reconciled_saved << " reconciled_released=" << reconciled_released
            << " final_executed=" << final_executed << " anomalies=" << anomalies.size();
        if (detected >= 0) out << " detected_by_negative_control=" << detected;
        out << "\n  told:";
        for (const auto& [k, v] : told) out << " " << k << "=" << v;
        out << "\n";
        for (const auto& n : notes) out << "  note: " << n << "\n";
        for (const auto& a : anomalies) out << "  ANOMALY: " << a << "\n";
        std::cout << out.str() << std::flush;
    }
};

struct CheckOptions {
    std::string scope;       // the keys of this scenario
    std::string idem_table;  // behind idem's back
    std::chrono::milliseconds reconciler_lease{300};
    bool final_retry = true;
};

inline std::string printable(const std::string& s) {
    std::string out;
    for (unsigned char c : s) {
        if (c >= 0x20 && c < 0x7f) {
            out += static_cast<char>(c);
        } else {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\x%02x", c);
            out += buf;
        }
    }
    return out;
}

/// Resolves what is left in progress (one reconciler sweep, once every lease has passed), then
/// checks the history against the stored records and the effects. Adds anomalies to `f`.
inline void check(idem::IdempotencyStore& store, const Effects& effects, const History& history, const CheckOptions& o,
                  Figures& f) {
    PgConn db(effects.direct_url());
    const auto calls = history.calls();
    f.calls += calls.size();
    for (const auto& [k, v] : history.tally()) f.told[k] += v;

    // Wait until every lease has passed (the load has stopped: nobody is running an effect).
    const auto wait_until = Clock::now() + 60s;
    while (db.scalar("SELECT count(*) FROM " + o.idem_table +
                         " WHERE scope = $1 AND state = 'in_progress' AND lease_until >= now()",
                     {o.scope}) > 0) {
        if (Clock::now() > wait_until) {
            f.anomaly("a lease still runs 60 s after the load stopped");
            break;
        }
        std::this_thread::sleep_for(50ms);
    }
    f.in_doubt += static_cast<std::size_t>(
        db.scalar("SELECT count(*) FROM " + o.idem_table + " WHERE scope = $1 AND state = 'in_progress'", {o.scope}));

    // (iv) ONE sweep resolves every key in doubt: effect row → save the response it produced;
    // no effect row → the effect certainly did not happen → release.
    idem::ReconcilerOptions sweep_all;
    sweep_all.batch = 1'000'000;
    sweep_all.lease = o.reconciler_lease;
    sweep_all.scopes = idem::ScopeFilter::exact(o.scope);
    idem::Reconciler reconciler(
        store,
        [&](idem::Reconciliation& r) {
            const auto ids = effects.of(db, r.key());
            if (ids.empty()) {
                r.release();
            } else {
                r.save(response_for(r.key(), ids.front()));
            }
        },
        sweep_all);
    const auto sweep = reconciler.run_once();
    f.reconciled_saved += sweep.saved;
    f.reconciled_released += sweep.released;
    if (sweep.failed > 0) f.anomaly("reconciler sweep: " + std::to_string(sweep.failed) + " keys failed");
    const auto left =
        db.scalar("SELECT count(*) FROM " + o.idem_table + " WHERE scope = $1 AND state = 'in_progress'", {o.scope});
    if (left != 0) f.anomaly(std::to_string(left) + " keys still in progress after lease + one reconciler sweep");

    // Every key the history names, and every key stored in the scope.
    std::map<Key, std::vector<const Call*>> by_key;
    for (const auto& c : calls) by_key[c.key].push_back(&c);
    {
        auto r = db.exec("SELECT key FROM " + o.idem_table + " WHERE scope = $1", {o.scope});
        for (int i = 0; i < r.rows(); ++i) by_key[Key(o.scope, r.text(i, 0))];
    }
    auto truth = effects.all();
    for (const auto& [sk, ids] : truth) {
        if (sk.first == o.scope) by_key[Key(sk.first, sk.second)];
    }
    f.keys += by_key.size();

    Effects::Writer writer(effects);
    for (const auto& [key, key_calls] : by_key) {
        const std::string k = printable(key.value());
        const auto ids = truth[{key.scope(), key.value()}];
        // (i) at most one effect per key
        if (ids.size() > 1) f.anomaly(k + ": " + std::to_string(ids.size()) + " effects (duplicate)");
        const auto row = read_row(db, o.idem_table, key);
        std::optional<std::string> stored;
        if (row) {
            if (row->state != "completed") {
                f.anomaly(k + ": still " + row->state);
            } else {
                stored = row->result;
                if (ids.size() != 1) {
                    f.anomaly(k + ": completed with " + std::to_string(ids.size()) + " effects");
                } else if (*stored != encoded_for(key, ids.front())) {
                    f.anomaly(k + ": stored response is not the one its effect produced");
                }
            }
        } else if (!ids.empty()) {
            f.anomaly(k + ": released/absent although its effect happened (a retry would run it again)");
        }
        for (const Call* c : key_calls) {
            // (ii) every answer given is the stored response, byte for byte
            if (is_answer(c->told) || (c->told == Told::response_not_saved && !c->bytes.empty())) {
                if (!c->right_fp) f.anomaly(k + ": a request with another fingerprint was answered");
                if (!stored) {
                    f.anomaly(k + ": told " + name(c->told) + " but nothing is stored");
                } else if (*stored != c->bytes) {
                    f.anomaly(k + ": told " + name(c->told) + " with bytes that differ from the stored response");
                }
            }
            // (iii) an acknowledged execution has exactly one effect: its own
            if (c->told == Told::executed && (ids.size() != 1 || ids.front() != c->effect_id)) {
                f.anomaly(k + ": told executed but effects are not exactly its own one");
            }
            // store_unavailable means fn was not called (claim) or did nothing (not_performed +
            // release)
            if ((c->told == Told::store_unavailable || c->told == Told::pool_timeout) && c->effect_id >= 0) {
                f.anomaly(k + ": told " + name(c->told) + " after its effect ran");
            }
            if (!c->right_fp && c->told != Told::mismatch && is_answer(c->told)) {
                f.anomaly(k + ": another request with this key was " + name(c->told));
            }
        }
        // Converges: a retry now replays the stored bytes (fn not run), or runs a released key
        // once.
        if (o.final_retry) {
            Call c = run_call(store, writer, key);
            if (stored) {
                if (c.told != Told::replayed || c.bytes != *stored || c.fn_started) {
                    f.anomaly(k + ": final retry was " + std::string(name(c.told)) + ", not a byte-identical replay");
                }
            } else if (c.told == Told::executed) {
                ++f.final_executed;
            } else {
                f.anomaly(k + ": final retry of a free key was " + std::string(name(c.told)) + " " + c.detail);
            }
        }
    }
    if (o.final_retry) {
        // After convergence: every key has exactly one effect.
        for (const auto& [sk, ids] : effects.all()) {
            if (sk.first == o.scope && ids.size() != 1) {
                f.anomaly(printable(sk.second) + ": " + std::to_string(ids.size()) + " effects after convergence");
            }
        }
    }
}

// ---- the server (scripts/with-postgres.sh's cluster)
// ------------------------------------------------

/// Whether this process may stop/kill/restart the server: started by scripts/with-postgres.sh.
inline bool server_controllable() { return !env("IDEM_PG_DATA").empty(); }

inline std::string pg_bin() { return env("IDEM_PG_BIN").empty() ? "/usr/lib/postgresql/15/bin" : env("IDEM_PG_BIN"); }

/// Runs `cmd` as the cluster's owner (runuser when we are root).
inline int as_pg_user(const std::string& cmd) {
    const std::string user = env("IDEM_PG_CTL_USER");
    std::string full = cmd;
    if (::geteuid() == 0 && !user.empty() && user != "root")
        full = "cd / && runuser -u " + shell_quote(user) + " -- " + cmd;
    return std::system(full.c_str());
}

inline int pg_ctl(const std::string& args) {
    return as_pg_user(shell_quote(pg_bin() + "/pg_ctl") + " -D " + shell_quote(env("IDEM_PG_DATA")) + " " + args +
                      " >/dev/null 2>&1");
}

inline void start_server() {
    std::string args = "-w -t 120 start";
    if (!env("IDEM_PG_LOG").empty()) args = "-l " + shell_quote(env("IDEM_PG_LOG")) + " " + args;
    if (pg_ctl(args) != 0) throw std::runtime_error("pg_ctl start failed (see " + env("IDEM_PG_LOG") + ")");
}

inline std::optional<pid_t> postmaster_pid() {
    std::ifstream in(env("IDEM_PG_DATA") + "/postmaster.pid");
    long pid = 0;
    if (!(in >> pid) || pid <= 0) return std::nullopt;
    return static_cast<pid_t>(pid);
}

/// The state letter of /proc/<pid>/stat (R, S, T, Z, ...), or 0 when there is no such process.
inline char process_state(pid_t pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(in, line)) return 0;
    const auto close = line.rfind(')');
    return close != std::string::npos && close + 2 < line.size() ? line[close + 2] : 0;
}

/// Gone, or a zombie nobody reaped yet (PID 1 here reaps with a delay).
inline bool process_gone(pid_t pid) {
    const char state = process_state(pid);
    return state == 0 || state == 'Z' || state == 'X';
}

inline std::vector<pid_t> children_of(pid_t parent) {
    std::vector<pid_t> out;
    if (DIR* dir = ::opendir("/proc")) {
        while (dirent* e = ::readdir(dir)) {
            const long pid = std::strtol(e->d_name, nullptr, 10);
            if (pid <= 0) continue;
            std::ifstream in(std::string("/proc/") + e->d_name + "/stat");
            std::string line;
            if (!std::getline(in, line)) continue;
            const auto close = line.rfind(')');
            if (close == std::string::npos) continue;
            std::istringstream rest(line.substr(close + 2));
            char state = 0;
            long ppid = 0;
            rest >> state >> ppid;
            if (ppid == parent) out.push_back(static_cast<pid_t>(pid));
        }
        ::closedir(dir);
    }
    return out;
}

/// kill -9 of the postmaster and every server process at once (an instance crash: WAL not yet
/// written from shared memory is lost), then waits until they are all gone.
/// `after_kill` runs right after the signals are sent.
inline void crash_server(const std::function<void()>& after_kill = {}) {
    const auto pm = postmaster_pid();
    if (!pm) throw std::runtime_error("no postmaster.pid: server not running?");
    // Freeze the postmaster first so it forks no new backend between the listing and the kill
    // (each child calls setsid(): there is no process group to kill at once).
    ::kill(*pm, SIGSTOP);
    const auto stopped_by = Clock::now() + 30s;  // generous: the kernel stops it when it next runs
    while (process_state(*pm) != 'T') {
        if (Clock::now() > stopped_by) {
            ::kill(*pm, SIGCONT);
            throw std::runtime_error("the postmaster did not stop (SIGSTOP) within 30 s");
        }
        std::this_thread::sleep_for(1ms);
    }
    std::vector<pid_t> victims = children_of(*pm);
    for (pid_t p : victims) ::kill(p, SIGKILL);
    ::kill(*pm, SIGKILL);
    if (after_kill) after_kill();
    victims.push_back(*pm);
    const auto deadline = Clock::now() + 30s;
    for (pid_t p : victims) {
        while (!process_gone(p) && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
    }
    // Wait for the zombie postmaster to be reaped (its pid in postmaster.pid would stop the
    // restart); if it is not reaped in time, it is dead all the same: remove the stale lock file.
    while (::kill(*pm, 0) == 0 && Clock::now() < deadline) std::this_thread::sleep_for(50ms);
    if (::kill(*pm, 0) == 0) std::filesystem::remove(env("IDEM_PG_DATA") + "/postmaster.pid");
}

/// Calls store.read() until one succeeds (at most 30 tries); returns how many failed first. After a
/// restart every pooled connection is dead, and a call retries into idle ones (see
/// docs/reliability.md).
inline int heal(idem::IdempotencyStore& store) {
    int failed = 0;
    for (; failed < 30; ++failed) {
        try {
            (void)store.read(Key("idem-fault-probe", "probe"));
            return failed;
        } catch (const idem::store_unavailable&) {
            std::this_thread::sleep_for(50ms);
        }
    }
    return failed;
}

/// Starts the server again at scope exit if a test left it down.
struct ServerGuard {
    bool down = false;
    ~ServerGuard() {
        if (down) {
            try {
                start_server();
            } catch (...) {
            }
        }
    }
};

}  // namespace fault
