// A bounded, thread-safe pool of Connections (internal).
//
// At most `size` connections exist (≥ 1: PostgresStore refuses pool_size 0); they are opened
// lazily. acquire() hands out an idle one — preferably the one this thread gave back last — opens
// a new one while under the bound, or waits up to `wait` for one to come back (then pool_timeout).
// A connection idle longer than `health_check_after` is pinged first. A Lease returns its
// connection on destruction, unless it broke: broken ones are closed.
//
// Thread affinity, without a lock on the common path: each thread has a parking slot (its
// thread_index() modulo `size`). give_back() parks the connection there with one atomic exchange,
// and this thread's next acquire() takes it back the same way. A connection that moves between
// threads brings its libpq buffers and socket state to another core's cache each time, and a
// mutex's cache line would bounce between the cores twice per call (docs/benchmarks.md has the
// cost). When the slot is taken (threads > size share slots) the connection goes to the shared
// idle list under the mutex. Parked connections
// are idle connections, never reserved: a caller whose slot is empty takes one from the idle list,
// else another thread's parked one, and opens a new one (or waits) only when none is idle — so the
// pool grows with concurrency, not with the number of threads that ever used it.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "../pool_waits.hpp"
#include "connection.hpp"
#include "idem/pool_stats.hpp"

namespace idem::pg {

class Pool;

class Lease {
public:
    Lease(Pool* pool, std::unique_ptr<Connection> conn) noexcept : pool_(pool), conn_(std::move(conn)) {}
    Lease(Lease&& other) noexcept = default;
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();

    Connection& operator*() const noexcept { return *conn_; }
    Connection* operator->() const noexcept { return conn_.get(); }

private:
    Pool* pool_;
    std::unique_ptr<Connection> conn_;
};

class Pool {
public:
    using Factory = std::function<std::unique_ptr<Connection>()>;
    using Ping = std::function<bool(Connection&)>;
    using Event = std::function<void(bool opened)>;  // opened or discarded, for statistics

    Pool(std::size_t size, std::chrono::milliseconds wait, std::chrono::milliseconds health_check_after,
         Factory factory, Ping ping, Event event);
    ~Pool();

    /// Waits until `deadline` (default: pool_wait from now) for a connection. Throws pool_timeout;
    /// store_unavailable or config_error when a new connection cannot be opened.
    Lease acquire(std::optional<Clock::time_point> deadline = std::nullopt);
    /// A connection without waiting for one: an idle one, or a new one while under the bound;
    /// nullopt when every connection is leased, or when a caller is already blocked waiting for
    /// one (a caller that may wait is not overtaken). A nullopt is not counted as an acquire.
    /// Throws store_unavailable or config_error when a new connection cannot be opened.
    std::optional<Lease> try_acquire();

    /// In a fork()ed child, before the pool is leaked: abandons (Connection::abandon_in_child) every
    /// parked connection, and the idle ones if the mutex can be had at once (a thread that held it
    /// at the fork does not exist here: then they are leaked untouched). Connections leased by the
    /// parent's threads are out of reach: their sockets stay open in the child until it exits, and
    /// nothing is sent on them.
    void abandon_in_child() noexcept;

    /// A connection just broke: the server may have restarted, so every idle connection last used
    /// before now is pinged before its next use (a retry then lands on a live or fresh connection).
    void suspect_idle() noexcept;

    /// Whether a caller is waiting for a connection now (group commit then gives its connection
    /// back instead of keeping it for the next group).
    [[nodiscard]] bool has_waiters() const noexcept { return waiters_.load(std::memory_order_relaxed) != 0; }

    /// Gauges now (under the mutex) and counters so far (PostgresStore::pool_stats). Acquires are
    /// counted in the caller's parking slot (a line the common path writes anyway: no shared
    /// counter); waits, their times and timeouts only on the path that blocks.
    [[nodiscard]] PoolStats stats() const;

private:
    friend class Lease;
    std::optional<Lease> take(bool wait, std::optional<Clock::time_point> deadline);
    void give_back(std::unique_ptr<Connection> conn) noexcept;
    void record_wait(Clock::duration waited) noexcept;  // one acquire that waited, in total
    struct alignas(64) Slot {                           // one cache line each: no false sharing between threads' slots
        std::atomic<Connection*> conn{nullptr};
        std::atomic<std::uint64_t> acquires{0};  // acquire() calls of the threads of this slot
    };
    Slot& own_slot() noexcept;
    std::unique_ptr<Connection> take_parked() noexcept;  // any thread's parked connection

    const std::size_t size_;
    const std::uint64_t generation_;  // the process that owns the connections (detail::fork_generation)
    const std::chrono::milliseconds wait_;
    const std::chrono::milliseconds health_check_after_;
    Factory factory_;
    Ping ping_;
    Event event_;

    mutable std::mutex mutex_;
    std::condition_variable returned_;
    struct Idle {
        std::thread::id last_thread;  // who gave it back
        std::unique_ptr<Connection> conn;
    };
    std::vector<Idle> idle_;
    std::size_t open_ = 0;  // parked + idle + leased + being opened
    // Parking slots (owning; `size` of them), and how many callers wait on `returned_`: give_back
    // parks without the mutex, so it must see a waiter and wake it (see give_back).
    std::unique_ptr<Slot[]> parked_;
    std::atomic<std::size_t> waiters_{0};
    std::size_t blocked_ = 0;                  // callers blocked on returned_ now (under the mutex; the waiters gauge)
    std::atomic<std::size_t> blocked_now_{0};  // blocked_, read without the mutex (try_acquire)
    detail::PoolWaits waits_;                  // acquires that waited, by total wait
    std::atomic<std::uint64_t> timeouts_{0};
    // Idle connections last used before this get pinged (Clock::rep: read without the mutex).
    std::atomic<Clock::rep> suspect_before_{Clock::time_point::min().time_since_epoch().count()};
};

}  // namespace idem::pg
