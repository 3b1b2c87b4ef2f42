// Downstream consumer of an installed idem with the redis component: find_package(idem COMPONENTS
// redis) and idem::redis. No server here: an unreachable Redis must come back as store_unavailable
// without running the effect, and a Redis replay tier that cannot be reached must be a miss.
#include <idem/idem.hpp>
#include <idem/redis.hpp>

#include <cstdio>
#include <memory>

int main() {
    idem::RedisOptions options;
    options.unix_socket = "/nonexistent/idem-consumer-redis.sock";
    idem::RedisStore store(options);
    bool ran = false;
    try {
        (void)idem::execute_once(store, idem::Key{"scope", "value"}, idem::fingerprint("a"), [&] {
            ran = true;
            return idem::Response{201, "ok"};
        });
        return 1;
    } catch (const idem::store_unavailable&) {
        if (ran) return 1;
    }
    idem::RedisReplayCacheOptions cache_options;
    cache_options.connection.unix_socket = options.unix_socket;
    idem::RedisReplayCache cache(cache_options);
    if (cache.find(idem::Key{"scope", "value"}) != nullptr || cache.stats().errors != 1) return 1;
    std::puts("idem redis consumer: ok");
    return 0;
}
