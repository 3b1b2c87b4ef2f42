#include "idem/postgres_store.hpp"

#include "idem/transaction.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <new>
#include <stdexcept>
#include <map>
#include <unordered_map>
#include <random>
#include <thread>

#include "../common.hpp"
#include "connection.hpp"
#include "group.hpp"
#include "pool.hpp"
#include "record.hpp"
#include "sql.hpp"

namespace idem {

using pg::Clock;
using pg::Params;
using pg::Step;
using pg::StepResult;
using pg::parse_record;

namespace {

bool claim_retryable(std::string_view sqlstate) {
    // serialization_failure, deadlock_detected, lock_not_available (lock_timeout while waiting on a
    // concurrent, uncommitted claim of the same key)
    return sqlstate == "40001" || sqlstate == "40P01" || sqlstate == "55P03";
}

[[noreturn]] void throw_statement_error(const StepResult& r, const char* what) {
    pg::throw_database_error(std::string("idem: ") + what + " failed: " + r.message(), std::string(r.sqlstate()));
}

// The store whose in-transaction effect runs on this thread (if any): a call to that store from
// inside the effect needs a second connection while the effect's transaction holds one.
thread_local const void* in_effect_of = nullptr;

// Parameters of the claim INSERT and of the expired re-claim ($1..$7).
void add_claim_params(Params& p, const Key& key, const Fingerprint& fp, Fence fence, std::chrono::milliseconds lease,
                      std::chrono::seconds retention) {
    p.text(key.scope())
        .text(key.value())
        .bytes(fp.bytes())
        .int2(static_cast<std::int16_t>(fp.algorithm()))
        .int8(fence)
        .int8(lease.count())
        .int8(retention.count());
}

// A member's own copy of a group's exception, message and all. Each member rethrows, catches and
// destroys its exception on its own thread; an exception object, or a std::runtime_error message,
// shared between threads is reference-counted inside libstdc++, out of ThreadSanitizer's sight
// (seen: races reported on the vptr, then on the message buffer).
template <class E>
std::exception_ptr fresh(const E& x) {
    return std::make_exception_ptr(E(std::string(x.what()), std::string(x.sqlstate())));
}

std::exception_ptr own_copy(const std::exception_ptr& e) {
    if (!e) return e;
    try {
        std::rethrow_exception(e);
    } catch (const pg::connection_broken& x) {
        return fresh(x);
    } catch (const pool_timeout& x) {
        return fresh(x);
    } catch (const store_unavailable& x) {
        return fresh(x);
    } catch (const config_error& x) {
        return fresh(x);
    } catch (const database_error& x) {
        return fresh(x);
    } catch (const corrupt_record& x) {
        return fresh(x);
    } catch (const lease_lost& x) {
        return fresh(x);
    } catch (const error& x) {
        return fresh(x);
    } catch (const std::bad_alloc&) {
        return std::make_exception_ptr(std::bad_alloc());
    } catch (const std::exception& x) {
        return std::make_exception_ptr(std::runtime_error(std::string(x.what())));
    } catch (...) {
        return std::make_exception_ptr(std::runtime_error("idem: unknown exception in a claim group"));
    }
}

std::string notify_payload(const pg::TableName& t, const Key& key) {
    // \x1f cannot occur in a key (control characters are refused), so the payload is unambiguous.
    return (t.schema.empty() ? t.table : t.schema + "." + t.table) + '\x1f' + key.scope() + '\x1f' + key.value();
}

}  // namespace

struct PostgresStore::Impl {
    PostgresOptions options;
    pg::ConnectSettings settings;
    pg::TableName table;
    std::vector<pg::StatementDef> defs;
    // Before the pool: connections forget() it as they close, so it must outlive them.
    std::unique_ptr<pg::Watchdog> watchdog;
    std::unique_ptr<pg::Pool> pool;

    std::atomic<std::size_t> waiting{0};  // callers inside wait_for_save
    // The process generation this store belongs to (see detail::fork_generation).
    const std::uint64_t generation = detail::fork_generation();

    ~Impl() {
        if (detail::fork_generation() == generation) return;  // the owner: the members close everything
        // A fork()ed child. The pooled connections are the parent's sessions, and the watchdog's
        // thread does not exist here (joining it, or destroying a condition variable it waited on,
        // never returns). Close this process's copies of the sockets and leak the rest, so that
        // nothing is said to the server on the parent's behalf.
        if (pool) pool->abandon_in_child();
        (void)pool.release();
        (void)watchdog.release();
    }

    /// Throws config_error when called in a fork()ed child of the process that made the store.
    void check_process() const {
        if (detail::fork_generation() != generation) {
            throw config_error(
                "idem: this PostgresStore belongs to the process that created it and cannot be used in a fork()ed "
                "child (its connections are the parent's sessions): create a new store in the child");
        }
    }

    /// A pooled connection for this store's own statements.
    pg::Lease acquire() {
        check_process();
        if (in_effect_of == this) {
            // Called from inside our own in-transaction effect, which holds a connection itself.
            if (options.pool_size == 1) {
                throw config_error(
                    "idem: PostgresStore called from inside its own in-transaction effect, whose open transaction "
                    "holds the pool's only connection (pool_size 1): run the effect's statements through its "
                    "Transaction, or give the store pool_size >= 2");
            }
            try {
                return pool->acquire();
            } catch (const pool_timeout& e) {
                throw pool_timeout(std::string(e.what()) +
                                   "; called from inside an in-transaction effect, which holds one connection itself");
            }
        }
        return pool->acquire();
    }

    // Statistics, sharded by thread: every call bumps a counter or two, and a single shared cache
    // line would bounce between the cores on each of them. stats() adds the shards up (unsigned
    // arithmetic: a shard's fetch_sub of another shard's add still sums exactly).
    struct alignas(64) Counters {
        std::atomic<std::uint64_t> round_trips{0}, claims{0}, claims_won{0}, saves{0}, releases{0}, reads{0},
            retries{0}, opened{0}, discarded{0}, claim_groups{0}, grouped_claims{0}, save_groups{0},
            grouped_saves{0};
    };
    std::atomic<std::uint64_t> largest_claim_group{0}, largest_save_group{0};
    std::array<Counters, 16> counter_shards;
    Counters& counters() noexcept { return counter_shards[detail::thread_index() % counter_shards.size()]; }

    Clock::time_point deadline() const {
        return Clock::now() + options.statement_timeout + options.lock_timeout + std::chrono::seconds(1);
    }

    pg::StepResults run(pg::Connection& conn, std::span<const Step> steps) {
        counters().round_trips.fetch_add(1, std::memory_order_relaxed);
        return conn.run(steps, deadline());
    }

    pg::StepResults run_one(pg::Connection& conn, pg::Stmt stmt, Params& params) {
        const Step step{&defs[stmt], &params};
        return run(conn, std::span(&step, 1));
    }

    std::optional<Record> select(pg::Connection& conn, const Key& key) {
        Params p;
        p.text(key.scope()).text(key.value());
        auto res = run_one(conn, pg::kSelect, p);
        if (!res[0].ok()) throw_statement_error(res[0], "read");
        if (res[0].rows() == 0) return std::nullopt;
        return parse_record(res[0].result.get(), 0);
    }

    // Runs `f` on a pooled connection; on a broken connection retries on a fresh one, up to
    // claim_attempts times in all. f(conn, attempt) gets the 1-based attempt number; attempt > 1
    // means an earlier attempt may have committed.
    //
    // Also retried: a serialization failure or deadlock (40001, 40P01) that f reports as a
    // database_error. Every caller's f is one single-statement write or read (save, release,
    // lease, phase, take-over, purge, read): PostgreSQL rolled that statement back whole, so it
    // is safe to send again. Under a REPEATABLE READ or SERIALIZABLE database default even a
    // one-row UPDATE can be chosen as the victim, and a save must not fail for it — its effect
    // has already run. (claim handles its own conflicts; run_in_transaction does not come here.)
    template <class F>
    auto with_connection(const char* what, F&& f, Clock::duration keep_trying = Clock::duration::zero()) {
        const auto retry_until = keep_trying > Clock::duration::zero() ? Clock::now() + keep_trying : Clock::time_point{};
        auto backoff = std::chrono::milliseconds(25);
        int conflicts = 0;
        for (int attempt = 1;; ++attempt) {
            std::string failure, sqlstate;
            bool broken = false;
            try {
                pg::Lease lease = acquire();
                return f(*lease, attempt);
            } catch (const pg::connection_broken& e) {
                failure = detail::without_prefix(e.what()), sqlstate = e.sqlstate(), broken = true;
                pool->suspect_idle();  // the retry must not pick another dead idle connection
            } catch (const pool_timeout&) {
                throw;  // already waited its bound
            } catch (const store_unavailable& e) {
                failure = detail::without_prefix(e.what()), sqlstate = e.sqlstate();  // could not connect (restart, failover)
            } catch (const database_error& e) {
                if (e.sqlstate() != "40001" && e.sqlstate() != "40P01") throw;
                if (++conflicts >= options.claim_attempts && Clock::now() >= retry_until) throw;
                counters().retries.fetch_add(1, std::memory_order_relaxed);
                // Jittered: the transaction that won the conflict is usually still running.
                thread_local std::minstd_rand jitter{std::random_device{}()};
                const auto cap = 5u * static_cast<unsigned>(std::min(conflicts, 20));
                std::this_thread::sleep_for(std::chrono::milliseconds(1 + jitter() % cap));
                continue;
            }
            // Broken connections: claim_attempts in all. Failed connects: only within keep_trying
            // (a request path should hear "unavailable" at once, a save should try hard).
            if ((broken ? attempt >= options.claim_attempts : true) && Clock::now() >= retry_until) {
                throw store_unavailable(std::string("idem: ") + what + ": " + failure, sqlstate);
            }
            counters().retries.fetch_add(1, std::memory_order_relaxed);
            // A broken pooled connection says little about the next one: retry at once. A failed
            // connect means the server is away: back off.
            if (!broken || attempt > 1) {
                std::this_thread::sleep_for(backoff);
                backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
            }
        }
    }

    // A saved key had waiters (ClaimOptions::wait): NOTIFY them from our own connection. Best
    // effort — a waiter also wakes at its deadline and re-reads.
    void wake_waiters(const Key& key) noexcept {
        try {
            with_connection("notify", [&](pg::Connection& conn, int) {
                Params p;
                const std::string payload = notify_payload(table, key);
                p.text(payload);
                run_one(conn, pg::kNotify, p);
            });
        } catch (...) {
        }
    }

    // A write that only the fence holder of an in-progress key may make.
    static void expect_owned(const pg::StepResults& res, const char* what, Fence fence) {
        if (!res[0].ok()) throw_statement_error(res[0], what);
        if (res[0].rows() != 1) {
            throw lease_lost(std::string("idem: ") + what + " refused: fence " + std::to_string(fence) +
                             " no longer owns the key");
        }
    }

    // Gives a stale claim (fence `stale`, lease passed) the fence `fresh`. The taken-over record on
    // success. Reconnect-safe: after a broken connection, finding `fresh` in place means we won.
    std::optional<Record> take_over(const Key& key, Fence stale, Fence fresh, std::chrono::milliseconds lease,
                                    bool new_attempt) {
        return with_connection("take_over", [&](pg::Connection& conn, int attempt) -> std::optional<Record> {
            Params p;
            p.text(key.scope()).text(key.value()).int8(stale).int8(fresh).int8(lease.count()).int4(new_attempt ? 1 : 0);
            auto res = run_one(conn, pg::kTakeOver, p);
            if (!res[0].ok()) throw_statement_error(res[0], "take_over");
            if (res[0].rows() == 1) return parse_record(res[0].result.get(), 0);
            if (attempt > 1) {
                auto record = select(conn, key);
                if (record && record->fence == fresh) return record;
            }
            return std::nullopt;
        });
    }

    // ClaimOptions::wait: LISTEN, flag the row as waited for, and wait for the saver's NOTIFY (or the
    // deadline). Returns false when there is nothing to wait for any more (the caller re-reads
    // either way). Holds one pooled connection while it waits.
    bool wait_for_save(const Key& key, Clock::time_point until) {
        // Waiters hold a connection while they listen: never more than pool_size - 1 of them, so
        // the owner's save always finds one.
        if (waiting.fetch_add(1) + 1 >= options.pool_size) {
            waiting.fetch_sub(1);
            return false;
        }
        struct Done {
            std::atomic<std::size_t>& n;
            ~Done() { n.fetch_sub(1); }
        } leave{waiting};
        return with_connection("wait", [&](pg::Connection& conn, int) {
            const std::string payload = notify_payload(table, key);
            Params none, mark;
            mark.text(key.scope()).text(key.value());
            // LISTEN first: a save committed after the mark is then certain to be heard.
            const Step steps[] = {{&defs[pg::kListen], &none}, {&defs[pg::kMarkWaiter], &mark}};
            bool heard = false;
            try {
                auto res = run(conn, steps);
                if (!res[0].ok()) throw_statement_error(res[0], "listen");
                if (!res[1].ok()) throw_statement_error(res[1], "wait");
                if (res[1].rows() == 1) heard = conn.wait_notification(pg::kChannel, payload, until);
                auto done = run_one(conn, pg::kUnlisten, none);
                if (!done[0].ok()) conn.mark_broken();
                // Drop notifications that arrived meanwhile, so the pooled connection is clean.
                conn.wait_notification(pg::kChannel, "", Clock::now());
            } catch (...) {
                conn.mark_broken();  // may still be listening: never pool it again
                throw;
            }
            return heard || Clock::now() < until;
        });
    }

    // ---- Group commit (docs/design.md, "Group commit") ----
    // How many groups may be in flight at once, per kind (claims, saves): see docs/design.md for the
    // figures behind the choice.
    static constexpr std::size_t kGroupsInFlight = 2;
    std::unique_ptr<pg::Combiner> claim_groups, save_groups;

    static void note_group(std::atomic<std::uint64_t>& groups, std::atomic<std::uint64_t>& members,
                           std::atomic<std::uint64_t>& largest, std::size_t n) noexcept {
        groups.fetch_add(1, std::memory_order_relaxed);
        members.fetch_add(n, std::memory_order_relaxed);
        for (auto seen = largest.load(std::memory_order_relaxed);
             n > seen && !largest.compare_exchange_weak(seen, n, std::memory_order_relaxed);) {
        }
    }

    // One claim() caller in a group. The leader writes `got` (and what goes with it) for every member
    // before Combiner::finish; the member reads it after join() returns.
    struct ClaimMember : pg::Combiner::Member {
        const Key* key;
        const Fingerprint* fp;
        Fence fence;
        std::chrono::milliseconds lease;
        std::chrono::seconds retention;
        Claim* out;  // `found`: the record read is decoded into out->existing
        enum class Got { alone, plain, won, found, absent, error } got = Got::alone;
        pg::StepResults plain;      // plain: a group of one ran today's round trip; these are its answers
        std::exception_ptr error;   // error: what the member's own call throws
    };

    // Today's claim round trip: [INSERT, SELECT | Sync]; see PostgresStore::claim.
    pg::StepResults claim_round_trip(const Key& key, const Fingerprint& fp, Fence fence, std::chrono::milliseconds lease,
                                     std::chrono::seconds retention) {
        return with_connection("claim", [&](pg::Connection& conn, int) {
            Params ins;
            add_claim_params(ins, key, fp, fence, lease, retention);
            Params sel;
            sel.text(key.scope()).text(key.value());
            // [INSERT, SELECT | Sync]: one round trip, one implicit transaction; the claim is
            // committed when the Sync's answer arrives, which run() waits for. The SELECT is its own
            // statement, so under READ COMMITTED it takes a new snapshot and sees a conflicting
            // claim that committed while the INSERT waited for it (one statement could not: see
            // docs/design.md); under REPEATABLE READ that case is a 40001 from the INSERT, retried.
            // One Sync instead of one per statement: one send() and one transaction fewer per claim.
            const Step steps[] = {{&defs[pg::kClaimInsert], &ins, false}, {&defs[pg::kSelect], &sel}};
            return run(conn, steps);
        });
    }

    // The leader's work: answers every member of `group` (never throws).
    void run_claim_group(const std::vector<pg::Combiner::Member*>& group) noexcept {
        const auto member = [&](std::size_t i) -> ClaimMember& { return static_cast<ClaimMember&>(*group[i]); };
        note_group(counters().claim_groups, counters().grouped_claims, largest_claim_group, group.size());
        const auto all = [&](ClaimMember::Got got, std::exception_ptr e = nullptr) {
            for (std::size_t i = 0; i < group.size(); ++i) member(i).got = got, member(i).error = own_copy(e);
        };
        if (group.size() == 1) {  // alone: exactly today's statements
            ClaimMember& c = member(0);
            try {
                c.plain = claim_round_trip(*c.key, *c.fp, c.fence, c.lease, c.retention);
                c.got = ClaimMember::Got::plain;
            } catch (...) {
                c.got = ClaimMember::Got::error, c.error = own_copy(std::current_exception());
            }
            return;
        }
        // Rows in key order: concurrent groups (and batches) lock shared keys in one order.
        std::vector<ClaimMember*> ms(group.size());
        for (std::size_t i = 0; i < group.size(); ++i) ms[i] = &member(i);
        std::sort(ms.begin(), ms.end(), [](const ClaimMember* a, const ClaimMember* b) { return *a->key < *b->key; });
        std::optional<pg::Lease> conn;
        try {
            conn.emplace(acquire());
        } catch (...) {
            // Nothing was sent: each member gets what its own call would have (pool_timeout,
            // store_unavailable, config_error), without waiting for a connection once more.
            all(ClaimMember::Got::error, std::current_exception());
            return;
        }
        try {
            const std::size_t n = ms.size();
            std::vector<std::string_view> scopes(n), values(n), digests(n);
            std::vector<std::int16_t> algs(n);
            std::vector<std::int64_t> fences(n), leases(n), retentions(n);
            for (std::size_t j = 0; j < n; ++j) {
                scopes[j] = ms[j]->key->scope();
                values[j] = ms[j]->key->value();
                digests[j] = ms[j]->fp->bytes();
                algs[j] = static_cast<std::int16_t>(ms[j]->fp->algorithm());
                fences[j] = ms[j]->fence;
                leases[j] = ms[j]->lease.count();
                retentions[j] = ms[j]->retention.count();
            }
            Params ins, sel;
            ins.text_array(scopes).text_array(values).bytea_array(digests).int2_array(algs).int8_array(fences)
                .int8_array(leases).int8_array(retentions);
            sel.text_array(scopes).text_array(values);
            // [INSERT … unnest | Sync | SELECT … unnest | Sync]: one round trip; the claims commit
            // at the first Sync, the read takes its own snapshot (as the single-key path's does).
            const Step steps[] = {{&defs[pg::kClaimGroupInsert], &ins}, {&defs[pg::kSelectBatch], &sel}};
            pg::StepResults res = run(**conn, steps);
            if (!res[0].ok()) {
                // Nothing of the group committed (a conflict, a cancel, one member's bad bytes...):
                // every member goes again alone, with its fence, and meets its own outcome.
                all(ClaimMember::Got::alone);
                return;
            }
            std::unordered_map<Fence, ClaimMember*> by_fence;
            for (ClaimMember* c : ms) {
                by_fence.emplace(c->fence, c);
                c->got = ClaimMember::Got::absent;
            }
            const PGresult* r = res[0].result.get();
            for (int row = 0; row < PQntuples(r); ++row) {
                if (auto it = by_fence.find(pg::get_int8(r, row, 0)); it != by_fence.end()) {
                    it->second->got = ClaimMember::Got::won;  // committed at the first Sync
                }
            }
            if (!res[1].ok()) {  // the read failed alone: whoever did not win goes again alone
                for (ClaimMember* c : ms) {
                    if (c->got != ClaimMember::Got::won) c->got = ClaimMember::Got::alone;
                }
                return;
            }
            std::map<std::pair<std::string_view, std::string_view>, int> found;  // (scope, key) → row
            const PGresult* rows = res[1].result.get();
            for (int row = 0; row < PQntuples(rows); ++row) {
                found.emplace(std::pair(pg::get_bytes(rows, row, pg::kRecordColumns),
                                        pg::get_bytes(rows, row, pg::kRecordColumns + 1)),
                              row);
            }
            for (ClaimMember* c : ms) {
                if (c->got == ClaimMember::Got::won) continue;
                auto it = found.find(std::pair(c->key->scope(), c->key->value()));
                if (it == found.end()) continue;  // absent: released or rolled back in between
                try {
                    parse_record(rows, it->second, c->out->existing.emplace());
                    c->got = ClaimMember::Got::found;
                } catch (...) {
                    c->out->existing.reset();
                    c->got = ClaimMember::Got::error, c->error = own_copy(std::current_exception());  // corrupt_record
                }
            }
        } catch (const pg::connection_broken&) {
            // The group may have committed before its answer was lost: each member goes again alone
            // with its own fence and recognises its row (today's reconnect-safe retry).
            pool->suspect_idle();
            all(ClaimMember::Got::alone);
        } catch (...) {
            all(ClaimMember::Got::alone);
        }
    }

    // One save() caller in a group.
    struct SaveMember : pg::Combiner::Member {
        const Key* key;
        Fence fence;
        std::string_view result;
        enum class Got { alone, saved, lost } got = Got::alone;
        bool waiters = false;  // saved: someone LISTENs for this key
        bool sent = false;     // alone: the group's statement may have committed this save
    };

    void run_save_group(const std::vector<pg::Combiner::Member*>& group) noexcept {
        note_group(counters().save_groups, counters().grouped_saves, largest_save_group, group.size());
        std::vector<SaveMember*> ms(group.size());
        for (std::size_t i = 0; i < group.size(); ++i) ms[i] = static_cast<SaveMember*>(group[i]);
        std::sort(ms.begin(), ms.end(), [](const SaveMember* a, const SaveMember* b) { return *a->key < *b->key; });
        // A key or fence twice in one UPDATE would be ambiguous (one row, two answers): the second
        // goes alone, after the group, exactly as a concurrent save of it does today.
        std::vector<SaveMember*> sent;
        std::unordered_map<Fence, SaveMember*> by_fence;
        for (std::size_t j = 0; j < ms.size(); ++j) {
            ms[j]->got = SaveMember::Got::alone;
            if ((j > 0 && *ms[j]->key == *ms[j - 1]->key) || !by_fence.emplace(ms[j]->fence, ms[j]).second) continue;
            sent.push_back(ms[j]);
        }
        std::optional<pg::Lease> conn;
        try {
            conn.emplace(acquire());
        } catch (...) {
            return;  // nothing sent: each goes alone (and keeps trying for its save_retry_window)
        }
        for (SaveMember* s : sent) s->sent = true;
        try {
            pg::StepResults res;
            if (sent.size() == 1) {  // alone: today's statement
                Params p;
                p.text(sent[0]->key->scope()).text(sent[0]->key->value()).int8(sent[0]->fence).bytes(sent[0]->result);
                res = run_one(**conn, pg::kSave, p);
            } else {
                std::vector<std::string_view> scopes, values, results;
                std::vector<std::int64_t> fences;
                for (SaveMember* s : sent) {
                    scopes.push_back(s->key->scope());
                    values.push_back(s->key->value());
                    fences.push_back(s->fence);
                    results.push_back(s->result);
                }
                Params p;
                p.text_array(scopes).text_array(values).int8_array(fences).bytea_array(results);
                res = run_one(**conn, pg::kSaveBatch, p);
            }
            if (!res[0].ok()) return;  // rolled back whole: each goes alone (40001 retried there, ...)
            for (SaveMember* s : sent) s->got = SaveMember::Got::lost;  // its fence no longer owns the key
            const PGresult* r = res[0].result.get();
            if (sent.size() == 1) {
                if (PQntuples(r) == 1) sent[0]->got = SaveMember::Got::saved, sent[0]->waiters = pg::get_bool(r, 0, 0);
                return;
            }
            for (int row = 0; row < PQntuples(r); ++row) {
                if (auto it = by_fence.find(pg::get_int8(r, row, 0)); it != by_fence.end()) {
                    it->second->got = SaveMember::Got::saved;
                    it->second->waiters = pg::get_bool(r, row, 1);
                }
            }
        } catch (const pg::connection_broken&) {
            pool->suspect_idle();
            for (SaveMember* s : sent) s->got = SaveMember::Got::alone;
        } catch (...) {
            for (SaveMember* s : sent) s->got = SaveMember::Got::alone;
        }
    }

};

PostgresStore::PostgresStore(std::string conninfo, PostgresOptions options) : impl_(std::make_unique<Impl>()) {
    Impl& m = *impl_;
    if (options.pool_size == 0) throw config_error("idem: pool_size must be at least 1");
    if (options.claim_attempts < 1) throw config_error("idem: claim_attempts must be at least 1");
    if (options.statement_timeout.count() <= 0 || options.lock_timeout.count() <= 0) {
        throw config_error("idem: statement_timeout and lock_timeout must be positive");
    }
    if (options.lock_timeout >= options.statement_timeout) {
        throw config_error("idem: lock_timeout must be shorter than statement_timeout");
    }
    if (options.default_lease.count() <= 0 || options.default_retention.count() <= 0) {
        throw config_error("idem: default_lease and default_retention must be positive");
    }
    m.table = pg::TableName::parse(options.table);
    m.defs = pg::statements(m.table);
    m.settings = pg::ConnectSettings{std::move(conninfo),     options.application_name,
                                     options.connect_timeout, options.statement_timeout,
                                     options.lock_timeout,    options.prepared_statements,
                                     options.session_options};
    m.options = std::move(options);
    // Deadlines are kept to within one tick (they are statement_timeout + lock_timeout + 1 s away).
    m.watchdog = std::make_unique<pg::Watchdog>(std::chrono::milliseconds(50));
    m.settings.watchdog = m.watchdog.get();
    const std::size_t in_flight = std::min(Impl::kGroupsInFlight, m.options.pool_size);
    m.claim_groups = std::make_unique<pg::Combiner>(in_flight);
    m.save_groups = std::make_unique<pg::Combiner>(in_flight);
    m.pool = std::make_unique<pg::Pool>(
        m.options.pool_size, m.options.pool_wait, m.options.health_check_after,
        [&m] { return std::make_unique<pg::Connection>(m.settings, m.defs); },
        [&m](pg::Connection& conn) {
            try {
                Params none;
                return m.run_one(conn, pg::kPing, none)[0].ok();
            } catch (const error&) {
                return false;
            }
        },
        [&m](bool opened) { (opened ? m.counters().opened : m.counters().discarded).fetch_add(1); });
}

PostgresStore::~PostgresStore() = default;

int PostgresStore::schema_version() noexcept { return pg::kSchemaVersion; }

std::string PostgresStore::schema_sql(const std::string& table) {
    return pg::schema_sql(pg::TableName::parse(table));
}

const PostgresOptions& PostgresStore::options() const noexcept { return impl_->options; }

std::size_t PostgresStore::max_result_bytes() const noexcept { return impl_->options.max_result_bytes; }

void PostgresStore::ensure_schema() {
    Impl& m = *impl_;
    m.check_process();
    // A plain (non-pipelined) connection of its own: DDL runs as one simple-protocol transaction.
    pg::ConnectSettings settings = m.settings;
    const std::string timeout = std::to_string(std::max<long long>(2, (settings.connect_timeout.count() + 999) / 1000));
    const char* keys[] = {"dbname", "connect_timeout", "application_name", nullptr};
    const char* values[] = {settings.conninfo.c_str(), timeout.c_str(), settings.application_name.c_str(), nullptr};
    pg::ConnPtr conn(PQconnectdbParams(keys, values, 1));
    if (!conn) throw store_unavailable("idem: ensure_schema: out of memory creating a PostgreSQL connection");
    if (PQstatus(conn.get()) != CONNECTION_OK) pg::throw_connect_error(PQerrorMessage(conn.get()));
    pg::quiet_notices(conn.get());
    const auto exec = [&](const std::string& sql, std::vector<std::string> params = {}) {
        std::vector<const char*> args;
        for (const auto& p : params) args.push_back(p.c_str());
        pg::ResultPtr r(params.empty() ? PQexec(conn.get(), sql.c_str())
                                       : PQexecParams(conn.get(), sql.c_str(), static_cast<int>(args.size()),
                                                      nullptr, args.data(), nullptr, nullptr, 0));
        const auto status = r ? PQresultStatus(r.get()) : PGRES_FATAL_ERROR;
        if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
            const char* state = r ? PQresultErrorField(r.get(), PG_DIAG_SQLSTATE) : nullptr;
            const std::string sqlstate = state ? state : "";
            std::string msg = "idem: ensure_schema failed: " + std::string(PQerrorMessage(conn.get()));
            while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
            if (sqlstate.empty()) throw store_unavailable(msg);  // the connection failed
            pg::throw_database_error(std::move(msg), sqlstate);
        }
        return r;
    };
    const std::string literal = m.table.schema.empty() ? m.table.table : m.table.schema + "." + m.table.table;
    exec("BEGIN");
    // Serialises concurrent ensure_schema() calls (several instances starting at once): without it,
    // two CREATE TABLE IF NOT EXISTS can still collide on the catalog's unique index. One lock for
    // every table: stores of different tables share the schema's idem_schema_version table.
    exec("SELECT pg_advisory_xact_lock(hashtext($1))", {"idem.ensure_schema"});
    if (!m.table.schema.empty()) exec("CREATE SCHEMA IF NOT EXISTS \"" + m.table.schema + "\"");
    exec(pg::schema_sql(m.table));
    auto r = exec("SELECT version FROM " + m.table.version_table + " WHERE table_name = $1", {literal});
    const int found = PQntuples(r.get()) == 1 ? std::stoi(PQgetvalue(r.get(), 0, 0)) : 0;
    if (found > pg::kSchemaVersion) {
        exec("ROLLBACK");
        throw config_error("idem: table " + literal + " has schema version " + std::to_string(found) +
                           ", newer than this idem (" + std::to_string(pg::kSchemaVersion) + ")");
    }
    exec("COMMIT");
}

Claim PostgresStore::claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options) {
    Impl& m = *impl_;
    m.counters().claims.fetch_add(1, std::memory_order_relaxed);
    const auto lease = options.lease.value_or(m.options.default_lease);
    const auto retention = options.retention.value_or(m.options.default_retention);
    const auto wait_until = options.wait > Clock::duration::zero() ? Clock::now() + options.wait : Clock::time_point{};
    // One fence for every attempt: after a broken connection, the retry recognises its own claim.
    const Fence fence = detail::new_fence();
    // Every path fills and returns this one object (so it is built in the caller's Claim: a
    // replay decodes its row straight into it, with no Record moved or copied on the way out).
    Claim out;
    const auto claimed = [&](std::optional<Record> taken = std::nullopt) {
        m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);
        out.status = ClaimStatus::claimed;
        out.fence = fence;
        out.existing = std::move(taken);
        out.retry_after = {};
    };
    const auto claim_params = [&](Params& p) { add_claim_params(p, key, fp, fence, lease, retention); };
    using Got = Impl::ClaimMember::Got;
    // Group commit takes the first attempt only (one round trip); whatever follows (retries, an
    // expired record, resume, wait) goes alone. Not from inside this store's own in-transaction
    // effect: that call must not wait behind a group (acquire() says why).
    bool grouped = m.options.group_commit && in_effect_of != &m;

    for (int failures = 0;;) {
        Got got = Got::alone;
        pg::StepResults res;
        if (grouped) {
            grouped = false;
            m.check_process();
            Impl::ClaimMember me;
            me.key = &key, me.fp = &fp, me.fence = fence, me.lease = lease, me.retention = retention, me.out = &out;
            std::vector<pg::Combiner::Member*> group;
            const auto role = m.claim_groups->join(me, m.options.pool_wait, group);
            if (role == pg::Combiner::Role::lead) {
                m.run_claim_group(group);
                m.claim_groups->finish(group);
            }
            if (me.got == Got::error) std::rethrow_exception(me.error);
            got = me.got;
            // (a group's failed statement counts as an attempt: going alone after it is a retry)
            if (got == Got::alone && role != pg::Combiner::Role::alone) {
                m.counters().retries.fetch_add(1, std::memory_order_relaxed);
            }
            if (got == Got::plain) res = std::move(me.plain);
        }
        if (got == Got::alone) {
            res = m.claim_round_trip(key, fp, fence, lease, retention);
            got = Got::plain;
        }
        bool conflicted = false;
        if (got == Got::plain) {
            const StepResult& inserted = res[0];
            const StepResult& selected = res[1];
            // ok() holds only when the whole segment committed: an INSERT whose read (or COMMIT)
            // failed afterwards was rolled back with it and is never taken for a claim.
            const StepResult* failure = res.first_failure();
            if (inserted.ok() && inserted.rows() == 1) {
                got = Got::won;
            } else if (failure != nullptr && !claim_retryable(failure->sqlstate())) {
                // Nothing of this attempt committed. A cancel, a timeout or a shortage is
                // store_unavailable, a missing privilege config_error: fn is not called either way.
                // (a failed COMMIT is reported on the read, the segment's last statement: "claim" for both)
                throw_statement_error(*failure, "claim");
            } else if (failure == nullptr && selected.rows() == 1) {
                parse_record(selected.result.get(), 0, out.existing.emplace());
                got = Got::found;
            } else {
                got = Got::absent;
                conflicted = failure != nullptr;
            }
        }
        if (got == Got::won) {
            claimed();
            return out;
        }
        if (got == Got::found) {
            Record& record = *out.existing;
            if (record.fence == fence && record.state == RecordState::in_progress) {
                claimed();  // ours, from an attempt whose answer was lost with its connection
                return out;
            }
            if (record.expired) {
                // Past retention: claim it again with a conditional UPDATE (one winner).
                const bool won = m.with_connection("claim (expired)", [&](pg::Connection& conn, int) {
                    Params p;
                    claim_params(p);
                    auto r = m.run_one(conn, pg::kReclaimExpired, p);
                    if (!r[0].ok()) throw_statement_error(r[0], "claim (expired)");
                    return r[0].rows() == 1;
                });
                if (won) {
                    claimed();
                    return out;
                }
                out.existing.reset();
                continue;  // someone else re-claimed it first: read again
            }
            out.status = classify(record, fp);
            out.fence = 0;
            if (out.status != ClaimStatus::in_progress) return out;
            if (options.resume_stale && record.lease_expired) {
                if (auto taken = m.take_over(key, record.fence, fence, lease, true)) {
                    emit(Event::taken_over, &key);
                    claimed(std::move(taken));
                    return out;
                }
                out.existing.reset();
                continue;  // another retry or a reconciler took it
            }
            if (Clock::now() < wait_until && m.wait_for_save(key, wait_until)) {
                out.existing.reset();
                continue;
            }
            // (a waiter that could not get a connection of its own answers in_progress right away)
            out.retry_after = detail::retry_after_hint(record.lease_until, std::chrono::system_clock::now(),
                                                       m.options.max_retry_after);
            return out;
        }
        // Nothing to read: the conflicting claim was released or rolled back in between, or we timed
        // out waiting for a concurrent uncommitted claim. Try again; past the bound, tell the caller
        // the key is busy — never a generic failure.
        if (++failures >= m.options.claim_attempts) {
            out.status = ClaimStatus::in_progress;
            out.fence = 0;
            out.existing.reset();
            out.retry_after = m.options.max_retry_after;
            return out;
        }
        m.counters().retries.fetch_add(1, std::memory_order_relaxed);
        if (conflicted) {
            thread_local std::minstd_rand jitter{std::random_device{}()};
            std::this_thread::sleep_for(std::chrono::milliseconds(1 + jitter() % (10u * static_cast<unsigned>(failures))));
        }
    }
}

void PostgresStore::save(const Key& key, Fence fence, std::string_view result) {
    Impl& m = *impl_;
    if (result.size() > m.options.max_result_bytes) {
        throw response_too_large("idem: result of " + std::to_string(result.size()) +
                                     " bytes exceeds max_result_bytes " + std::to_string(m.options.max_result_bytes),
                                 std::string(result));
    }
    m.counters().saves.fetch_add(1, std::memory_order_relaxed);
    // Group commit: the first attempt may share one UPDATE with concurrent saves (see claim()).
    bool group_sent = false;  // the group's statement may have committed this save before it failed
    if (m.options.group_commit && in_effect_of != &m) {
        m.check_process();
        Impl::SaveMember me;
        me.key = &key, me.fence = fence, me.result = result;
        std::vector<pg::Combiner::Member*> group;
        if (m.save_groups->join(me, m.options.pool_wait, group) == pg::Combiner::Role::lead) {
            m.run_save_group(group);
            m.save_groups->finish(group);
        }
        if (me.got == Impl::SaveMember::Got::lost) {
            throw lease_lost("idem: save refused: fence " + std::to_string(fence) + " no longer owns the key");
        }
        if (me.got == Impl::SaveMember::Got::saved) {
            if (me.waiters) m.wake_waiters(key);
            return;
        }
        group_sent = me.sent;
        if (group_sent) m.counters().retries.fetch_add(1, std::memory_order_relaxed);
    }
    const bool waiters = m.with_connection("save", [&](pg::Connection& conn, int attempt) {
        Params p;
        p.text(key.scope()).text(key.value()).int8(fence).bytes(result);
        auto res = m.run_one(conn, pg::kSave, p);
        if (!res[0].ok()) throw_statement_error(res[0], "save");
        if (res[0].rows() == 1) return pg::get_bool(res[0].result.get(), 0, 0);
        // Not updated: either an earlier attempt of this very save landed before its connection
        // broke (a retry finds its own bytes in place), or the fence lost the key.
        if (attempt > 1 || group_sent) {
            auto record = m.select(conn, key);
            if (record && record->fence == fence && record->state == RecordState::completed &&
                record->result == result) {
                return false;
            }
        }
        throw lease_lost("idem: save refused: fence " + std::to_string(fence) + " no longer owns the key");
    }, m.options.save_retry_window);
    if (waiters) {
        m.wake_waiters(key);
    }
}

std::vector<Claim> PostgresStore::claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                              const ClaimOptions& options) {
    Impl& m = *impl_;
    if (keys.size() != fps.size()) throw config_error("idem: claim_batch needs one fingerprint per key");
    const auto lease = options.lease.value_or(m.options.default_lease);
    const auto retention = options.retention.value_or(m.options.default_retention);
    std::vector<std::optional<Claim>> out(keys.size());
    // Claims won so far: released again if a later part of the batch fails, so an exception never
    // strands a claim whose effect will not run. Not a key taken over (resume_stale, `existing`
    // set): an earlier attempt's outcome is unknown there, and deleting its record (recovery point
    // included) would let the next claim run the effect again. It stays in progress, stale again
    // when our lease passes.
    const auto release_won = [&] {
        for (std::size_t i = 0; i < out.size(); ++i) {
            if (out[i] && out[i]->status == ClaimStatus::claimed && !out[i]->existing) {
                try {
                    release(keys[i], out[i]->fence);
                } catch (const error&) {
                    // stays in progress: safe (the effect did not run), the reconciler releases it
                }
            }
        }
    };
    try {
        // Chunks keep one transaction's lock count and one statement's size bounded.
        constexpr std::size_t kChunk = 1024;
        for (std::size_t begin = 0; begin < keys.size(); begin += kChunk) {
            const std::size_t n = std::min(kChunk, keys.size() - begin);
            // Claims in key order: concurrent batches that share keys lock them in the same order.
            std::vector<std::size_t> order(n);
            for (std::size_t j = 0; j < n; ++j) order[j] = begin + j;
            std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return keys[a] < keys[b]; });
            for (std::size_t j = 1; j < n; ++j) {
                if (keys[order[j]] == keys[order[j - 1]]) throw config_error("idem: claim_batch keys must be distinct");
            }
            std::vector<Fence> fences(n);
            std::vector<std::string_view> scopes(n), values(n), digests(n);
            std::vector<std::int16_t> algs(n);
            for (std::size_t j = 0; j < n; ++j) {
                const std::size_t i = order[j];
                fences[j] = detail::new_fence();
                scopes[j] = keys[i].scope();
                values[j] = keys[i].value();
                digests[j] = fps[i].bytes();
                algs[j] = static_cast<std::int16_t>(fps[i].algorithm());
            }
            m.counters().claims.fetch_add(n, std::memory_order_relaxed);

            for (int failures = 0;; ++failures) {
                // [INSERT … SELECT FROM unnest | Sync | SELECT … JOIN unnest | Sync]: every claim of the
                // chunk commits together, one round trip, two statements.
                pg::StepResults res = m.with_connection("claim_batch", [&](pg::Connection& conn, int) {
                    Params ins, sel;
                    ins.text_array(scopes)
                        .text_array(values)
                        .bytea_array(digests)
                        .int2_array(algs)
                        .int8_array(fences)
                        .int8(lease.count())
                        .int8(retention.count());
                    sel.text_array(scopes).text_array(values);
                    const Step steps[] = {{&m.defs[pg::kClaimBatchInsert], &ins}, {&m.defs[pg::kSelectBatch], &sel}};
                    return m.run(conn, steps);
                });
                if (!res[0].ok()) {
                    if (!claim_retryable(res[0].sqlstate())) throw_statement_error(res[0], "claim_batch");
                    m.counters().retries.fetch_add(1, std::memory_order_relaxed);
                    if (failures + 1 < m.options.claim_attempts) {
                        thread_local std::minstd_rand jitter{std::random_device{}()};
                        std::this_thread::sleep_for(std::chrono::milliseconds(1 + jitter() % 20));
                        continue;
                    }
                    // Contended: settle each key on its own (each with its own bounded retries).
                    m.counters().claims.fetch_sub(n, std::memory_order_relaxed);  // claim() counts again
                    for (std::size_t j = 0; j < n; ++j) out[order[j]] = claim(keys[order[j]], fps[order[j]], options);
                    break;
                }
                // The INSERT committed under its own Sync: its claims are won whatever happens to the
                // read. Recorded first, so that release_won() frees them if the batch throws later.
                std::unordered_map<Fence, std::size_t> won;  // fence → position in `order`
                for (std::size_t j = 0; j < n; ++j) won.emplace(fences[j], j);
                std::vector<bool> inserted(n, false);
                const PGresult* r = res[0].result.get();
                for (int row = 0; row < PQntuples(r); ++row) {
                    if (auto it = won.find(pg::get_int8(r, row, 0)); it != won.end()) inserted[it->second] = true;
                }
                for (std::size_t j = 0; j < n; ++j) {
                    if (!inserted[j]) continue;
                    m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);
                    out[order[j]] = Claim{ClaimStatus::claimed, fences[j], std::nullopt, {}};
                }
                if (!res[1].ok()) {
                    // The read failed (a transaction of its own): only the keys the INSERT did not
                    // win need it. Each takes the single-key path, which retries or reports the
                    // failure; if one throws, release_won() frees the claims won above.
                    for (std::size_t j = 0; j < n; ++j) {
                        if (inserted[j]) continue;
                        m.counters().claims.fetch_sub(1, std::memory_order_relaxed);  // claim() counts again
                        out[order[j]] = claim(keys[order[j]], fps[order[j]], options);
                    }
                    break;
                }
                std::map<std::pair<std::string_view, std::string_view>, int> found;  // (scope, key) → row
                const PGresult* rows = res[1].result.get();
                for (int row = 0; row < PQntuples(rows); ++row) {
                    found.emplace(std::pair(pg::get_bytes(rows, row, pg::kRecordColumns),
                                            pg::get_bytes(rows, row, pg::kRecordColumns + 1)),
                                  row);
                }
                for (std::size_t j = 0; j < n; ++j) {
                    const std::size_t i = order[j];
                    if (inserted[j]) continue;  // recorded above
                    std::optional<Record> record;
                    if (auto it = found.find(std::pair(scopes[j], values[j])); it != found.end()) {
                        record = parse_record(rows, it->second);
                    }
                    if (record && record->fence == fences[j] && record->state == RecordState::in_progress) {
                        // ours: an attempt whose answer was lost with its connection committed it
                        m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);
                        out[i] = Claim{ClaimStatus::claimed, fences[j], std::nullopt, {}};
                        continue;
                    }
                    const ClaimStatus status = record ? classify(*record, fps[i]) : ClaimStatus::in_progress;
                    // The rare cases (a vanished row, an expired record, resume or wait requested) take
                    // the single-key path, which knows them all.
                    if (!record || record->expired ||
                        (status == ClaimStatus::in_progress && (options.resume_stale || options.wait.count() > 0))) {
                        m.counters().claims.fetch_sub(1, std::memory_order_relaxed);
                        out[i] = claim(keys[i], fps[i], options);
                        continue;
                    }
                    Claim c{status, 0, std::move(record), {}};
                    if (status == ClaimStatus::in_progress) {
                        c.retry_after = detail::retry_after_hint(c.existing->lease_until,
                                                                 std::chrono::system_clock::now(),
                                                                 m.options.max_retry_after);
                    }
                    out[i] = std::move(c);
                }
                break;
            }
        }
    } catch (...) {
        release_won();
        throw;
    }
    std::vector<Claim> claims;
    claims.reserve(out.size());
    for (auto& c : out) claims.push_back(std::move(*c));
    return claims;
}

std::vector<SaveStatus> PostgresStore::save_batch(std::span<const SaveRequest> saves) {
    Impl& m = *impl_;
    std::vector<SaveStatus> statuses(saves.size(), SaveStatus::lease_lost);
    std::vector<std::string_view> scopes, values, results;
    std::vector<Fence> fences;
    std::unordered_map<Fence, std::size_t> index;  // fence → position in saves
    for (std::size_t i = 0; i < saves.size(); ++i) {
        if (saves[i].result.size() > m.options.max_result_bytes) {
            statuses[i] = SaveStatus::too_large;  // decided before any I/O
            continue;
        }
        scopes.push_back(saves[i].key.scope());
        values.push_back(saves[i].key.value());
        results.push_back(saves[i].result);
        fences.push_back(saves[i].fence);
        index.emplace(saves[i].fence, i);
    }
    if (fences.empty()) return statuses;
    m.counters().saves.fetch_add(fences.size(), std::memory_order_relaxed);
    std::vector<std::size_t> notify;
    m.with_connection("save_batch", [&](pg::Connection& conn, int attempt) {
        notify.clear();
        // One UPDATE … FROM unnest: one statement, one commit for every result.
        Params p;
        p.text_array(scopes).text_array(values).int8_array(fences).bytea_array(results);
        auto res = m.run_one(conn, pg::kSaveBatch, p);
        if (!res[0].ok()) throw_statement_error(res[0], "save_batch");
        const PGresult* r = res[0].result.get();
        for (int row = 0; row < PQntuples(r); ++row) {
            auto it = index.find(pg::get_int8(r, row, 0));
            if (it == index.end()) continue;
            statuses[it->second] = SaveStatus::saved;
            if (pg::get_bool(r, row, 1)) notify.push_back(it->second);
        }
        if (attempt > 1) {  // an earlier attempt of this batch may have committed before its connection broke
            for (auto [fence, i] : index) {
                if (statuses[i] != SaveStatus::lease_lost) continue;
                auto record = m.select(conn, saves[i].key);
                if (record && record->fence == fence && record->state == RecordState::completed &&
                    record->result == saves[i].result) {
                    statuses[i] = SaveStatus::saved;
                }
            }
        }
    }, m.options.save_retry_window);
    for (std::size_t i : notify) m.wake_waiters(saves[i].key);
    return statuses;
}

void PostgresStore::release(const Key& key, Fence fence) {
    Impl& m = *impl_;
    m.counters().releases.fetch_add(1, std::memory_order_relaxed);
    m.with_connection("release", [&](pg::Connection& conn, int attempt) {
        Params p;
        p.text(key.scope()).text(key.value()).int8(fence);
        auto res = m.run_one(conn, pg::kRelease, p);
        if (!res[0].ok()) throw_statement_error(res[0], "release");
        if (res[0].rows() == 1) return;
        if (attempt > 1) {
            // A retry: our first DELETE may have landed (and someone may have claimed since).
            auto record = m.select(conn, key);
            if (!record || record->fence != fence) return;
        }
        throw lease_lost("idem: release refused: fence " + std::to_string(fence) + " no longer owns the key");
    });
}

void PostgresStore::extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) {
    Impl& m = *impl_;
    m.with_connection("extend_lease", [&](pg::Connection& conn, int) {
        Params p;
        p.text(key.scope()).text(key.value()).int8(fence).int8(lease.count());
        m.expect_owned(m.run_one(conn, pg::kExtendLease, p), "extend_lease", fence);
    });
}

void PostgresStore::record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) {
    Impl& m = *impl_;
    m.with_connection("record_phase", [&](pg::Connection& conn, int) {
        Params p;
        p.text(key.scope()).text(key.value()).int8(fence).text(phase).bytes(data);
        m.expect_owned(m.run_one(conn, pg::kRecordPhase, p), "record_phase", fence);
    });
}

std::optional<Fence> PostgresStore::take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                              bool new_attempt) {
    const Fence fence = detail::new_fence();
    if (!impl_->take_over(key, stale_fence, fence, lease, new_attempt)) return std::nullopt;
    emit(Event::taken_over, &key);
    return fence;
}

std::optional<Record> PostgresStore::read(const Key& key) {
    Impl& m = *impl_;
    m.counters().reads.fetch_add(1, std::memory_order_relaxed);
    return m.with_connection("read", [&](pg::Connection& conn, int) { return m.select(conn, key); });
}

std::vector<StaleKey> PostgresStore::list_stale(std::size_t limit, const ScopeFilter& scopes) {
    Impl& m = *impl_;
    m.counters().reads.fetch_add(1, std::memory_order_relaxed);
    const pg::Stmt stmt = scopes.kind() == ScopeFilter::Kind::exact    ? pg::kListStaleInScope
                          : scopes.kind() == ScopeFilter::Kind::prefix ? pg::kListStaleScopePrefix
                                                                       : pg::kListStale;
    return m.with_connection("list_stale", [&](pg::Connection& conn, int) {
        Params p;
        p.int8(static_cast<std::int64_t>(std::min<std::size_t>(limit, INT64_MAX)));
        if (stmt != pg::kListStale) p.text(scopes.text());
        // list_stale must scan (no index separates in-progress keys): seqscan back on for it, each
        // step under its own Sync so that the reset runs even if the scan fails. Sessions without
        // idem's options (poolers) never turned it off.
        Params none;
        const bool toggle = m.options.session_options;
        const Step with_toggle[] = {{&m.defs[pg::kSeqscanOn], &none},
                                    {&m.defs[stmt], &p},
                                    {&m.defs[pg::kSeqscanDefault], &none}};
        auto res = toggle ? m.run(conn, with_toggle) : m.run_one(conn, stmt, p);
        const StepResult& listed = res[toggle ? 1 : 0];
        if (toggle && (!res[0].ok() || !res[2].ok())) conn.mark_broken();  // session state unknown
        if (!listed.ok()) throw_statement_error(listed, "list_stale");
        std::vector<StaleKey> out;
        const PGresult* r = listed.result.get();
        for (int row = 0; row < PQntuples(r); ++row) {
            Key key(std::string(pg::get_bytes(r, row, pg::kRecordColumns)),
                    std::string(pg::get_bytes(r, row, pg::kRecordColumns + 1)));
            // One row that cannot be decoded (written by a newer idem, or damaged) must not stop
            // every other stale key from being listed — and so resolved. It is left out and
            // reported with its key; its clients get corrupt_record from their own claims.
            try {
                Record record = parse_record(r, row);
                out.push_back(StaleKey{std::move(key), std::move(record)});
            } catch (const corrupt_record& e) {
                const std::string detail = "list_stale: corrupt_record: " + std::string(detail::without_prefix(e.what())) +
                                           " (left out of the listing)";
                emit(Event::reconcile_failed, &key, {}, 1, detail);
            }
        }
        return out;
    });
}

std::size_t PostgresStore::purge_expired(std::size_t batch_size, std::size_t max_batches) {
    Impl& m = *impl_;
    if (batch_size == 0) throw config_error("idem: purge_expired batch_size must be at least 1");
    std::size_t total = 0;
    for (std::size_t batch = 0; batch < max_batches; ++batch) {
        // Each batch its own short transaction: locks are held for one batch only.
        const std::size_t deleted = m.with_connection("purge_expired", [&](pg::Connection& conn, int) {
            Params p;
            p.int8(static_cast<std::int64_t>(std::min<std::size_t>(batch_size, INT64_MAX)));
            auto res = m.run_one(conn, pg::kPurge, p);
            if (!res[0].ok()) throw_statement_error(res[0], "purge_expired");
            return static_cast<std::size_t>(std::strtoull(PQcmdTuples(res[0].result.get()), nullptr, 10));
        });
        total += deleted;
        if (deleted < batch_size) break;
    }
    if (total > 0) emit(Event::purged, nullptr, {}, total);
    return total;
}

PostgresStore::TransactionOutcome PostgresStore::run_in_transaction(
    const Key& key, const Fingerprint& fp, const ClaimOptions& options,
    const std::function<std::string(Transaction&)>& effect) {
    Impl& m = *impl_;
    // A lock wait the statement timeout cuts short would cancel the claim (57014) instead of
    // answering in_progress: refused before any I/O.
    if (options.transaction_lock_wait && *options.transaction_lock_wait >= m.options.statement_timeout) {
        throw config_error("idem: ClaimOptions::transaction_lock_wait must be shorter than the store's statement_timeout");
    }
    m.counters().claims.fetch_add(1, std::memory_order_relaxed);
    const auto lease = options.lease.value_or(m.options.default_lease);
    const auto retention = options.retention.value_or(m.options.default_retention);
    const Fence fence = detail::new_fence();

    std::optional<pg::Lease> conn;
    const auto rollback = [&] {
        try {
            Params none;
            auto r = m.run_one(**conn, pg::kRollback, none);
            if (!r[0].ok()) (*conn)->mark_broken();
        } catch (const error&) {
            (*conn)->mark_broken();
        }
    };
    // The claim: BEGIN; claim; read. Nothing commits before the effect has run, so a pooled
    // connection found dead (a restart or failover since its last use) is simply replaced, as the
    // other entry points do (claim_attempts in all).
    // transaction_lock_wait: the claim's INSERT alone runs under that lock_timeout (set_config,
    // local to the transaction), which is back to the session's before fn runs.
    static const pg::StatementDef set_lock_wait{"", "SELECT set_config('lock_timeout', $1, true)", {pg::oid::text}};
    static const pg::StatementDef reset_lock_wait{"", "SET LOCAL lock_timeout TO DEFAULT", {}};
    const auto& lock_wait = options.transaction_lock_wait;
    const std::size_t shift = lock_wait ? 1 : 0;  // the claim's results move one step down
    for (int failures = 0, broken = 0;;) {
        if (!conn) conn.emplace(m.acquire());
        try {
            Params none, ins, sel, wait_ms;
            add_claim_params(ins, key, fp, fence, lease, retention);
            sel.text(key.scope()).text(key.value());
            const std::string wait_text = lock_wait ? std::to_string(std::max<std::int64_t>(1, lock_wait->count())) + "ms" : "";
            wait_ms.text(wait_text);
            // One round trip, one open transaction (READ COMMITTED: the SELECT still takes its own
            // snapshot). SET LOCAL enable_seqscan = on: fn's own statements are planned as the user
            // expects; idem's lookups need the session's off only (see connection.cpp).
            const Step plain[] = {{&m.defs[pg::kBegin], &none, false},
                                  {&m.defs[pg::kClaimInsert], &ins, false},
                                  {&m.defs[pg::kSelect], &sel, false},
                                  {&m.defs[pg::kSeqscanLocalOn], &none, true}};
            const Step waiting[] = {{&m.defs[pg::kBegin], &none, false},
                                    {&set_lock_wait, &wait_ms, false},
                                    {&m.defs[pg::kClaimInsert], &ins, false},
                                    {&m.defs[pg::kSelect], &sel, false},
                                    {&reset_lock_wait, &none, false},
                                    {&m.defs[pg::kSeqscanLocalOn], &none, true}};
            auto res = lock_wait ? m.run(**conn, waiting) : m.run(**conn, plain);
            // Any failure aborted the transaction: the INSERT's row is not ours, whatever it said.
            const StepResult* failure = res.first_failure();
            bool won = failure == nullptr && res[1 + shift].rows() == 1;
            if (failure == nullptr && !won && res[2 + shift].rows() == 1) {
                Record record = parse_record(res[2 + shift].result.get(), 0);
                if (record.expired) {
                    const Step reclaim[] = {{&m.defs[pg::kSeqscanLocalDefault], &none, false},
                                            {&m.defs[pg::kReclaimExpired], &ins, false},
                                            {&m.defs[pg::kSeqscanLocalOn], &none, true}};
                    auto r = m.run(**conn, reclaim);
                    if (const StepResult* f = r.first_failure()) {
                        rollback();
                        throw_statement_error(*f, "claim (expired)");
                    }
                    won = r[1].rows() == 1;
                }
                if (!won) {
                    rollback();
                    if (record.expired) continue;  // someone else re-claimed it first: read again
                    const ClaimStatus status = classify(record, fp);
                    TransactionOutcome out{status, {}, {}};
                    if (status == ClaimStatus::completed) out.result = std::move(*record.result);
                    if (status == ClaimStatus::in_progress) {
                        out.retry_after = detail::retry_after_hint(record.lease_until, std::chrono::system_clock::now(),
                                                                   m.options.max_retry_after);
                    }
                    return out;
                }
            }
            if (won) break;
            rollback();
            if (failure != nullptr && !claim_retryable(failure->sqlstate())) {
                throw_statement_error(*failure, failure == &res[0] ? "begin" : "claim");
            }
            if (lock_wait && failure != nullptr && failure->sqlstate() == "55P03") {
                // Another open transaction holds the key: answer at once instead of waiting.
                return TransactionOutcome{ClaimStatus::in_progress, {}, m.options.max_retry_after};
            }
            // Lock timeout on a concurrent open transaction, or the row vanished: bounded retry.
            if (++failures >= m.options.claim_attempts) {
                return TransactionOutcome{ClaimStatus::in_progress, {}, m.options.max_retry_after};
            }
            m.counters().retries.fetch_add(1, std::memory_order_relaxed);
        } catch (const pg::connection_broken& e) {
            conn.reset();  // broken: closed as its lease ends
            m.pool->suspect_idle();
            if (++broken >= m.options.claim_attempts) {
                throw store_unavailable(std::string("idem: in-transaction claim: ") +
                                            std::string(detail::without_prefix(e.what())),
                                        e.sqlstate());
            }
            m.counters().retries.fetch_add(1, std::memory_order_relaxed);
        }
    }
    m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);

    try {
        Transaction tx(&**conn, key, m.options.statement_timeout + m.options.lock_timeout + std::chrono::seconds(1));
        std::string bytes;
        try {
            // Marked as inside this store's effect: a call to the store from fn needs a second
            // connection (Impl::acquire says so clearly instead of waiting for the pool).
            struct InEffect {
                const void* previous = in_effect_of;
                explicit InEffect(const void* store) noexcept { in_effect_of = store; }
                ~InEffect() { in_effect_of = previous; }
            } inside(&m);
            bytes = effect(tx);
        } catch (...) {
            rollback();  // claim and effect go together
            throw;
        }
        if (bytes.size() > m.options.max_result_bytes) {
            rollback();
            throw response_too_large("idem: result of " + std::to_string(bytes.size()) +
                                         " bytes exceeds max_result_bytes (rolled back)",
                                     std::move(bytes));
        }
        Params none, save;
        save.text(key.scope()).text(key.value()).int8(fence).bytes(bytes);
        const Step steps[] = {{&m.defs[pg::kSeqscanLocalDefault], &none, false},
                              {&m.defs[pg::kSave], &save, false},
                              {&m.defs[pg::kCommit], &none, true}};
        pg::StepResults res;
        try {
            res = m.run(**conn, steps);
        } catch (const pg::connection_broken& e) {
            throw outcome_unknown(std::string("idem: the transaction's COMMIT was sent but its answer was lost: ") +
                                      std::string(detail::without_prefix(e.what())) +
                                      " — retry with the same key to learn the outcome",
                                  e.sqlstate());
        }
        if (const StepResult* failure = res.first_failure()) {
            rollback();
            // (an effect that swallowed its own statement's error left the transaction aborted:
            // the first statement here reports it)
            throw_statement_error(*failure, failure == &res[2] ? "commit" : "save (in transaction)");
        }
        if (res[1].rows() != 1) {
            rollback();
            // Only fn itself can have changed idem's row in its own transaction; the COMMIT was
            // already sent with the save, so the effect committed without its result.
            throw database_error("idem: in-transaction save matched no row (did the effect change idem's own row?): "
                                 "the transaction committed without a stored result");
        }
        m.counters().saves.fetch_add(1, std::memory_order_relaxed);
        return TransactionOutcome{ClaimStatus::claimed, {}, {}};
    } catch (const pg::connection_broken& e) {
        // The connection broke while fn ran: its transaction, claim included, rolled back.
        throw store_unavailable(std::string("idem: in-transaction mode: ") + std::string(detail::without_prefix(e.what())),
                                e.sqlstate());
    }
}

Transaction::Rows Transaction::exec(std::string_view sql, const std::vector<std::optional<std::string>>& params) {
    auto& conn = *static_cast<pg::Connection*>(connection_);
    const pg::StatementDef def{"", std::string(sql), {}};
    Params p;
    for (const auto& v : params) p.text_format(v ? std::optional<std::string_view>(*v) : std::nullopt);
    const Step step{&def, &p, true, 0};
    auto res = conn.run(std::span(&step, 1), Clock::now() + timeout_);
    if (!res[0].ok()) throw database_error("idem: transaction statement failed: " + res[0].message(), std::string(res[0].sqlstate()));
    Rows out;
    const PGresult* r = res[0].result.get();
    const char* tuples = PQcmdTuples(const_cast<PGresult*>(r));
    out.affected = tuples && *tuples ? std::strtoull(tuples, nullptr, 10) : static_cast<std::size_t>(PQntuples(r));
    for (int row = 0; row < PQntuples(r); ++row) {
        Row cells;
        for (int col = 0; col < PQnfields(r); ++col) {
            if (PQgetisnull(r, row, col)) {
                cells.emplace_back(std::nullopt);
            } else {
                cells.emplace_back(std::string(PQgetvalue(r, row, col), static_cast<std::size_t>(PQgetlength(r, row, col))));
            }
        }
        out.rows.push_back(std::move(cells));
    }
    return out;
}

pg_conn* Transaction::native_handle() const noexcept {
    return static_cast<pg::Connection*>(connection_)->native();
}

StoreStats PostgresStore::stats() const {
    StoreStats s;
    for (const auto& c : impl_->counter_shards) {
        s.round_trips += c.round_trips.load();
        s.claims += c.claims.load();
        s.claims_won += c.claims_won.load();
        s.saves += c.saves.load();
        s.releases += c.releases.load();
        s.reads += c.reads.load();
        s.retries += c.retries.load();
        s.connections_opened += c.opened.load();
        s.connections_discarded += c.discarded.load();
        s.claim_groups += c.claim_groups.load();
        s.grouped_claims += c.grouped_claims.load();
        s.save_groups += c.save_groups.load();
        s.grouped_saves += c.grouped_saves.load();
    }
    s.largest_claim_group = impl_->largest_claim_group.load();
    s.largest_save_group = impl_->largest_save_group.load();
    return s;
}

}  // namespace idem
