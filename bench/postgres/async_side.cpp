// The async side (see async_side.hpp).
#include "async_side.hpp"

#include <idem/asio.hpp>
#include <idem/postgres_store.hpp>

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "../common/util.hpp"
#include "options.hpp"

namespace bench {
namespace {

namespace net = boost::asio;

// What the coroutines of one phase share (all on the one event loop thread: no locking).
struct Flight {
    Flight(idem::asio::AsyncPostgresStore& s, const idem::Fingerprint& f, Case k, std::int64_t n)
        : store(s), fp(f), kind(k), preloaded(n) {}

    idem::asio::AsyncPostgresStore& store;
    const idem::Fingerprint& fp;
    Case kind;
    std::int64_t preloaded;
    bool timed = false;
    bool stop = false;
    int active = 0;
    net::steady_timer* deadline = nullptr;  // cancelled when the last coroutine ends early
    std::uint64_t calls = 0, unexpected = 0;
    Histogram hist;
    std::string error;
};

// One call as LibraryOp makes it (sides.cpp): the same keys, effect and expected outcomes.
net::awaitable<bool> one_call(Flight& f, Rng& rng) {
    const auto effect = [] { return kResult; };  // the no-op effect
    switch (f.kind) {
        case Case::fresh: {
            idem::Key key(kScope, random_hex_key(rng));
            const auto r =
                co_await idem::asio::async_execute_once(f.store, std::move(key), f.fp, effect, net::use_awaitable);
            co_return r.outcome() == idem::Outcome::executed;
        }
        case Case::replay:
        case Case::replay_cached: {
            idem::Key key(kScope, preloaded_key(kReplayBase, rng.below(static_cast<std::uint64_t>(f.preloaded))));
            const auto r =
                co_await idem::asio::async_execute_once(f.store, std::move(key), f.fp, effect, net::use_awaitable);
            co_return r.outcome() == idem::Outcome::replayed&& r.response() == kResult;
        }
        case Case::conflict: {
            idem::Key key(kScope, preloaded_key(kConflictBase, rng.below(static_cast<std::uint64_t>(f.preloaded))));
            const auto r =
                co_await idem::asio::async_execute_once(f.store, std::move(key), f.fp, effect, net::use_awaitable);
            co_return r.outcome() == idem::Outcome::in_progress;
        }
    }
    co_return false;
}

// One request slot: calls again as soon as its call completed, until the phase stops (timed) or
// after kWarmupCalls calls (warm-up). The Rng is the slot's own stream, as a thread's in run_phase.
net::awaitable<void> slot(Flight& f, Rng rng) {
    try {
        for (int i = 0; f.timed ? !f.stop : i < kWarmupCalls; ++i) {
            const auto t0 = Clock::now();
            const bool good = co_await one_call(f, rng);
            if (f.timed) {
                f.hist.record(static_cast<std::uint64_t>(std::chrono::nanoseconds(Clock::now() - t0).count()));
                ++f.calls;
                if (!good) ++f.unexpected;
            }
        }
    } catch (const std::exception& e) {
        if (f.error.empty()) f.error = e.what();
        f.stop = true;
    }
    if (--f.active == 0 && f.deadline != nullptr) f.deadline->cancel();
}

}  // namespace

struct AsyncSide::Impl {
    net::io_context io{1};
    idem::asio::AsyncPostgresStore store;

    Impl(const std::string& conninfo, const idem::PostgresOptions& options)
        : store(io.get_executor(), conninfo, options) {}

    // Starts `n` slots and runs the loop until every one has ended (an idle store keeps no work).
    void run(Flight& f, int n, std::uint64_t seed) {
        f.active = n;
        for (int i = 0; i < n; ++i) {
            net::co_spawn(io, slot(f, Rng::stream(seed, static_cast<std::uint64_t>(i))), net::detached);
        }
        io.run();
        io.restart();
    }
};

AsyncSide::AsyncSide(const std::string& conninfo, const std::string& table, int pool, bool fingerprint_secret) {
    idem::PostgresOptions options;
    if (fingerprint_secret) options.fingerprint_secret = idem::FingerprintSecret(kBenchFingerprintSecret);
    options.table = table;
    options.pool_size = static_cast<std::size_t>(pool);
    options.application_name = "idem-bench-async";
    impl_ = std::make_unique<Impl>(conninfo, options);
}

AsyncSide::~AsyncSide() = default;

PhaseResult AsyncSide::phase(Admin& admin, Case kind, int in_flight, double seconds, std::uint64_t seed,
                             const idem::Fingerprint& fp, std::int64_t preloaded) {
    Flight warm{impl_->store, fp, kind, preloaded};
    impl_->run(warm, in_flight, seed ^ 0x5741524D5550ull);  // untimed: opens the connections too
    if (!warm.error.empty()) throw std::runtime_error(warm.error);

    Flight f{impl_->store, fp, kind, preloaded};
    f.timed = true;
    net::steady_timer deadline(impl_->io);
    f.deadline = &deadline;

    PhaseResult r;
    const Counters before = library_counters(impl_->store);
    r.lsn_from = admin.wal_lsn();
    const double cpu_start = process_cpu_seconds();
    const auto start = Clock::now();
    deadline.expires_at(start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds)));
    deadline.async_wait([&f](const boost::system::error_code&) { f.stop = true; });
    impl_->run(f, in_flight, seed);
    const auto end = Clock::now();
    r.cpu_seconds = process_cpu_seconds() - cpu_start;
    if (!f.error.empty()) throw std::runtime_error(f.error);
    const Counters after = library_counters(impl_->store);
    r.lsn_to = admin.wal_lsn();

    r.seconds = seconds_between(start, end);
    r.calls = f.calls;
    r.unexpected = f.unexpected;
    r.hist.merge(f.hist);
    r.delta = counters_delta(after, before);
    return r;
}

}  // namespace bench
