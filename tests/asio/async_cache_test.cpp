// tests/asio/async_cache_test.cpp — AsyncPostgresStore::set_replay_cache: replays of completed keys
// answered from a ReplayCache in process memory with no round trip (CachedStore's rules), against
// a real PostgreSQL: byte-identical replays, mismatch on another fingerprint, in-progress keys
// never cached, sealed results cached opened, off by default.
#include "idem/asio.hpp"
#include "idem/idem.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "test_env.hpp"

#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

namespace net = boost::asio;
using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;
using idem_test::PgConn;

namespace {

// A private table, an io_context run by one thread, and the store on it (application_name of its
// own, so the test can find its backends).
struct Fixture {
    explicit Fixture(idem::PostgresOptions o = {})
        : table(idem_test::unique_name("idem_async_cache")), app(idem_test::unique_name("idem_async_cache_app")) {
        o.table = table;
        o.application_name = app;
        store.emplace(io.get_executor(), idem_test::require_db(), o);
        store->blocking().ensure_schema();
        runner = std::thread([this] { io.run(); });
    }
    ~Fixture() {
        work.reset();
        runner.join();
        store.reset();
        try {
            PgConn(idem_test::database_url()).exec("DROP TABLE IF EXISTS " + table);
        } catch (...) {
        }
    }

    // Ends every backend of the store's asynchronous connections (blocking()'s carry the same
    // application_name; they are ended too): a round trip now needs a new connection.
    void terminate_backends() const {
        PgConn(idem_test::database_url())
            .exec("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", {app});
    }

    std::string table, app;
    net::io_context io;
    std::optional<net::executor_work_guard<net::io_context::executor_type>> work{io.get_executor()};
    std::optional<idem::asio::AsyncPostgresStore> store;
    std::thread runner;
};

idem::Key key(const std::string& v) { return idem::Key("async-cache", v); }
idem::Fingerprint fp(const std::string& body) { return idem::fingerprint(body); }

const std::string kBody("charged \0 once", 14);

// An effect that counts its runs (outside the library) and returns kBody.
struct Charge {
    std::atomic<int>* runs;
    Response operator()() const {
        ++*runs;
        return Response{201, kBody, {{"Location", "/charges/1"}}};
    }
};

idem::Result<Response> call(idem::asio::AsyncPostgresStore& store, const idem::Key& k, const idem::Fingerprint& f,
                            std::atomic<int>& runs) {
    return idem::asio::async_execute_once(store, k, f, Charge{&runs}, net::use_future).get();
}

void check_bytes(const idem::Result<Response>& r) {
    REQUIRE(r.outcome() == Outcome::replayed);
    CHECK(r.response().status == 201);
    CHECK(r.response().body == kBody);
    CHECK(r.response().headers == Response::Headers{{"Location", "/charges/1"}});
}

}  // namespace

TEST_CASE("async cache: replays of a completed key are byte-identical and, after the first, make no round trip",
          "[asio][cache]") {
    Fixture f;
    auto cache = std::make_shared<idem::ReplayCache>();
    f.store->set_replay_cache(cache);
    CHECK(f.store->replay_cache() == cache);
    auto observer = std::make_shared<idem::CountingObserver>();
    f.store->set_observer(observer);
    std::atomic<int> runs{0};
    const auto k = key(idem_test::unique_name("k"));

    REQUIRE(call(*f.store, k, fp("a"), runs).outcome() == Outcome::executed);
    CHECK(cache->stats().inserts == 0);             // a claim won, and a save, fill nothing
    check_bytes(call(*f.store, k, fp("a"), runs));  // the database's answer, now cached
    CHECK(cache->stats().inserts == 1);
    CHECK(cache->stats().hits == 0);

    // From here on the database is not asked: its backends are gone, and no round trip is made,
    // no connection opened, no claim counted.
    f.terminate_backends();
    const idem::StoreStats before = f.store->stats();
    const std::uint64_t replayed_before = observer->snapshot().count(idem::Event::replayed);
    for (int i = 0; i < 5; ++i) check_bytes(call(*f.store, k, fp("a"), runs));
    // The blocking claim() goes the same way: the stored bytes, no round trip.
    const idem::Claim blocking = f.store->claim(k, fp("a"));
    REQUIRE(blocking.status == idem::ClaimStatus::completed);
    REQUIRE(blocking.existing);
    REQUIRE(blocking.existing->result);
    CHECK(idem::codec<Response>::decode(*blocking.existing->result).body == kBody);

    const idem::StoreStats after = f.store->stats();
    CHECK(after.round_trips == before.round_trips);
    CHECK(after.claims == before.claims);
    CHECK(after.connections_opened == before.connections_opened);
    CHECK(cache->stats().hits == 6);
    CHECK(runs == 1);
    // A hit is reported as the database's answer is: replayed, to the store's observer.
    CHECK(observer->snapshot().count(idem::Event::replayed) == replayed_before + 5);
    CHECK(observer->snapshot().count(idem::Event::executed) == 1);

    // A new key still reaches the database (a new connection).
    REQUIRE(call(*f.store, key(idem_test::unique_name("k")), fp("a"), runs).outcome() == Outcome::executed);
    CHECK(f.store->stats().connections_opened > before.connections_opened);
    CHECK(runs == 2);
}

TEST_CASE("async cache: another fingerprint on a cached key is a mismatch with no round trip, the effect not run",
          "[asio][cache]") {
    const bool keyed = GENERATE(false, true);
    CAPTURE(keyed);
    idem::PostgresOptions o;
    if (keyed) o.fingerprint_secret = idem::FingerprintSecret("an async cache fingerprint secret, 32 bytes+"s);
    Fixture f(o);
    auto cache = std::make_shared<idem::ReplayCache>();
    f.store->set_replay_cache(cache);
    auto observer = std::make_shared<idem::CountingObserver>();
    f.store->set_observer(observer);
    std::atomic<int> runs{0};

    const auto k = key(idem_test::unique_name("k"));
    REQUIRE(call(*f.store, k, fp("a"), runs).outcome() == Outcome::executed);
    check_bytes(call(*f.store, k, fp("a"), runs));  // cached
    auto before = f.store->stats();
    CHECK(call(*f.store, k, fp("b"), runs).outcome() == Outcome::mismatch);
    CHECK(f.store->claim(k, fp("b")).status == idem::ClaimStatus::mismatch);
    CHECK(f.store->stats().round_trips == before.round_trips);
    CHECK(cache->stats().hits == 2);
    CHECK(runs == 1);
    CHECK(observer->snapshot().count(idem::Event::mismatch) == 1);

    // A mismatch the database answers on a completed record is cached too: the right request
    // then replays from the cache.
    const auto k2 = key(idem_test::unique_name("k2"));
    REQUIRE(call(*f.store, k2, fp("a"), runs).outcome() == Outcome::executed);
    CHECK(call(*f.store, k2, fp("b"), runs).outcome() == Outcome::mismatch);  // the database's answer
    CHECK(cache->stats().inserts == 2);
    before = f.store->stats();
    check_bytes(call(*f.store, k2, fp("a"), runs));
    CHECK(call(*f.store, k2, fp("b"), runs).outcome() == Outcome::mismatch);
    CHECK(f.store->stats().round_trips == before.round_trips);
    CHECK(cache->stats().hits == 4);
    CHECK(runs == 2);
}

TEST_CASE("async cache: an in-progress key is never served from the cache; after the save it replays",
          "[asio][cache]") {
    Fixture f;
    auto cache = std::make_shared<idem::ReplayCache>();
    f.store->set_replay_cache(cache);
    std::atomic<int> runs{0};
    const auto k = key(idem_test::unique_name("k"));

    const idem::Claim owner = f.store->claim(k, fp("a"));
    REQUIRE(owner.status == idem::ClaimStatus::claimed);
    for (int i = 0; i < 2; ++i) {
        const auto before = f.store->stats();
        CHECK(call(*f.store, k, fp("a"), runs).outcome() == Outcome::in_progress);
        CHECK(f.store->stats().claims == before.claims + 1);  // asked the database each time
    }
    CHECK(runs == 0);
    CHECK(cache->stats().inserts == 0);
    CHECK(cache->stats().entries == 0);
    CHECK(cache->stats().hits == 0);

    f.store->save(k, owner.fence, idem::codec<Response>::encode(Response{201, kBody, {{"Location", "/charges/1"}}}));
    check_bytes(call(*f.store, k, fp("a"), runs));  // the database's answer, now cached
    CHECK(cache->stats().inserts == 1);
    const auto before = f.store->stats();
    check_bytes(call(*f.store, k, fp("a"), runs));
    CHECK(f.store->stats().round_trips == before.round_trips);
    CHECK(cache->stats().hits == 1);
    CHECK(runs == 0);
}

TEST_CASE("async cache: a sealed store caches the opened record and replays the plaintext from the cache",
          "[asio][cache][sealing]") {
    auto ring = std::make_shared<idem::Keyring>();
    ring->add(1, std::string(32, 'K'));
    idem::PostgresOptions o;
    o.sealing.keyring = ring;
    Fixture f(o);
    auto cache = std::make_shared<idem::ReplayCache>();
    f.store->set_replay_cache(cache);
    std::atomic<int> runs{0};
    const auto k = key(idem_test::unique_name("k"));

    REQUIRE(call(*f.store, k, fp("a"), runs).outcome() == Outcome::executed);
    // At rest the result is sealed: the plaintext is nowhere in the row.
    const auto row = PgConn(idem_test::database_url())
                         .exec("SELECT position(convert_to($3, 'UTF8') in result) FROM " + f.table +
                                   " WHERE scope = $1 AND key = $2",
                               {k.scope(), k.value(), "charged"});
    REQUIRE(row.rows() == 1);
    CHECK(row.integer(0, 0) == 0);

    check_bytes(call(*f.store, k, fp("a"), runs));  // opened by the store, then cached
    const auto cached = cache->find(k);
    REQUIRE(cached);
    REQUIRE(cached->result);
    CHECK(idem::codec<Response>::decode(*cached->result).body == kBody);

    const auto before = f.store->stats();
    check_bytes(call(*f.store, k, fp("a"), runs));
    // A sealed store's mismatch carries no result, from the cache as from the database.
    const idem::Claim wrong = f.store->claim(k, fp("b"));
    CHECK(wrong.status == idem::ClaimStatus::mismatch);
    REQUIRE(wrong.existing);
    CHECK_FALSE(wrong.existing->result);
    CHECK(f.store->stats().round_trips == before.round_trips);
    CHECK(cache->stats().hits == 3);  // (the find above, and these two)
    CHECK(runs == 1);
}

TEST_CASE("async cache: off by default, and set_replay_cache(nullptr) turns it off", "[asio][cache]") {
    Fixture f;
    CHECK(f.store->replay_cache() == nullptr);
    std::atomic<int> runs{0};
    const auto k = key(idem_test::unique_name("k"));
    REQUIRE(call(*f.store, k, fp("a"), runs).outcome() == Outcome::executed);
    auto before = f.store->stats();
    for (int i = 0; i < 3; ++i) check_bytes(call(*f.store, k, fp("a"), runs));
    CHECK(f.store->stats().claims == before.claims + 3);  // every replay asks the database

    auto cache = std::make_shared<idem::ReplayCache>();
    f.store->set_replay_cache(cache);
    check_bytes(call(*f.store, k, fp("a"), runs));  // cached
    check_bytes(call(*f.store, k, fp("a"), runs));  // hit
    CHECK(cache->stats().hits == 1);
    f.store->set_replay_cache(nullptr);
    CHECK(f.store->replay_cache() == nullptr);
    before = f.store->stats();
    check_bytes(call(*f.store, k, fp("a"), runs));
    CHECK(f.store->stats().claims == before.claims + 1);
    CHECK(cache->stats().hits == 1);
    CHECK(runs == 1);
}
