// What a sealed result is bound to beside its key (idem/sealing.hpp, format 2): the claim that saved
// it and the deployment that keeps it. Against real PostgreSQL, with the test's own connection as
// the writer of the table: a result written back under a later claim of its key, or copied into
// another table under the same keyring, is corrupt_record, never replayed; SealingOptions::context
// names the deployment when it must survive a rename; format-1 records still open until
// open_format_1 is turned off. Needs IDEM_TEST_DATABASE_URL (scripts/with-postgres.sh).
#include "idem/idem.hpp"
#include "idem/sealing.hpp"
#include "pg.hpp"
#include "require_db.hpp"

#include <catch2/catch.hpp>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Outcome;
using idem_test::PgConn;

namespace {

std::shared_ptr<const idem::Keyring> keyring() {
    auto r = std::make_shared<idem::Keyring>();
    r->add(1, std::string(32, 'k'));
    return r;
}

using idem_test::require_db;

/// A table of its own, dropped at the end.
struct Table {
    std::string url, name = idem_test::unique_name("idem_bind");
    explicit Table(std::string u) : url(std::move(u)) {}
    ~Table() { idem_test::drop_idem_table(url, name); }
    [[nodiscard]] idem::PostgresOptions options(std::string context = {}, bool format_1 = true) const {
        idem::PostgresOptions o;
        o.table = name;
        o.pool_size = 2;
        o.sealing.keyring = keyring();
        o.sealing.context = std::move(context);
        o.sealing.open_format_1 = format_1;
        return o;
    }
};

/// An effect that counts its runs outside the library and returns `body`.
auto counting(int& runs, std::string body) {
    return [&runs, body] {
        ++runs;
        return body;
    };
}

std::string hex_of(std::string_view bytes) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string out;
    for (unsigned char c : bytes) out += {digits[c >> 4], digits[c & 15]};
    return out;
}

std::string result_hex(PgConn& db, const std::string& table, const idem::Key& key) {
    return db
        .exec("SELECT encode(result, 'hex') FROM " + table + " WHERE scope = $1 AND key = $2",
              {key.scope(), key.value()})
        .text(0, 0);
}

}  // namespace

TEST_CASE("sealed: a response written back under a later claim of its key is corrupt_record", "[sealing][postgres]") {
    // A's response, kept by a writer of the table, put back after A expired and the key was
    // claimed and completed again (B): bound to A's claim, it does not open as B's.
    const auto url = require_db();
    Table t(url);
    idem::PostgresStore store(url, t.options());
    store.ensure_schema();
    PgConn writer(url);
    const idem::Key key(idem_test::unique_name("back"), "k");
    const auto fp = idem::fingerprint("POST"s);
    idem::ClaimOptions short_retention;
    short_retention.retention = 1s;
    int runs = 0;
    REQUIRE(idem::execute_once(store, key, fp, counting(runs, "A"), short_retention).outcome() == Outcome::executed);
    const std::string a = result_hex(writer, t.name, key);
    for (int i = 0; writer.scalar("SELECT (expires_at < clock_timestamp())::int FROM " + t.name + " WHERE scope = $1",
                                  {key.scope()}) == 0;
         ++i) {
        if (i > 3000) FAIL("A never expired by the database's clock");
        std::this_thread::sleep_for(10ms);
    }
    REQUIRE(idem::execute_once(store, key, fp, counting(runs, "B")).outcome() == Outcome::executed);
    writer.exec("UPDATE " + t.name + " SET result = decode($3, 'hex') WHERE scope = $1 AND key = $2",
                {key.scope(), key.value(), a});
    CHECK_THROWS_AS(idem::execute_once(store, key, fp, counting(runs, "C")), idem::corrupt_record);  // before: A
    CHECK_THROWS_AS(store.read(key), idem::corrupt_record);
    CHECK(runs == 2);  // never run again
}

TEST_CASE("sealed: a response copied into another table is corrupt_record; one context opens both",
          "[sealing][postgres]") {
    const auto url = require_db();
    Table source(url), target(url), renamed(url);
    idem::PostgresStore from(url, source.options());
    from.ensure_schema();
    idem::PostgresStore to(url, target.options());
    to.ensure_schema();
    PgConn writer(url);
    const idem::Key key(idem_test::unique_name("moved"), "k");
    const auto fp = idem::fingerprint("POST"s);
    int runs = 0;
    REQUIRE(idem::execute_once(from, key, fp, counting(runs, "paid")).outcome() == Outcome::executed);
    // The whole row, fence included, copied under the same scope and key: the table differs.
    writer.exec("INSERT INTO " + target.name + " SELECT * FROM " + source.name + " WHERE scope = $1", {key.scope()});
    CHECK_THROWS_AS(idem::execute_once(to, key, fp, counting(runs, "again")), idem::corrupt_record);  // before: paid
    CHECK(runs == 1);

    // A deployment whose table was renamed names its old table as its context: its rows open.
    idem::PostgresStore after_rename(url, renamed.options(source.name));
    after_rename.ensure_schema();
    writer.exec("INSERT INTO " + renamed.name + " SELECT * FROM " + source.name + " WHERE scope = $1", {key.scope()});
    const auto r = idem::execute_once(after_rename, key, fp, counting(runs, "again"));
    CHECK(r.outcome() == Outcome::replayed);
    CHECK(r.response() == "paid");
    CHECK(runs == 1);
}

TEST_CASE("sealed: format-1 records open until open_format_1 is turned off", "[sealing][postgres]") {
    // What a store before 1.0 wrote: bound to the key only (idem::seal without a binding).
    const auto url = require_db();
    Table t(url);
    idem::PostgresStore store(url, t.options());
    store.ensure_schema();
    PgConn writer(url);
    const idem::Key key(idem_test::unique_name("v1"), "k");
    const auto fp = idem::fingerprint("POST"s);
    const auto claim = store.claim(key, fp);
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    const std::string v1 = idem::seal(*keyring(), key, "old bytes");
    writer.exec("UPDATE " + t.name +
                    " SET state = 'completed', result = decode($3, 'hex'), completed_at = now() WHERE scope = $1 AND "
                    "key = $2",
                {key.scope(), key.value(), hex_of(v1)});
    int runs = 0;
    const auto replay = idem::execute_once(store, key, fp, counting(runs, "new"));
    CHECK(replay.outcome() == Outcome::replayed);
    CHECK(replay.response() == "old bytes");
    idem::PostgresStore strict(url, t.options({}, false));
    CHECK_THROWS_AS(idem::execute_once(strict, key, fp, counting(runs, "new")), idem::corrupt_record);
    CHECK(runs == 0);
}
