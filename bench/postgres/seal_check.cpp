// --seal-check (see seal_check.hpp). CPU time, not wall time: it is what sealing adds (the round
// trips are the same with and without it), and it does not move with the database's fsync latency.
#include "seal_check.hpp"

#include <time.h>

#include <cstdio>
#include <memory>
#include <stdexcept>
#include <vector>

#include "../common/util.hpp"
#include "cases.hpp"
#include "sides.hpp"

namespace bench {
namespace {

double thread_cpu_us() {
    timespec ts{};
    ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

struct Side {
    std::unique_ptr<idem::PostgresStore> store;
    double new_us = 0, replay_us = 0;
    std::uint64_t calls = 0;
};

}  // namespace

void seal_check(const Options& o, Admin& admin, Tables& tables, const std::string& prefix, std::uint64_t seed) {
    const std::string table = tables.add(prefix + "_seal");
    auto keyring = std::make_shared<idem::Keyring>();
    keyring->add(1, std::string(idem::Keyring::key_size, 'k'));
    Side sides[2];
    for (int sealed = 0; sealed < 2; ++sealed) {
        idem::PostgresOptions options;
        options.pool_size = 1;
        options.table = table;
        if (sealed == 1) options.sealing.keyring = keyring;
        sides[sealed].store = std::make_unique<idem::PostgresStore>(o.db, options);
        prewarm(*sides[sealed].store, 1);
    }
    (void)admin;
    const idem::Response response{
        201, std::string(static_cast<std::size_t>(o.seal_check), 'x'), {{"Content-Type", "application/json"}}};
    const idem::Fingerprint fp = idem::fingerprint("idem-bench seal", 1);
    constexpr int kCallsPerRound = 2000;
    Rng rng(seed);
    for (int round = 0; round < 2 * o.rounds; ++round) {
        Side& side = sides[(round % 4 == 0 || round % 4 == 3) ? 0 : 1];  // ABBA
        std::vector<idem::Key> keys;
        keys.reserve(kCallsPerRound);
        for (int i = 0; i < kCallsPerRound; ++i) keys.emplace_back(kScope, random_hex_key(rng));
        const auto effect = [&] { return response; };
        double t0 = thread_cpu_us();
        for (const auto& key : keys) {
            if (idem::execute_once(*side.store, key, fp, effect).outcome() != idem::Outcome::executed)
                throw std::runtime_error("seal check: a new call was not executed");
        }
        double t1 = thread_cpu_us();
        for (const auto& key : keys) {
            if (idem::execute_once(*side.store, key, fp, effect).outcome() != idem::Outcome::replayed)
                throw std::runtime_error("seal check: a replay was not replayed");
        }
        const double t2 = thread_cpu_us();
        side.new_us += t1 - t0;
        side.replay_us += t2 - t1;
        side.calls += kCallsPerRound;
    }
    // seal and open alone, on one encoded result
    const std::string encoded = idem::codec<idem::Response>::encode(response);
    const idem::Key key(kScope, "seal-check");
    constexpr int kReps = 20000;
    double t0 = thread_cpu_us();
    std::string sealed;
    const idem::SealBinding bound{1, "idem-bench"};  // what the stores bind a stored result to
    for (int i = 0; i < kReps; ++i) sealed = idem::seal(*keyring, key, encoded, bound);
    double t1 = thread_cpu_us();
    std::size_t opened = 0;
    for (int i = 0; i < kReps; ++i) opened += idem::open_sealed(*keyring, key, sealed, bound).size();
    const double t2 = thread_cpu_us();
    if (opened != encoded.size() * kReps) throw std::runtime_error("seal check: open_sealed lost bytes");

    std::printf("seal check (1 thread, %lld-byte bodies, %d x %d calls per side, alternating; client CPU per call):\n",
                static_cast<long long>(o.seal_check), o.rounds, kCallsPerRound);
    std::printf("  %-10s %12s %12s\n", "side", "new (µs)", "replay (µs)");
    for (int s = 0; s < 2; ++s) {
        const double n = static_cast<double>(sides[s].calls);
        std::printf("  %-10s %12.1f %12.1f\n", s == 0 ? "plain" : "sealed", sides[s].new_us / n,
                    sides[s].replay_us / n);
    }
    const double n0 = static_cast<double>(sides[0].calls), n1 = static_cast<double>(sides[1].calls);
    std::printf("  sealing adds %.1f µs per new call and %.1f µs per replay\n",
                sides[1].new_us / n1 - sides[0].new_us / n0, sides[1].replay_us / n1 - sides[0].replay_us / n0);
    std::printf("  seal() of the %zu-byte result: %.2f µs; open_sealed(): %.2f µs\n", encoded.size(), (t1 - t0) / kReps,
                (t2 - t1) / kReps);
    std::fflush(stdout);
}

}  // namespace bench
