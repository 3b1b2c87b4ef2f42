// PostgresStore::inspect() and distribute(), on plain PostgreSQL (the normal suite: no Citus, a clear
// refusal) and on a Citus cluster (scripts/citus-check.sh sets IDEM_TEST_CITUS_DISTRIBUTE to the
// column its event trigger distributes new tables by, and IDEM_TEST_CITUS_WORKER_URL to a worker).
// Tables whose name contains "_local_" are left undistributed by that trigger.
#include "idem/idem.hpp"
#include "pg.hpp"
#include "require_db.hpp"

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

using namespace std::string_literals;
using idem_test::PgConn;

namespace {

using idem_test::require_db;

std::string env(const char* name) {
    const char* v = std::getenv(name);
    return v ? v : "";
}

bool citus_run() { return !env("IDEM_TEST_CITUS_DISTRIBUTE").empty(); }

class Table {
public:
    Table(std::string url, std::string prefix) : url_(std::move(url)), name_(idem_test::unique_name(prefix)) {}
    [[nodiscard]] const std::string& name() const { return name_; }
    ~Table() { idem_test::drop_idem_table(url_, name_); }
    Table(const Table&) = delete;
    Table& operator=(const Table&) = delete;
    [[nodiscard]] idem::PostgresOptions options() const {
        idem::PostgresOptions o;
        o.table = name_;
        o.pool_size = 2;
        return o;
    }

private:
    std::string url_, name_;
};

bool mentions(const std::vector<std::string>& warnings, const std::string& what) {
    for (const auto& w : warnings) {
        if (w.find(what) != std::string::npos) return true;
    }
    return false;
}

}  // namespace

TEST_CASE("without Citus: inspect() says so and distribute() refuses clearly", "[postgres][citus]") {
    if (citus_run()) {
        SUCCEED("a Citus run: see the Citus cases");
        return;
    }
    {
        const auto url = require_db();
        Table table(url, "idem_ci");
        idem::PostgresStore store(url, table.options());
        store.ensure_schema();
        const idem::Deployment d = store.inspect();
        CHECK_FALSE(d.citus);
        CHECK(d.citus_version.empty());
        CHECK(d.coordinator);
        CHECK_FALSE(d.distributed_by.has_value());
        CHECK(d.warnings.empty());
        try {
            store.distribute(idem::DistributeBy::scope);
            FAIL("distribute() without Citus must throw");
        } catch (const idem::config_error& e) {
            CHECK(std::string(e.what()).find("citus extension is not installed") != std::string::npos);
        }
        // batches still go (array statements), and the table is untouched
        const std::vector<idem::Key> keys{{"ci", "a"}, {"ci", "b"}};
        const std::vector<idem::Fingerprint> fps{idem::fingerprint("a"s), idem::fingerprint("b"s)};
        auto claims = store.claim_batch(keys, fps);
        CHECK(claims[0].status == idem::ClaimStatus::claimed);
        CHECK(claims[1].status == idem::ClaimStatus::claimed);
    }
}

TEST_CASE("Citus: inspect() sees the distribution; distribute() is idempotent and refuses a change",
          "[postgres][citus]") {
    if (!citus_run()) {
        SUCCEED("not a Citus run (scripts/citus-check.sh runs this)");
        return;
    }
    const auto url = require_db();
    const std::string by = env("IDEM_TEST_CITUS_DISTRIBUTE");
    const auto column = by == "key" ? idem::DistributeBy::key : idem::DistributeBy::scope;
    const auto other = by == "key" ? idem::DistributeBy::scope : idem::DistributeBy::key;
    Table table(url, "idem_ci");
    idem::PostgresStore store(url, table.options());
    store.ensure_schema();
    const idem::Deployment d = store.inspect();
    CHECK(d.citus);
    CHECK_FALSE(d.citus_version.empty());
    CHECK(d.coordinator);
    REQUIRE(d.distributed_by.has_value());
    CHECK(*d.distributed_by == column);
    store.distribute(column);  // already: nothing to do
    try {
        store.distribute(other);
        FAIL("distributing by the other column must throw");
    } catch (const idem::config_error& e) {
        CHECK(std::string(e.what()).find("already distributed by " + by) != std::string::npos);
    }
    store.ensure_schema();  // again, on the distributed table
    // ... and when it must create something there: a missing index is made again (on every shard)
    PgConn admin(url);
    const std::string index = table.name() + "_expires_at_idx";
    admin.exec("DROP INDEX " + index);
    store.ensure_schema();
    CHECK(admin.scalar("SELECT count(*) FROM pg_indexes WHERE indexname = $1", {index}) == 1);
}

TEST_CASE("Citus: distribute() a local table, then batches and the single-key path on it", "[postgres][citus]") {
    if (!citus_run()) {
        SUCCEED("not a Citus run (scripts/citus-check.sh runs this)");
        return;
    }
    const auto url = require_db();
    for (const auto by : {idem::DistributeBy::scope, idem::DistributeBy::key}) {
        Table table(url, "idem_ci_local_");
        idem::PostgresStore store(url, table.options());
        store.ensure_schema();
        CHECK_FALSE(store.inspect().distributed_by.has_value());
        std::vector<idem::Key> keys;
        std::vector<idem::Fingerprint> fps;
        for (int i = 0; i < 40; ++i) {
            keys.emplace_back("tenant-" + std::to_string(i % 4), "k" + std::to_string(i));
            fps.push_back(idem::fingerprint("req"s, i));
        }
        // rows written before distribute() move into the shards
        auto before = store.claim_batch(std::span(keys).first(10), std::span(fps).first(10));
        store.distribute(by);
        const idem::Deployment d = store.inspect();
        REQUIRE(d.distributed_by.has_value());
        CHECK(*d.distributed_by == by);
        // Every statement of a batch stays on one shard and commits on its own: no two-phase
        // commit (whose outcome a broken connection would leave in doubt until Citus recovers it).
        // Citus records each two-phase commit in pg_dist_transaction (its recovery only deletes).
        PgConn admin(url);
        const auto two_phase = [&] { return admin.scalar("SELECT count(*) FROM pg_dist_transaction"); };
        const auto two_phase_before = two_phase();
        auto claims = store.claim_batch(keys, fps);
        int claimed = 0, in_progress = 0;
        for (const auto& c : claims) {
            claimed += c.status == idem::ClaimStatus::claimed;
            in_progress += c.status == idem::ClaimStatus::in_progress;
        }
        CHECK(claimed == 30);
        CHECK(in_progress == 10);
        std::vector<std::string> results;
        results.reserve(keys.size());  // the SaveRequests view these strings
        std::vector<idem::SaveRequest> saves;
        for (std::size_t i = 0; i < claims.size(); ++i) {
            if (claims[i].status == idem::ClaimStatus::claimed) {
                results.push_back("result-" + keys[i].value());
                saves.push_back({keys[i], claims[i].fence, results.back()});
            }
        }
        saves.push_back({keys[0], before[0].fence + 1, "a stale fence"});  // not ours: lease_lost
        const auto statuses = store.save_batch(saves);
        for (std::size_t i = 0; i + 1 < saves.size(); ++i) CHECK(statuses[i] == idem::SaveStatus::saved);
        CHECK(statuses.back() == idem::SaveStatus::lease_lost);
        auto again = store.claim_batch(keys, fps);
        for (std::size_t i = 10; i < keys.size(); ++i) {
            CHECK(again[i].status == idem::ClaimStatus::completed);
            REQUIRE(again[i].existing.has_value());
            CHECK(again[i].existing->result == "result-" + keys[i].value());
        }
        for (std::size_t i = 0; i < 10; ++i) CHECK(again[i].status == idem::ClaimStatus::in_progress);
        CHECK(two_phase() <= two_phase_before);
        // control: a write over every shard (both workers) is a two-phase commit, and is counted
        const auto control_before = two_phase();
        admin.exec("UPDATE " + table.name() + " SET attempt = attempt");
        CHECK(two_phase() > control_before);
    }
}

TEST_CASE("Citus: inspect() warns when idem's lock_timeout does not reach the workers", "[postgres][citus]") {
    if (!citus_run()) {
        SUCCEED("not a Citus run (scripts/citus-check.sh runs this)");
        return;
    }
    const auto url = require_db();
    Table table(url, "idem_ci");
    auto options = table.options();
    // scripts/citus-check.sh applies the documented ALTER ROLE … SET lock_timeout = '1000ms'
    // (idem's default): a store asking for another value is told that the shards will not honour it.
    options.lock_timeout = std::chrono::milliseconds(700);
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    const auto warnings = store.inspect().warnings;
    CHECK(mentions(warnings, "lock_timeout = 1000ms (idem asks for 700ms)"));
    CHECK(mentions(warnings, "SET lock_timeout = '700ms'"));
    idem::PostgresStore matching(url, table.options());
    CHECK_FALSE(mentions(matching.inspect().warnings, "lock_timeout"));
}

TEST_CASE("Citus: ensure_schema() and distribute() refuse a worker node", "[postgres][citus]") {
    const std::string worker = env("IDEM_TEST_CITUS_WORKER_URL");
    if (worker.empty()) {
        SUCCEED("no worker given (scripts/citus-check.sh gives one)");
        return;
    }
    idem::PostgresOptions options;
    options.table = idem_test::unique_name("idem_ci_worker");
    idem::PostgresStore store(worker, options);
    try {
        store.ensure_schema();
        FAIL("ensure_schema() on a worker must throw");
    } catch (const idem::config_error& e) {
        CHECK(std::string(e.what()).find("Citus worker node") != std::string::npos);
    }
    CHECK_THROWS_AS(store.distribute(idem::DistributeBy::scope), idem::config_error);
    CHECK_FALSE(store.inspect().coordinator);
    PgConn conn(worker);
    CHECK(conn.scalar("SELECT count(*) FROM pg_class WHERE relname = $1", {options.table}) == 0);
    // With generations, a claim's key lock is the node's own: inspect() says to claim through the
    // coordinator.
    const auto warns_generations = [](const idem::Deployment& d) {
        for (const auto& w : d.warnings) {
            if (w.find("generations") != std::string::npos) return true;
        }
        return false;
    };
    CHECK_FALSE(warns_generations(store.inspect()));
    options.generations = idem::PostgresOptions::Generations{};
    idem::PostgresStore generational(worker, options);
    CHECK(warns_generations(generational.inspect()));
}

namespace {

// Waits until the database's clock has reached `ms` (epoch milliseconds).
void wait_for_clock(PgConn& db, long long ms) {
    for (int i = 0; db.scalar("SELECT ((extract(epoch FROM clock_timestamp()) * 1000)::bigint >= $1::bigint)::int",
                              {std::to_string(ms)}) == 0;
         ++i) {
        if (i > 3000) FAIL("the database's clock never reached " << ms);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
}

}  // namespace

TEST_CASE("Citus: a distributed generational table's maintenance attaches and retires generations",
          "[postgres][citus][generations]") {
    // purge_expired() on a distributed table: the generations it attaches (under the table's
    // SHARE lock, on the coordinator) are distributed with the table, it retires an ended one
    // (closing trigger, plain DETACH, DROP) and every key keeps its answer across generations.
    if (!citus_run()) {
        SUCCEED("not a Citus run (scripts/citus-check.sh)");
        return;
    }
    using namespace std::chrono_literals;
    constexpr long long kLength = 3000;
    const auto url = require_db();
    Table table(url, "idem_ci_gen");
    auto options = table.options();
    options.generations = idem::PostgresOptions::Generations{std::chrono::milliseconds(kLength), 2};
    options.lock_timeout = 1000ms;  // the role's, as scripts/citus-check.sh sets it
    options.statement_timeout = 30s;
    idem::PostgresStore store(url, options);
    store.ensure_schema();
    PgConn admin(url);
    const auto partitions = [&] {
        return admin.scalar("SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1)", {table.name()});
    };
    const auto distributed_partitions = [&] {
        return admin.scalar(
            "SELECT count(*) FROM pg_inherits i JOIN pg_dist_partition d ON d.logicalrelid = i.inhrelid "
            "WHERE i.inhparent = to_regclass($1)",
            {table.name()});
    };
    REQUIRE(partitions() == 3);
    const std::string scope = idem_test::unique_name("cigen");
    const auto fp = idem::fingerprint("POST"s);
    idem::ClaimOptions short_retention, long_retention;
    short_retention.retention = 1s;
    long_retention.retention = std::chrono::hours(1);
    const idem::Key early(scope, "early"), later(scope, "later");
    const auto first = store.claim(early, fp, short_retention);
    REQUIRE(first.status == idem::ClaimStatus::claimed);
    store.save(early, first.fence, "early bytes");
    const auto g0 = admin.scalar("SELECT generation FROM " + table.name() + " WHERE scope = $1", {scope});
    wait_for_clock(admin, g0 + kLength);  // the next generation is current: `later` goes there
    const auto second = store.claim(later, fp, long_retention);
    REQUIRE(second.status == idem::ClaimStatus::claimed);
    store.save(later, second.fence, "later bytes");
    CHECK(admin.scalar("SELECT count(DISTINCT generation) FROM " + table.name() + " WHERE scope = $1", {scope}) == 2);
    wait_for_clock(admin, g0 + kLength + 1500);  // `early` has expired, and its generation has ended

    // A maintainer asking for 4 ahead: fewer than half are ready, so it attaches the missing ones.
    auto maintainer_options = options;
    maintainer_options.generations->ahead = 4;
    idem::PostgresStore maintainer(url, maintainer_options);
    CHECK(maintainer.purge_expired() == 1);  // g0 retired with its one expired key
    CHECK(admin.scalar("SELECT count(*) FROM pg_class WHERE relname = $1",
                       {table.name() + "_g" + std::to_string(g0)}) == 0);
    CHECK(partitions() >= 5);  // the current generation and four ahead
    CHECK(distributed_partitions() == partitions());
    const auto replay = store.claim(later, fp, long_retention);
    REQUIRE(replay.status == idem::ClaimStatus::completed);
    CHECK(replay.existing->result == "later bytes");
    CHECK(store.claim(early, fp, short_retention).status == idem::ClaimStatus::claimed);  // expired, gone: new
    CHECK(admin.scalar("SELECT count(*) FROM " + table.name() + " WHERE scope = $1", {scope}) == 2);
}
