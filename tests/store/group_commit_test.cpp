// Group commit (PostgresOptions::group_commit): concurrent claim() / save() callers that find no
// pooled connection free share one statement and one commit, and each still gets exactly its own
// outcome, fence and error. Groups are forced to form by holding every connection of the store on a
// lock that the test's own session holds, so that the next callers must queue; everything is
// checked against what the database holds.
// Needs IDEM_TEST_DATABASE_URL (run under scripts/with-postgres.sh).
#include "idem/idem.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "store_env.hpp"
#include "threads.hpp"

#include <spawn.h>
#include <sys/wait.h>
#include <array>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

extern char** environ;

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::ClaimStatus;
using idem_test::PgConn;

namespace {

using idem_test::require_db;

const idem::Fingerprint kFp = idem::fingerprint("POST /group"s);

/// Group commit engages only for a caller that finds no pooled connection free. The tests that
/// watch groups form give their store kHeld connections and tie each up with a claim (or a save)
/// waiting on the test's own lock: every caller that arrives meanwhile finds none free, queues in
/// the group commit, and its leader waits for a connection.
constexpr int kHeld = 1;

/// A private idem table (dropped at the end) and a superuser session to look at it.
struct Table {
    std::string url;
    std::string name = idem_test::unique_name("idem_gc");
    std::string app = idem_test::unique_name("idem_gc_app");
    PgConn admin;

    explicit Table(std::string u) : url(std::move(u)), admin(url) {
        idem::PostgresStore(url, options()).ensure_schema();
    }
    ~Table() { idem_test::drop_idem_table(url, name); }
    Table(const Table&) = delete;
    Table& operator=(const Table&) = delete;

    /// Long lock and statement timeouts: a group held on the test's lock must not give up.
    [[nodiscard]] idem::PostgresOptions options(std::size_t pool_size = 16) const {
        idem::PostgresOptions o;
        o.table = name;
        o.pool_size = pool_size;
        o.application_name = app;
        o.group_commit = true;
        o.lock_timeout = 20s;
        o.statement_timeout = 30s;
        return idem_test::env_options(o);  // IDEM_TEST_STATEMENT_SHAPE (tests/CMakeLists.txt)
    }

    /// Rows of `key` holding `fence` (0 or 1).
    long long rows_with(const std::string& scope, const std::string& key, idem::Fence fence) {
        return admin.scalar("SELECT count(*) FROM " + name + " WHERE scope = $1 AND key = $2 AND fence = $3",
                            {scope, key, std::to_string(fence)});
    }

    /// Waits until `n` of the store's backends wait on a lock (the groups the test holds in flight).
    void await_lock_waiters(int n) {
        for (int i = 0; i < 3000; ++i) {
            if (admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                             "AND wait_event_type = 'Lock'",
                             {app}) >= n)
                return;
            std::this_thread::sleep_for(10ms);
        }
        FAIL("the held groups never waited on the test's lock");
    }
};

/// Holds kHeld claims (keys blocker-1, ...), each on a pooled connection of its own, waiting on the
/// test's own uncommitted rows of them: a store with kHeld connections has none free meanwhile.
/// `release()` rolls back, and the held claims win.
class Hold {
public:
    Hold(Table& t, const std::string& scope, idem::PostgresStore& store) : blocker_(t.url) {
        blocker_.exec("BEGIN");
        for (int b = 1; b <= kHeld; ++b) {
            blocker_.exec("INSERT INTO " + t.name +
                              " (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, expires_at) "
                              "VALUES ($1, $2, 'in_progress', '\\x00', 1, 1, now(), now() + interval '1 day')",
                          {scope, "blocker-" + std::to_string(b)});
        }
        for (std::size_t b = 0; b < kHeld; ++b) {
            held_.emplace_back([&store, scope, b, this] {
                try {
                    held_claims_[b] = store.claim(idem::Key(scope, "blocker-" + std::to_string(b + 1)), kFp);
                } catch (...) {  // seen by the test's row count
                }
            });
        }
        try {
            t.await_lock_waiters(kHeld);
        } catch (...) {
            release();  // join the held claims: a joinable thread must not be destroyed
            throw;
        }
    }
    ~Hold() { release(); }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

    void release() {
        if (released_) return;
        released_ = true;
        blocker_.exec("ROLLBACK");
        for (auto& th : held_) th.join();
    }

private:
    PgConn blocker_;
    std::vector<std::thread> held_;
    std::array<idem::Claim, kHeld> held_claims_;
    bool released_ = false;
};

/// Waits (at most 30 s: a loaded machine) until `n` callers of `store` wait for a connection,
/// queued by group commit or in the pool. If they never do, the test case fails here and goes on
/// (its threads still have to be let go and joined).
void await_waiters(const idem::PostgresStore& store, std::size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (store.pool_stats().waiters < n) {
        if (std::chrono::steady_clock::now() > deadline) {
            FAIL_CHECK("after 30 s, " << store.pool_stats().waiters << " callers wait for a connection, not " << n);
            return;
        }
        std::this_thread::sleep_for(1ms);
    }
}

/// Starts `n` threads running body(i), waits until all of them wait for a connection of `store`
/// (queued behind a Hold), releases it, then joins them. The store's pool_wait must outlast the
/// time the threads take to start.
template <class Body>
void queue_behind(Hold& hold, idem::PostgresStore& store, int n, Body body) {
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
        threads.emplace_back([&, i] {
            try {
                body(i);
            } catch (...) {
                errors[static_cast<std::size_t>(i)] = std::current_exception();
            }
        });
    }
    await_waiters(store, static_cast<std::size_t>(n));
    hold.release();
    for (auto& th : threads) th.join();
    for (auto& e : errors) {
        if (e) std::rethrow_exception(e);
    }
}

}  // namespace

TEST_CASE("claims that find no connection free share one group: each keeps its outcome, fence, lease",
          "[group_commit]") {
    IDEM_NOT_ON_CITUS("it sees the groups it holds through their lock waits in the coordinator's pg_stat_activity");
    Table t(require_db());
    auto options = t.options(kHeld);
    options.pool_wait = 60s;  // queued callers never give up and go alone while the test holds them
    idem::PostgresStore store(t.url, options);
    const auto scope = idem_test::unique_name("claims");
    constexpr int kDistinct = 12, kSame = 8;
    std::vector<idem::Claim> claims(kDistinct + kSame);
    {
        Hold hold(t, scope, store);
        queue_behind(hold, store, kDistinct + kSame, [&](int i) {
            // Distinct keys, each with its own lease and retention; then 8 callers on one key.
            idem::ClaimOptions o;
            o.lease = std::chrono::milliseconds(10'000 + 1000 * i);
            o.retention = std::chrono::seconds(3600 + i);
            const std::string k = i < kDistinct ? "k" + std::to_string(i) : "same";
            claims[static_cast<std::size_t>(i)] = store.claim(idem::Key(scope, k), kFp, o);
        });
    }
    const auto stats = store.stats();
    const idem::GroupCommitStats groups = store.group_commit_stats();
    INFO("groups " << groups.claim_groups << ", grouped claims " << groups.grouped_claims << ", largest "
                   << groups.largest_claim_group);
    CHECK(groups.largest_claim_group > 1);                 // a group did form
    CHECK(groups.grouped_claims == stats.claims - kHeld);  // all but the held ones, which found a connection
    for (int i = 0; i < kDistinct; ++i) {
        const auto& c = claims[static_cast<std::size_t>(i)];
        const std::string k = "k" + std::to_string(i);
        CAPTURE(k);
        REQUIRE(c.status == ClaimStatus::claimed);
        CHECK(t.rows_with(scope, k, c.fence) == 1);
        // Per-member lease and retention, by the database's clock. The lease counts from when the
        // member's row is made, a moment after its transaction began (created_at): its own lease,
        // not the next member's (leases 1 s apart).
        const auto lease_ms =
            t.admin.scalar("SELECT (extract(epoch FROM lease_until - created_at) * 1000)::bigint FROM " + t.name +
                               " WHERE scope = $1 AND key = $2",
                           {scope, k});
        CHECK(lease_ms >= 10'000 + 1000 * i);
        CHECK(lease_ms < 10'000 + 1000 * (i + 1));
        CHECK(t.admin.scalar("SELECT extract(epoch FROM expires_at - created_at)::bigint FROM " + t.name +
                                 " WHERE scope = $1 AND key = $2",
                             {scope, k}) == 3600 + i);
    }
    // Duplicates (most of them in one group): exactly one wins, the others see it in progress.
    int won = 0, busy = 0;
    idem::Fence winner = 0;
    for (int i = kDistinct; i < kDistinct + kSame; ++i) {
        const auto& c = claims[static_cast<std::size_t>(i)];
        if (c.status == ClaimStatus::claimed) ++won, winner = c.fence;
        if (c.status == ClaimStatus::in_progress) ++busy;
    }
    CHECK(won == 1);
    CHECK(busy == kSame - 1);
    CHECK(t.rows_with(scope, "same", winner) == 1);
    // The held claims won once the test's rows were rolled back.
    CHECK(t.admin.scalar("SELECT count(*) FROM " + t.name + " WHERE scope = $1 AND key LIKE 'blocker-%'", {scope}) ==
          kHeld);
}

TEST_CASE("grouped claims key their fingerprints and classify found rows by their algorithm", "[group_commit]") {
    IDEM_NOT_ON_CITUS("it sees the groups it holds through their lock waits in the coordinator's pg_stat_activity");
    Table t(require_db());
    const auto scope = idem_test::unique_name("keyed");
    const idem::FingerprintSecret secret("a fingerprint secret of at least 32 bytes"s);
    const idem::Fingerprint other = idem::fingerprint("POST /group"s, "another request"s);
    {
        // Rows written before the secret was set (plain SHA-256).
        idem::PostgresStore plain(t.url, t.options());
        for (const char* k : {"old-same", "old-other"}) {
            const auto c = plain.claim(idem::Key(scope, k), kFp);
            REQUIRE(c.status == ClaimStatus::claimed);
            plain.save(idem::Key(scope, k), c.fence, "old");
        }
    }
    auto options = t.options(kHeld);
    options.fingerprint_secret = secret;
    options.pool_wait = 60s;  // queued callers never give up and go alone while the test holds them
    idem::PostgresStore store(t.url, options);
    constexpr int kNew = 6;
    std::vector<idem::Claim> claims(kNew + 2);
    {
        Hold hold(t, scope, store);
        queue_behind(hold, store, kNew + 2, [&](int i) {
            const auto n = static_cast<std::size_t>(i);
            if (i < kNew) claims[n] = store.claim(idem::Key(scope, "k" + std::to_string(i)), kFp);
            if (i == kNew) claims[n] = store.claim(idem::Key(scope, "old-same"), kFp);
            if (i == kNew + 1) claims[n] = store.claim(idem::Key(scope, "old-other"), other);
        });
    }
    CHECK(store.group_commit_stats().largest_claim_group > 1);  // a group did form
    for (int i = 0; i < kNew; ++i) {
        const std::string k = "k" + std::to_string(i);
        CAPTURE(k);
        CHECK(claims[static_cast<std::size_t>(i)].status == ClaimStatus::claimed);
        auto r = t.admin.exec(
            "SELECT fingerprint_alg, encode(fingerprint, 'hex') FROM " + t.name + " WHERE scope = $1 AND key = $2",
            {scope, k});
        REQUIRE(r.rows() == 1);
        CHECK(r.integer(0, 0) == 2);
        CHECK(r.text(0, 1) == secret.key(kFp).hex());
    }
    CHECK(claims[kNew].status == ClaimStatus::completed);     // plain row, same request
    CHECK(claims[kNew + 1].status == ClaimStatus::mismatch);  // plain row, another request
}

TEST_CASE("group commit engages only for callers that find no connection free", "[group_commit]") {
    Table t(require_db());
    // T threads, each claiming and saving its own keys, on a pool of P connections.
    const auto [threads, pool] = GENERATE(std::pair{16, 16}, std::pair{64, 8});
    CAPTURE(threads, pool);
    auto options = t.options(static_cast<std::size_t>(pool));
    options.pool_wait = 120s;  // a loaded machine: one effect per key is the point, not the wait
    idem::PostgresStore store(t.url, options);
    const auto scope = idem_test::unique_name("engage");
    constexpr int kPerThread = 20;
    std::mutex mutex;
    std::map<std::string, idem::Fence> won;
    std::atomic<int> not_claimed{0};
    idem_test::run_threads(threads, [&](int th) {
        for (int i = 0; i < kPerThread; ++i) {
            const idem::Key key(scope, "t" + std::to_string(th) + "-" + std::to_string(i));
            const auto c = store.claim(key, kFp);
            if (c.status != ClaimStatus::claimed) {
                ++not_claimed;
                continue;
            }
            store.save(key, c.fence, "done " + key.value());
            std::lock_guard lock(mutex);
            won[key.value()] = c.fence;
        }
    });
    const auto stats = store.stats();
    const auto groups = store.group_commit_stats();
    INFO("claim groups " << groups.claim_groups << " (" << groups.grouped_claims << " claims, largest "
                         << groups.largest_claim_group << "), save groups " << groups.save_groups << " ("
                         << groups.grouped_saves << " saves), round trips " << stats.round_trips);
    const auto calls = static_cast<std::uint64_t>(threads * kPerThread);
    CHECK(not_claimed == 0);
    REQUIRE(won.size() == calls);
    CHECK(t.admin.scalar("SELECT count(*) FROM " + t.name + " WHERE scope = $1 AND state = 'completed'", {scope}) ==
          static_cast<long long>(calls));
    if (threads <= pool) {
        // Every caller found a connection: exactly the calls without group commit, 2 round trips each.
        CHECK(groups.claim_groups == 0);
        CHECK(groups.save_groups == 0);
        CHECK(stats.round_trips == 2 * calls);
    } else {
        // Most callers found none free and shared transactions: fewer round trips than calls.
        CHECK(groups.largest_claim_group > 1);
        CHECK(groups.largest_save_group > 1);
        CHECK(stats.round_trips < 2 * calls);
    }
}

TEST_CASE("a caller that finds a connection free goes alone at once, whatever the groups do", "[group_commit]") {
    IDEM_NOT_ON_CITUS("it sees the claims it holds through their lock waits in the coordinator's pg_stat_activity");
    Table t(require_db());
    idem::PostgresStore store(t.url, t.options(16));
    const auto scope = idem_test::unique_name("free");
    Hold hold(t, scope, store);  // kHeld claims wait on the test's lock; the other connections are free
    std::atomic<bool> done{false};
    idem::Claim c;
    std::thread caller([&] {
        c = store.claim(idem::Key(scope, "free"), kFp);
        done = true;
    });
    // Generous for a loaded machine; the held claim waits on the test's lock for as long as it takes.
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (!done && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
    const bool before_release = done;
    hold.release();
    caller.join();
    CHECK(before_release);
    CHECK(c.status == ClaimStatus::claimed);
    CHECK(t.rows_with(scope, "free", c.fence) == 1);
    CHECK(store.group_commit_stats().claim_groups == 0);  // every claim found a connection: none grouped
}

TEST_CASE("callers that find every connection held get pool_timeout after pool_wait, not later", "[group_commit]") {
    IDEM_NOT_ON_CITUS("it sees the claims it holds through their lock waits in the coordinator's pg_stat_activity");
    Table t(require_db());
    auto options = t.options(kHeld);
    // Long enough that a busy machine's scheduling delays stay small beside it.
    options.pool_wait = 3s;
    idem::PostgresStore store(t.url, options);
    const auto scope = idem_test::unique_name("patience");
    const auto saved = store.claim(idem::Key(scope, "saved"), kFp);
    REQUIRE(saved.status == ClaimStatus::claimed);
    Hold hold(t, scope, store);  // holds every connection
    // The first claim leads a group and waits for a connection, the others queue behind it; when
    // the leader's wait ends the queue becomes the next group, whose leader's wait is its own.
    // Each call's wait ends pool_wait after it began: never a second pool_wait after the first
    // (in the queue, then alone; or as a promoted leader). The save leads a save group alone.
    // Each caller starts once the one before it waits (or after 30 s: the check below then fails).
    constexpr int kCallers = 5;  // 4 claims, then the save
    std::array<std::string, kCallers> outcome;
    std::array<std::chrono::milliseconds, kCallers> waited{};
    std::vector<std::thread> callers;
    std::size_t most_waiters = 0;
    for (int i = 0; i < kCallers; ++i) {
        callers.emplace_back([&, i] {
            const auto began = std::chrono::steady_clock::now();
            try {
                if (i + 1 < kCallers) {
                    (void)store.claim(idem::Key(scope, "k" + std::to_string(i)), kFp);
                } else {
                    store.save(idem::Key(scope, "saved"), saved.fence, "r");
                }
                outcome[static_cast<std::size_t>(i)] = "answered";
            } catch (const idem::pool_timeout&) {
                outcome[static_cast<std::size_t>(i)] = "pool_timeout";
            } catch (const std::exception& e) {
                outcome[static_cast<std::size_t>(i)] = e.what();
            }
            waited[static_cast<std::size_t>(i)] =
                std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - began);
        });
        // Every caller waits for a connection, queued or in the pool: all are waiters.
        const auto deadline = std::chrono::steady_clock::now() + 30s;
        while (most_waiters < static_cast<std::size_t>(i) + 1 && std::chrono::steady_clock::now() < deadline) {
            most_waiters = std::max(most_waiters, store.pool_stats().waiters);
            if (most_waiters < static_cast<std::size_t>(i) + 1) std::this_thread::sleep_for(1ms);
        }
    }
    for (auto& th : callers) th.join();
    hold.release();
    CHECK(most_waiters == kCallers);
    for (int i = 0; i < kCallers; ++i) {
        CAPTURE(i, waited[static_cast<std::size_t>(i)].count());
        CHECK(outcome[static_cast<std::size_t>(i)] == "pool_timeout");
        // Generous for a loaded machine, and well under the two pool_waits of a second wait.
        CHECK(waited[static_cast<std::size_t>(i)] >= 2950ms);
        CHECK(waited[static_cast<std::size_t>(i)] < 5000ms);
        if (i + 1 < kCallers) {
            CHECK(t.admin.scalar("SELECT count(*) FROM " + t.name + " WHERE scope = $1 AND key = $2",
                                 {scope, "k" + std::to_string(i)}) == 0);
        }
    }
    CHECK(t.admin.scalar("SELECT count(*) FROM " + t.name + " WHERE scope = $1 AND key = 'saved' AND result IS NULL",
                         {scope}) == 1);
}

TEST_CASE("a claim retried after its group waits for a connection afresh, not to the queue's deadline",
          "[group_commit]") {
    IDEM_NOT_ON_CITUS("it sees the claims it holds through their lock waits in the coordinator's pg_stat_activity");
    Table t(require_db());
    auto options = t.options(kHeld);
    // Each claim below waits lock_timeout on the test's rows, and the retry of the first must wait
    // for the second's: within a fresh pool_wait it gets the connection (a second to spare); to
    // the deadline of its wait in the group's queue it would not (a second short).
    options.lock_timeout = 2s;
    options.pool_wait = 3s;
    options.claim_attempts = 2;
    idem::PostgresStore store(t.url, options);
    const auto scope = idem_test::unique_name("requeue");
    PgConn locker(t.url);
    locker.exec("BEGIN");
    for (const char* k : {"busy-b", "busy-c"}) {
        locker.exec("INSERT INTO " + t.name +
                        " (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, expires_at) "
                        "VALUES ($1, $2, 'in_progress', '\\x00', 1, 1, now(), now() + interval '1 day')",
                    {scope, k});
    }
    std::array<std::string, 2> outcome;
    const auto claim = [&](std::size_t i, const char* key) {
        try {
            const auto c = store.claim(idem::Key(scope, key), kFp);
            outcome[i] = c.status == ClaimStatus::in_progress ? "in_progress" : "other status";
        } catch (const std::exception& e) {
            outcome[i] = e.what();
        }
    };
    std::thread b, c;
    {
        Hold hold(t, scope, store);  // the store's only connection
        b = std::thread(claim, 0, "busy-b");
        await_waiters(store, 1);  // b queues in a group, its wait's deadline pool_wait away
    }                             // let go: b's group takes the connection and waits on busy-b for lock_timeout
    t.await_lock_waiters(1);
    c = std::thread(claim, 1, "busy-c");
    await_waiters(store, 1);  // c queues behind b's group, and holds the connection after it
    b.join();
    c.join();
    locker.exec("ROLLBACK");
    CHECK(outcome[0] == "in_progress");
    // c's own retry competes with b's for the one connection, and may wait longer than pool_wait
    // where a claim's lock waits take longer (a Citus coordinator); the test is about b's.
    CHECK((outcome[1] == "in_progress" || outcome[1].starts_with("idem: no PostgreSQL connection free")));
}

TEST_CASE("saves that find no connection free share one UPDATE: each keeps its own answer", "[group_commit]") {
    IDEM_NOT_ON_CITUS("it sees the saves it holds through their lock waits in the coordinator's pg_stat_activity");
    Table t(require_db());
    auto options = t.options(kHeld);
    options.max_result_bytes = 64;
    options.pool_wait = 60s;  // queued savers never give up and go alone while the test holds them
    idem::PostgresStore store(t.url, options);
    const auto scope = idem_test::unique_name("saves");
    constexpr int kSavers = 12;
    std::vector<idem::Fence> fences;
    for (int i = 0; i < kSavers; ++i) {
        const auto c = store.claim(idem::Key(scope, "k" + std::to_string(i)), kFp);
        REQUIRE(c.status == ClaimStatus::claimed);
        fences.push_back(c.fence);
    }
    // Hold every connection: kHeld saves wait on row locks the test's session holds.
    std::vector<idem::Fence> blockers;
    for (int b = 1; b <= kHeld; ++b) {
        blockers.push_back(store.claim(idem::Key(scope, "blocker-" + std::to_string(b)), kFp).fence);
    }
    PgConn locker(t.url);
    locker.exec("BEGIN");
    locker.exec("SELECT 1 FROM " + t.name + " WHERE scope = $1 AND key LIKE 'blocker-%' FOR UPDATE", {scope});
    std::vector<std::thread> held;
    for (int b = 0; b < kHeld; ++b) {
        held.emplace_back([&, b] {
            store.save(idem::Key(scope, "blocker-" + std::to_string(b + 1)), blockers[static_cast<std::size_t>(b)],
                       "held");
        });
    }
    t.await_lock_waiters(kHeld);
    const idem::GroupCommitStats before = store.group_commit_stats();

    // Saver 0: a result over max_result_bytes (refused before any I/O, alone); saver 1: a fence that
    // does not own its key (lease_lost, alone in its group); saver 2 twice with the same fence (one
    // saves, the second finds it completed: lease_lost, as two concurrent saves today); the rest save.
    std::vector<std::string> outcome(kSavers + 1);
    std::vector<std::thread> savers;
    for (int i = 0; i <= kSavers; ++i) {
        savers.emplace_back([&, i] {
            const int k = i == kSavers ? 2 : i;
            const idem::Fence fence = fences[static_cast<std::size_t>(k)] + (i == 1 ? 1 : 0);
            const std::string body = i == 0 ? std::string(65, 'x') : "body-" + std::to_string(k);
            try {
                store.save(idem::Key(scope, "k" + std::to_string(k)), fence, body);
                outcome[static_cast<std::size_t>(i)] = "saved";
            } catch (const idem::response_too_large&) {
                outcome[static_cast<std::size_t>(i)] = "too_large";
            } catch (const idem::lease_lost&) {
                outcome[static_cast<std::size_t>(i)] = "lease_lost";
            }
        });
    }
    // Every saver but saver 0 (refused before any I/O) waits for the held connection.
    await_waiters(store, static_cast<std::size_t>(kSavers));
    locker.exec("COMMIT");
    for (auto& th : held) th.join();
    for (auto& th : savers) th.join();

    const idem::GroupCommitStats groups = store.group_commit_stats();
    INFO("save groups " << groups.save_groups << ", grouped " << groups.grouped_saves << ", largest "
                        << groups.largest_save_group);
    CHECK(groups.largest_save_group > 1);
    CHECK(groups.grouped_saves - before.grouped_saves == kSavers);  // saver 0 never got to a group
    CHECK(outcome[0] == "too_large");
    CHECK(outcome[1] == "lease_lost");
    CHECK(((outcome[2] == "saved") != (outcome[kSavers] == "saved")));
    CHECK(((outcome[2] == "lease_lost") != (outcome[kSavers] == "lease_lost")));
    for (int i = 3; i < kSavers; ++i) CHECK(outcome[static_cast<std::size_t>(i)] == "saved");
    // What the database holds: every saved body byte for byte, the refused keys still in progress.
    for (int i = 0; i < kSavers; ++i) {
        const auto rec = store.read(idem::Key(scope, "k" + std::to_string(i)));
        REQUIRE(rec);
        CAPTURE(i);
        if (i < 2) {
            CHECK(rec->state == idem::RecordState::in_progress);
        } else {
            CHECK(rec->state == idem::RecordState::completed);
            CHECK(rec->result == "body-" + std::to_string(i));
        }
    }
}

TEST_CASE("group commit under a cancel storm: no key claimed twice, every claim committed",
          "[group_commit][atomicity]") {
    Table t(require_db());
    auto options = t.options(8);
    options.lock_timeout = 1s;
    options.statement_timeout = 5s;
    idem::PostgresStore store(t.url, options);
    const auto scope = idem_test::unique_name("storm");
    constexpr int kThreads = 16, kKeys = 60;
    std::atomic<bool> stop{false};
    std::atomic<long long> cancels{0};
    std::thread canceller([&] {
        PgConn admin(t.url);
        while (!stop) {
            cancels += admin
                           .exec(
                               "SELECT pg_cancel_backend(pid) FROM pg_stat_activity "
                               "WHERE application_name = $1 AND state = 'active'",
                               {t.app})
                           .rows();
        }
    });
    std::mutex mutex;
    std::map<std::string, std::vector<idem::Fence>> claimed;
    std::atomic<int> unavailable{0}, attempts{0};
    // Every thread claims every key, or stops starting claims once the storm has raged for a
    // minute: a machine busy with other work (a Citus coordinator doing the work of three servers)
    // makes each cancelled claim slow, and the checks below hold for however many were made.
    const auto storm_ends = std::chrono::steady_clock::now() + 60s;
    idem_test::run_threads(kThreads, [&](int th) {
        for (int i = 0; i < kKeys && std::chrono::steady_clock::now() < storm_ends; ++i) {
            ++attempts;
            const std::string k = "k" + std::to_string((i * 7 + th * 37) % kKeys);  // every thread, every key
            try {
                const auto c = store.claim(idem::Key(scope, k), kFp);
                if (c.status == ClaimStatus::claimed) {
                    std::lock_guard lock(mutex);
                    claimed[k].push_back(c.fence);
                }
            } catch (const idem::store_unavailable&) {
                ++unavailable;
            }
        }
    });
    stop = true;
    canceller.join();
    INFO("claims " << attempts << ", cancels " << cancels << ", unavailable " << unavailable << ", largest group "
                   << store.group_commit_stats().largest_claim_group);
    CHECK(cancels > 0);
    CHECK(attempts >= kThreads);
    int anomalies = 0;
    for (const auto& [k, fences] : claimed) {
        anomalies += static_cast<int>(fences.size()) - 1;
        for (idem::Fence f : fences) anomalies += t.rows_with(scope, k, f) == 1 ? 0 : 1;
    }
    CHECK(anomalies == 0);
    const long long rows = t.admin.scalar("SELECT count(*) FROM " + t.name + " WHERE scope = $1", {scope});
    if (idem_test::citus_run()) {
        // On Citus a cancel that interrupts the coordinator while a shard commits can leave a claim
        // committed whose caller was told store_unavailable (docs/scale-out.md, "Limits"): such a
        // key stays in progress, never claimed twice. At most one per unavailable answer.
        INFO(rows << " rows for " << claimed.size() << " keys claimed");
        CHECK(rows >= static_cast<long long>(claimed.size()));
        CHECK(rows - static_cast<long long>(claimed.size()) <= unavailable);
    } else {
        CHECK(static_cast<long long>(claimed.size()) == rows);
    }
}

TEST_CASE("group commit with backends terminated: members retry with their own fences and find their rows",
          "[group_commit][backend_kill]") {
    Table t(require_db());
    auto options = t.options(8);
    options.lock_timeout = 1s;
    options.statement_timeout = 5s;
    options.claim_attempts = 20;  // so that a retry, not the bound, decides every claim
    idem::PostgresStore store(t.url, options);
    const auto scope = idem_test::unique_name("kill");
    constexpr int kThreads = 16, kKeys = 40;
    std::atomic<bool> stop{false};
    std::atomic<long long> kills{0};
    std::thread killer([&] {
        PgConn admin(t.url);
        while (!stop) {
            kills += admin
                         .exec(
                             "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                             "WHERE application_name = $1 AND state = 'active' ORDER BY random() LIMIT 1",
                             {t.app})
                         .rows();
            std::this_thread::sleep_for(20ms);
        }
    });
    // Each key has one claimer: any answer but `claimed` means a retry did not recognise its row.
    // At least kKeys keys per thread, and on until the killer has hit kMinKills backends (groups
    // make the claims fast: 640 of them can be over before a 20 ms killer finds one busy), within
    // a generous bound.
    constexpr long long kMinKills = 5;
    const auto until = std::chrono::steady_clock::now() + 60s;
    std::mutex mutex;
    std::map<std::string, idem::Fence> claimed;
    std::atomic<int> not_claimed{0}, unavailable{0};
    idem_test::run_threads(kThreads, [&](int th) {
        for (int i = 0; i < kKeys || (kills < kMinKills && std::chrono::steady_clock::now() < until); ++i) {
            const std::string k = "t" + std::to_string(th) + "-" + std::to_string(i);
            try {
                const auto c = store.claim(idem::Key(scope, k), kFp);
                if (c.status != ClaimStatus::claimed) {
                    ++not_claimed;
                    continue;
                }
                std::lock_guard lock(mutex);
                claimed[k] = c.fence;
            } catch (const idem::store_unavailable&) {
                ++unavailable;
            }
        }
    });
    stop = true;
    killer.join();
    const auto stats = store.stats();
    INFO("kills " << kills << ", unavailable " << unavailable << ", retries " << stats.retries << ", largest group "
                  << store.group_commit_stats().largest_claim_group);
    CHECK(kills > 0);
    CHECK(not_claimed == 0);
    int anomalies = 0;
    for (const auto& [k, f] : claimed) anomalies += t.rows_with(scope, k, f) == 1 ? 0 : 1;
    CHECK(anomalies == 0);
}

TEST_CASE("group commit, several processes x 16 threads on one key and on many keys: one effect per key",
          "[group_commit][processes]") {
    const auto url = require_db();
    Table t(url);
    const std::string effects = idem_test::unique_name("idem_gc_effects");
    PgConn admin(url);
    admin.exec("CREATE TABLE " + effects +
               " (scope text NOT NULL, key text NOT NULL, pid int NOT NULL, tid int NOT NULL, "
               "at timestamptz NOT NULL DEFAULT clock_timestamp())");
    idem_test::DropTable drop_effects(url, effects);
    const int keys = GENERATE(1, 150);
    const auto scope = idem_test::unique_name("procs");
    constexpr int kProcesses = 3, kThreads = 16;
    const auto dir = std::filesystem::temp_directory_path() / idem_test::unique_name("idem_gc_race");
    std::filesystem::create_directories(dir);
    const auto start_at = std::chrono::duration_cast<std::chrono::milliseconds>(
                              (std::chrono::system_clock::now() + 1500ms).time_since_epoch())
                              .count();
    ::setenv("IDEM_TEST_GROUP_COMMIT", "1", 1);  // the workers' stores (support/store_env.hpp)
    ::setenv("IDEM_RACE_POOL_SIZE", "4", 1);     // 16 threads on 4 connections: most calls find none free
    std::vector<pid_t> pids;
    for (int p = 0; p < kProcesses; ++p) {
        std::vector<std::string> args = {IDEM_RACE_WORKER,
                                         url,
                                         t.name,
                                         effects,
                                         scope,
                                         std::to_string(keys),
                                         std::to_string(kThreads),
                                         std::to_string(start_at),
                                         (dir / ("w" + std::to_string(p))).string()};
        std::vector<char*> argv;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        pid_t pid = 0;
        REQUIRE(::posix_spawn(&pid, IDEM_RACE_WORKER, nullptr, nullptr, argv.data(), environ) == 0);
        pids.push_back(pid);
    }
    for (pid_t pid : pids) {
        int status = 0;
        REQUIRE(::waitpid(pid, &status, 0) == pid);
        CHECK(WIFEXITED(status));
        CHECK(WEXITSTATUS(status) == 0);  // each worker checked every answer it got
    }
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    CAPTURE(keys);
    CHECK(admin.scalar("SELECT count(*) FROM " + effects + " WHERE scope = $1", {scope}) == keys);
    CHECK(admin.scalar("SELECT count(DISTINCT key) FROM " + effects + " WHERE scope = $1", {scope}) == keys);
}

TEST_CASE("a relayed group whose connection dies in flight: every member goes alone with its fence, once",
          "[group_commit][atomicity]") {
    IDEM_NOT_ON_CITUS("it sees the groups it holds through their lock waits in the coordinator's pg_stat_activity");
    // One connection. A claim of blocker-0 takes it and waits on the test's lock; a claim of
    // blocker-1, finding none free, leads a group and waits for it; once blocker-0 is let go that
    // group is sent and waits on the test's second lock (blocker-1), holding the connection. Callers
    // now queue behind it. Once blocker-1 is let go, its leader sends the queued group on its own
    // connection (the relay) and hands it over; that group meets a third uncommitted row (held-2)
    // and waits there, on the relaying connection. The test terminates that backend: the group's
    // answers are lost after it was sent by one thread and while another waited for them. Every
    // member must then claim alone, exactly once.
    Table t(require_db());
    auto options = t.options(1);
    options.pool_wait = 60s;  // queued callers never give up and go alone while the test holds them
    idem::PostgresStore store(t.url, options);
    const auto scope = idem_test::unique_name("relay");
    const auto insert_held = [&](PgConn& session, const std::string& key) {
        session.exec("BEGIN");
        session.exec("INSERT INTO " + t.name +
                         " (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, expires_at) "
                         "VALUES ($1, $2, 'in_progress', '\\x00', 1, 1, now(), now() + interval '1 day')",
                     {scope, key});
    };
    PgConn zero(t.url), first(t.url), second(t.url);
    insert_held(zero, "blocker-0");
    insert_held(first, "blocker-1");
    insert_held(second, "held-2");
    idem::Claim alone, lone;
    std::thread holder([&] { alone = store.claim(idem::Key(scope, "blocker-0"), kFp); });
    t.await_lock_waiters(1);
    std::thread leader([&] { lone = store.claim(idem::Key(scope, "blocker-1"), kFp); });
    await_waiters(store, 1);  // blocker-1's leader waits for the connection
    zero.exec("ROLLBACK");    // blocker-0 wins and gives the connection to blocker-1's group
    holder.join();
    REQUIRE(alone.status == ClaimStatus::claimed);
    t.await_lock_waiters(1);     // blocker-1's group waits on the test's lock, on the only connection
    constexpr int kQueued = 10;  // k0..k8 and held-2
    std::vector<idem::Claim> claims(kQueued);
    std::vector<std::thread> queued;
    for (int i = 0; i < kQueued; ++i) {
        queued.emplace_back([&, i] {
            const std::string k = i == kQueued - 1 ? "held-2" : "k" + std::to_string(i);
            claims[static_cast<std::size_t>(i)] = store.claim(idem::Key(scope, k), kFp);
        });
    }
    await_waiters(store, static_cast<std::size_t>(kQueued));  // they queue behind blocker-1's group
    const auto before = store.stats();
    const idem::GroupCommitStats groups_before = store.group_commit_stats();
    first.exec("ROLLBACK");  // the lone claim wins; its leader relays the queued group
    leader.join();
    REQUIRE(lone.status == ClaimStatus::claimed);
    t.await_lock_waiters(1);  // the relayed group waits on held-2
    const long long pid = t.admin.scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'", {t.app});
    // The group's array statement, not a lone claim (the one-shard statement shapes have no arrays,
    // and their claims are never relayed: the group's own leader sends them).
    const char* shape = std::getenv("IDEM_TEST_STATEMENT_SHAPE");
    if (shape == nullptr || std::string(shape) == "arrays") {
        CHECK(t.admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND pid = $2 "
                             "AND query LIKE '%unnest%'",
                             {t.app, std::to_string(pid)}) == 1);
    }
    t.admin.exec("SELECT pg_terminate_backend($1)", {std::to_string(pid)});
    // The members go alone: k0..k8 claim at once; held-2 waits on the second session until it rolls back.
    t.await_lock_waiters(1);
    second.exec("ROLLBACK");
    for (auto& th : queued) th.join();
    const auto stats = store.stats();
    const idem::GroupCommitStats groups = store.group_commit_stats();
    INFO("groups " << groups.claim_groups - groups_before.claim_groups << ", retries "
                   << stats.retries - before.retries);
    // A group formed, and its members went again alone (all ten, unless a busy machine started
    // some of their threads only after the release).
    CHECK(groups.largest_claim_group >= 2);
    CHECK(stats.retries - before.retries >= 2);
    for (int i = 0; i < kQueued; ++i) {
        const std::string k = i == kQueued - 1 ? "held-2" : "k" + std::to_string(i);
        const auto& c = claims[static_cast<std::size_t>(i)];
        CAPTURE(k);
        CHECK(c.status == ClaimStatus::claimed);
        CHECK(t.rows_with(scope, k, c.fence) == 1);
        CHECK(t.admin.scalar("SELECT count(*) FROM " + t.name + " WHERE scope = $1 AND key = $2", {scope, k}) == 1);
    }
}
