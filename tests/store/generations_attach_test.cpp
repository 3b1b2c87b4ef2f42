// Generations attached while a claim waits: a claim statement that waits on a key's lock (behind
// an in-transaction claim) while maintenance attaches newer generations must still see a claim of
// any of its keys in one of them — for a batch, a commit group and a single call. Effects are
// counted by the test, outside the library; rows are counted with the test's own connection.
#include "generations_support.hpp"
#include "require_db.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <set>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem_test::PgConn;
using namespace idem_test::gen;

namespace {

constexpr auto kAttachLength = 1s;

// Options for the claiming stores: waits on a key's lock and statements far longer than the test.
idem::PostgresOptions patient(const std::string& table, std::size_t pool, std::size_t ahead) {
    auto o = gen_options(table, pool, ahead);
    o.generations->length = kAttachLength;
    o.lock_timeout = 20s;
    o.statement_timeout = 40s;
    return o;
}

// The table's generations (partition starts), oldest first.
std::vector<long long> generations_of(PgConn& db, const std::string& table) {
    const auto r = db.exec(
        "SELECT substring(c.relname FROM '_g([0-9]+)$')::bigint FROM pg_inherits i JOIN pg_class c ON c.oid = "
        "i.inhrelid WHERE i.inhparent = to_regclass($1) ORDER BY 1",
        {table});
    std::vector<long long> out;
    for (int row = 0; row < r.rows(); ++row) out.push_back(r.integer(row, 0));
    return out;
}

// A completed key of long retention in each of the table's generations: none of them can be
// closed while the test runs (maintenance closes only generations whose keys have all expired),
// so no claim of the test meets a closed generation and tries again in a new transaction.
void keep_generations_open(PgConn& db, const std::string& table) {
    for (const long long g : generations_of(db, table)) {
        db.exec("INSERT INTO " + table +
                    " (scope, key, state, fingerprint, fingerprint_alg, fence, result, lease_until, completed_at, "
                    "expires_at, generation) VALUES ('keep-open', $1::text, 'completed', '\\x00'::bytea, 1, 1, "
                    "'kept'::bytea, now(), now(), now() + interval '1 day', $1::bigint)",
                {std::to_string(g)});
    }
}

// The oldest of `after` not in `before`, or the newest of `before`.
long long first_new_generation(const std::vector<long long>& before, const std::vector<long long>& after) {
    for (const long long g : after) {
        if (std::find(before.begin(), before.end(), g) == before.end()) return g;
    }
    return before.back();
}

// Waits until the database's clock has reached `start_ms` (epoch milliseconds).
void wait_for_clock(PgConn& db, long long start_ms) {
    wait_for(db, "SELECT ((extract(epoch FROM clock_timestamp()) * 1000)::bigint >= $1::bigint)::int",
             {std::to_string(start_ms)});
}

// A maintenance run (purge_expired on a store of its own, `ahead` generations, `lock_wait` as its
// lock_timeout) in the background, and the test's view of what it did.
class Maintenance {
public:
    Maintenance(const std::string& url, const std::string& table, std::chrono::milliseconds lock_wait)
        : store_(url, options(table, lock_wait)), run_(std::async(std::launch::async, [this] {
              try {
                  (void)store_.purge_expired();
              } catch (const idem::store_unavailable&) {
                  // a lock wait given up: generations are attached at the next maintenance
              }
          })) {}
    ~Maintenance() { finish(); }
    void finish() {
        if (run_.valid()) run_.get();
    }
    [[nodiscard]] bool done() const { return run_.wait_for(0s) == std::future_status::ready; }

private:
    static idem::PostgresOptions options(const std::string& table, std::chrono::milliseconds lock_wait) {
        auto o = patient(table, 1, 4);
        o.lock_timeout = lock_wait;
        return o;
    }
    idem::PostgresStore store_;
    std::future<void> run_;
};

// Waits until maintenance has attached a generation that `before` lacks, or waits on a lock of
// the table to attach one (then it attaches nothing while the claims it waits for run).
void wait_for_attach_or_lock_wait(PgConn& db, const std::string& table, const std::vector<long long>& before) {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    for (;;) {
        if (generations_of(db, table) != before) return;
        if (db.scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                      "AND wait_event = 'relation' AND query LIKE 'LOCK TABLE%'") > 0) {
            return;
        }
        if (std::chrono::steady_clock::now() > deadline) FAIL("maintenance neither attached nor waited to attach");
        std::this_thread::sleep_for(10ms);
    }
}

// An execute_once of `key` whose effect counts its runs in `runs`.
std::future<idem::Result<std::string>> call_async(idem::PostgresStore& store, const idem::Key& key,
                                                  const idem::Fingerprint& fp, std::atomic<int>& runs,
                                                  std::string body) {
    return std::async(std::launch::async, [&store, key, fp, &runs, body] {
        return idem::execute_once(store, key, fp, [&runs, body] {
            ++runs;
            return body;
        });
    });
}

// Waits until `call` has returned or waits on a lock of the table (behind maintenance).
void wait_for_done_or_table_wait(PgConn& db, const std::future<idem::Result<std::string>>& call) {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (call.wait_for(0s) != std::future_status::ready) {
        if (db.scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                      "AND wait_event = 'relation' AND query LIKE 'INSERT%'") > 0) {
            return;
        }
        if (std::chrono::steady_clock::now() > deadline) FAIL("the call neither returned nor waited on the table");
        std::this_thread::sleep_for(10ms);
    }
}

// The late caller's part, once the claim under test waits on `held`'s key: maintenance attaches
// newer generations (or waits to), a generation attached meanwhile becomes current, and another
// caller runs `key` through `other` — in that generation when it exists. Then the holder ends.
void attach_then_call_other(PgConn& admin, const std::string& url, const std::string& table, idem::PostgresStore& other,
                            const idem::Key& key, const idem::Fingerprint& fp, std::atomic<int>& runs,
                            HeldClaim& held) {
    const auto before = generations_of(admin, table);
    Maintenance maintenance(url, table, 30s);
    wait_for_attach_or_lock_wait(admin, table, before);
    // The first generation past those that existed: attached by now, or to be attached once the
    // claims maintenance waits for are done.
    wait_for_clock(admin, before.back() + std::chrono::milliseconds(kAttachLength).count());
    auto late = call_async(other, key, fp, runs, "late");
    wait_for_done_or_table_wait(admin, late);
    CHECK(held.release().outcome() == idem::Outcome::executed);
    const auto r = late.get();
    CHECK((r.outcome() == idem::Outcome::replayed || r.outcome() == idem::Outcome::in_progress ||
           r.outcome() == idem::Outcome::executed));
    maintenance.finish();
}

}  // namespace

TEST_CASE("generations: a batch waiting on a key sees a claim made in a generation attached meanwhile",
          "[generations]") {
    // execute_batch([a, b, c]) claims in one statement, key by key in order; it waits on b, which
    // an in-transaction claim holds. Meanwhile maintenance attaches newer generations and another
    // caller claims c. When b is free the batch reaches c: it must find that claim, wherever it is.
    // Each statement shape: one array statement, or (as on Citus) one-row claims in one transaction
    // per scope or per key.
    using Shape = idem::PostgresOptions::StatementShape;
    const auto shape = GENERATE(Shape::arrays, Shape::per_scope, Shape::per_key);
    CAPTURE(static_cast<int>(shape));
    const auto url = idem_test::require_db();
    Tables tables(url);
    auto options = patient(tables.idem, 4, 1);
    options.statement_shape = shape;
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    idem::PostgresStore other(url, patient(tables.idem, 2, 1));
    PgConn admin(url);
    keep_generations_open(admin, tables.idem);
    const std::string scope = idem_test::unique_name("batchwait");
    const auto fp = idem::fingerprint("POST"s);
    const idem::Key a(scope, "a"), b(scope, "b"), c(scope, "c");
    HeldClaim held(store, b, fp);
    std::atomic<int> runs_a{0}, runs_c{0};
    auto batch = std::async(std::launch::async, [&] {
        std::vector<idem::Message> messages{{a, fp}, {b, fp}, {c, fp}};
        return idem::execute_batch(store, messages, [&](std::size_t i) {
            if (i == 0) ++runs_a;
            if (i == 2) ++runs_c;
            return "batch"s;
        });
    });
    wait_for(admin, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' AND query LIKE 'INSERT%'");

    attach_then_call_other(admin, url, tables.idem, other, c, fp, runs_c, held);
    const auto results = batch.get();
    REQUIRE(results.size() == 3);
    CHECK(runs_a == 1);
    CHECK(runs_c == 1);  // before generations were attached only under the table's lock: 2
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.idem + " WHERE scope = $1 AND key = 'c'", {scope}) == 1);
}

TEST_CASE("generations: a commit group waiting on a key sees a claim made in a generation attached meanwhile",
          "[generations]") {
    // The same with group commit: one connection, tied up by a claim that waits on a held key, so
    // that the claims of a2, b and c queue and go out as one group, which then waits on b.
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, patient(tables.idem, 4, 1));
    store.ensure_schema();
    auto grouped_options = patient(tables.idem, 1, 1);
    grouped_options.group_commit = true;
    idem::PostgresStore grouped(url, grouped_options);
    PgConn admin(url);
    keep_generations_open(admin, tables.idem);
    const std::string scope = idem_test::unique_name("groupwait");
    const auto fp = idem::fingerprint("POST"s);
    const idem::Key a(scope, "a"), a2(scope, "a2"), b(scope, "b"), c(scope, "c");
    auto holder_a = std::make_unique<HeldClaim>(store, a, fp);
    HeldClaim held(store, b, fp);
    auto first = std::async(std::launch::async, [&] { return grouped.claim(a, fp); });
    wait_for(admin, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'");
    std::atomic<int> runs_a2{0}, runs_b{0}, runs_c{0};
    auto call_a2 = call_async(grouped, a2, fp, runs_a2, "group");
    auto call_b = call_async(grouped, b, fp, runs_b, "group");
    auto call_c = call_async(grouped, c, fp, runs_c, "group");
    for (int i = 0; grouped.pool_stats().waiters < 3; ++i) {
        if (i > 2000) FAIL("the claims of a2, b and c never queued for a group");
        std::this_thread::sleep_for(10ms);
    }
    (void)holder_a->release();  // a is done: the one connection comes back, a2, b and c go as a group
    holder_a.reset();
    CHECK(first.get().status == idem::ClaimStatus::completed);
    wait_for(admin, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' AND query LIKE '%unnest%'");

    std::atomic<int> runs_other{0};
    attach_then_call_other(admin, url, tables.idem, store, c, fp, runs_other, held);
    (void)call_a2.get();
    (void)call_b.get();
    (void)call_c.get();
    CHECK(grouped.group_commit_stats().largest_claim_group == 3);
    CHECK(runs_a2 == 1);
    CHECK(runs_b == 0);               // b was completed by its holder
    CHECK(runs_c + runs_other == 1);  // before generations were attached under the lock: 2
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.idem + " WHERE scope = $1 AND key = 'c'", {scope}) == 1);
}

TEST_CASE("generations: a single claim waiting on its key sees a claim of it in a generation attached meanwhile",
          "[generations]") {
    // The test's own transaction holds the key's lock (the claimable function), as another
    // instance's claim would; a claim of the key waits on it. Maintenance attaches generations
    // meanwhile (or cannot, while the claim waits); the holder then writes its claim of the key
    // into the first generation attached meanwhile (else the newest) and commits. The waiting claim must find that row.
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, patient(tables.idem, 2, 1));
    store.ensure_schema();
    PgConn admin(url), holder(url);
    keep_generations_open(admin, tables.idem);
    const idem::Key key(idem_test::unique_name("singlewait"), "k");
    const auto fp = idem::fingerprint("POST"s);
    holder.exec("BEGIN");
    REQUIRE(holder.exec("SELECT " + tables.idem + "_claimable($1, $2)", {key.scope(), key.value()}).text(0, 0) == "t");
    std::atomic<int> runs{0};
    auto waiting = call_async(store, key, fp, runs, "waiting");
    wait_for(admin, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' AND query LIKE 'INSERT%'");
    const auto before = generations_of(admin, tables.idem);
    {
        Maintenance maintenance(url, tables.idem, 300ms);  // gives up while the claim waits
        maintenance.finish();
    }
    const auto after = generations_of(admin, tables.idem);
    const auto newest = first_new_generation(before, after);
    wait_for_clock(admin, newest);
    std::string fp_hex = "\\x" + fp.hex();
    holder.exec("INSERT INTO " + tables.idem +
                    " (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, expires_at, generation) "
                    "VALUES ($1, $2, 'in_progress', $3::bytea, 1, 7, now() + interval '1 hour', "
                    "now() + interval '1 day', $4::bigint)",
                {key.scope(), key.value(), fp_hex, std::to_string(newest)});
    holder.exec("COMMIT");
    const auto r = waiting.get();
    INFO("generations before " << before.size() << ", after maintenance " << after.size());
    CHECK(r.outcome() == idem::Outcome::in_progress);  // before generations were attached under the lock: executed
    CHECK(runs == 0);
    CHECK(admin.scalar("SELECT count(*) FROM " + tables.idem + " WHERE scope = $1", {key.scope()}) == 1);
}

TEST_CASE("generations: a claim that waited on its key's lock gets its whole lease", "[generations]") {
    // The lease counts from when the claim writes its row, after the wait, not from the start of
    // its transaction: a claim that waited longer than its lease must not come back already stale
    // (a resume-mode caller or the reconciler would take it over while its effect runs).
    const auto url = idem_test::require_db();
    Tables tables(url);
    idem::PostgresStore store(url, patient(tables.idem, 2, 8));
    store.ensure_schema();
    PgConn admin(url), holder(url);
    const idem::Key key(idem_test::unique_name("leasewait"), "k");
    const auto fp = idem::fingerprint("POST"s);
    holder.exec("BEGIN");
    REQUIRE(holder.exec("SELECT " + tables.idem + "_claimable($1, $2)", {key.scope(), key.value()}).text(0, 0) == "t");
    idem::ClaimOptions options;
    options.lease = 3s;
    auto waiting = std::async(std::launch::async, [&] { return store.claim(key, fp, options); });
    wait_for(admin, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory' AND query LIKE 'INSERT%'");
    std::this_thread::sleep_for(4s);  // a wait longer than the lease
    holder.exec("ROLLBACK");
    const auto claim = waiting.get();
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    const auto left_ms =
        admin.scalar("SELECT (extract(epoch FROM lease_until - clock_timestamp()) * 1000)::bigint FROM " + tables.idem +
                         " WHERE scope = $1 AND key = $2",
                     {key.scope(), key.value()});
    INFO("lease left after the claim returned: " << left_ms << " ms");
    CHECK(left_ms > 1000);  // before the lease counted from the row: about -1000 (already stale)
}
