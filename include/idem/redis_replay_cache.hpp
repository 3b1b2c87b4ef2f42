// idem/redis_replay_cache.hpp — the former path of idem/redis/replay_cache.hpp, kept so that existing includes compile.
// New code includes idem/redis.hpp (the component's umbrella header) or idem/redis/replay_cache.hpp.
#pragma once

#include "idem/redis/replay_cache.hpp"
