// quickstart — run a "charge" at most once per idempotency key, with PostgreSQL as the arbiter.
//
//   quickstart "host=/run/postgresql dbname=app"      (or set IDEM_TEST_DATABASE_URL /
//   DATABASE_URL)
//
// What it shows, in order:
//   1. a new key: the effect runs, its response is stored                 -> executed
//   2. the same request again (a client retry): the stored bytes come back -> replayed
//   3. the same key with a different request (another amount)              -> mismatch
//   4. the same key while the first call is still running                  -> in_progress
// and which HTTP answer a service would send for each.
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <future>
#include <idem/idem.hpp>
#include <iostream>
#include <string>
#include <thread>

namespace {

// Where to connect: argv[1], else IDEM_TEST_DATABASE_URL, else DATABASE_URL.
std::string conninfo_from(int argc, char** argv) {
    if (argc > 1) return argv[1];
    for (const char* name : {"IDEM_TEST_DATABASE_URL", "DATABASE_URL"}) {
        if (const char* value = std::getenv(name); value && *value) return value;
    }
    return {};
}

// The HTTP answer for an outcome: this mapping is the whole integration with a web framework.
void print_http(const idem::Result<idem::Response>& r) {
    std::cout << "  outcome: " << idem::to_string(r.outcome()) << "\n  HTTP:    ";
    switch (r.outcome()) {
        case idem::Outcome::executed:  // the stored response, as produced
            std::cout << r.response().status << "  " << r.response().body << "\n";
            break;
        case idem::Outcome::replayed:  // the very same bytes, marked as a replay
            std::cout << r.response().status << "  " << r.response().body << "\n           Idempotent-Replayed: true\n";
            break;
        case idem::Outcome::in_progress:  // the first request is still running: come back later
            std::cout << "409 Conflict\n           Retry-After: " << (r.retry_after().count() + 999) / 1000
                      << "  (retry_after " << r.retry_after().count() << " ms)\n";
            break;
        case idem::Outcome::mismatch:  // the key was reused for a different request: a client bug
            std::cout << "422 Unprocessable Content (key reused with a different request)\n";
            break;
    }
}

}  // namespace

int main(int argc, char** argv) {
    const std::string conninfo = conninfo_from(argc, argv);
    if (conninfo.empty()) {
        std::cerr << "usage: quickstart CONNINFO\n"
                     "  or set IDEM_TEST_DATABASE_URL or DATABASE_URL, e.g.\n"
                     "  DATABASE_URL='host=/run/postgresql dbname=app' quickstart\n";
        return 2;
    }

    try {
        // One store per process, shared by every thread. Nothing connects until first use.
        idem::PostgresOptions options;
        options.table = "idem_quickstart";
        idem::PostgresStore store(conninfo, options);
        store.ensure_schema();  // creates the table if needed; safe to run at every start

        // The key: the client's Idempotency-Key header, within a scope (tenant + endpoint).
        // A fresh value per run, so the demo starts clean each time.
        const std::string run = std::to_string(std::chrono::system_clock::now().time_since_epoch().count());
        const idem::Key key("acct_42:POST /charges", "order-1001-" + run);

        // The fingerprint: what the request asked for. Same key + different fingerprint = mismatch.
        const auto request = idem::fingerprint("POST /charges", std::int64_t{25000}, "BRL");

        // The effect: the side effect that must happen once. It returns the response to store.
        int charges = 0;
        auto charge = [&] {
            ++charges;
            std::cout << "  >>> charging the card: R$ 250.00 (charge #" << charges << ")\n";
            return idem::Response{
                201, R"({"id":"ch_1001","amount":25000,"currency":"BRL"})", {{"Content-Type", "application/json"}}};
        };

        std::cout << "1. first request\n";
        const auto first = idem::execute_once(store, key, request, charge);
        print_http(first);

        std::cout << "2. the client retries (say its connection timed out)\n";
        const auto retry = idem::execute_once(store, key, request, charge);
        print_http(retry);
        const bool same_bytes = retry.response() == first.response();
        std::cout << "  identical response: " << (same_bytes ? "yes" : "NO") << "\n";

        std::cout << "3. the same key with a different amount\n";
        const auto other = idem::fingerprint("POST /charges", std::int64_t{99900}, "BRL");
        print_http(idem::execute_once(store, key, other, charge));

        std::cout << "4. a retry arrives while the first call is still running\n";
        const idem::Key slow_key("acct_42:POST /charges", "order-1002-" + run);
        std::promise<void> started;
        std::promise<void> finish;
        std::thread slow([&] {
            bool signalled = false;
            try {
                (void)idem::execute_once(store, slow_key, request, [&] {
                    started.set_value();
                    signalled = true;
                    finish.get_future().wait();  // a slow payment provider
                    return idem::Response{201, R"({"id":"ch_1002"})", {}};
                });
            } catch (const idem::error& e) {
                std::cerr << "slow request failed: " << e.what() << "\n";
                if (!signalled) started.set_value();
            }
        });
        started.get_future().wait();
        print_http(idem::execute_once(store, slow_key, request, charge));
        finish.set_value();
        slow.join();

        std::cout << "\nthe card was charged " << charges << " time(s) for order-1001\n";
        return charges == 1 && same_bytes ? 0 : 1;
    } catch (const idem::store_unavailable& e) {
        // Nothing was claimed and the effect did not run: answer 503 and let the client retry.
        std::cerr << "database unavailable (HTTP 503): " << e.what() << "\n";
        return 1;
    } catch (const idem::error& e) {
        std::cerr << "idem error: " << e.what() << "\n";
        return 1;
    }
}
