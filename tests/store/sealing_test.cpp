// Sealed responses (idem/sealing.hpp): the keyring and the record format on their own, then
// PostgresStore with SealingOptions against real PostgreSQL — what is at rest (read back with the
// test's own connection), records altered, truncated, copied from another key or sealed under a key
// id the keyring lacks (corrupt_record, the effect never run again), rotation, a table moving from
// unsealed to sealed, batches and in-transaction mode. Needs IDEM_TEST_DATABASE_URL for the store
// cases (scripts/with-postgres.sh).
#include "idem/sealing.hpp"
#include "idem/idem.hpp"
#include "idem/postgres_transaction.hpp"
#include "pg.hpp"
#include "require_db.hpp"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

using namespace std::string_literals;
using idem::Outcome;
using idem::Response;
using idem_test::PgConn;

namespace {

const std::string kBody = "card 4242 charged 1999 BRL";

std::shared_ptr<const idem::Keyring> ring(std::initializer_list<std::uint32_t> ids) {
    auto r = std::make_shared<idem::Keyring>();
    for (std::uint32_t id : ids) r->add(id, std::string(32, static_cast<char>('A' + id)));
    return r;
}

idem::SealingOptions sealing(std::shared_ptr<const idem::Keyring> keyring, bool open_unsealed = false) {
    idem::SealingOptions s;
    s.keyring = std::move(keyring);
    s.open_unsealed = open_unsealed;
    return s;
}

using idem_test::require_db;

idem::Fingerprint fp_of(int amount) { return idem::fingerprint("POST /charges"s, amount); }

/// A private table with idem's schema, and stores on it with the sealing each case asks for.
class Fixture {
public:
    Fixture() : url_(require_db()), table_(idem_test::unique_name("idem_seal")), admin_(url_) {}
    ~Fixture() {
        stores_.clear();
        idem_test::drop_idem_table(url_, table_);
    }
    Fixture(const Fixture&) = delete;
    Fixture& operator=(const Fixture&) = delete;

    idem::PostgresStore& store(idem::SealingOptions s) {
        idem::PostgresOptions o;
        o.table = table_;
        o.pool_size = 2;
        o.sealing = std::move(s);
        stores_.push_back(std::make_unique<idem::PostgresStore>(url_, o));
        if (stores_.size() == 1) stores_.back()->ensure_schema();
        return *stores_.back();
    }

    /// Runs `sql` on the table (written `T` in it) with the test's own connection.
    idem_test::PgResult sql(std::string text, const std::vector<std::string>& params = {}) {
        for (std::size_t at = text.find(" T "); at != std::string::npos; at = text.find(" T ", at + 1)) {
            text.replace(at, 3, " " + table_ + " ");
        }
        return admin_.exec(text, params);
    }
    long long count(std::string text, const std::vector<std::string>& params = {}) {
        return std::stoll(sql(std::move(text), params).text(0, 0));
    }

private:
    std::string url_;
    std::string table_;
    PgConn admin_;
    std::vector<std::unique_ptr<idem::PostgresStore>> stores_;
};

/// execute_once with an effect that counts its runs outside the library.
idem::Result<Response> charge(idem::IdempotencyStore& store, const idem::Key& key, int& runs, int amount = 1999) {
    return idem::execute_once(store, key, fp_of(amount), [&] {
        ++runs;
        return Response{201, kBody, {{"Content-Type", "text/plain"}}};
    });
}

}  // namespace

TEST_CASE("a keyring: ids, the sealing key, parsing, bad keys refused", "[sealing][unit]") {
    idem::Keyring k;
    CHECK(k.empty());
    CHECK(k.sealing_id() == 0);
    k.add(7, std::string(32, 'x')).add(3, std::string(32, 'y'));
    CHECK(k.sealing_id() == 7);
    CHECK(k.ids() == std::vector<std::uint32_t>{3, 7});
    CHECK_THROWS_AS(k.add(0, std::string(32, 'x')), idem::config_error);
    CHECK_THROWS_AS(k.add(7, std::string(32, 'x')), idem::config_error);
    CHECK_THROWS_AS(k.add(8, std::string(31, 'x')), idem::config_error);
    CHECK_THROWS_AS(k.add(8, std::string(33, 'x')), idem::config_error);

    const std::string hex(64, 'a');
    const auto parsed =
        idem::Keyring::parse("# rotated monthly\n\n1 " + hex + "\r\n  2\t" + std::string(64, 'F') + "\n");
    CHECK(parsed.ids() == std::vector<std::uint32_t>{1, 2});
    CHECK(parsed.sealing_id() == 2);
    for (const std::string& bad :
         std::vector<std::string>{"1"s, "x " + hex, "0 " + hex, "1 " + hex.substr(2), "1 " + hex + "00",
                                  "1 " + std::string(63, 'a') + "g", "1 " + hex + "\n1 " + hex}) {
        CAPTURE(bad);
        try {
            (void)idem::Keyring::parse(bad);
            FAIL("accepted");
        } catch (const idem::config_error& e) {
            CHECK(std::string(e.what()).find("keyring line") != std::string::npos);
            CHECK(std::string(e.what()).find(hex) == std::string::npos);  // never the key
        }
    }
    CHECK_THROWS_AS(idem::Keyring::from_file("/nonexistent/keyring"), idem::config_error);
}

TEST_CASE("a keyring file its group or others may read is refused, as ssh refuses such a key", "[sealing][unit]") {
    const auto path = std::filesystem::temp_directory_path() / idem_test::unique_name("idem_keyring");
    std::ofstream(path) << "1 " << std::string(64, 'a') << "\n";
    const auto remove = [&] { std::filesystem::remove(path); };
    using P = std::filesystem::perms;
    for (const auto mode : {P::owner_read | P::owner_write | P::group_read, P::owner_read | P::others_read,
                            P::owner_read | P::owner_write | P::group_read | P::others_read}) {
        std::filesystem::permissions(path, mode);
        try {
            (void)idem::Keyring::from_file(path.string());
            FAIL("accepted a keyring its group or others may read");  // before: accepted
        } catch (const idem::config_error& e) {
            CHECK(std::string(e.what()).find("chmod 600") != std::string::npos);
            CHECK(std::string(e.what()).find(std::string(64, 'a')) == std::string::npos);
        }
    }
    std::filesystem::permissions(path, P::owner_read | P::owner_write);
    CHECK(idem::Keyring::from_file(path.string()).ids() == std::vector<std::uint32_t>{1});
    std::filesystem::permissions(path, P::owner_read);
    CHECK(idem::Keyring::from_file(path.string()).ids() == std::vector<std::uint32_t>{1});
    remove();
}

TEST_CASE("a sealed record: opens for its key only, any change refused", "[sealing][unit]") {
    const auto keys = ring({1, 2});
    const idem::Key key("acct_1:POST /charges", "k-1");
    const std::string sealed = idem::seal(*keys, key, kBody);
    CHECK(sealed.size() == kBody.size() + idem::seal_overhead);
    CHECK(sealed.find(kBody) == std::string::npos);
    CHECK(idem::sealed_key_id(sealed) == 2u);
    // a synthetic IV: the same bytes for the same key and plaintext, other salts for anything else
    CHECK(idem::seal(*keys, key, kBody) == sealed);
    CHECK(idem::seal(*keys, key, kBody + ".").substr(8, 28) != sealed.substr(8, 28));
    CHECK(idem::seal(*keys, idem::Key("acct_1:POST /charges", "k-2"), kBody).substr(8, 28) != sealed.substr(8, 28));
    // a record made for a replay tier does not open as a stored result, nor the other way round
    const std::string entry = idem::seal(*keys, key, kBody, idem::SealPurpose::tier_entry);
    CHECK_THROWS_AS(idem::open_sealed(*keys, key, entry), idem::corrupt_record);
    CHECK(idem::open_sealed(*keys, key, entry, idem::SealPurpose::tier_entry) == kBody);
    CHECK_THROWS_AS(idem::open_sealed(*keys, key, sealed, idem::SealPurpose::tier_entry), idem::corrupt_record);
    CHECK(idem::open_sealed(*keys, key, sealed) == kBody);
    CHECK(idem::open_sealed(*keys, key, idem::seal(*keys, key, "")).empty());

    // every byte matters: header, salt, nonce, ciphertext and tag
    for (std::size_t i = 0; i < sealed.size(); ++i) {
        std::string altered = sealed;
        altered[i] = static_cast<char>(altered[i] ^ 0x01);
        CAPTURE(i);
        CHECK_THROWS_AS(idem::open_sealed(*keys, key, altered), idem::corrupt_record);
    }
    CHECK_THROWS_AS(idem::open_sealed(*keys, key, sealed.substr(0, sealed.size() - 1)), idem::corrupt_record);
    CHECK_THROWS_AS(idem::open_sealed(*keys, key, sealed.substr(0, 20)), idem::corrupt_record);
    CHECK_THROWS_AS(idem::open_sealed(*keys, key, kBody), idem::corrupt_record);
    // another key, another scope, another keyring holding the same id with other bytes
    CHECK_THROWS_AS(idem::open_sealed(*keys, idem::Key("acct_1:POST /charges", "k-2"), sealed), idem::corrupt_record);
    CHECK_THROWS_AS(idem::open_sealed(*keys, idem::Key("acct_2:POST /charges", "k-1"), sealed), idem::corrupt_record);
    // scope/value boundaries are length-prefixed: ("ab","c") is not ("a","bc")
    const std::string ab = idem::seal(*keys, idem::Key("ab", "c"), kBody);
    CHECK_THROWS_AS(idem::open_sealed(*keys, idem::Key("a", "bc"), ab), idem::corrupt_record);
    idem::Keyring other;
    other.add(2, std::string(32, 'z'));
    CHECK_THROWS_AS(idem::open_sealed(other, key, sealed), idem::corrupt_record);
    try {
        (void)idem::open_sealed(*ring({1}), key, sealed);
        FAIL("opened without key 2");
    } catch (const idem::corrupt_record& e) {
        CHECK(std::string(e.what()).find("key id 2") != std::string::npos);
    }
}

TEST_CASE("sealed: nothing of the response is at rest; the replay is the bytes produced", "[sealing][postgres]") {
    Fixture f;
    auto& store = f.store(sealing(ring({1})));
    const idem::Key key(idem_test::unique_name("seal"), "k-1");
    int runs = 0;
    const auto first = charge(store, key, runs);
    REQUIRE(first.outcome() == Outcome::executed);
    const auto again = charge(store, key, runs);
    REQUIRE(again.outcome() == Outcome::replayed);
    CHECK(again.response().body == kBody);
    CHECK(again.response().status == 201);
    CHECK(runs == 1);
    CHECK(charge(store, key, runs, 2000).outcome() == Outcome::mismatch);
    CHECK(runs == 1);

    // The row, read with the test's own connection: sealed with key id 1, no plaintext in it.
    CHECK(f.count("SELECT count(*) FROM T WHERE key = $1 AND substring(result from 1 for 8) = '\\x6964533200000001'",
                  {"k-1"}) == 1);
    CHECK(f.count("SELECT position(convert_to($2, 'UTF8') in result) FROM T WHERE key = $1", {"k-1", kBody}) == 0);
    CHECK(f.count("SELECT position('IDR1'::bytea in result) FROM T WHERE key = $1", {"k-1"}) == 0);
    // read() opens it too
    const auto record = store.read(key);
    REQUIRE(record);
    REQUIRE(record->result);
    CHECK(idem::codec<Response>::decode(*record->result).body == kBody);

    // A store without the keyring reads the sealed bytes as they are: they do not decode.
    auto& plain = f.store({});
    CHECK_THROWS(charge(plain, key, runs));
    CHECK(runs == 1);
}

TEST_CASE("sealed: an altered, truncated, copied or unknown-key record is corrupt_record, never a re-run",
          "[sealing][postgres]") {
    Fixture f;
    auto& store = f.store(sealing(ring({1, 2})));
    const std::string scope = idem_test::unique_name("seal");
    int runs = 0;
    for (const char* k : {"flip", "cut", "copy", "source", "unknown", "header"}) {
        REQUIRE(charge(store, idem::Key(scope, k), runs).outcome() == Outcome::executed);
    }
    REQUIRE(runs == 6);
    f.sql("UPDATE T SET result = set_byte(result, 40, get_byte(result, 40) # 1) WHERE key = 'flip'");
    f.sql("UPDATE T SET result = substring(result from 1 for octet_length(result) - 1) WHERE key = 'cut'");
    f.sql("UPDATE T SET result = (SELECT result FROM T WHERE key = 'source') WHERE key = 'copy'");
    f.sql("UPDATE T SET result = set_byte(result, 4, 99) WHERE key = 'header'");  // key id byte
    auto& only_first = f.store(sealing(ring({1})));  // lacks key 2, which sealed every record here

    for (const char* k : {"flip", "cut", "copy", "header"}) {
        CAPTURE(k);
        CHECK_THROWS_AS(charge(store, idem::Key(scope, k), runs), idem::corrupt_record);
        CHECK_THROWS_AS(store.read(idem::Key(scope, k)), idem::corrupt_record);
    }
    CHECK_THROWS_AS(charge(only_first, idem::Key(scope, "unknown"), runs), idem::corrupt_record);
    CHECK(runs == 6);  // never run again
    // the untouched ones still replay
    CHECK(charge(store, idem::Key(scope, "source"), runs).response().body == kBody);
    CHECK(charge(store, idem::Key(scope, "unknown"), runs).response().body == kBody);
    CHECK(runs == 6);
    // the keys stay completed: nothing was deleted or re-claimed
    CHECK(f.count("SELECT count(*) FROM T WHERE state = 'completed'") == 6);
}

TEST_CASE("sealed: rotation — records sealed before and after a new key both open", "[sealing][postgres]") {
    Fixture f;
    const std::string scope = idem_test::unique_name("seal");
    int runs = 0;
    auto& before = f.store(sealing(ring({1})));
    REQUIRE(charge(before, idem::Key(scope, "old"), runs).outcome() == Outcome::executed);
    auto& after = f.store(sealing(ring({1, 2})));
    REQUIRE(charge(after, idem::Key(scope, "new"), runs).outcome() == Outcome::executed);
    CHECK(f.count("SELECT get_byte(result, 7) FROM T WHERE key = 'old'") == 1);
    CHECK(f.count("SELECT get_byte(result, 7) FROM T WHERE key = 'new'") == 2);
    CHECK(charge(after, idem::Key(scope, "old"), runs).response().body == kBody);
    CHECK(charge(after, idem::Key(scope, "new"), runs).response().body == kBody);
    // the old store cannot open the new key's record: an error, not a re-run
    CHECK_THROWS_AS(charge(before, idem::Key(scope, "new"), runs), idem::corrupt_record);
    CHECK(runs == 2);
}

TEST_CASE("sealed: a table written before sealing — refused, or opened with open_unsealed", "[sealing][postgres]") {
    Fixture f;
    const std::string scope = idem_test::unique_name("seal");
    int runs = 0;
    auto& plain = f.store({});
    REQUIRE(charge(plain, idem::Key(scope, "before"), runs).outcome() == Outcome::executed);
    auto& strict = f.store(sealing(ring({1})));
    CHECK_THROWS_AS(charge(strict, idem::Key(scope, "before"), runs), idem::corrupt_record);
    auto& migrating = f.store(sealing(ring({1}), /*open_unsealed=*/true));
    CHECK(charge(migrating, idem::Key(scope, "before"), runs).response().body == kBody);
    REQUIRE(charge(migrating, idem::Key(scope, "after"), runs).outcome() == Outcome::executed);
    CHECK(f.count("SELECT count(*) FROM T WHERE key = 'after' AND substring(result from 1 for 4) = 'idS2'::bytea") ==
          1);
    CHECK(charge(strict, idem::Key(scope, "after"), runs).response().body == kBody);
    // open_unsealed does not open an altered sealed record
    f.sql("UPDATE T SET result = set_byte(result, 50, get_byte(result, 50) # 1) WHERE key = 'after'");
    CHECK_THROWS_AS(charge(migrating, idem::Key(scope, "after"), runs), idem::corrupt_record);
    CHECK(runs == 2);
}

TEST_CASE("sealed: batches and in-transaction mode seal and open too", "[sealing][postgres]") {
    Fixture f;
    auto& store = f.store(sealing(ring({1})));
    const std::string scope = idem_test::unique_name("seal");
    std::vector<idem::Key> keys{idem::Key(scope, "b1"), idem::Key(scope, "b2"), idem::Key(scope, "b3")};
    std::vector<idem::Fingerprint> fps(3, fp_of(1));
    auto claims = store.claim_batch(keys, fps);
    std::vector<idem::SaveRequest> saves;
    const std::vector<std::string> bodies{"one", "two", "three"};
    for (std::size_t i = 0; i < 3; ++i) {
        REQUIRE(claims[i].status == idem::ClaimStatus::claimed);
        saves.push_back({keys[i], claims[i].fence, bodies[i]});
    }
    for (auto s : store.save_batch(saves)) CHECK(s == idem::SaveStatus::saved);
    CHECK(f.count("SELECT count(*) FROM T WHERE substring(result from 1 for 4) = 'idS2'::bytea") == 3);
    claims = store.claim_batch(keys, fps);
    for (std::size_t i = 0; i < 3; ++i) {
        REQUIRE(claims[i].status == idem::ClaimStatus::completed);
        CHECK(claims[i].existing->result == bodies[i]);
    }

    int runs = 0;
    const idem::Key tx_key(scope, "tx");
    const auto effect = [&](idem::Transaction&) {
        ++runs;
        return kBody;
    };
    auto first = store.run_in_transaction(tx_key, fp_of(1), {}, effect);
    CHECK(first.status == idem::ClaimStatus::claimed);
    CHECK(f.count("SELECT count(*) FROM T WHERE key = 'tx' AND substring(result from 1 for 4) = 'idS2'::bytea") == 1);
    auto again = store.run_in_transaction(tx_key, fp_of(1), {}, effect);
    CHECK(again.status == idem::ClaimStatus::completed);
    CHECK(again.result == kBody);
    f.sql("UPDATE T SET result = set_byte(result, 45, get_byte(result, 45) # 1) WHERE key = 'tx'");
    CHECK_THROWS_AS(store.run_in_transaction(tx_key, fp_of(1), {}, effect), idem::corrupt_record);
    CHECK(runs == 1);
}

TEST_CASE("sealed: an empty keyring is a configuration error", "[sealing][postgres]") {
    idem::PostgresOptions o;
    o.sealing.keyring = std::make_shared<idem::Keyring>();
    CHECK_THROWS_AS(idem::PostgresStore("dbname=unused", o), idem::config_error);
}

TEST_CASE("sealed: open_unsealed never returns the bytes of a truncated sealed record", "[sealing][postgres]") {
    // open_result() treats anything sealed_key_id() does not recognise as unsealed, and
    // sealed_key_id() needs seal_overhead bytes: a sealed record cut below 52 bytes is returned
    // as stored — ciphertext handed out as the result.
    Fixture f;
    const std::string scope = idem_test::unique_name("seal");
    auto& migrating = f.store(sealing(ring({1}), /*open_unsealed=*/true));
    const idem::Key key(scope, "short");
    const auto c = migrating.claim(key, fp_of(1));
    REQUIRE(c.status == idem::ClaimStatus::claimed);
    migrating.save(key, c.fence, "ok");
    REQUIRE(f.count("SELECT octet_length(result) FROM T WHERE key = 'short'") == 2 + idem::seal_overhead);
    f.sql("UPDATE T SET result = substring(result from 1 for 40) WHERE key = 'short'");
    CHECK_THROWS_AS(migrating.read(key), idem::corrupt_record);
    CHECK_THROWS_AS(migrating.claim(key, fp_of(1)), idem::corrupt_record);
}

TEST_CASE("sealed: claim_batch meeting a sealed record that does not open releases what it won",
          "[sealing][postgres]") {
    Fixture f;
    auto& store = f.store(sealing(ring({1})));
    const std::string scope = idem_test::unique_name("seal");
    int runs = 0;
    REQUIRE(charge(store, idem::Key(scope, "bad"), runs).outcome() == Outcome::executed);
    f.sql("UPDATE T SET result = set_byte(result, 40, get_byte(result, 40) # 1) WHERE key = 'bad'");
    std::vector<idem::Key> keys{idem::Key(scope, "a-new"), idem::Key(scope, "bad"), idem::Key(scope, "z-new")};
    std::vector<idem::Fingerprint> fps(3, fp_of(1999));
    CHECK_THROWS_AS(store.claim_batch(keys, fps), idem::corrupt_record);
    CHECK(f.count("SELECT count(*) FROM T WHERE key IN ('a-new', 'z-new')") == 0);
    CHECK(runs == 1);
}

TEST_CASE("sealed: a reused key on a record that does not open is mismatch on every path", "[sealing][postgres]") {
    // claim() opens the result of a mismatch (which never replays) and throws corrupt_record; the
    // in-transaction path does not open it and answers mismatch. One key, two answers.
    Fixture f;
    auto& store = f.store(sealing(ring({1})));
    const std::string scope = idem_test::unique_name("seal");
    int runs = 0;
    const idem::Key key(scope, "bad");
    REQUIRE(charge(store, key, runs).outcome() == Outcome::executed);
    f.sql("UPDATE T SET result = set_byte(result, 40, get_byte(result, 40) # 1) WHERE key = 'bad'");
    const auto effect = [&](idem::Transaction&) {
        ++runs;
        return kBody;
    };
    CHECK(store.run_in_transaction(key, fp_of(2000), {}, effect).status == idem::ClaimStatus::mismatch);
    CHECK(charge(store, key, runs, 2000).outcome() == Outcome::mismatch);
    CHECK(runs == 1);
}

TEST_CASE("sealed: a CachedStore in front answers a mismatch without the result, as the store does",
          "[sealing][postgres][cache]") {
    // The cache holds opened records; a reused key must not get another request's plaintext from
    // it, where the sealed store itself drops a mismatch's result.
    Fixture f;
    auto& store = f.store(sealing(ring({1})));
    idem::CachedStore cached(store, idem::ReplayCacheOptions{});
    const idem::Key key(idem_test::unique_name("seal"), "reused");
    int runs = 0;
    REQUIRE(charge(cached, key, runs).outcome() == Outcome::executed);
    const idem::Claim replay = cached.claim(key, fp_of(1999));  // from the store: cached now
    REQUIRE(replay.status == idem::ClaimStatus::completed);
    REQUIRE(cached.cache().find(key));

    const auto rejected = cached.cache().stats().rejected;
    const idem::Claim from_store = store.claim(key, fp_of(2000));
    REQUIRE(from_store.status == idem::ClaimStatus::mismatch);
    REQUIRE(from_store.existing);
    CHECK_FALSE(from_store.existing->result);
    const idem::Claim from_cache = cached.claim(key, fp_of(2000));
    CHECK(from_cache.status == idem::ClaimStatus::mismatch);
    REQUIRE(from_cache.existing);
    CHECK_FALSE(from_cache.existing->result);
    CHECK(charge(cached, key, runs, 2000).outcome() == Outcome::mismatch);
    CHECK(cached.cache().stats().rejected == rejected);  // a result-less mismatch is not offered to it
    // The matching request still replays, from the cache.
    const auto trips = store.stats().round_trips;
    const auto again = charge(cached, key, runs);
    REQUIRE(again.outcome() == Outcome::replayed);
    CHECK(again.response().body == kBody);
    CHECK(store.stats().round_trips == trips);
    CHECK(runs == 1);
}
