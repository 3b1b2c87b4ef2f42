// Raw hiredis: one blocking connection (Raw), the names RedisStore gives a key's records, and the
// housekeeping the benchmark does by hand (preloading records, deleting its keys).
#pragma once

#include <hiredis/hiredis.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

#include "cases.hpp"
#include "options.hpp"

namespace bench::redis {

using Reply = std::unique_ptr<redisReply, decltype(&freeReplyObject)>;

/// One blocking hiredis connection: what the floor and the housekeeping use.
class Raw {
public:
    explicit Raw(const Options& o);
    ~Raw() { redisFree(c_); }
    Raw(const Raw&) = delete;
    Raw& operator=(const Raw&) = delete;

    void append(std::initializer_list<std::string_view> args) { append(args.begin(), args.size()); }
    void append(const std::string_view* args, std::size_t n);
    Reply get();
    Reply command(std::initializer_list<std::string_view> args) {
        append(args);
        return get();
    }

private:
    [[noreturn]] void fail() { throw std::runtime_error(std::string("Redis connection: ") + c_->errstr); }
    redisContext* c_ = nullptr;
};

inline std::string_view text(const redisReply& r) {
    return r.str ? std::string_view(r.str, r.len) : std::string_view();
}

/// A key's names as RedisStore writes them under `prefix` (idem/redis/store.hpp, key_prefix).
struct Names {
    std::string prefix;
    std::string record(const std::string& member) const { return prefix + "r:" + member; }
    std::string index() const { return prefix + "in_progress"; }
};
inline std::string member_of(std::string_view key) {
    return std::to_string(kScope.size()) + ":" + kScope + std::string(key);
}

/// The server's clock (TIME), in milliseconds.
std::int64_t redis_now_ms(Raw& raw);

/// Writes `count` records as RedisStore's scripts write them: completed (expiring in a day) or
/// in progress (lease of a day, in the index), keys base + i.
void preload(Raw& raw, const Names& names, bool completed, std::int64_t base, std::int64_t count,
             std::string_view fp_alg, std::string_view fp);

/// Deletes every key under `prefix` (SCAN + UNLINK).
void drop_prefix(Raw& raw, const std::string& prefix);

}  // namespace bench::redis
