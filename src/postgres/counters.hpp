// The counters behind StoreStats, shared by PostgresStore and idem::asio (internal).
//
// Every call bumps one or two of them. PostgresStore keeps a set per thread shard (one shared cache
// line would bounce between the cores on each call) and adds the shards up in stats(); idem::asio
// keeps one set on its strand. Relaxed atomics: a count is a statistic, never a synchronisation.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "idem/group_commit_stats.hpp"
#include "idem/store.hpp"

namespace idem::pg {

struct alignas(64) Counters {
    std::atomic<std::uint64_t> round_trips{0}, claims{0}, claims_won{0}, saves{0}, releases{0}, reads{0}, retries{0},
        opened{0}, discarded{0}, claim_groups{0}, grouped_claims{0}, save_groups{0}, grouped_saves{0};

    /// Adds these counts to `s` (unsigned arithmetic: a shard's decrement of another shard's
    /// increment still sums exactly).
    void add_to(StoreStats& s) const noexcept {
        const auto get = [](const std::atomic<std::uint64_t>& c) { return c.load(std::memory_order_relaxed); };
        s.round_trips += get(round_trips);
        s.claims += get(claims);
        s.claims_won += get(claims_won);
        s.saves += get(saves);
        s.releases += get(releases);
        s.reads += get(reads);
        s.retries += get(retries);
        s.connections_opened += get(opened);
        s.connections_discarded += get(discarded);
    }
    void add_to(GroupCommitStats& g) const noexcept {
        g.claim_groups += claim_groups.load(std::memory_order_relaxed);
        g.grouped_claims += grouped_claims.load(std::memory_order_relaxed);
        g.save_groups += save_groups.load(std::memory_order_relaxed);
        g.grouped_saves += grouped_saves.load(std::memory_order_relaxed);
    }
};

inline void bump(std::atomic<std::uint64_t>& counter) noexcept { counter.fetch_add(1, std::memory_order_relaxed); }

/// The largest commit groups seen, per kind.
struct LargestGroups {
    std::atomic<std::uint64_t> claims{0}, saves{0};

    void add_to(GroupCommitStats& s) const noexcept {
        const std::uint64_t c = claims.load(std::memory_order_relaxed), v = saves.load(std::memory_order_relaxed);
        if (c > s.largest_claim_group) s.largest_claim_group = c;
        if (v > s.largest_save_group) s.largest_save_group = v;
    }
};

/// A commit group of `n` members was sent: counted in `groups` and `members`, `largest` raised to n.
inline void note_group(std::atomic<std::uint64_t>& groups, std::atomic<std::uint64_t>& members,
                       std::atomic<std::uint64_t>& largest, std::size_t n) noexcept {
    groups.fetch_add(1, std::memory_order_relaxed);
    members.fetch_add(n, std::memory_order_relaxed);
    for (auto seen = largest.load(std::memory_order_relaxed);
         n > seen && !largest.compare_exchange_weak(seen, n, std::memory_order_relaxed);) {
    }
}

}  // namespace idem::pg
