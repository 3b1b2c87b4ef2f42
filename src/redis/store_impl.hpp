// RedisStore's state and its driver (internal): the connections, the retry loop, the scripts'
// calls and answers. Shared by redis_store.cpp (the single-key calls) and batch.cpp.
#pragma once

#include "idem/redis/store.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "connection.hpp"
#include "idem/errors.hpp"
#include "poll_schedule.hpp"
#include "process.hpp"
#include "record.hpp"
#include "resend_rules.hpp"
#include "retry_policy.hpp"
#include "scripts.hpp"
#include "sealed_results.hpp"
#include "store_rules.hpp"

namespace idem {

using redis::Connection;
using redis::Reply;
using redis::ReplyType;
using SysClock = std::chrono::system_clock;

using redis::decode_record;
using redis::from_ms;
using redis::member_of;
using redis::parse_int;

namespace redis_store {

constexpr int kAttempts = 2;  // a call whose connection broke is sent once more on a fresh one

// "key:value" lines of an INFO section.
inline std::string_view info_field(std::string_view info, std::string_view name) {
    std::size_t pos = 0;
    while (pos < info.size()) {
        std::size_t end = info.find('\n', pos);
        if (end == std::string_view::npos) end = info.size();
        std::string_view line = info.substr(pos, end - pos);
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        if (line.size() > name.size() && line.substr(0, name.size()) == name && line[name.size()] == ':') {
            return line.substr(name.size() + 1);
        }
        pos = end + 1;
    }
    return {};
}

}  // namespace redis_store

using redis_store::info_field;
using redis_store::kAttempts;

struct RedisStore::Impl {
    RedisOptions options;
    std::string where;
    std::string record_prefix;  // <prefix>r:
    std::string index_key;      // <prefix>in_progress
    std::uint64_t generation = detail::fork_generation();
    redis::Pool pool;

    struct Counters {
        std::atomic<std::uint64_t> round_trips{0}, claims{0}, claims_won{0}, saves{0}, releases{0}, reads{0},
            retries{0};
    } counters;

    mutable std::mutex warnings_mutex;
    std::vector<std::string> warnings;

    explicit Impl(RedisOptions o)
        : options(std::move(o)),
          where(redis::location(options)),
          record_prefix(options.key_prefix + "r:"),
          index_key(options.key_prefix + "in_progress"),
          pool(options.pool_size, options.pool_wait, [this] { return open(); }) {}

    std::string record_key(const Key& key) const { return record_prefix + member_of(key); }
    /// A key's member of the index and the Redis key of its record, computed once.
    struct Names {
        std::string member;
        std::string record;
    };
    Names names(const Key& key) const {
        Names n{member_of(key), record_prefix};
        n.record += n.member;
        return n;
    }

    // A refusal of a command sent at connect: a passing state of the server's (LOADING after a
    // restart, BUSY, MASTERDOWN...) is store_unavailable, as for any command, so a save keeps
    // trying within save_retry_window; any other refusal stays until the server or the options
    // change: config_error, saying `what` was refused.
    [[noreturn]] void refused_at_connect(std::string_view message, const std::string& what) const {
        if (redis::passing_refusal(message)) redis::throw_error_reply(message, "connect", where);
        throw config_error(what);
    }

    // A new connection: the persistence check, the scripts loaded, in one round trip.
    std::unique_ptr<Connection> open() {
        auto conn = std::make_unique<Connection>(options);
        const bool check = options.durability != RedisDurability::unchecked;
        if (check) {
            conn->append({"CONFIG", "GET", "appendonly"});
            conn->append({"CONFIG", "GET", "appendfsync"});
            conn->append({"CONFIG", "GET", "maxmemory-policy"});
            conn->append({"CONFIG", "GET", "no-appendfsync-on-rewrite"});
        }
        conn->append({"INFO", "replication"});
        for (std::string_view script : redis::kScripts) conn->append({"SCRIPT", "LOAD", script});
        std::string appendonly, appendfsync, eviction, no_fsync_on_rewrite;
        if (check) {
            for (std::string* out : {&appendonly, &appendfsync, &eviction, &no_fsync_on_rewrite}) {
                Reply reply = conn->read("connect");
                if (redis::type_of(*reply) == ReplyType::error) {
                    refused_at_connect(
                        redis::text_of(*reply),
                        fmt::format("idem: connect: Redis at {} refused CONFIG GET ({}); RedisStore checks the "
                                    "server's persistence (RedisOptions::durability) — allow CONFIG for this user, or "
                                    "set durability = RedisDurability::unchecked if the persistence is known another "
                                    "way",
                                    where, redis::text_of(*reply)));
                }
                if (redis::size_of(*reply) == 2) *out = std::string(redis::text_of(redis::element(*reply, 1)));
            }
        }
        Reply replication = conn->read("connect");
        std::string replication_info;
        if (redis::type_of(*replication) == ReplyType::string) replication_info = redis::text_of(*replication);
        // Without INFO a replica would go unseen (durability = unchecked vouches for the server's
        // persistence, not for its role): refused whatever the durability.
        if (redis::type_of(*replication) == ReplyType::error) {
            refused_at_connect(
                redis::text_of(*replication),
                fmt::format(
                    "idem: connect: Redis at {} refused INFO replication ({}); RedisStore checks that the server "
                    "is a primary, whatever RedisOptions::durability says — allow INFO for this user (ACL: "
                    "+info)",
                    where, redis::text_of(*replication)));
        }
        conn->script_shas.clear();
        for (std::size_t i = 0; i < redis::kScripts.size(); ++i) {
            Reply reply = conn->read("connect");
            if (redis::type_of(*reply) != ReplyType::string) {
                if (redis::type_of(*reply) == ReplyType::error) {
                    refused_at_connect(redis::text_of(*reply),
                                       fmt::format("idem: connect: Redis at {} refused to load idem's scripts: {}",
                                                   where, redis::text_of(*reply)));
                }
                throw store_unavailable(fmt::format("idem: connect: unexpected answer to SCRIPT LOAD from {}", where));
            }
            conn->script_shas.emplace_back(redis::text_of(*reply));
        }
        refuse_replica(replication_info);
        check_grants(*conn);
        if (check) {
            check_persistence(appendonly, appendfsync, no_fsync_on_rewrite);
            check_eviction(eviction);
        }
        note_replication(replication_info);
        return conn;
    }

    // Every command the store runs, as its ACL user: a grant missing is config_error now, before
    // anything is written — not after a claim's script wrote its record and the WAIT behind it was
    // refused, which would strand the claim until its lease passed.
    void check_grants(Connection& conn) const {
        append_script(conn, redis::kAclProbe, {}, {options.key_prefix, options.wait_replicas > 0 ? "1" : "0"});
        Reply reply = conn.read("connect");
        if (redis::type_of(*reply) == ReplyType::error) {
            refused_at_connect(
                redis::text_of(*reply),
                fmt::format("idem: connect: Redis at {} refused idem's ACL check: {}", where, redis::text_of(*reply)));
        }
        if (redis::type_of(*reply) != ReplyType::array || redis::size_of(*reply) == 0) return;
        std::string denied;
        for (std::size_t i = 0; i < redis::size_of(*reply); ++i) {
            if (i > 0) denied += ", ";
            denied += redis::text_of(redis::element(*reply, i));
        }
        throw config_error(fmt::format(
            "idem: connect: the Redis ACL user{} at {} may not run {} (NOPERM); nothing was written. RedisStore runs "
            "EVALSHA, the commands of its scripts (TIME, HMGET, HGET, HSET, DEL, PEXPIREAT, ZADD, ZREM, ZRANGE){}, "
            "on keys that all start with RedisOptions::key_prefix \"{}\": grant this ACL user those commands and "
            "~{}*",
            options.username.empty() ? "" : " \"" + options.username + "\"", where, denied,
            options.wait_replicas > 0 ? " and WAIT (wait_replicas > 0: +wait)" : "", options.key_prefix,
            options.key_prefix));
    }

    void check_persistence(const std::string& appendonly, const std::string& appendfsync,
                           const std::string& no_fsync_on_rewrite) const {
        const bool aof = appendonly == "yes";
        if (no_fsync_on_rewrite == "yes") {
            // Redis then skips fsync while a BGSAVE or AOF rewrite runs: seconds of acknowledged
            // writes can be lost in a crash, whatever appendfsync says.
            throw config_error(
                fmt::format("idem: Redis at {} has no-appendfsync-on-rewrite=yes: while it rewrites its AOF or saves a "
                            "snapshot it does not fsync, and acknowledged claims can be lost in a crash. Set "
                            "no-appendfsync-on-rewrite no, or RedisOptions::durability = RedisDurability::unchecked",
                            where));
        }
        const bool ok = aof && (appendfsync == "always" ||
                                (options.durability == RedisDurability::fsync_everysec && appendfsync == "everysec"));
        if (ok) return;
        throw config_error(
            fmt::format("idem: Redis at {} has appendonly={} appendfsync={}: an acknowledged claim could be lost in a "
                        "crash, and with it the one-effect promise. Set appendonly yes and appendfsync always on the "
                        "server, or accept the loss window knowingly with RedisOptions::durability = {}",
                        where, appendonly.empty() ? "?" : appendonly, appendfsync.empty() ? "?" : appendfsync,
                        options.durability == RedisDurability::fsync_always && aof && appendfsync == "everysec"
                            ? "RedisDurability::fsync_everysec"
                            : "RedisDurability::unchecked"));
    }

    // A server that evicts keys under memory pressure would drop claims (in-progress records) or
    // completed records before their retention: the next call would run the effect again.
    void check_eviction(const std::string& policy) const {
        if (policy == "noeviction") return;
        throw config_error(fmt::format(
            "idem: Redis at {} has maxmemory-policy={}: under memory pressure it would evict claims and stored "
            "results, and a retry would run the effect again. Set maxmemory-policy noeviction (a full server "
            "then refuses writes, which idem reports as store_unavailable), or RedisOptions::durability = "
            "RedisDurability::unchecked to vouch for the server",
            where, policy.empty() ? "?" : policy));
    }

    // A replica answers from a copy that may lag (a replay missed, a claim seen free), and a
    // writable one would arbitrate keys apart from its primary: two effects for one key. After a
    // failover the address may point at a new primary soon, so this is an outage, not a setting.
    void refuse_replica(std::string_view info) const {
        if (info_field(info, "role") != "slave") return;
        throw store_unavailable(fmt::format(
            "idem: Redis at {} is a replica (INFO replication: role:slave); RedisStore reads and writes only "
            "on a primary",
            where));
    }

    void note_replication(std::string_view info) {
        const std::string_view replicas = info_field(info, "connected_slaves");
        if (replicas.empty() || replicas == "0" || options.wait_replicas > 0) return;
        std::string warning = fmt::format(
            "Redis at {} has {} replica(s) and wait_replicas = 0: a failover can lose writes the primary "
            "acknowledged (a lost claim can let an effect run twice); set RedisOptions::wait_replicas",
            where, replicas);
        std::lock_guard lock(warnings_mutex);
        if (std::find(warnings.begin(), warnings.end(), warning) == warnings.end())
            warnings.push_back(std::move(warning));
    }

    void refuse_in_child() const {
        if (generation != detail::fork_generation()) {
            throw config_error("idem: a RedisStore was used in a fork()ed child; make a new store in the child");
        }
    }

    // Queues EVALSHA of `script` with `keys` and `args` on `conn` (a few of each: no heap).
    static void append_script(Connection& conn, redis::Script script, std::initializer_list<std::string_view> keys,
                              std::initializer_list<std::string_view> args) {
        constexpr std::size_t kMost = 16;
        std::array<std::string_view, kMost> argv{};
        const char digit[2] = {static_cast<char>('0' + keys.size()), '\0'};  // at most 2 keys
        std::size_t n = 0;
        argv[n++] = "EVALSHA";
        argv[n++] = conn.script_shas[script];
        argv[n++] = std::string_view(digit, 1);
        for (std::string_view k : keys) argv[n++] = k;
        for (std::string_view a : args) argv[n++] = a;
        conn.append(std::span<const std::string_view>(argv.data(), n));
    }

    // After a batch of writes: WAIT for the replicas, when asked to (part of the same round trip).
    void append_wait(Connection& conn) const {
        if (options.wait_replicas == 0) return;
        conn.append(
            {"WAIT", std::to_string(options.wait_replicas), std::to_string(options.wait_replicas_timeout.count())});
    }
    void read_wait(Connection& conn, std::string_view what) const {
        if (options.wait_replicas == 0) return;
        Reply reply = conn.read(what);
        if (redis::type_of(*reply) == ReplyType::error) throw_reply(redis::text_of(*reply), what);
        if (redis::integer_of(*reply) < options.wait_replicas) {
            throw store_unavailable(fmt::format(
                "idem: {}: only {} of {} replicas of Redis at {} confirmed the write within {} ms; it is on the "
                "primary and may be lost in a failover",
                what, redis::integer_of(*reply), options.wait_replicas, where, options.wait_replicas_timeout.count()));
        }
    }

    // Runs `fn(conn, attempt)` on a pooled connection, as detail::RetryPolicy says: a broken
    // connection or a timeout sends it once more on a fresh one (the scripts recognise their own
    // earlier writes), and within `keep_trying` (a save's save_retry_window) again and again;
    // a connection that cannot be opened (the server away) is retried only within `keep_trying`,
    // so a claim hears store_unavailable at once. A script missing from the server (SCRIPT FLUSH)
    // reloads them on a fresh connection too. pool_timeout is thrown at once: it waited its bound.
    template <class Fn>
    auto with_connection(
        std::string_view what, Fn&& fn,
        std::chrono::steady_clock::duration keep_trying = std::chrono::steady_clock::duration::zero()) {
        refuse_in_child();
        using Failure = detail::RetryPolicy::Failure;
        detail::RetryPolicy retry(kAttempts, keep_trying);
        for (;;) {
            std::optional<redis::Pool::Lease> acquired;
            try {
                acquired.emplace(pool.acquire());
            } catch (const pool_timeout&) {
                throw;
            } catch (const store_unavailable&) {
                const auto pause = retry.after(Failure::unreachable);
                if (!pause) throw;
                counters.retries.fetch_add(1, std::memory_order_relaxed);
                std::this_thread::sleep_for(*pause);
                continue;
            }
            redis::Pool::Lease& lease = *acquired;
            std::optional<std::chrono::milliseconds> pause;
            try {
                counters.round_trips.fetch_add(1, std::memory_order_relaxed);
                return fn(*lease, retry.attempt());
            } catch (const store_unavailable&) {
                if (!lease->broken()) throw;  // the server's own refusal (LOADING, OOM...): as it said
                lease.discard();
                pool.drop_idle();  // a restart broke them all; do not find out one call at a time
                pause = retry.after(Failure::broken);
                if (!pause) throw;
            } catch (const noscript&) {
                lease.discard();
                pool.drop_idle();
                pause = retry.after(Failure::broken);
                if (!pause) {
                    throw store_unavailable(
                        fmt::format("idem: {}: Redis at {} keeps losing idem's scripts", what, where));
                }
            }
            counters.retries.fetch_add(1, std::memory_order_relaxed);
            if (pause->count() > 0) std::this_thread::sleep_for(*pause);
        }
    }

    struct noscript {};

    // An error reply to a command of the store's, thrown as redis::throw_error_reply says; a key the
    // ACL user may not access (NOPERM) is config_error naming the key prefix to grant.
    [[noreturn]] void throw_reply(std::string_view message, std::string_view what) const {
        if (message.substr(0, 6) == "NOPERM" && message.find("key") != std::string_view::npos) {
            throw config_error(fmt::format(
                "idem: {}: Redis at {} answered: {}; every key of this store starts with RedisOptions::key_prefix "
                "\"{}\": grant this ACL user ~{}* (or choose a key_prefix its key patterns cover)",
                what, where, message, options.key_prefix, options.key_prefix));
        }
        redis::throw_error_reply(message, what, where);
    }

    // The answer to a script: its reply, errors thrown as idem errors.
    Reply script_reply(Connection& conn, std::string_view what) const {
        Reply reply = conn.read(what);
        if (redis::type_of(*reply) == ReplyType::error) {
            const std::string_view message = redis::text_of(*reply);
            if (message.substr(0, 8) == "NOSCRIPT") throw noscript{};
            throw_reply(message, what);
        }
        return reply;
    }

    // Writes whose script answers 1 (done), 0 (the fence does not own the key) or -1 (a hash idem
    // did not write: corrupt_record); retried as with_connection says for `keep_trying`.
    bool fenced_write(std::string_view what, const std::function<void(Connection&)>& send,
                      std::chrono::steady_clock::duration keep_trying = std::chrono::steady_clock::duration::zero()) {
        const long long answer = with_connection(
            what,
            [&](Connection& conn, int) {
                send(conn);
                append_wait(conn);
                Reply reply = script_reply(conn, what);
                read_wait(conn, what);
                return redis::type_of(*reply) == ReplyType::integer ? redis::integer_of(*reply) : 0;
            },
            keep_trying);
        if (answer < 0)
            throw corrupt_record(fmt::format("idem: {}: the Redis key holds a hash idem did not write", what));
        return answer == 1;
    }

    std::optional<Record> read_record(Connection& conn, const Key& key) {
        append_script(conn, redis::kRead, {record_key(key)}, {});
        Reply reply = script_reply(conn, "read");
        if (redis::size_of(*reply) != 12)
            throw database_error("idem: read: unexpected answer from Redis's read script");
        return decode_record(*reply, 1, redis::integer_of(redis::element(*reply, 0)));
    }

    void send_claim(Connection& conn, const Key& key, const Fingerprint& fp, Fence fence, const ClaimOptions& o) {
        const auto lease = o.lease.value_or(options.default_lease);
        const auto retention =
            std::chrono::duration_cast<std::chrono::milliseconds>(o.retention.value_or(options.default_retention));
        // Times are Unix ms in the record, read back as system_clock time_points: keep them far
        // inside what those hold.
        constexpr auto kLongest = std::chrono::hours(24 * 366 * 100);
        if (lease.count() <= 0 || lease > kLongest || retention.count() <= 0 || retention > kLongest) {
            throw config_error("idem: claim: ClaimOptions::lease and retention must be positive and under 100 years");
        }
        const Names n = names(key);
        append_script(
            conn, redis::kClaim, {n.record, index_key},
            {std::to_string(fence), std::to_string(static_cast<int>(fp.algorithm())), fp.bytes(),
             std::to_string(lease.count()), std::to_string(retention.count()), o.resume_stale ? "1" : "0", n.member});
    }

    // The claim script's answer for `fence`.
    Claim claim_answer(const redisReply& reply, const Key& key, const Fingerprint& fp, Fence fence,
                       const ClaimOptions& claim_options, IdempotencyStore& store) {
        if (redis::type_of(reply) != ReplyType::array || redis::size_of(reply) < 2) {
            throw database_error("idem: claim: unexpected answer from Redis's claim script");
        }
        const std::string_view tag = redis::text_of(redis::element(reply, 0));
        const std::int64_t now = redis::integer_of(redis::element(reply, 1));
        if (tag == "corrupt") {
            throw corrupt_record(
                fmt::format("idem: claim: the Redis key of {} holds a hash idem did not write", key.value()));
        }
        if (tag == "claimed") {
            counters.claims_won.fetch_add(1, std::memory_order_relaxed);
            return Claim{ClaimStatus::claimed, fence, std::nullopt, {}};
        }
        if (redis::size_of(reply) != 13)
            throw database_error("idem: claim: unexpected answer from Redis's claim script");
        std::optional<Record> record = decode_record(reply, 2, now);
        if (!record) throw database_error("idem: claim: Redis's claim script found no record yet created none");
        if (tag == "own") {
            // Our own claim, whose first answer was lost: after a resume takeover the record already
            // shows what a first answer would have (the new fence and attempt, the earlier phase).
            counters.claims_won.fetch_add(1, std::memory_order_relaxed);
            if (record->attempt <= 1) return Claim{ClaimStatus::claimed, fence, std::nullopt, {}};
            return Claim{ClaimStatus::claimed, fence, std::move(record), {}};
        }
        if (tag == "taken") {
            // The script answers the record as it was; the caller gets it as every store gives a
            // takeover: the new fence, attempt and lease, the earlier attempt's phase and data.
            counters.claims_won.fetch_add(1, std::memory_order_relaxed);
            const Fence stale = record->fence;
            record->fence = fence;
            ++record->attempt;
            record->lease_until = from_ms(now) + claim_options.lease.value_or(options.default_lease);
            record->lease_expired = false;
            store.emit(Event::taken_over, &key);
            return Claim{ClaimStatus::claimed, fence, std::move(record), {}, stale};
        }
        Claim claim{claim_status(*record, fp), 0, std::move(record), {}};
        if (claim.status == ClaimStatus::in_progress) {
            claim.retry_after =
                detail::retry_after_hint(claim.existing->lease_until, from_ms(now), options.max_retry_after);
        }
        return claim;
    }

    void check_size(std::string_view result) const {
        idem::detail::check_result_size(result, options.max_result_bytes);
    }
};

}  // namespace idem
