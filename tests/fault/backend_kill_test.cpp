// Fault scenario 1 — backends killed: pg_terminate_backend on random idem connections, 20 rounds,
// under load from 8 client threads. Guarantee: no duplicate effect, every answer byte-identical to
// the stored response, the pool heals, keys in doubt are resolved by one reconciler sweep.
#include "store_env.hpp"
#include "fault.hpp"

using namespace fault;

TEST_CASE("scenario 1: backends terminated under load", "[fault][backend_kill]") {
    const std::string url = require_db();
    IdemTable table(url);
    Effects effects(url);
    idem::PostgresOptions options;
    options.table = table.name();
    options.pool_size = 8;
    options.application_name = idem_test::unique_name("idem_fault_kill");
    options.statement_timeout = 5s;
    options.lock_timeout = 1s;
    idem::PostgresStore store(url, idem_test::env_options(options));
    store.ensure_schema();

    History history;
    LoadOptions lo;
    lo.scope = idem_test::unique_name("kill");
    lo.claim.lease = 1s;
    Figures f;
    f.scenario = "backend_kill";

    PgConn admin(url);
    std::minstd_rand rng(static_cast<unsigned>(::getpid()));
    {
        Load load(store, effects, history, lo);
        load.start();
        std::this_thread::sleep_for(300ms);
        for (int round = 0; round < 20; ++round) {
            std::this_thread::sleep_for(std::chrono::milliseconds(80 + rng() % 150));
            const auto victims = static_cast<int>(1 + rng() % 3);
            auto r = admin.exec("SELECT pg_terminate_backend(pid) FROM (SELECT pid FROM "
                                "pg_stat_activity WHERE application_name = $1 "
                                "ORDER BY random() LIMIT " +
                                    std::to_string(victims) + ") v",
                                {options.application_name});
            f.faults += r.rows();
            ++f.rounds;
        }
        std::this_thread::sleep_for(300ms);
        load.stop();
    }
    const auto stats = store.stats();
    f.notes.push_back("store: retries=" + std::to_string(stats.retries) +
                      " connections_opened=" + std::to_string(stats.connections_opened) +
                      " connections_discarded=" + std::to_string(stats.connections_discarded));

    // The pool heals: broken connections were discarded, at most pool_size are open, new calls
    // work.
    CHECK(f.faults > 0);
    CHECK(stats.connections_discarded > 0);
    CHECK(admin.scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                       {options.application_name}) <= static_cast<long long>(options.pool_size));
    {
        Effects::Writer writer(effects);
        for (int i = 0; i < 16; ++i) {
            Call c = run_call(store, writer, Key(lo.scope, "after-" + std::to_string(i)));
            CHECK(c.told == Told::executed);
            history.add(std::move(c));
        }
    }

    check(store, effects, history, CheckOptions{lo.scope, table.name()}, f);
    f.print();
    CHECK(f.calls > 100);
    CHECK(f.anomalies.empty());
}
