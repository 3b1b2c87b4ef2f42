// Hostile input and tenant isolation.
//   Oversized responses: max_result_bytes is decided before the result is reported as saved — a
//   typed response_too_large (an outcome_unknown carrying the bytes), no I/O for the save, nothing
//   stored, the key stays in progress for the reconciler. Keys: over 255 bytes, NUL and other
//   control characters, invalid UTF-8 → invalid_key before any I/O; SQL-looking and LIKE-looking
//   keys are stored and matched verbatim. Tenants: the same key value in scopes A and B is two
//   keys; no call naming scope B's key with scope A's fence can save, release, extend, record on or
//   take over B's key; a reconciler for scope prefix A never sees B.
#include "fault.hpp"

using namespace fault;

namespace {

struct Fixture {
    std::string url = require_db();
    IdemTable table{url};
    Effects effects{url};
    PgConn db{url};

    idem::PostgresOptions options() const {
        idem::PostgresOptions o;
        o.table = table.name();
        o.pool_size = 2;
        o.application_name = "idem_fault_hostile";
        return o;
    }
    long long rows() { return db.scalar("SELECT count(*) FROM " + table.name()); }
    std::string snapshot(const Key& key) {
        auto r = db.exec("SELECT row_to_json(t)::text FROM " + table.name() + " t WHERE scope = $1 AND key = $2",
                         {key.scope(), key.value()});
        return r.rows() == 0 ? std::string("<none>") : r.text(0, 0);
    }
};

}  // namespace

TEST_CASE("oversized responses: response_too_large before anything is saved", "[fault][hostile]") {
    Fixture fx;
    auto options = fx.options();
    options.max_result_bytes = 1024;
    idem::PostgresStore store(fx.url, options);
    store.ensure_schema();
    const std::string scope = idem_test::unique_name("big");
    Figures f;
    f.scenario = "oversized";
    int runs = 0;

    // Exactly at the limit: stored and replayed.
    const Key fits(scope, "fits");
    const auto at_limit = idem::execute_once(store, fits, fp_for(fits), [&] {
        ++runs;
        return std::string(1024, '\xab');
    });
    CHECK(at_limit.outcome() == idem::Outcome::executed);
    CHECK(idem::execute_once(store, fits, fp_for(fits), [&] { return std::string(); }).response() ==
          std::string(1024, '\xab'));

    // One byte over: the claim is the only round trip; the caller gets the bytes in the exception.
    const Key big(scope, "too-big");
    const auto before = store.stats();
    std::string carried;
    try {
        (void)idem::execute_once(
            store, big, fp_for(big),
            [&] {
                ++runs;
                return std::string(1025, '\xcd');
            },
            idem::ClaimOptions{200ms, {}, false, {}});
        FAIL("no response_too_large");
    } catch (const idem::response_too_large& e) {
        carried = e.encoded_result();
        CHECK(dynamic_cast<const idem::outcome_unknown*>(&e) != nullptr);
    }
    const auto after = store.stats();
    CHECK(carried == std::string(1025, '\xcd'));
    CHECK(after.round_trips - before.round_trips == 1);  // the claim; no I/O for the save
    CHECK(after.saves == before.saves);
    const auto row = read_row(fx.db, fx.table.name(), big);
    REQUIRE(row);
    CHECK(row->state == "in_progress");
    CHECK_FALSE(row->result.has_value());
    CHECK(runs == 2);
    // A retry does not run it again: the outcome is unknown to idem, the key stays in progress.
    CHECK(idem::execute_once(store, big, fp_for(big), [&] {
              ++runs;
              return std::string("x");
          }).outcome() == idem::Outcome::in_progress);
    CHECK(runs == 2);
    // Response (headers + body) is measured encoded, too.
    const Key big_response(scope, "too-big-response");
    CHECK_THROWS_AS(
        idem::execute_once(store, big_response, fp_for(big_response),
                           [] {
                               return Response{200, std::string(1000, 'x'), {{"X-Pad", std::string(100, 'y')}}};
                           }),
        idem::response_too_large);
    // save_batch: too_large for the big one, the small one saved.
    {
        const Key a(scope, "batch-small"), b(scope, "batch-big");
        const auto ca = store.claim(a, fp_for(a));
        const auto cb = store.claim(b, fp_for(b));
        const std::string small(10, 's'), large(2000, 'l');
        const idem::SaveRequest reqs[] = {{a, ca.fence, small}, {b, cb.fence, large}};
        const auto statuses = store.save_batch(reqs);
        CHECK(statuses[0] == idem::SaveStatus::saved);
        CHECK(statuses[1] == idem::SaveStatus::too_large);
        CHECK(read_row(fx.db, fx.table.name(), b)->state == "in_progress");
        store.release(b, cb.fence);
    }
    // The reconciler resolves it with a result that fits (here: a summary of the real one).
    std::this_thread::sleep_for(300ms);
    idem::ReconcilerOptions summarise;
    summarise.lease = 300ms;
    summarise.scopes = idem::ScopeFilter::exact(scope);
    idem::Reconciler reconciler(
        store, [&](idem::Reconciliation& r) { r.save_encoded("summary:1025 bytes"); }, summarise);
    const auto sweep = reconciler.run_once();
    CHECK(sweep.saved >= 1);
    CHECK(idem::execute_once(store, big, fp_for(big), [&] { return std::string("never"); }).response() ==
          "summary:1025 bytes");
    f.rounds = 1, f.faults = 3, f.keys = 5;
    f.print();
}

TEST_CASE("hostile keys: invalid ones refused before any I/O, the rest stored verbatim", "[fault][hostile]") {
    Fixture fx;
    idem::PostgresStore store(fx.url, fx.options());
    store.ensure_schema();
    const std::string scope = idem_test::unique_name("hostile");
    Effects::Writer writer(fx.effects);
    History history;
    Figures f;
    f.scenario = "hostile_keys";

    const std::vector<std::pair<std::string, std::string>> invalid = {
        {"256 bytes", std::string(256, 'k')},
        {"4 KiB", std::string(4096, 'k')},
        {"empty", ""},
        {"NUL inside", std::string("ab\0cd", 5)},
        {"NUL alone", std::string(1, '\0')},
        {"0xFF", "ab\xff"},
        {"overlong '/'", "\xc0\xaf"},
        {"UTF-16 surrogate", "\xed\xa0\x80"},
        {"truncated sequence", "\xe2\x82"},
        {"past U+10FFFF", "\xf4\x90\x80\x80"},
        {"lone continuation", "\x80"},
        {"tab", "a\tb"},
        {"newline", "a\nb"},
        {"DEL", "a\x7f"},
        {"C1 NEL", "a\xc2\x85"},
        {"multibyte over 255 bytes",
         [] {
             std::string s;
             for (int i = 0; i < 128; ++i) s += "\xc3\xa9";  // 256 bytes of é
             return s;
         }()},
    };
    const auto rows_before = fx.rows();
    const auto stats_before = store.stats();
    int runs = 0;
    for (const auto& [what, bad] : invalid) {
        CAPTURE(what);
        for (bool as_scope : {false, true}) {
            CHECK_THROWS_AS(idem::execute_once(store, as_scope ? Key(bad, "v") : Key(scope, bad), idem::fingerprint(1),
                                               [&] {
                                                   ++runs;
                                                   return Response{200};
                                               }),
                            idem::invalid_key);
            ++f.faults;
        }
    }
    CHECK(runs == 0);
    CHECK(store.stats().round_trips == stats_before.round_trips);  // refused before any I/O
    CHECK(fx.rows() == rows_before);

    std::string max_multibyte;
    for (int i = 0; i < 127; ++i) max_multibyte += "\xc3\xa9";
    max_multibyte += "a";  // 255 bytes
    const std::vector<std::string> verbatim = {
        std::string(255, 'k'),
        max_multibyte,
        "'; DROP TABLE " + fx.table.name() + "; --",
        "Robert'); DROP TABLE students;--",
        "\" OR \"1\"=\"1",
        "' OR '1'='1",
        "$1",
        "$2::text",
        "\\",
        "\\x00",
        "%",
        "_",
        "a%b_c",
        "E'\\\\'",
        ";",
        "/* comment */",
        "-- comment",
        "\xf0\x9f\x92\xb3 card",  // emoji
        "\xe2\x80\xae"
        "txet",  // U+202E right-to-left override (not a control character)
        "\xef\xbb\xbf"
        "bom",  // U+FEFF
        " leading and trailing ",
        "K",
        "k",  // case is significant
    };
    std::set<std::string> expected;
    for (const auto& value : verbatim) {
        CAPTURE(printable(value));
        const Key key(scope, value);
        Call first = run_call(store, writer, key);
        CHECK(first.told == Told::executed);
        Call again = run_call(store, writer, key);
        CHECK(again.told == Told::replayed);
        CHECK(again.bytes == first.bytes);
        history.add(std::move(first));
        history.add(std::move(again));
        expected.insert(value);
        // The same text as a scope.
        const Key as_scope(value, "v");
        CHECK(idem::execute_once(store, as_scope, fp_for(as_scope), [] {
                  return Response{201, "s"};
              }).outcome() == idem::Outcome::executed);
        CHECK(store.read(as_scope).has_value());
        fx.db.exec("DELETE FROM " + fx.table.name() + " WHERE scope = $1", {value});
    }
    // Stored exactly as given, nothing more, nothing less; the table is still there.
    auto stored = fx.db.exec("SELECT key FROM " + fx.table.name() + " WHERE scope = $1", {scope});
    std::set<std::string> got;
    for (int i = 0; i < stored.rows(); ++i) got.insert(stored.text(i, 0));
    CHECK(got == expected);
    CHECK(fx.db.scalar("SELECT count(*) FROM " + fx.table.name()) == static_cast<long long>(expected.size()));

    // LIKE metacharacters in a reconciler's scope prefix are not wildcards.
    {
        const std::string base = idem_test::unique_name("pfx");
        const Key pct(base + "%", "x"), other(base + "ab", "x"), under(base + "_", "x");
        for (const Key& k : {pct, other, under}) {
            (void)store.claim(k, fp_for(k), idem::ClaimOptions{10ms, {}, false, {}});
        }
        std::this_thread::sleep_for(100ms);
        for (const auto& [prefix, want] :
             std::vector<std::pair<std::string, std::string>>{{base + "%", pct.scope()}, {base + "_", under.scope()}}) {
            const auto stale = store.list_stale(100, idem::ScopeFilter::prefix(prefix));
            REQUIRE(stale.size() == 1);
            CHECK(stale.front().key.scope() == want);
        }
        for (const Key& k : {pct, other, under})
            fx.db.exec("DELETE FROM " + fx.table.name() + " WHERE scope = $1", {k.scope()});
    }

    check(store, fx.effects, history, CheckOptions{scope, fx.table.name()}, f);
    f.rounds = 1;
    f.print();
    CHECK(f.anomalies.empty());
}

TEST_CASE("tenant isolation: scope A can never touch a key of scope B", "[fault][hostile][isolation]") {
    Fixture fx;
    idem::PostgresStore store(fx.url, fx.options());
    store.ensure_schema();
    const std::string A = idem_test::unique_name("tenantA"), B = idem_test::unique_name("tenantB");
    Effects::Writer writer(fx.effects);
    Figures f;
    f.scenario = "tenant_isolation";

    // The same value in both scopes: two keys, two effects, each replays its own bytes.
    const Key a(A, "order-1"), b(B, "order-1");
    Call ea = run_call(store, writer, a);
    Call eb = run_call(store, writer, b);
    CHECK(ea.told == Told::executed);
    CHECK(eb.told == Told::executed);  // not a replay of A's
    CHECK(ea.bytes != eb.bytes);
    CHECK(run_call(store, writer, a).bytes == ea.bytes);
    CHECK(run_call(store, writer, b).bytes == eb.bytes);
    // A different request under the same value in another scope is not a mismatch there.
    const Key a2(A, "order-2"), b2(B, "order-2");
    CHECK(idem::execute_once(store, a2, idem::fingerprint(1), [] {
              return Response{201, "a"};
          }).outcome() == idem::Outcome::executed);
    CHECK(idem::execute_once(store, b2, idem::fingerprint(2), [] {
              return Response{201, "b"};
          }).outcome() == idem::Outcome::executed);
    // No ambiguity at the scope/value boundary.
    const Key left(A + ":x", "y"), right(A, "x:y");
    CHECK(idem::execute_once(store, left, fp_for(left), [] {
              return Response{201, "left"};
          }).outcome() == idem::Outcome::executed);
    CHECK(idem::execute_once(store, right, fp_for(right), [] {
              return Response{201, "right"};
          }).outcome() == idem::Outcome::executed);

    // Claims in progress in both scopes; every write naming B's key with A's fence is refused and
    // changes nothing.
    const Key pa(A, "pending"), pb(B, "pending");
    const auto fa = store.claim(pa, fp_for(pa), idem::ClaimOptions{50ms, {}, false, {}}).fence;
    const auto fb = store.claim(pb, fp_for(pb), idem::ClaimOptions{50ms, {}, false, {}}).fence;
    REQUIRE(fa != 0);
    REQUIRE(fb != 0);
    std::this_thread::sleep_for(120ms);  // both leases passed: take_over would be allowed with the right fence
    const std::string b_before = fx.snapshot(pb);
    CHECK_THROWS_AS(store.save(pb, fa, "stolen"), idem::lease_lost);
    CHECK_THROWS_AS(store.release(pb, fa), idem::lease_lost);
    CHECK_THROWS_AS(store.extend_lease(pb, fa, 1h), idem::lease_lost);
    CHECK_THROWS_AS(store.record_phase(pb, fa, "hijacked", "x"), idem::lease_lost);
    CHECK_FALSE(store.take_over(pb, fa, 1h, true).has_value());
    CHECK_FALSE(store.take_over(pb, fa, 1h, false).has_value());
    CHECK(fx.snapshot(pb) == b_before);
    f.faults += 6;
    // Reading B's key through the scope-A key value returns A's record only.
    CHECK(store.read(pa)->fence == fa);
    CHECK(store.read(pb)->fence == fb);
    // B's fence on A's key: same.
    const std::string a_before = fx.snapshot(pa);
    CHECK_THROWS_AS(store.save(pa, fb, "stolen"), idem::lease_lost);
    CHECK_THROWS_AS(store.release(pa, fb), idem::lease_lost);
    CHECK_FALSE(store.take_over(pa, fb, 1h, false).has_value());
    CHECK(fx.snapshot(pa) == a_before);
    f.faults += 3;

    // A reconciler for scope A lists and takes only A's stale keys.
    std::vector<std::string> seen;
    idem::ReconcilerOptions only_a;
    only_a.lease = 300ms;
    only_a.scopes = idem::ScopeFilter::exact(A);
    idem::Reconciler reconciler(
        store,
        [&](idem::Reconciliation& r) {
            seen.push_back(r.key().scope());
            r.release();
        },
        only_a);
    const auto sweep = reconciler.run_once();
    CHECK(sweep.released == 1);
    CHECK(seen == std::vector<std::string>{A});
    CHECK_FALSE(store.read(pa).has_value());
    CHECK(fx.snapshot(pb) == b_before);
    // Replays of B after all that are still B's.
    CHECK(run_call(store, writer, b).bytes == eb.bytes);
    store.release(pb, fb);
    f.rounds = 1, f.keys = 8;
    f.print();
}
