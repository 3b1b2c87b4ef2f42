// What every call of idem-bench --store redis | tiered shares: the scope, result, lease and retention
// it sends, the untimed calls before each phase, and the cases.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace bench::redis {

inline const std::string kScope = "bench";
inline const std::string kResult = "ok";
// What RedisStore sends with its default options (default_lease 30 s, default_retention 24 h).
inline constexpr std::int64_t kLeaseMs = 30'000;
inline constexpr std::int64_t kRetentionMs = 86'400'000;
inline constexpr std::int64_t kDayMs = 86'400'000;
inline constexpr int kWarmupCalls = 3;

enum class Case { fresh, replay, conflict };
/// Every case, in the order a run takes them unless --cases names others.
inline constexpr std::array kCases{Case::fresh, Case::replay, Case::conflict};
inline const char* case_name(Case c) { return c == Case::fresh ? "new" : c == Case::replay ? "replay" : "conflict"; }

}  // namespace bench::redis
