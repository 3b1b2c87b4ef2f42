// Raw hiredis (see raw.hpp).
#include "raw.hpp"

#include <algorithm>

#include "../common/util.hpp"

namespace bench::redis {

Raw::Raw(const Options& o) {
    c_ = o.socket.empty() ? redisConnect(o.host.c_str(), o.port) : redisConnectUnix(o.socket.c_str());
    if (c_ == nullptr || c_->err != 0) {
        const std::string why = c_ ? c_->errstr : "out of memory";
        if (c_) redisFree(c_);
        throw std::runtime_error("cannot connect to Redis: " + why);
    }
}

void Raw::append(const std::string_view* args, std::size_t n) {
    constexpr std::size_t kMax = 32;
    if (n > kMax) throw std::logic_error("Raw::append: too many arguments");
    const char* argv[kMax];
    std::size_t lens[kMax];
    for (std::size_t i = 0; i < n; ++i) {
        argv[i] = args[i].data();
        lens[i] = args[i].size();
    }
    if (redisAppendCommandArgv(c_, static_cast<int>(n), argv, lens) != REDIS_OK) fail();
}

Reply Raw::get() {
    void* raw = nullptr;
    if (redisGetReply(c_, &raw) != REDIS_OK || raw == nullptr) fail();
    Reply r(static_cast<redisReply*>(raw), &freeReplyObject);
    if (r->type == REDIS_REPLY_ERROR) throw std::runtime_error(std::string("Redis: ") + r->str);
    return r;
}

std::int64_t redis_now_ms(Raw& raw) {
    const Reply t = raw.command({"TIME"});
    return std::stoll(std::string(text(*t->element[0]))) * 1000 + std::stoll(std::string(text(*t->element[1]))) / 1000;
}

void preload(Raw& raw, const Names& names, bool completed, std::int64_t base, std::int64_t count,
             std::string_view fp_alg, std::string_view fp) {
    const std::int64_t now = redis_now_ms(raw);
    const std::string c = std::to_string(now), l = std::to_string(completed ? now : now + kDayMs),
                      e = std::to_string(now + kDayMs + (completed ? 0 : kRetentionMs));
    const std::string index = names.index();
    Rng rng(static_cast<std::uint64_t>(base) ^ 0x5EEDull);
    constexpr std::int64_t kChunk = 1000;
    for (std::int64_t from = 0; from < count; from += kChunk) {
        const std::int64_t to = std::min(count, from + kChunk);
        for (std::int64_t i = from; i < to; ++i) {
            const std::string member = member_of(preloaded_key(base, static_cast<std::uint64_t>(i)));
            const std::string record = names.record(member);
            const std::string fence = std::to_string(random_fence(rng));
            if (completed) {
                raw.append({"HSET", record, "s", "c",     "fa", fp_alg, "fp", fp, "f", fence,
                            "a",    "1",    "r", kResult, "c",  c,      "l",  l,  "e", e});
                raw.append({"PEXPIREAT", record, e});
            } else {
                raw.append(
                    {"HSET", record, "s", "p", "fa", fp_alg, "fp", fp, "f", fence, "a", "1", "c", c, "l", l, "e", e});
                raw.append({"ZADD", index, l, member});
            }
        }
        for (std::int64_t i = from; i < to; ++i) {
            (void)raw.get();
            (void)raw.get();
        }
    }
}

void drop_prefix(Raw& raw, const std::string& prefix) {
    std::string cursor = "0";
    const std::string pattern = prefix + "*";
    do {
        const Reply r = raw.command({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
        cursor = std::string(text(*r->element[0]));
        const redisReply& keys = *r->element[1];
        for (std::size_t i = 0; i < keys.elements; ++i) raw.append({"UNLINK", text(*keys.element[i])});
        for (std::size_t i = 0; i < keys.elements; ++i) (void)raw.get();
    } while (cursor != "0");
}

}  // namespace bench::redis
