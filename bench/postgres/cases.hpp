// What every idem-bench call over PostgreSQL shares: the scope, result, lease and retention it
// sends, the untimed calls before each phase, and the names of the cases and of the sides
// (bench/postgres/main.cpp describes them).
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace bench {

inline const std::string kScope = "bench";
inline const std::string kResult = "ok";
// What PostgresStore sends with its default options (default_lease 30 s, default_retention 24 h).
inline constexpr std::int64_t kLeaseMs = 30'000;
inline constexpr std::int64_t kRetentionS = 86'400;
inline constexpr int kWarmupCalls = 3;

enum class Case { fresh, replay, conflict, replay_cached };
/// Every case, in the order the matrix runs them unless --cases names others.
inline constexpr std::array kCases{Case::fresh, Case::replay, Case::conflict, Case::replay_cached};

inline const char* case_name(Case c) {
    switch (c) {
        case Case::fresh: return "new";
        case Case::replay: return "replay";
        case Case::conflict: return "conflict";
        case Case::replay_cached: return "replay-cached";
    }
    return "?";
}

/// Round trips per call of one transaction per call (floor, idem); replay-cached: the floor's.
inline std::uint64_t expected_round_trips(Case c) { return c == Case::fresh ? 2 : 1; }

/// The sides of a case (see the top of bench/postgres/main.cpp), in the order of a round's first half.
/// async: idem::asio with N requests in flight (bench/postgres/async_side.hpp), only in the async points.
enum class SideKind { floor, ideal, ideal_threads, idem, idem_gc, async };

inline const char* side_name(SideKind k) {
    switch (k) {
        case SideKind::floor: return "floor";
        case SideKind::ideal: return "ideal";
        case SideKind::ideal_threads: return "ideal_threads";
        case SideKind::idem: return "idem";
        case SideKind::idem_gc: return "idem_gc";
        case SideKind::async: return "async";
    }
    return "?";
}

}  // namespace bench
