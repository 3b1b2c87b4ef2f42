// Keyed fingerprints at rest (PostgresOptions::fingerprint_secret, idem/fingerprint_secret.hpp),
// against a real PostgreSQL: the bytes in the table are the HMAC, not the plain SHA-256; same
// request replays, another is a mismatch; rows written without a secret still replay (and still
// refuse another request) once the secret is set, on every claim path (single, batch,
// in-transaction); a keyed row met without the secret is config_error with the effect not run; a
// row keyed with another secret is a mismatch. Effects are counted here, rows read with the test's
// own libpq session. Needs IDEM_TEST_DATABASE_URL (run under scripts/with-postgres.sh).
#include "idem/fingerprint_secret.hpp"
#include "idem/idem.hpp"
#include "idem/postgres_transaction.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "store_env.hpp"

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::ClaimStatus;
using idem::Outcome;
using idem_test::PgConn;

namespace {

using idem_test::require_db;

// A low-entropy request: the kind a reader of the table could confirm by hashing guesses.
idem::Fingerprint fp_of(std::int64_t cents) { return idem::fingerprint("POST /charges"s, cents, "BRL"s, "tok_visa"s); }

const idem::FingerprintSecret kSecretA("secret A: 32 bytes or more of key material"s);
const idem::FingerprintSecret kSecretB("secret B: another 32 bytes or more of key!"s);

struct Table {
    std::string url;
    std::string name = idem_test::unique_name("idem_fpk");
    PgConn admin;

    explicit Table(std::string u) : url(std::move(u)), admin(url) {
        idem::PostgresStore(url, options()).ensure_schema();
    }
    ~Table() { idem_test::drop_idem_table(url, name); }
    Table(const Table&) = delete;
    Table& operator=(const Table&) = delete;

    [[nodiscard]] idem::PostgresOptions options(std::optional<idem::FingerprintSecret> secret = std::nullopt) const {
        idem::PostgresOptions o;
        o.table = name;
        o.pool_size = 2;
        o.fingerprint_secret = std::move(secret);
        return idem_test::env_options(o);
    }

    /// The row's fingerprint_alg and fingerprint (hex), as stored.
    [[nodiscard]] std::pair<long long, std::string> at_rest(const idem::Key& key) {
        auto r = admin.exec(
            "SELECT fingerprint_alg, encode(fingerprint, 'hex') FROM " + name + " WHERE scope = $1 AND key = $2",
            {key.scope(), key.value()});
        REQUIRE(r.rows() == 1);
        return {r.integer(0, 0), r.text(0, 1)};
    }
    [[nodiscard]] std::string row_text(const idem::Key& key) {
        auto r = admin.exec("SELECT state || ' ' || fence || ' ' || encode(fingerprint, 'hex') FROM " + name +
                                " WHERE scope = $1 AND key = $2",
                            {key.scope(), key.value()});
        return r.rows() == 1 ? r.text(0, 0) : "";
    }
};

}  // namespace

TEST_CASE("FingerprintSecret: shorter than 32 bytes is config_error; keyed digest is an HMAC of the plain one",
          "[fingerprint_secret]") {
    CHECK_THROWS_AS(idem::FingerprintSecret(std::string(31, 'x')), idem::config_error);
    const idem::Fingerprint plain = fp_of(100);
    const idem::Fingerprint keyed = kSecretA.key(plain);
    CHECK(keyed.algorithm() == idem::FingerprintAlgorithm::hmac_sha256);
    CHECK(keyed.hex() != plain.hex());
    REQUIRE(keyed.plain_digest() != nullptr);
    CHECK(*keyed.plain_digest() == plain.digest());
    CHECK(kSecretA.key(keyed) == keyed);              // keying twice changes nothing
    CHECK(kSecretB.key(plain).hex() != keyed.hex());  // another secret, another digest
    CHECK(kSecretA.key(fp_of(101)).hex() != keyed.hex());
    CHECK(keyed.stored().plain_digest() == nullptr);  // what a store keeps
}

TEST_CASE("keyed store: the row holds the HMAC, not the plain SHA-256; same request replays, another mismatches",
          "[fingerprint_secret]") {
    Table t(require_db());
    idem::PostgresStore store(t.url, t.options(kSecretA));
    const auto scope = idem_test::unique_name("keyed");
    const idem::Key key(scope, "charge-1");
    int runs = 0;
    auto effect = [&] { return ++runs, "charged"s; };

    const auto before = store.stats().round_trips;
    REQUIRE(idem::execute_once(store, key, fp_of(100), effect).outcome() == Outcome::executed);
    CHECK(store.stats().round_trips - before == 2);  // claim, save: unchanged by keying
    const auto [alg, hex] = t.at_rest(key);
    CHECK(alg == 2);
    CHECK(hex != fp_of(100).hex());  // a guess hashed by a reader of the table does not match
    CHECK(hex == kSecretA.key(fp_of(100)).hex());

    const auto replay = idem::execute_once(store, key, fp_of(100), effect);
    CHECK(replay.outcome() == Outcome::replayed);
    CHECK(replay.response() == "charged");
    CHECK(idem::execute_once(store, key, fp_of(999), effect).outcome() == Outcome::mismatch);
    CHECK(runs == 1);
    // read() answers the stored (keyed) fingerprint.
    const auto record = store.read(key);
    REQUIRE(record);
    CHECK(record->fingerprint.algorithm() == idem::FingerprintAlgorithm::hmac_sha256);
    CHECK(record->fingerprint.hex() == hex);
}

TEST_CASE("migration: rows written without a secret replay under it, another request is still a mismatch",
          "[fingerprint_secret]") {
    Table t(require_db());
    const auto scope = idem_test::unique_name("migrate");
    const idem::Key done(scope, "done"), other(scope, "other"), in_tx(scope, "in-tx"), fresh(scope, "fresh");
    int runs = 0;
    auto effect = [&] { return ++runs, "paid-" + std::to_string(runs); };
    {
        idem::PostgresStore plain(t.url, t.options());
        REQUIRE(idem::execute_once(plain, done, fp_of(100), effect).outcome() == Outcome::executed);
        REQUIRE(idem::execute_once(plain, other, fp_of(200), effect).outcome() == Outcome::executed);
        REQUIRE(idem::execute_once(plain, in_tx, fp_of(300), effect).outcome() == Outcome::executed);
    }
    CHECK(t.at_rest(done) == std::make_pair(1LL, fp_of(100).hex()));
    REQUIRE(runs == 3);

    idem::PostgresStore store(t.url, t.options(kSecretA));
    // Single claim.
    const auto r = idem::execute_once(store, done, fp_of(100), effect);
    CHECK(r.outcome() == Outcome::replayed);
    CHECK(r.response() == "paid-1");
    CHECK(idem::execute_once(store, done, fp_of(101), effect).outcome() == Outcome::mismatch);
    // Batch: a plain row replayed, a plain row refused, a new key written keyed.
    const std::vector<idem::Key> keys{done, other, fresh};
    const std::vector<idem::Fingerprint> fps{fp_of(100), fp_of(201), fp_of(400)};
    const auto claims = store.claim_batch(keys, fps);
    CHECK(claims[0].status == ClaimStatus::completed);
    CHECK(claims[1].status == ClaimStatus::mismatch);
    REQUIRE(claims[2].status == ClaimStatus::claimed);
    store.save(fresh, claims[2].fence, "paid-batch");
    CHECK(t.at_rest(fresh) == std::make_pair(2LL, kSecretA.key(fp_of(400)).hex()));
    CHECK(t.at_rest(done).first == 1);  // an old row is not rewritten
    // In-transaction mode.
    int tx_runs = 0;
    auto tx_effect = [&](idem::Transaction&) { return ++tx_runs, "tx"s; };
    CHECK(idem::execute_once_in_transaction(store, in_tx, fp_of(300), tx_effect).outcome() == Outcome::replayed);
    CHECK(idem::execute_once_in_transaction(store, in_tx, fp_of(301), tx_effect).outcome() == Outcome::mismatch);
    const idem::Key tx_new(scope, "tx-new");
    CHECK(idem::execute_once_in_transaction(store, tx_new, fp_of(500), tx_effect).outcome() == Outcome::executed);
    CHECK(t.at_rest(tx_new) == std::make_pair(2LL, kSecretA.key(fp_of(500)).hex()));
    CHECK(idem::execute_once_in_transaction(store, tx_new, fp_of(500), tx_effect).outcome() == Outcome::replayed);
    CHECK(runs == 3);
    CHECK(tx_runs == 1);
}

TEST_CASE("migration: resume mode takes over a stale plain row for the same request, under the secret",
          "[fingerprint_secret]") {
    Table t(require_db());
    const auto scope = idem_test::unique_name("resume");
    const idem::Key key(scope, "stale");
    {
        idem::PostgresStore plain(t.url, t.options());
        idem::ClaimOptions o;
        o.lease = 1ms;
        REQUIRE(plain.claim(key, fp_of(100), o).status == ClaimStatus::claimed);
    }
    t.admin.exec("UPDATE " + t.name + " SET lease_until = now() - interval '1 minute' WHERE scope = $1", {scope});
    idem::PostgresStore store(t.url, t.options(kSecretA));
    idem::ClaimOptions resume;
    resume.resume_stale = true;
    CHECK(store.claim(key, fp_of(101), resume).status == ClaimStatus::mismatch);
    const auto taken = store.claim(key, fp_of(100), resume);
    CHECK(taken.status == ClaimStatus::claimed);
    REQUIRE(taken.existing);
    CHECK(taken.existing->attempt == 2);
}

TEST_CASE("a keyed row met by a store without the secret is config_error, the effect not run, the row unchanged",
          "[fingerprint_secret]") {
    Table t(require_db());
    const auto scope = idem_test::unique_name("nosecret");
    const idem::Key key(scope, "keyed");
    int runs = 0;
    auto effect = [&] { return ++runs, "charged"s; };
    {
        idem::PostgresStore keyed(t.url, t.options(kSecretA));
        REQUIRE(idem::execute_once(keyed, key, fp_of(100), effect).outcome() == Outcome::executed);
    }
    const std::string row = t.row_text(key);
    idem::PostgresStore store(t.url, t.options());
    CHECK_THROWS_WITH(idem::execute_once(store, key, fp_of(100), effect),
                      Catch::Contains("rows were keyed; configure fingerprint_secret"));
    CHECK_THROWS_AS(idem::execute_once(store, key, fp_of(999), effect), idem::config_error);
    const std::vector<idem::Key> keys{key, idem::Key(scope, "new")};
    const std::vector<idem::Fingerprint> fps{fp_of(100), fp_of(1)};
    CHECK_THROWS_AS(store.claim_batch(keys, fps), idem::config_error);
    CHECK(t.row_text(idem::Key(scope, "new")).empty());  // the batch released what it had won
    int tx_runs = 0;
    CHECK_THROWS_AS(
        idem::execute_once_in_transaction(store, key, fp_of(100), [&](idem::Transaction&) { return ++tx_runs, "tx"s; }),
        idem::config_error);
    CHECK(runs == 1);
    CHECK(tx_runs == 0);
    CHECK(t.row_text(key) == row);
}

TEST_CASE("a row keyed with another secret is a mismatch, never a replay", "[fingerprint_secret]") {
    Table t(require_db());
    const auto scope = idem_test::unique_name("rotate");
    const idem::Key key(scope, "k");
    int runs = 0;
    auto effect = [&] { return ++runs, "charged"s; };
    {
        idem::PostgresStore a(t.url, t.options(kSecretA));
        REQUIRE(idem::execute_once(a, key, fp_of(100), effect).outcome() == Outcome::executed);
    }
    idem::PostgresStore b(t.url, t.options(kSecretB));
    CHECK(idem::execute_once(b, key, fp_of(100), effect).outcome() == Outcome::mismatch);
    const std::vector<idem::Key> keys{key};
    const std::vector<idem::Fingerprint> fps{fp_of(100)};
    CHECK(b.claim_batch(keys, fps)[0].status == ClaimStatus::mismatch);
    CHECK(runs == 1);
}

TEST_CASE("CachedStore in front of a keyed store compares cached records by the same rule", "[fingerprint_secret]") {
    Table t(require_db());
    const auto scope = idem_test::unique_name("cached");
    const idem::Key old_key(scope, "old"), new_key(scope, "new");
    int runs = 0;
    auto effect = [&] { return ++runs, "charged"s; };
    {
        idem::PostgresStore plain(t.url, t.options());
        REQUIRE(idem::execute_once(plain, old_key, fp_of(100), effect).outcome() == Outcome::executed);
    }
    idem::PostgresStore primary(t.url, t.options(kSecretA));
    idem::CachedStore store(primary);
    REQUIRE(idem::execute_once(store, new_key, fp_of(200), effect).outcome() == Outcome::executed);
    for (const auto& [key, fp] : {std::pair{old_key, fp_of(100)}, std::pair{new_key, fp_of(200)}}) {
        CAPTURE(key.value());
        REQUIRE(idem::execute_once(store, key, fp, effect).outcome() == Outcome::replayed);  // fills the cache
        const auto before = primary.stats().round_trips;
        CHECK(idem::execute_once(store, key, fp, effect).outcome() == Outcome::replayed);
        CHECK(primary.stats().round_trips == before);  // answered from the cache
        // A cached record the request does not match: asked of the store, which words the mismatch.
        CHECK(idem::execute_once(store, key, fp_of(1), effect).outcome() == Outcome::mismatch);
        CHECK(primary.stats().round_trips == before + 1);
    }
    CHECK(runs == 2);
}

TEST_CASE("keyed store: PostgreSQL's statement log never holds the plain digest", "[fingerprint_secret]") {
    // A reader of the server's log (log_statement = 'all' logs every statement with its parameters)
    // is who keyed fingerprints are for, as a reader of the table is: only the keyed digest may be
    // sent, on every path — single claims, a batch, in-transaction mode, resume mode on a stale
    // row written before the secret.
    const auto url = require_db();
    const char* log_path = std::getenv("IDEM_PG_LOG");
    if (log_path == nullptr || *log_path == '\0') {
        SUCCEED("no server log to read (IDEM_PG_LOG: run under scripts/with-postgres.sh)");
        return;
    }
    Table t(url);
    const std::string logged = url + " options='-c log_statement=all -c log_min_duration_statement=0'";
    const auto fp = fp_of(12345);
    const idem::Key stale("acct", "stale");
    {
        idem::PostgresStore plain(url, t.options());  // before the secret, and before the log is read
        idem::ClaimOptions short_lease;
        short_lease.lease = 1ms;
        REQUIRE(plain.claim(stale, fp, short_lease).status == ClaimStatus::claimed);
    }
    std::ifstream before(log_path, std::ios::binary | std::ios::ate);
    const auto start = before.tellg();
    idem::PostgresStore store(logged, t.options(kSecretA));
    int runs = 0;
    const auto effect = [&] { return ++runs, "paid"s; };
    REQUIRE(idem::execute_once(store, idem::Key("acct", "single"), fp, effect).outcome() == Outcome::executed);
    const std::vector<idem::Message> batch{{idem::Key("acct", "b1"), fp}, {idem::Key("acct", "b2"), fp}};
    (void)idem::execute_batch(store, batch, [](std::size_t) { return "paid"s; });
    (void)idem::execute_once_in_transaction(store, idem::Key("acct", "tx"), fp,
                                            [](idem::Transaction&) { return "paid"s; });
    std::this_thread::sleep_for(20ms);  // the 1 ms lease has passed
    idem::ClaimOptions resume;
    resume.resume_stale = true;
    CHECK(store.claim(stale, fp, resume).status == ClaimStatus::claimed);  // taken over: the same request
    std::ifstream log(log_path, std::ios::binary);
    log.seekg(start);
    const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    CHECK(text.find(kSecretA.key(fp).hex()) != std::string::npos);  // the log holds the parameters
    CHECK(text.find(fp.hex()) == std::string::npos);
}
