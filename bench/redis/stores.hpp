// The two runs of idem-bench --store redis | tiered (bench/redis/redis_main.cpp describes them), and the
// checks of --expect-round-trips on their figures.
#pragma once

#include <idem/idem.hpp>

#include <cstdint>
#include <vector>

#include "options.hpp"
#include "phase.hpp"

namespace bench::redis {

/// --store redis: RedisStore vs the raw-hiredis floor, every thread count and case.
std::vector<Run> run_redis(const Options& o, const idem::Fingerprint& fp, std::uint64_t seed);
/// --expect-round-trips for --store redis: false (with a FAIL line on stderr) unless every call had
/// the expected outcome and round trips per call are new 2, replay 1, conflict 1.
bool check_redis(const std::vector<Run>& runs);

/// --store tiered: replays through PostgresStore alone and through the Redis tier(s) in front of it.
std::vector<Run> run_tiered(const Options& o, const idem::Fingerprint& fp, std::uint64_t seed);
/// --expect-round-trips for --store tiered: false (with a FAIL line on stderr) unless every call had
/// the expected outcome, PostgresStore's replays 1 round trip each and the tiers' none to the primary.
bool check_tiered(const std::vector<Run>& runs);

}  // namespace bench::redis
