// AsyncPostgresStore's pool figures (internal), for pool_stats(): written on the store's strand —
// by the store (acquires, their waits, the requests group commit queues) and by each connection
// (whether it is open, and idle) — and read with relaxed loads from any thread. Shared with the
// connections, which may outlive the store (its destructor posts their close to the strand).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "../pool_waits.hpp"

namespace idem::asio::detail {

class PoolGauges {
public:
    /// One connection's share of the gauges.
    struct Part {
        bool open = false;  ///< being opened, or open and not broken
        bool idle = false;  ///< open, with no request in flight
    };

    /// Moves a connection's share from `was` to `now`: one atomic addition, none if they are equal.
    void move(Part was, Part now) noexcept {
        // Differences modulo 2^64: neither field ever drops below zero, so none borrows from the other.
        const auto delta = [](bool from, bool to) { return std::uint64_t{to} - std::uint64_t{from}; };
        const std::uint64_t d = delta(was.open, now.open) * kOpen + delta(was.idle, now.idle) * kIdle;
        if (d != 0) connections_.fetch_add(d, std::memory_order_relaxed);
    }

    /// (open, idle) now, from one load: idle <= open.
    [[nodiscard]] std::pair<std::size_t, std::size_t> open_idle() const noexcept {
        const std::uint64_t word = connections_.load(std::memory_order_relaxed);
        return {static_cast<std::size_t>(word & (kIdle - 1)), static_cast<std::size_t>(word / kIdle)};
    }

    std::atomic<std::uint64_t> acquires{0};       ///< acquire() calls
    std::atomic<std::size_t> opening_waiters{0};  ///< acquires waiting now for a connection being opened
    std::atomic<std::size_t> queued{0};           ///< first attempts group commit queues now
    idem::detail::PoolWaits waits;                ///< acquires that waited, by total wait

private:
    // Open connections in the low 32 bits, idle ones in the high 32: one word, read at one instant.
    static constexpr std::uint64_t kOpen = 1;
    static constexpr std::uint64_t kIdle = std::uint64_t{1} << 32;
    std::atomic<std::uint64_t> connections_{0};
};

}  // namespace idem::asio::detail
