// idem/redis_store.hpp — the former path of idem/redis/store.hpp, kept so that existing includes compile.
// New code includes idem/redis.hpp (the component's umbrella header) or idem/redis/store.hpp.
#pragma once

#include "idem/redis/store.hpp"
