// The calls of each side of a case (bench/postgres/main.cpp describes the sides): an op is called as
// op(thread, rng) by run_phase and answers whether the call had the outcome its case expects.
//   LibraryOp: execute_once through the store(s) (idem, idem_gc); FloorOp: the same statements over
//   raw libpq (floor); IdealOp: a whole round of calls in one batch statement (ideal);
//   IdealThreadsOp: the same rounds, gathered from one call per thread (ideal_threads).
#pragma once

#include <idem/idem.hpp>
#include <idem/postgres_store.hpp>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../common/util.hpp"
#include "cases.hpp"
#include "floor.hpp"
#include "phase.hpp"

namespace bench {

// Opens the whole pool before anything is timed (the pool opens connections lazily).
void prewarm(idem::PostgresStore& store, int threads);

struct LibraryOp {
    std::vector<idem::IdempotencyStore*> stores;  // one shared store, or one per thread (diagnostic)
    const idem::Fingerprint& fp;
    Case kind;
    std::int64_t preloaded;

    bool operator()(int thread, Rng& rng) const;
};

struct FloorOp {
    std::vector<std::unique_ptr<FloorClient>>& clients;
    std::string_view fp;
    Case kind;
    std::int64_t preloaded;

    bool operator()(int thread, Rng& rng) const;
};

// One round of `group` calls through the ideal-grouping client (run on one thread; run_matrix
// multiplies the calls by `group`).
struct IdealOp {
    IdealClient* client;  // null when --no-ideal (then never called)
    std::string_view fp;
    Case kind;
    std::int64_t preloaded;
    std::size_t group;
    std::vector<std::string>& keys;
    std::vector<std::int64_t>& fences;

    bool operator()(int, Rng& rng) const;
};

// The ideal rounds made by `threads` blocking callers, one call each (the "ideal_threads" side):
// each caller puts its key into the round and waits; the last to arrive sends the round's statement
// on the one connection and wakes the rest. A caller that stops (the phase is over) leaves, and the
// rounds go on without it, so nobody waits for a caller that will not come.
class IdealGather {
public:
    IdealGather(IdealClient* client, std::size_t callers) : client_(client), callers_(callers) {}

    /// Adds (key, fence) to the current round of `phase` (0 claim, 1 save) and returns once it was
    /// sent: true when the round had the outcome `kind` expects for every call.
    bool arrive(int phase, Case kind, std::string key, std::int64_t fence, std::string_view fp);

    /// This caller makes no more calls (also after an error).
    void leave() noexcept;

private:
    // Sends the round (the caller holds the lock) and wakes its callers; a failure reaches each of them.
    void send(std::unique_lock<std::mutex>&) noexcept;

    IdealClient* client_;
    std::mutex mutex_;
    std::condition_variable cv_;
    std::size_t callers_;
    std::vector<std::pair<std::string, std::int64_t>> round_;
    std::vector<std::string> keys_;
    std::vector<std::int64_t> fences_;
    std::uint64_t generation_ = 0;
    int phase_ = 0;
    Case kind_ = Case::fresh;
    std::string_view fp_;
    bool good_ = false;
    std::string error_;
};

struct IdealThreadsOp {
    IdealGather& gather;
    std::string_view fp;
    Case kind;
    std::int64_t preloaded;

    bool operator()(int, Rng& rng) const;
    void leave(int) const noexcept { gather.leave(); }
};

}  // namespace bench
