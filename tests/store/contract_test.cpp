// The IdempotencyStore contract, through execute_once and the store interface, run on every store.
//
// Built once per store from this one file: idem_contract_memory (MemoryStore, no database),
// idem_contract_postgres (PostgresStore), idem_contract_async (idem::asio::AsyncPostgresStore,
// execute_once through async_execute_once), idem_contract_redis (RedisStore) and
// idem_contract_tiered (CachedStore with a ReplayCache and a RedisReplayCache in front of
// PostgresStore); the PostgreSQL ones need IDEM_TEST_DATABASE_URL, see scripts/with-postgres.sh. Every execute_once
// goes through the backend (backends.hpp): backend.execute_once(store, key, fp, fn).
#include "backends.hpp"
#include "idem/idem.hpp"

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <exception>
#include <latch>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Outcome;
using idem::Response;

#if defined(IDEM_CONTRACT_POSTGRES)
using Backends = std::tuple<idem_test::PostgresBackend>;
#elif defined(IDEM_CONTRACT_ASYNC)
using Backends = std::tuple<idem_test::AsyncPostgresBackend>;
#elif defined(IDEM_CONTRACT_REDIS)
using Backends = std::tuple<idem_test::RedisBackend>;
#elif defined(IDEM_CONTRACT_TIERED)
using Backends = std::tuple<idem_test::TieredBackend>;
#else
using Backends = std::tuple<idem_test::MemoryBackend>;
#endif

namespace {

using Codec = idem::codec<Response>;

Response charge_response(const std::string& id) {
    return Response{201,
                    R"({"id":")" + id + R"(","amount":25000,"currency":"BRL"})",
                    {{"Content-Type", "application/json"}, {"Location", "/charges/" + id}}};
}

idem::Fingerprint charge_fp(std::int64_t amount = 25000) { return idem::fingerprint("POST /charges"s, amount, "BRL"s); }

std::string random_bytes(std::size_t n, unsigned seed) {
    std::mt19937 rng(seed);
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng() & 0xFF);
    return s;
}

// A user result type with its own codec (the pattern response.hpp documents).
struct Receipt {
    std::string charge_id;
    std::int64_t amount_cents = 0;
    std::string currency;
    bool captured = false;
    friend bool operator==(const Receipt&, const Receipt&) = default;
};

/// Thrown by an effect to model a provider timeout: the outcome is unknown.
struct ProviderTimeout : std::runtime_error {
    using std::runtime_error::runtime_error;
    int code = 504;
};

/// A not_performed subclass carrying the caller's own data.
struct Declined : idem::not_performed {
    explicit Declined(std::string reason) : idem::not_performed("declined: " + reason), why(std::move(reason)) {}
    std::string why;
};

}  // namespace

template <>
struct idem::codec<Receipt> {
    static std::string encode(const Receipt& r) {
        std::string out = r.charge_id;
        out += '\0';
        out += std::to_string(r.amount_cents);
        out += '\0';
        out += r.currency;
        out += '\0';
        out += r.captured ? '1' : '0';
        return out;
    }
    static Receipt decode(std::string_view bytes) {
        Receipt r;
        const auto a = bytes.find('\0');
        const auto b = bytes.find('\0', a + 1);
        const auto c = bytes.find('\0', b + 1);
        if (a == bytes.npos || b == bytes.npos || c == bytes.npos || c + 2 != bytes.size()) {
            throw idem::corrupt_record("bad receipt");
        }
        r.charge_id = std::string(bytes.substr(0, a));
        r.amount_cents = std::stoll(std::string(bytes.substr(a + 1, b - a - 1)));
        r.currency = std::string(bytes.substr(b + 1, c - b - 1));
        r.captured = bytes[c + 1] == '1';
        return r;
    }
};

TEMPLATE_LIST_TEST_CASE("new key: executed, the effect runs once, the response is stored", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const idem::Key key(idem_test::fresh_scope("new"), "k-1");
    int runs = 0;

    auto r = backend.execute_once(store, key, charge_fp(), [&] {
        ++runs;
        return charge_response("ch_1");
    });
    CHECK(r.outcome() == Outcome::executed);
    CHECK_FALSE(r.is_replay());
    REQUIRE(r.has_response());
    CHECK(r.response() == charge_response("ch_1"));
    CHECK(runs == 1);

    const auto record = store.read(key);
    REQUIRE(record.has_value());
    CHECK(record->state == idem::RecordState::completed);
    CHECK(record->fingerprint == charge_fp());
    CHECK(record->attempt == 1);
    REQUIRE(record->result.has_value());
    CHECK(*record->result == Codec::encode(charge_response("ch_1")));

    const auto stats = store.stats();
    CHECK(stats.claims == 1);
    CHECK(stats.claims_won == 1);
    CHECK(stats.saves == 1);
    CHECK(stats.releases == 0);
}

TEMPLATE_LIST_TEST_CASE("repeat: replayed with identical bytes, the effect does not run again", "[contract]",
                        Backends) {
    TestType backend;
    auto& store = backend.make();
    const idem::Key key(idem_test::fresh_scope("repeat"), "k-1");
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return charge_response("ch_" + std::to_string(runs));  // a second run would answer differently
    };

    const auto first = backend.execute_once(store, key, charge_fp(), effect);
    REQUIRE(first.outcome() == Outcome::executed);
    for (int i = 0; i < 3; ++i) {
        const auto again = backend.execute_once(store, key, charge_fp(), effect);
        CHECK(again.outcome() == Outcome::replayed);
        CHECK(again.is_replay());
        REQUIRE(again.has_response());
        CHECK(again.response().status == 201);
        CHECK(again.response().headers == first.response().headers);
        CHECK(again.response().body == first.response().body);
        CHECK(Codec::encode(again.response()) == Codec::encode(first.response()));
    }
    CHECK(runs == 1);
    // Through a cache, the primary sees the first replay (which fills the cache) and no other.
    CHECK(store.stats().claims == (TestType::replays_from_cache ? 2 : 4));
    CHECK(store.stats().claims_won == 1);
    CHECK(store.stats().saves == 1);
}

TEMPLATE_LIST_TEST_CASE("same key, different fingerprint: mismatch, the effect does not run", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const idem::Key key(idem_test::fresh_scope("mismatch"), "k-1");
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return charge_response("ch_1");
    };

    REQUIRE(backend.execute_once(store, key, charge_fp(25000), effect).outcome() == Outcome::executed);
    const auto other = backend.execute_once(store, key, charge_fp(99999), effect);
    CHECK(other.outcome() == Outcome::mismatch);
    CHECK_FALSE(other.has_response());
    CHECK_THROWS_AS(other.response(), std::logic_error);
    CHECK(runs == 1);
    // the stored record is untouched, and the original request still replays
    CHECK(store.read(key)->fingerprint == charge_fp(25000));
    CHECK(backend.execute_once(store, key, charge_fp(25000), effect).outcome() == Outcome::replayed);
    CHECK(runs == 1);
}

TEMPLATE_LIST_TEST_CASE("a second call while the first runs gets in_progress (or mismatch)", "[contract]", Backends) {
    TestType backend;
    idem_test::StoreConfig config;
    config.max_retry_after = 2s;
    auto& store = backend.make(config);
    const idem::Key key(idem_test::fresh_scope("inprogress"), "k-1");
    std::atomic<int> runs{0};
    std::latch entered(1);
    std::latch finish(1);

    std::optional<idem::Result<Response>> first;
    std::exception_ptr first_error;
    std::thread worker([&] {
        try {
            first.emplace(backend.execute_once(store, key, charge_fp(), [&] {
                ++runs;
                entered.count_down();
                finish.wait();
                return charge_response("ch_1");
            }));
        } catch (...) {
            first_error = std::current_exception();
            entered.count_down();
        }
    });
    entered.wait();

    std::optional<idem::Result<Response>> second;
    std::optional<idem::Result<Response>> third;
    try {
        second.emplace(backend.execute_once(store, key, charge_fp(), [&] {
            ++runs;
            return charge_response("ch_2");
        }));
        third.emplace(backend.execute_once(store, key, charge_fp(1), [&] {
            ++runs;
            return charge_response("ch_3");
        }));
    } catch (...) {
        finish.count_down();
        worker.join();
        throw;
    }
    finish.count_down();
    worker.join();
    if (first_error) std::rethrow_exception(first_error);

    REQUIRE(second.has_value());
    CHECK(second->outcome() == Outcome::in_progress);
    CHECK_FALSE(second->has_response());
    CHECK(second->retry_after() > 0ms);
    CHECK(second->retry_after() <= 2s);
    REQUIRE(third.has_value());
    CHECK(third->outcome() == Outcome::mismatch);  // the fingerprint is checked first

    REQUIRE(first.has_value());
    CHECK(first->outcome() == Outcome::executed);
    CHECK(runs == 1);
    const auto after = backend.execute_once(store, key, charge_fp(), [&] {
        ++runs;
        return charge_response("ch_4");
    });
    CHECK(after.outcome() == Outcome::replayed);
    CHECK(after.response() == charge_response("ch_1"));
    CHECK(runs == 1);
}

TEMPLATE_LIST_TEST_CASE("fn throws not_performed: rethrown, key released, the key runs again", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const idem::Key key(idem_test::fresh_scope("notperformed"), "k-1");
    int runs = 0;

    try {
        (void)backend.execute_once(store, key, charge_fp(), [&]() -> Response {
            ++runs;
            throw Declined("rate limited");
        });
        FAIL("not_performed was swallowed");
    } catch (const Declined& e) {  // the very exception, subclass and data intact
        CHECK(e.why == "rate limited");
        CHECK(std::string(e.what()) == "declined: rate limited");
    }
    CHECK(runs == 1);
    CHECK_FALSE(store.read(key).has_value());
    CHECK(store.stats().releases == 1);

    const auto retry = backend.execute_once(store, key, charge_fp(), [&] {
        ++runs;
        return charge_response("ch_2");
    });
    CHECK(retry.outcome() == Outcome::executed);
    CHECK(retry.response() == charge_response("ch_2"));
    CHECK(runs == 2);
    CHECK(store.read(key)->state == idem::RecordState::completed);
}

TEMPLATE_LIST_TEST_CASE("fn throws another exception: rethrown unchanged, the key stays in progress", "[contract]",
                        Backends) {
    TestType backend;
    auto& store = backend.make();
    const idem::Key key(idem_test::fresh_scope("unknown"), "k-1");
    int runs = 0;

    try {
        (void)backend.execute_once(store, key, charge_fp(), [&]() -> Response {
            ++runs;
            throw std::runtime_error("provider timed out");
        });
        FAIL("the exception was swallowed");
    } catch (const std::exception& e) {
        CHECK(typeid(e) == typeid(std::runtime_error));  // not wrapped into an idem::error
        CHECK(std::string(e.what()) == "provider timed out");
    }
    try {
        (void)backend.execute_once(store, idem::Key(key.scope(), "k-2"), charge_fp(), [&]() -> Response {
            ++runs;
            throw ProviderTimeout("gateway 504");
        });
        FAIL("the exception was swallowed");
    } catch (const ProviderTimeout& e) {
        CHECK(e.code == 504);
    }
    CHECK(runs == 2);
    CHECK(store.stats().releases == 0);

    const auto record = store.read(key);
    REQUIRE(record.has_value());
    CHECK(record->state == idem::RecordState::in_progress);
    CHECK_FALSE(record->result.has_value());

    const auto next = backend.execute_once(store, key, charge_fp(), [&] {
        ++runs;
        return charge_response("ch_again");
    });
    CHECK(next.outcome() == Outcome::in_progress);
    CHECK(next.retry_after() > 0ms);
    CHECK(runs == 2);
}

TEMPLATE_LIST_TEST_CASE("a business error (402) is saved and replayed like any result", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const idem::Key key(idem_test::fresh_scope("declined"), "k-1");
    int runs = 0;
    const Response declined{402, R"({"error":"card_declined"})", {{"Content-Type", "application/json"}}};
    auto effect = [&] {
        ++runs;
        return declined;
    };

    const auto first = backend.execute_once(store, key, charge_fp(), effect);
    CHECK(first.outcome() == Outcome::executed);
    CHECK(first.response().status == 402);
    const auto again = backend.execute_once(store, key, charge_fp(), effect);
    CHECK(again.outcome() == Outcome::replayed);
    CHECK(again.response() == declined);
    CHECK(runs == 1);
}

TEMPLATE_LIST_TEST_CASE("scopes isolate keys: the same value in two scopes runs twice", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const auto base = idem_test::fresh_scope("iso");
    const idem::Key in_a(base + ":acct_1", "same-value");
    const idem::Key in_b(base + ":acct_2", "same-value");
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return charge_response("ch_" + std::to_string(runs));
    };

    CHECK(backend.execute_once(store, in_a, charge_fp(), effect).outcome() == Outcome::executed);
    const auto b = backend.execute_once(store, in_b, charge_fp(), effect);
    CHECK(b.outcome() == Outcome::executed);
    CHECK(b.response() == charge_response("ch_2"));
    CHECK(runs == 2);
    // scope and value are not concatenated: ("s:a","b") and ("s","a:b") are different keys
    CHECK(backend.execute_once(store, idem::Key(base + "x", "y"), charge_fp(), effect).outcome() == Outcome::executed);
    CHECK(backend.execute_once(store, idem::Key(base, "xy"), charge_fp(), effect).outcome() == Outcome::executed);
    CHECK(runs == 4);
    CHECK(backend.execute_once(store, in_a, charge_fp(), effect).response() == charge_response("ch_1"));
    CHECK(runs == 4);
}

TEMPLATE_LIST_TEST_CASE("binary bodies replay byte for byte: NUL bytes, all values, 1 MiB", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const auto scope = idem_test::fresh_scope("binary");
    std::string every_byte;
    for (int i = 0; i < 256; ++i) every_byte.push_back(static_cast<char>(i));

    const Response nul{200, "a\0b\0\0c"s + every_byte, {{"X-Bin", "\0\xff\x01"s}, {"X-Empty", ""}}};
    const Response big{200, random_bytes(1u << 20, 7), {{"Content-Type", "application/octet-stream"}}};
    const std::string raw = "\0\0\0raw\xff"s + random_bytes(4096, 9);

    int runs = 0;
    for (const auto* response : {&nul, &big}) {
        const idem::Key key(scope, "k-" + std::to_string(response->body.size()));
        auto effect = [&] {
            ++runs;
            return *response;
        };
        CHECK(backend.execute_once(store, key, charge_fp(), effect).outcome() == Outcome::executed);
        const auto again = backend.execute_once(store, key, charge_fp(), effect);
        REQUIRE(again.outcome() == Outcome::replayed);
        CHECK(again.response().body.size() == response->body.size());
        CHECK(again.response().body == response->body);
        CHECK(again.response().headers == response->headers);
        CHECK(*store.read(key)->result == Codec::encode(*response));
    }
    CHECK(runs == 2);

    // std::string results are stored as is
    const idem::Key key(scope, "raw");
    CHECK(backend.execute_once(store, key, charge_fp(), [&] { return raw; }).outcome() == Outcome::executed);
    const auto again = backend.execute_once(store, key, charge_fp(), [&] { return "other"s; });
    CHECK(again.outcome() == Outcome::replayed);
    CHECK(again.response() == raw);
    CHECK(*store.read(key)->result == raw);
}

TEMPLATE_LIST_TEST_CASE("response_too_large: key stays in progress, the exception carries the result", "[contract]",
                        Backends) {
    TestType backend;
    idem_test::StoreConfig config;
    config.max_result_bytes = 256;
    auto& store = backend.make(config);
    CHECK(store.max_result_bytes() == 256);
    const idem::Key key(idem_test::fresh_scope("toolarge"), "k-1");
    const Response large{200, std::string(1000, 'x'), {{"Content-Type", "text/plain"}}};
    int runs = 0;

    try {
        (void)backend.execute_once(store, key, charge_fp(), [&] {
            ++runs;
            return large;
        });
        FAIL("a result over max_result_bytes was accepted");
    } catch (const idem::response_too_large& e) {
        CHECK(e.encoded_result() == Codec::encode(large));
        CHECK(Codec::decode(e.encoded_result()) == large);
        CHECK(dynamic_cast<const idem::outcome_unknown*>(&e) != nullptr);
    }
    CHECK(runs == 1);
    const auto record = store.read(key);
    REQUIRE(record.has_value());
    CHECK(record->state == idem::RecordState::in_progress);
    CHECK_FALSE(record->result.has_value());
    CHECK(backend
              .execute_once(store, key, charge_fp(),
                            [&] {
                                ++runs;
                                return large;
                            })
              .outcome() == Outcome::in_progress);
    CHECK(runs == 1);

    // the limit is inclusive: a result of exactly max_result_bytes is stored
    const idem::Key exact(key.scope(), "k-exact");
    const std::string fits(256, 'y');
    CHECK(backend.execute_once(store, exact, charge_fp(), [&] { return fits; }).outcome() == Outcome::executed);
    const auto direct = store.claim(idem::Key(key.scope(), "k-direct"), charge_fp());
    REQUIRE(direct.status == idem::ClaimStatus::claimed);
    CHECK_THROWS_AS(store.save(idem::Key(key.scope(), "k-direct"), direct.fence, std::string(257, 'z')),
                    idem::response_too_large);
}

TEMPLATE_LIST_TEST_CASE("a user type with its own codec round trips", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const idem::Key key(idem_test::fresh_scope("receipt"), "order-77");
    int runs = 0;
    const Receipt receipt{"ch_77", 25000, "BRL", true};
    auto effect = [&] {
        ++runs;
        return receipt;
    };

    const auto first = backend.execute_once(store, key, charge_fp(), effect);
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(first.response())>, Receipt>);
    CHECK(first.outcome() == Outcome::executed);
    CHECK(first.response() == receipt);
    const auto again = backend.execute_once(store, key, charge_fp(), effect);
    CHECK(again.outcome() == Outcome::replayed);
    CHECK(again.response() == receipt);
    CHECK(runs == 1);
    CHECK(*store.read(key)->result == idem::codec<Receipt>::encode(receipt));
}

TEMPLATE_LIST_TEST_CASE("claim: the winner gets a fence, later claims see the record", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const idem::Key key(idem_test::fresh_scope("claim"), "k-1");

    const auto won = store.claim(key, charge_fp(), idem::ClaimOptions{.lease = 5s, .retention = 3600s});
    REQUIRE(won.status == idem::ClaimStatus::claimed);
    CHECK(won.fence > 0);
    CHECK_FALSE(won.existing.has_value());

    const auto record = store.read(key);
    REQUIRE(record.has_value());
    CHECK(record->state == idem::RecordState::in_progress);
    CHECK(record->fence == won.fence);
    CHECK(record->attempt == 1);
    CHECK(record->fingerprint == charge_fp());
    CHECK_FALSE(record->result.has_value());
    CHECK_FALSE(record->lease_expired);
    CHECK_FALSE(record->expired);
    CHECK(record->lease_until - record->created_at >= 4900ms);
    CHECK(record->lease_until - record->created_at <= 5100ms);
    CHECK(record->expires_at - record->created_at >= 3599s);
    CHECK(record->expires_at - record->created_at <= 3601s);
    const auto now = std::chrono::system_clock::now();
    CHECK(record->created_at <= now + 1s);
    CHECK(record->created_at >= now - 60s);

    const auto lost = store.claim(key, charge_fp());
    CHECK(lost.status == idem::ClaimStatus::in_progress);
    REQUIRE(lost.existing.has_value());
    CHECK(lost.existing->state == idem::RecordState::in_progress);
    CHECK(lost.retry_after > 0ms);
    CHECK(store.claim(key, charge_fp(1)).status == idem::ClaimStatus::mismatch);

    store.save(key, won.fence, "done");
    const auto done = store.claim(key, charge_fp());
    CHECK(done.status == idem::ClaimStatus::completed);
    REQUIRE(done.existing.has_value());
    CHECK(done.existing->result == std::optional<std::string>("done"));
    CHECK(store.claim(key, charge_fp(1)).status == idem::ClaimStatus::mismatch);
    CHECK(store.stats().claims_won == 1);
}

TEMPLATE_LIST_TEST_CASE("save/release with a wrong fence: lease_lost and nothing changes", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const auto scope = idem_test::fresh_scope("fence");
    const idem::Key key(scope, "k-1");

    const auto claim = store.claim(key, charge_fp());
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    const idem::Fence wrong = claim.fence ^ 1;

    CHECK_THROWS_AS(store.save(key, wrong, "stolen"), idem::lease_lost);
    CHECK_THROWS_AS(store.release(key, wrong), idem::lease_lost);
    auto record = store.read(key);
    REQUIRE(record.has_value());
    CHECK(record->state == idem::RecordState::in_progress);
    CHECK(record->fence == claim.fence);
    CHECK_FALSE(record->result.has_value());

    // keys nobody claimed
    CHECK_THROWS_AS(store.save(idem::Key(scope, "never"), claim.fence, "x"), idem::lease_lost);
    CHECK_THROWS_AS(store.release(idem::Key(scope, "never"), claim.fence), idem::lease_lost);
    CHECK_FALSE(store.read(idem::Key(scope, "never")).has_value());
    // the right fence on another key is still the wrong fence
    const auto other = store.claim(idem::Key(scope, "k-2"), charge_fp());
    REQUIRE(other.status == idem::ClaimStatus::claimed);
    CHECK(other.fence != claim.fence);
    CHECK_THROWS_AS(store.save(idem::Key(scope, "k-2"), claim.fence, "x"), idem::lease_lost);

    store.save(key, claim.fence, "done");
    // a completed key can no longer be released, whatever the fence: that would let it run twice
    CHECK_THROWS_AS(store.release(key, claim.fence), idem::lease_lost);
    CHECK_THROWS_AS(store.release(key, wrong), idem::lease_lost);
    CHECK_THROWS_AS(store.save(key, wrong, "stolen"), idem::lease_lost);
    record = store.read(key);
    REQUIRE(record.has_value());
    CHECK(record->state == idem::RecordState::completed);
    CHECK(record->result == std::optional<std::string>("done"));
}

TEMPLATE_LIST_TEST_CASE("list_stale: a claim whose lease passed is listed, and its fence completes it", "[contract]",
                        Backends) {
    TestType backend;
    auto& store = backend.make();
    const auto scope = idem_test::fresh_scope("stale");
    const idem::Key stale1(scope, "stale-1");
    const idem::Key stale2(scope, "stale-2");
    const idem::Key fresh(scope, "fresh");
    const idem::Key completed(scope, "completed");

    const auto c1 = store.claim(stale1, charge_fp(), idem::ClaimOptions{.lease = 50ms, .retention = {}});
    std::this_thread::sleep_for(5ms);
    const auto c2 = store.claim(stale2, charge_fp(), idem::ClaimOptions{.lease = 50ms, .retention = {}});
    const auto cf = store.claim(fresh, charge_fp(), idem::ClaimOptions{.lease = 30s, .retention = {}});
    const auto cc = store.claim(completed, charge_fp(), idem::ClaimOptions{.lease = 50ms, .retention = {}});
    REQUIRE(c1.status == idem::ClaimStatus::claimed);
    REQUIRE(c2.status == idem::ClaimStatus::claimed);
    REQUIRE(cf.status == idem::ClaimStatus::claimed);
    REQUIRE(cc.status == idem::ClaimStatus::claimed);
    store.save(completed, cc.fence, Codec::encode(charge_response("done")));
    std::this_thread::sleep_for(150ms);

    const auto listed = store.list_stale(10);
    REQUIRE(listed.size() == 2);
    CHECK(listed[0].key == stale1);  // oldest lease first
    CHECK(listed[0].record.fence == c1.fence);
    CHECK(listed[0].record.state == idem::RecordState::in_progress);
    CHECK(listed[0].record.fingerprint == charge_fp());
    CHECK(listed[0].record.lease_expired);
    CHECK_FALSE(listed[0].record.expired);
    CHECK(listed[1].key == stale2);
    CHECK(listed[1].record.fence == c2.fence);
    CHECK(store.list_stale(1).size() == 1);
    CHECK(store.list_stale(1)[0].key == stale1);
    CHECK(store.read(stale1)->lease_expired);
    CHECK_FALSE(store.read(fresh)->lease_expired);
    // listing can be narrowed to one scope, or to scopes starting with a prefix
    CHECK(store.list_stale(10, idem::ScopeFilter::exact(scope)).size() == 2);
    CHECK(store.list_stale(10, idem::ScopeFilter::exact(scope + "-other")).empty());
    CHECK(store.list_stale(10, idem::ScopeFilter::prefix(scope.substr(0, 3))).size() == 2);
    CHECK(store.list_stale(10, idem::ScopeFilter::all()).size() == 2);
    // and counted with the same filters, whatever the limit of a listing
    CHECK(store.count_stale() == 2);
    CHECK(store.count_stale(idem::ScopeFilter::exact(scope)) == 2);
    CHECK(store.count_stale(idem::ScopeFilter::exact(scope + "-other")) == 0);
    CHECK(store.count_stale(idem::ScopeFilter::prefix(scope.substr(0, 3))) == 2);

    // a stale key still answers in_progress to clients
    int runs = 0;
    CHECK(backend
              .execute_once(store, stale1, charge_fp(),
                            [&] {
                                ++runs;
                                return charge_response("x");
                            })
              .outcome() == Outcome::in_progress);

    // the reconciler learned the charge happened: it saves with the listed fence
    store.save(listed[0].key, listed[0].record.fence, Codec::encode(charge_response("ch_reconciled")));
    const auto replay = backend.execute_once(store, stale1, charge_fp(), [&] {
        ++runs;
        return charge_response("x");
    });
    CHECK(replay.outcome() == Outcome::replayed);
    CHECK(replay.response() == charge_response("ch_reconciled"));
    // ... and that it did not happen for the other: it releases, the key runs again
    store.release(listed[1].key, listed[1].record.fence);
    CHECK(backend
              .execute_once(store, stale2, charge_fp(),
                            [&] {
                                ++runs;
                                return charge_response("ch_2");
                            })
              .outcome() == Outcome::executed);
    CHECK(runs == 1);
    CHECK(store.list_stale(10).empty());
    CHECK(store.count_stale() == 0);
}

namespace {

/// Claims `key` with a 50 ms lease (stale soon).
void claim_briefly(idem::IdempotencyStore& store, const idem::Key& key) {
    REQUIRE(store.claim(key, charge_fp(), idem::ClaimOptions{.lease = 50ms, .retention = {}}).status ==
            idem::ClaimStatus::claimed);
}

std::vector<std::string> scopes_of(const std::vector<idem::StaleKey>& listed) {
    std::vector<std::string> scopes;
    for (const auto& s : listed) scopes.push_back(s.key.scope());
    return scopes;
}

/// Keeps every event with its key and detail (copied: they are valid during on_event only).
class RecordingObserver final : public idem::Observer {
public:
    struct Seen {
        idem::Event event;
        std::optional<idem::Key> key;
        std::string detail;
    };
    void on_event(const idem::EventInfo& e) noexcept override {
        std::lock_guard lock(mutex_);
        seen_.push_back(Seen{e.event, e.key ? std::optional<idem::Key>(*e.key) : std::nullopt, std::string(e.detail)});
    }
    std::vector<Seen> of(idem::Event event) const {
        std::lock_guard lock(mutex_);
        std::vector<Seen> out;
        for (const auto& s : seen_)
            if (s.event == event) out.push_back(s);
        return out;
    }

private:
    mutable std::mutex mutex_;
    std::vector<Seen> seen_;
};

}  // namespace

// There is no way to hand list_stale (or ReconcilerOptions) a bare string: a call site must say
// whether "tenant" is a scope or a prefix.
static_assert(!std::is_convertible_v<std::string, idem::ScopeFilter>);
static_assert(!std::is_convertible_v<const char*, idem::ScopeFilter>);
static_assert(!std::is_constructible_v<idem::ScopeFilter, std::string>);

TEMPLATE_LIST_TEST_CASE(
    "list_stale: ScopeFilter::exact lists one scope only; prefix (the negative "
    "control) also lists the longer scopes",
    "[contract][scope]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const std::string tenant = idem_test::unique_name("tenant");
    const std::string tenant_b = tenant + "B";
    const std::string tenant_sub = tenant + ":eu";
    const std::string accented = tenant + "É";  // a multi-byte UTF-8 prefix
    claim_briefly(store, idem::Key(tenant, "k1"));
    std::this_thread::sleep_for(5ms);
    claim_briefly(store, idem::Key(tenant_b, "k1"));
    std::this_thread::sleep_for(5ms);
    claim_briefly(store, idem::Key(tenant, "k2"));
    std::this_thread::sleep_for(5ms);
    claim_briefly(store, idem::Key(tenant_sub, "k1"));
    std::this_thread::sleep_for(5ms);
    claim_briefly(store, idem::Key(accented + "1", "k1"));
    std::this_thread::sleep_for(150ms);

    const auto exact = store.list_stale(10, idem::ScopeFilter::exact(tenant));
    REQUIRE(exact.size() == 2);
    CHECK(exact[0].key == idem::Key(tenant, "k1"));  // oldest lease first
    CHECK(exact[1].key == idem::Key(tenant, "k2"));
    CHECK(scopes_of(store.list_stale(10, idem::ScopeFilter::exact(tenant_b))) == std::vector<std::string>{tenant_b});
    CHECK(store.list_stale(10, idem::ScopeFilter::exact(tenant + "X")).empty());
    CHECK(store.list_stale(1, idem::ScopeFilter::exact(tenant)).size() == 1);
    // The trap exact() avoids: as a prefix, "tenant" also selects "tenantB" (and "tenant:eu").
    CHECK(scopes_of(store.list_stale(10, idem::ScopeFilter::prefix(tenant))) ==
          std::vector<std::string>{tenant, tenant_b, tenant, tenant_sub, accented + "1"});
    CHECK(scopes_of(store.list_stale(10, idem::ScopeFilter::prefix(tenant + ":"))) ==
          std::vector<std::string>{tenant_sub});
    CHECK(scopes_of(store.list_stale(10, idem::ScopeFilter::prefix(accented))) ==
          std::vector<std::string>{accented + "1"});
    // all() and the default argument: every stale key of the (private) table.
    CHECK(store.list_stale(10, idem::ScopeFilter::all()).size() == 5);
    CHECK(store.list_stale(10).size() == 5);
    CHECK(store.list_stale(10, idem::ScopeFilter{}).size() == 5);
}

TEMPLATE_LIST_TEST_CASE("list_stale: '%', '_' and '\\' in a scope prefix are literal characters", "[contract][scope]",
                        Backends) {
    TestType backend;
    auto& store = backend.make();
    const std::string base = idem_test::unique_name("lit");
    const std::vector<std::string> scopes = {base + "a%1", base + "a_1", base + "ab1", base + "a\\1", base + "aZ%1"};
    for (const auto& scope : scopes) claim_briefly(store, idem::Key(scope, "k"));
    std::this_thread::sleep_for(150ms);
    const auto listed = [&](const idem::ScopeFilter& filter) {
        auto got = scopes_of(store.list_stale(10, filter));
        std::sort(got.begin(), got.end());
        return got;
    };
    // As LIKE patterns, "a%" would match all five and "a_" four of them.
    CHECK(listed(idem::ScopeFilter::prefix(base + "a%")) == std::vector<std::string>{base + "a%1"});
    CHECK(listed(idem::ScopeFilter::prefix(base + "a_")) == std::vector<std::string>{base + "a_1"});
    CHECK(listed(idem::ScopeFilter::prefix(base + "a\\")) == std::vector<std::string>{base + "a\\1"});
    CHECK(listed(idem::ScopeFilter::prefix(base + "%")).empty());
    CHECK(listed(idem::ScopeFilter::exact(base + "a_1")) == std::vector<std::string>{base + "a_1"});
    CHECK(listed(idem::ScopeFilter::exact(base + "a%")).empty());
    CHECK(listed(idem::ScopeFilter::prefix(base + "a")).size() == 5);
}

// Review control (passes at 503ebc0): the stores agree byte for byte where a collation-aware or
// space-padding comparison would not — trailing spaces, case, NFC vs NFD, a 4-byte character.
TEMPLATE_LIST_TEST_CASE(
    "ScopeFilter: trailing spaces, case and Unicode normal forms are distinct scopes "
    "in both stores",
    "[contract][scope]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const std::string base = idem_test::unique_name("bytes");
    const std::string nfc = base + "\xC3\xA9";            // é, one code point
    const std::string nfd = base + "e\xCC\x81";           // e + COMBINING ACUTE ACCENT
    const std::string emoji = base + "\xF0\x9F\x92\xB3";  // U+1F4B3
    const std::vector<std::string> scopes = {base, base + " ", base + "  ", nfc, nfd, emoji + "x"};
    std::string upper = base;
    for (auto& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    for (const auto& scope : scopes) claim_briefly(store, idem::Key(scope, "k"));
    claim_briefly(store, idem::Key(upper, "k"));
    std::this_thread::sleep_for(150ms);
    const auto listed = [&](const idem::ScopeFilter& filter) {
        auto got = scopes_of(store.list_stale(20, filter));
        std::sort(got.begin(), got.end());
        return got;
    };
    CHECK(listed(idem::ScopeFilter::exact(base)) == std::vector<std::string>{base});
    CHECK(listed(idem::ScopeFilter::exact(base + " ")) == std::vector<std::string>{base + " "});
    CHECK(listed(idem::ScopeFilter::prefix(base + " ")) == std::vector<std::string>{base + " ", base + "  "});
    CHECK(listed(idem::ScopeFilter::exact(nfc)) == std::vector<std::string>{nfc});
    CHECK(listed(idem::ScopeFilter::exact(nfd)) == std::vector<std::string>{nfd});
    CHECK(listed(idem::ScopeFilter::prefix(base + "e")) == std::vector<std::string>{nfd});
    CHECK(listed(idem::ScopeFilter::prefix(emoji)) == std::vector<std::string>{emoji + "x"});
    CHECK(listed(idem::ScopeFilter::prefix(base)).size() == scopes.size());
    CHECK(listed(idem::ScopeFilter::exact(upper)) == std::vector<std::string>{upper});
}

TEMPLATE_LIST_TEST_CASE("ScopeFilter: an invalid exact scope or prefix is invalid_key, before any I/O",
                        "[contract][scope]", Backends) {
    TestType backend;
    auto& store = backend.make();
    (void)store.list_stale(1);  // connected
    const auto trips = store.stats().round_trips;
    const std::string too_long(idem::Key::max_bytes + 1, 's');
    for (const std::string& bad : {std::string(), too_long, std::string("ten\x01nt"), std::string("ten\x7f"),
                                   std::string("caf\xc3"), std::string("\xff\xfe"), std::string("a\0b", 3)}) {
        CAPTURE(bad);
        CHECK_THROWS_AS(store.list_stale(10, idem::ScopeFilter::exact(bad)), idem::invalid_key);
        CHECK_THROWS_AS(store.list_stale(10, idem::ScopeFilter::prefix(bad)), idem::invalid_key);
    }
    // Empty means "refused", not "every scope": an unset setting must not widen the selection.
    CHECK_THROWS_WITH(idem::ScopeFilter::prefix(""), Catch::Contains("empty"));
    CHECK(store.stats().round_trips == trips);
    // The longest valid scope is fine both ways.
    const std::string longest(idem::Key::max_bytes, 's');
    CHECK(idem::ScopeFilter::exact(longest).text() == longest);
    CHECK(idem::ScopeFilter::prefix(longest).kind() == idem::ScopeFilter::Kind::prefix);
    CHECK(idem::ScopeFilter::all() == idem::ScopeFilter{});
    CHECK(idem::ScopeFilter::exact("t") != idem::ScopeFilter::prefix("t"));
    CHECK(idem::ScopeFilter::exact("t").matches("t"));
    CHECK_FALSE(idem::ScopeFilter::exact("t").matches("tB"));
    CHECK(idem::ScopeFilter::prefix("t").matches("tB"));
}

TEMPLATE_LIST_TEST_CASE(
    "Reconciler: a result over max_result_bytes is reported (sweep failures, "
    "observer) and the key is backed off, not retried every lease",
    "[contract][reconciler]", Backends) {
    TestType backend;
    idem_test::StoreConfig config;
    config.max_result_bytes = 1024;
    auto& store = backend.make(config);
    auto observer = std::make_shared<RecordingObserver>();
    store.set_observer(observer);
    const auto scope = idem_test::fresh_scope("toolarge");
    const idem::Key big(scope, "big"), fine(scope, "fine");
    claim_briefly(store, big);
    std::this_thread::sleep_for(5ms);
    claim_briefly(store, fine);
    std::this_thread::sleep_for(150ms);

    std::atomic<int> big_calls{0}, fine_calls{0};
    const auto resolver = [&](idem::Reconciliation& r) {
        if (r.key() == big) {
            ++big_calls;
            r.save_encoded(std::string(2000, 'x'));
        } else {
            ++fine_calls;
            r.save(charge_response("ch_fine"));
        }
    };
    idem::ReconcilerOptions options;
    options.lease = 100ms;
    options.scopes = idem::ScopeFilter::exact(scope);
    // failure_backoff: the default (15 minutes)

    SECTION("default backoff: reported once, not tried again once the reconciler's lease passed") {
        idem::Reconciler reconciler(store, resolver, options);
        const auto s1 = reconciler.run_once();
        CHECK(s1.listed == 2);
        CHECK(s1.taken == 2);
        CHECK(s1.saved == 1);
        CHECK(s1.failed == 1);
        REQUIRE(s1.failures.size() == 1);
        const auto& failure = s1.failures[0];
        CHECK(failure.key == big);
        CHECK(failure.stage == idem::Reconciler::Stage::save);
        CHECK(failure.error_type == "response_too_large");
        CHECK(failure.sqlstate.empty());
        CHECK(failure.message == "idem: result of 2000 bytes exceeds max_result_bytes 1024");
        CHECK(failure.backed_off);
        const auto events = observer->of(idem::Event::reconcile_failed);
        REQUIRE(events.size() == 1);
        CHECK(events[0].key == std::optional<idem::Key>(big));
        CHECK(events[0].detail ==
              "save: response_too_large: idem: result of 2000 bytes exceeds "
              "max_result_bytes 1024 (left alone for 900000 ms)");
        CHECK(observer->of(idem::Event::reconciled).size() == 1);

        // Still in progress to clients; held for the backoff, by the store's clock.
        const auto record = store.read(big);
        REQUIRE(record);
        CHECK(record->state == idem::RecordState::in_progress);
        CHECK(record->lease_until > std::chrono::system_clock::now() + 14min);
        int runs = 0;
        CHECK(backend
                  .execute_once(store, big, charge_fp(),
                                [&] {
                                    ++runs;
                                    return charge_response("x");
                                })
                  .outcome() == Outcome::in_progress);
        CHECK(runs == 0);

        // Past the reconciler's 100 ms lease: without the backoff it would be listed and resolved
        // (and fail) again here, every lease, forever.
        std::this_thread::sleep_for(300ms);
        CHECK(store.list_stale(10).empty());
        const auto s2 = reconciler.run_once();
        CHECK(s2.listed == 0);
        CHECK(s2.failures.empty());
        CHECK(big_calls == 1);
        CHECK(fine_calls == 1);
        CHECK(observer->of(idem::Event::reconcile_failed).size() == 1);
    }

    SECTION("a 1 s backoff: tried again after it, reported again; a fixed resolver then resolves it") {
        options.failure_backoff = 1s;
        idem::Reconciler reconciler(store, resolver, options);
        CHECK(reconciler.run_once().failures.size() == 1);
        std::this_thread::sleep_for(1300ms);  // past the backoff
        const auto again = reconciler.run_once();
        CHECK(again.listed == 1);
        REQUIRE(again.failures.size() == 1);
        CHECK(again.failures[0].key == big);
        CHECK(again.failures[0].backed_off);
        CHECK(big_calls == 2);
        CHECK(observer->of(idem::Event::reconcile_failed).size() == 2);
        std::this_thread::sleep_for(1200ms);
        idem::Reconciler fixed(
            store, [&](idem::Reconciliation& r) { r.save_encoded("summary: 2000 bytes"); }, options);
        const auto s = fixed.run_once();
        CHECK(s.saved == 1);
        CHECK(s.failures.empty());
        CHECK(store.read(big)->result == std::optional<std::string>("summary: 2000 bytes"));
    }

    SECTION("failure_backoff 0: tried again when the reconciler's lease passes, reported each time") {
        options.failure_backoff = 0ms;
        idem::Reconciler reconciler(store, resolver, options);
        const auto s1 = reconciler.run_once();
        REQUIRE(s1.failures.size() == 1);
        CHECK_FALSE(s1.failures[0].backed_off);
        std::this_thread::sleep_for(300ms);
        const auto s2 = reconciler.run_once();
        CHECK(s2.listed == 1);
        REQUIRE(s2.failures.size() == 1);
        CHECK(s2.failures[0].key == big);
        CHECK(big_calls == 2);
        const auto events = observer->of(idem::Event::reconcile_failed);
        REQUIRE(events.size() == 2);
        CHECK(events[1].detail ==
              "save: response_too_large: idem: result of 2000 bytes exceeds "
              "max_result_bytes 1024");
    }
    CHECK_THROWS_AS(idem::Reconciler(store, resolver,
                                     [] {
                                         idem::ReconcilerOptions o;
                                         o.failure_backoff = -1ms;
                                         return o;
                                     }()),
                    idem::config_error);
}

#if defined(IDEM_CONTRACT_POSTGRES)
namespace {

/// A stale key (claimed briefly, its lease passed) and a Reconciler of its scope only, with a 100 ms
/// lease: a key the reconciler fails on is listed again 100 ms later unless it was backed off.
idem::Reconciler stale_key_reconciler(idem::IdempotencyStore& store, const idem::Key& key,
                                      idem::Reconciler::Resolver resolver) {
    claim_briefly(store, key);
    std::this_thread::sleep_for(150ms);
    idem::ReconcilerOptions options;
    options.lease = 100ms;
    options.scopes = idem::ScopeFilter::exact(key.scope());
    return idem::Reconciler(store, std::move(resolver), options);
}

}  // namespace

TEST_CASE(
    "Reconciler: the database refusing the save (a CHECK constraint, 23514) is reported with "
    "its SQLSTATE and backed off",
    "[contract][reconciler]") {
    idem_test::PostgresBackend backend;
    auto& store = backend.make();
    auto observer = std::make_shared<RecordingObserver>();
    store.set_observer(observer);
    idem_test::PgConn(backend.conninfo())
        .exec("ALTER TABLE " + backend.table() + " ADD CONSTRAINT small_results CHECK (length(result) < 100)");
    const auto scope = idem_test::fresh_scope("refused");
    const idem::Key key(scope, "k");
    int calls = 0;
    auto reconciler = stale_key_reconciler(store, key, [&](idem::Reconciliation& r) {
        ++calls;
        r.save_encoded(std::string(500, 'x'));
    });
    const auto s1 = reconciler.run_once();
    REQUIRE(s1.failures.size() == 1);
    CHECK(s1.failures[0].stage == idem::Reconciler::Stage::save);
    CHECK(s1.failures[0].error_type == "database_error");
    CHECK(s1.failures[0].sqlstate == "23514");
    CHECK(s1.failures[0].backed_off);
    const auto events = observer->of(idem::Event::reconcile_failed);
    REQUIRE(events.size() == 1);
    CHECK(events[0].detail.starts_with("save: database_error 23514: "));
    std::this_thread::sleep_for(300ms);
    CHECK(reconciler.run_once().listed == 0);
    CHECK(calls == 1);
    CHECK(store.read(key)->state == idem::RecordState::in_progress);
}
// reconciler.hpp: a save refused by "SQLSTATE class ... 42 rule/privilege" backs off. 42501
// (insufficient privilege: a column privilege on `result` missing, a row-level security WITH CHECK
// policy) is thrown as config_error, not database_error, so will_repeat() never sees class 42 for it.
// The trigger stands in for the privilege check: it refuses the completing UPDATE with 42501 while
// take_over and extend_lease (which leave the row in progress) still pass.
TEST_CASE(
    "Reconciler: a save refused for missing privilege (42501) is backed off like the other "
    "class 42 refusals",
    "[contract][reconciler]") {
    IDEM_NOT_ON_CITUS("its refusal is a trigger on the table");
    idem_test::PostgresBackend backend;
    auto& store = backend.make();
    const std::string fn = backend.table() + "_deny_save";
    idem_test::PgConn admin(backend.conninfo());
    admin.exec("CREATE FUNCTION " + fn +
               "() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN IF NEW.state = 'completed' THEN "
               "RAISE EXCEPTION 'permission denied for column result' USING ERRCODE = '42501'; "
               "END IF; RETURN NEW; END $$");
    admin.exec("CREATE TRIGGER deny_save BEFORE UPDATE ON " + backend.table() + " FOR EACH ROW EXECUTE FUNCTION " + fn +
               "()");
    const auto scope = idem_test::fresh_scope("denied");
    const idem::Key key(scope, "k");
    int calls = 0;
    auto reconciler = stale_key_reconciler(store, key, [&](idem::Reconciliation& r) {
        ++calls;
        r.save_encoded("done");
    });
    const auto s1 = reconciler.run_once();
    REQUIRE(s1.failures.size() == 1);
    CHECK(s1.failures[0].stage == idem::Reconciler::Stage::save);
    CHECK(s1.failures[0].sqlstate == "42501");
    CHECK(s1.failures[0].backed_off);
    std::this_thread::sleep_for(300ms);  // past the reconciler's 100 ms lease
    CHECK(reconciler.run_once().listed == 0);
    CHECK(calls == 1);  // the provider is not asked again every lease
    admin.exec("DROP TABLE " + backend.table() + " CASCADE");
    admin.exec("DROP FUNCTION " + fn + "()");
}

// The observer's detail goes to logs and metrics pipelines. PostgreSQL's message for a refused row
// carries a DETAIL line "Failing row contains (scope, key, ..., \\x<result bytes>...)": the first
// bytes of the response the resolver saved (here a card number), the fingerprint and the phase data.
TEST_CASE(
    "Reconciler: the reconcile_failed detail does not carry the row's data from the database "
    "message",
    "[contract][reconciler]") {
    idem_test::PostgresBackend backend;
    auto& store = backend.make();
    auto observer = std::make_shared<RecordingObserver>();
    store.set_observer(observer);
    idem_test::PgConn(backend.conninfo())
        .exec("ALTER TABLE " + backend.table() + " ADD CONSTRAINT small_results CHECK (length(result) < 10)");
    const auto scope = idem_test::fresh_scope("leak");
    const idem::Key key(scope, "k");
    auto reconciler =
        stale_key_reconciler(store, key, [&](idem::Reconciliation& r) { r.save_encoded("card=4242424242424242"); });
    const auto s1 = reconciler.run_once();
    REQUIRE(s1.failures.size() == 1);
    CHECK(s1.failures[0].sqlstate == "23514");
    const auto events = observer->of(idem::Event::reconcile_failed);
    REQUIRE(events.size() == 1);
    CAPTURE(events[0].detail);
    CHECK(events[0].detail.starts_with("save: database_error 23514: "));
    // "4242424242" as bytea hex output
    CHECK(events[0].detail.find("34323432343234323432") == std::string::npos);
    CHECK(events[0].detail.find('\n') == std::string::npos);  // one line
}

// One row the store cannot decode (here: a fingerprint algorithm this build does not know, as a
// newer idem writing to the same table during a rolling upgrade would store) makes list_stale throw
// for the whole listing: every sweep fails, reported without a key, and no other stale key in the
// selected scopes is ever resolved. "A failure on one key is recorded ... and the sweep goes on."
TEST_CASE("Reconciler: one undecodable stale row does not stop the other keys from being resolved",
          "[contract][reconciler]") {
    idem_test::PostgresBackend backend;
    auto& store = backend.make();
    const auto scope = idem_test::fresh_scope("poison");
    const idem::Key poison(scope, "a-poison"), good(scope, "b-good");
    claim_briefly(store, poison);
    std::this_thread::sleep_for(5ms);
    claim_briefly(store, good);
    idem_test::PgConn(backend.conninfo())
        .exec("UPDATE " + backend.table() + " SET fingerprint_alg = 9 WHERE scope = $1 AND key = $2",
              {scope, poison.value()});
    std::this_thread::sleep_for(150ms);
    int resolved_good = 0;
    idem::ReconcilerOptions options;
    options.lease = 100ms;
    options.scopes = idem::ScopeFilter::exact(scope);
    idem::Reconciler reconciler(
        store,
        [&](idem::Reconciliation& r) {
            if (r.key() == good) ++resolved_good;
            r.save_encoded("done");
        },
        options);
    auto observer = std::make_shared<RecordingObserver>();
    store.set_observer(observer);
    idem::Reconciler::Sweep sweep;
    CHECK_NOTHROW(sweep = reconciler.run_once());
    CHECK(resolved_good == 1);
    CHECK(store.read(good)->state == idem::RecordState::completed);
    // The undecodable row is reported with its key, not silently dropped.
    const auto reported = observer->of(idem::Event::reconcile_failed);
    REQUIRE(reported.size() == 1);
    CHECK(reported[0].key == poison);
    CHECK(reported[0].detail.find("unknown fingerprint algorithm 9") != std::string::npos);
}
#endif

// A failure_backoff the stores cannot represent: MemoryStore computes steady_clock::now() + backoff
// in nanoseconds (signed overflow past ~292 years; milliseconds::max() wraps to -1 ms, so the key is
// "backed off" into the past and handed to the resolver again at the next sweep), PostgreSQL refuses
// the interval (22008) and the key is not backed off at all. Either way the setting does not do what
// it says; the constructor checks only for a negative value.
TEMPLATE_LIST_TEST_CASE("Reconciler: a failure_backoff too long to represent is a config_error",
                        "[contract][reconciler]", Backends) {
    TestType backend;
    auto& store = backend.make();
    idem::ReconcilerOptions options;
    options.failure_backoff = std::chrono::milliseconds::max();  // "never retry it by itself"
    CHECK_THROWS_AS(idem::Reconciler(
                        store, [](idem::Reconciliation&) {}, options),
                    idem::config_error);
}

TEMPLATE_LIST_TEST_CASE("fn taking Context& learns key, fence and attempt 1", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const idem::Key key(idem_test::fresh_scope("context"), "k-ctx");
    std::optional<idem::Key> seen_key;
    idem::Fence seen_fence = 0;
    int seen_attempt = 0;
    std::optional<idem::Record> during;

    const auto r = backend.execute_once(store, key, charge_fp(), [&](idem::Context& ctx) {
        seen_key = ctx.key();
        seen_fence = ctx.fence();
        seen_attempt = ctx.attempt();
        during = store.read(ctx.key());
        return charge_response("ch_ctx");
    });
    CHECK(r.outcome() == Outcome::executed);
    REQUIRE(seen_key.has_value());
    CHECK(*seen_key == key);
    CHECK(seen_attempt == 1);
    CHECK(seen_fence > 0);
    REQUIRE(during.has_value());
    CHECK(during->state == idem::RecordState::in_progress);
    CHECK(during->fence == seen_fence);
    // the fence is the one that owned the key: a write with it after completion changes nothing
    CHECK_THROWS_AS(store.release(key, seen_fence), idem::lease_lost);
    CHECK(store.read(key)->state == idem::RecordState::completed);
}

TEMPLATE_LIST_TEST_CASE("many keys from several threads each run once", "[contract]", Backends) {
    TestType backend;
    auto& store = backend.make();
    const auto scope = idem_test::fresh_scope("threads");
    constexpr int kKeys = 50;
    constexpr int kThreads = 8;
    std::array<std::atomic<int>, kKeys> runs{};
    std::atomic<int> executed{0};
    std::atomic<int> replayed{0};
    std::atomic<int> other{0};
    std::latch start(kThreads);
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(kThreads);
    for (int t = 0; t < kThreads; ++t) {
        threads.emplace_back([&, t] {
            try {
                start.arrive_and_wait();
                for (int i = 0; i < kKeys; ++i) {
                    const int k = (i + t * 7) % kKeys;
                    const auto r = backend.execute_once(store, idem::Key(scope, std::to_string(k)), charge_fp(), [&] {
                        ++runs[static_cast<std::size_t>(k)];
                        return charge_response(std::to_string(k));
                    });
                    if (r.outcome() == Outcome::executed) {
                        ++executed;
                    } else if (r.outcome() == Outcome::replayed && r.response() == charge_response(std::to_string(k))) {
                        ++replayed;
                    } else if (r.outcome() != Outcome::in_progress) {
                        ++other;
                    }
                }
            } catch (...) {
                errors[static_cast<std::size_t>(t)] = std::current_exception();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
        if (e) std::rethrow_exception(e);
    }
    CHECK(executed == kKeys);
    CHECK(other == 0);
    for (int k = 0; k < kKeys; ++k) {
        CAPTURE(k);
        CHECK(runs[static_cast<std::size_t>(k)] == 1);
    }
    CHECK(store.stats().claims_won == kKeys);
}
