// idem/redis.hpp — the idem::redis component: idempotency keys and replay tiers in Redis.
//
// find_package(idem COMPONENTS redis) and link idem::redis. RedisStore (redis/store.hpp) is the
// store contract over Redis 7, one Lua script per step; RedisReplayCache (redis/replay_cache.hpp)
// keeps completed records in Redis as a replay tier in front of a primary store. hiredis is an
// implementation detail: no header of the component includes it. docs/design.md, "Redis".
#pragma once

#include "idem/redis/replay_cache.hpp"
#include "idem/redis/store.hpp"
