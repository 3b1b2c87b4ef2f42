#include "idem/redis/store.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "common.hpp"
#include "connection.hpp"
#include "idem/errors.hpp"
#include "poll_schedule.hpp"
#include "resend_rules.hpp"
#include "scripts.hpp"

namespace idem {

using redis::Connection;
using redis::Reply;
using redis::ReplyType;
using SysClock = std::chrono::system_clock;

namespace {

constexpr int kAttempts = 2;  // a call whose connection broke is sent once more on a fresh one

std::string member_of(const Key& key) {
    std::string m = std::to_string(key.scope().size());
    m += ':';
    m += key.scope();
    m += key.value();
    return m;
}

template <class Int>
Int parse_int(std::string_view text, const char* field) {
    Int value{};
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc{} || end != text.data() + text.size()) {
        throw corrupt_record(fmt::format("idem: Redis record field '{}' is not an integer", field));
    }
    return value;
}

SysClock::time_point from_ms(std::int64_t ms) { return redis::time_from_unix_ms(ms, "a Redis record"); }

// The 11 fields of a record (scripts.hpp: s fa fp f a r ph pd c l e) at reply[first..], as read at `now`.
std::optional<Record> decode_record(const redisReply& reply, std::size_t first, std::int64_t now) {
    auto field = [&](std::size_t i) -> std::optional<std::string_view> {
        const redisReply& e = redis::element(reply, first + i);
        if (redis::type_of(e) == ReplyType::nil) return std::nullopt;
        if (redis::type_of(e) != ReplyType::string) {
            throw corrupt_record("idem: a Redis record field is neither text nor missing");
        }
        return redis::text_of(e);
    };
    const auto state = field(0);
    if (!state) return std::nullopt;
    auto required = [&](std::size_t i, const char* name) {
        auto v = field(i);
        if (!v) throw corrupt_record(fmt::format("idem: Redis record has no field '{}'", name));
        return *v;
    };
    Record record;
    if (*state == "p") {
        record.state = RecordState::in_progress;
    } else if (*state == "c") {
        record.state = RecordState::completed;
    } else {
        throw corrupt_record(fmt::format("idem: Redis record has unknown state '{}'", *state));
    }
    record.fingerprint = Fingerprint::from_bytes(parse_int<std::int16_t>(required(1, "fa"), "fa"), required(2, "fp"));
    record.fence = parse_int<Fence>(required(3, "f"), "f");
    record.attempt = parse_int<std::int32_t>(required(4, "a"), "a");
    if (record.state == RecordState::completed) record.result = std::string(required(5, "r"));
    if (auto ph = field(6)) record.phase = std::string(*ph);
    if (auto pd = field(7)) record.phase_data = std::string(*pd);
    record.created_at = from_ms(parse_int<std::int64_t>(required(8, "c"), "c"));
    const auto lease_ms = parse_int<std::int64_t>(required(9, "l"), "l");
    const auto expires_ms = parse_int<std::int64_t>(required(10, "e"), "e");
    record.lease_until = from_ms(lease_ms);
    record.expires_at = from_ms(expires_ms);
    record.read_at = from_ms(now);
    record.lease_expired = record.state == RecordState::in_progress && lease_ms < now;
    record.expired = record.state == RecordState::completed && expires_ms < now;
    return record;
}

void check_options(const RedisOptions& o) {
    auto bad = [](const std::string& what) { throw config_error("idem: RedisOptions: " + what); };
    if (o.pool_size == 0) bad("pool_size must be at least 1");
    if (o.unix_socket.empty() && o.host.empty()) bad("set host or unix_socket");
    if (o.unix_socket.empty() && (o.port <= 0 || o.port > 65535)) bad("port must be 1 to 65535");
    if (o.database < 0) bad("database must be 0 or more");
    if (o.key_prefix.empty()) bad("key_prefix must not be empty (it keeps idem's keys apart from others)");
    if (o.connect_timeout.count() <= 0 || o.command_timeout.count() <= 0) bad("timeouts must be positive");
    if (o.default_lease.count() <= 0) bad("default_lease must be positive");
    if (o.default_retention.count() <= 0) bad("default_retention must be positive");
    if (o.max_result_bytes == 0 || o.max_result_bytes > (512u << 20)) bad("max_result_bytes must be 1 byte to 512 MiB");
    if (o.wait_replicas < 0) bad("wait_replicas must be 0 or more");
    if (o.wait_replicas > 0 && o.wait_replicas_timeout.count() <= 0) bad("wait_replicas_timeout must be positive");
    if (o.wait_replicas > 0 && o.wait_replicas_timeout >= o.command_timeout) {
        bad("wait_replicas_timeout must be shorter than command_timeout (else every WAIT times out client-side)");
    }
}

// "key:value" lines of an INFO section.
std::string_view info_field(std::string_view info, std::string_view name) {
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

}  // namespace

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
                    throw config_error(fmt::format(
                        "idem: connect: Redis at {} refused CONFIG GET ({}); RedisStore checks the server's "
                        "persistence (RedisOptions::durability) — allow CONFIG for this user, or set "
                        "durability = RedisDurability::unchecked if the persistence is known another way",
                        where, redis::text_of(*reply)));
                }
                if (redis::size_of(*reply) == 2) *out = std::string(redis::text_of(redis::element(*reply, 1)));
            }
        }
        Reply replication = conn->read("connect");
        std::string replication_info;
        if (redis::type_of(*replication) == ReplyType::string) replication_info = redis::text_of(*replication);
        conn->script_shas.clear();
        for (std::size_t i = 0; i < redis::kScripts.size(); ++i) {
            Reply reply = conn->read("connect");
            if (redis::type_of(*reply) != ReplyType::string) {
                if (redis::type_of(*reply) == ReplyType::error) {
                    throw config_error(fmt::format("idem: connect: Redis at {} refused to load idem's scripts: {}",
                                                   where, redis::text_of(*reply)));
                }
                throw store_unavailable(fmt::format("idem: connect: unexpected answer to SCRIPT LOAD from {}", where));
            }
            conn->script_shas.emplace_back(redis::text_of(*reply));
        }
        refuse_replica(replication_info);
        if (check) {
            check_persistence(appendonly, appendfsync, no_fsync_on_rewrite);
            check_eviction(eviction);
        }
        note_replication(replication_info);
        return conn;
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
        if (redis::type_of(*reply) == ReplyType::error) redis::throw_error_reply(redis::text_of(*reply), what, where);
        if (redis::integer_of(*reply) < options.wait_replicas) {
            throw store_unavailable(fmt::format(
                "idem: {}: only {} of {} replicas of Redis at {} confirmed the write within {} ms; it is on the "
                "primary and may be lost in a failover",
                what, redis::integer_of(*reply), options.wait_replicas, where, options.wait_replicas_timeout.count()));
        }
    }

    // Runs `fn(conn, attempt)` on a pooled connection; a broken connection or a timeout sends it
    // once more on a fresh one (the scripts recognise their own earlier writes). A script missing
    // from the server (SCRIPT FLUSH) reloads them on a fresh connection too.
    template <class Fn>
    auto with_connection(std::string_view what, Fn&& fn) {
        refuse_in_child();
        for (int attempt = 1;; ++attempt) {
            auto lease = pool.acquire();
            try {
                counters.round_trips.fetch_add(1, std::memory_order_relaxed);
                return fn(*lease, attempt);
            } catch (const store_unavailable&) {
                if (!lease->broken()) throw;  // the server's own refusal (LOADING, OOM...): as it said
                lease.discard();
                pool.drop_idle();  // a restart broke them all; do not find out one call at a time
                if (attempt >= kAttempts) throw;
                counters.retries.fetch_add(1, std::memory_order_relaxed);
            } catch (const noscript&) {
                lease.discard();
                pool.drop_idle();
                if (attempt >= kAttempts) {
                    throw store_unavailable(
                        fmt::format("idem: {}: Redis at {} keeps losing idem's scripts", what, where));
                }
                counters.retries.fetch_add(1, std::memory_order_relaxed);
            }
        }
    }

    struct noscript {};

    // The answer to a script: its reply, errors thrown as idem errors.
    Reply script_reply(Connection& conn, std::string_view what) const {
        Reply reply = conn.read(what);
        if (redis::type_of(*reply) == ReplyType::error) {
            const std::string_view message = redis::text_of(*reply);
            if (message.substr(0, 8) == "NOSCRIPT") throw noscript{};
            redis::throw_error_reply(message, what, where);
        }
        return reply;
    }

    // Writes whose script answers 1 (done), 0 (the fence does not own the key) or -1 (a hash idem
    // did not write: corrupt_record).
    bool fenced_write(std::string_view what, const std::function<void(Connection&)>& send) {
        const long long answer = with_connection(what, [&](Connection& conn, int) {
            send(conn);
            append_wait(conn);
            Reply reply = script_reply(conn, what);
            read_wait(conn, what);
            return redis::type_of(*reply) == ReplyType::integer ? redis::integer_of(*reply) : 0;
        });
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
            record->fence = fence;
            ++record->attempt;
            record->lease_until = from_ms(now) + claim_options.lease.value_or(options.default_lease);
            record->lease_expired = false;
            store.emit(Event::taken_over, &key);
            return Claim{ClaimStatus::claimed, fence, std::move(record), {}};
        }
        Claim claim{classify(*record, fp), 0, std::move(record), {}};
        if (claim.status == ClaimStatus::in_progress) {
            claim.retry_after =
                detail::retry_after_hint(claim.existing->lease_until, from_ms(now), options.max_retry_after);
        }
        return claim;
    }

    void check_size(std::string_view result) const {
        if (result.size() > options.max_result_bytes) {
            throw response_too_large(fmt::format("idem: result of {} bytes exceeds max_result_bytes {}", result.size(),
                                                 options.max_result_bytes),
                                     std::string(result));
        }
    }
};

RedisStore::RedisStore(RedisOptions options) {
    check_options(options);
    impl_ = std::make_unique<Impl>(std::move(options));
}

RedisStore::~RedisStore() = default;

Claim RedisStore::claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options) {
    Impl& m = *impl_;
    m.counters.claims.fetch_add(1, std::memory_order_relaxed);
    const Fence fence = detail::new_fence();
    detail::PollSchedule polls(std::chrono::steady_clock::now() + options.wait);
    for (;;) {
        Claim claim = m.with_connection("claim", [&](Connection& conn, int) {
            m.send_claim(conn, key, fp, fence, options);
            m.append_wait(conn);
            Reply reply = m.script_reply(conn, "claim");
            m.read_wait(conn, "claim");
            return m.claim_answer(*reply, key, fp, fence, options, *this);
        });
        if (claim.status != ClaimStatus::in_progress) return claim;
        // ClaimOptions::wait: poll until the running attempt saves (no notifications here).
        if (std::chrono::steady_clock::now() >= polls.end()) return claim;
        std::this_thread::sleep_until(polls.next());
    }
}

std::vector<Claim> RedisStore::claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                           const ClaimOptions& options) {
    if (keys.size() != fps.size()) throw config_error("idem: claim_batch: keys and fingerprints differ in number");
    if (keys.empty()) return {};
    Impl& m = *impl_;
    m.counters.claims.fetch_add(keys.size(), std::memory_order_relaxed);
    std::vector<Fence> fences(keys.size());
    for (auto& f : fences) f = detail::new_fence();
    ClaimOptions once = options;
    once.wait = std::chrono::milliseconds(0);
    // Every answer is read before any is acted on, so no reply is left unread on a connection that
    // goes back to the pool. A retry sends the same fences: keys already won answer `own`.
    struct Answers {
        std::vector<Reply> replies;
        std::exception_ptr first_error;
    };
    Answers answers = m.with_connection("claim_batch", [&](Connection& conn, int) {
        for (std::size_t i = 0; i < keys.size(); ++i) m.send_claim(conn, keys[i], fps[i], fences[i], once);
        m.append_wait(conn);
        Answers a;
        a.replies.reserve(keys.size());
        for (std::size_t i = 0; i < keys.size(); ++i) {
            try {
                a.replies.push_back(m.script_reply(conn, "claim_batch"));
            } catch (const Impl::noscript&) {
                throw;
            } catch (...) {
                if (conn.broken()) throw;
                if (!a.first_error) a.first_error = std::current_exception();
                a.replies.emplace_back();
            }
        }
        m.read_wait(conn, "claim_batch");
        return a;
    });
    std::vector<Claim> claims(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
        if (!answers.replies[i]) continue;
        try {
            claims[i] = m.claim_answer(*answers.replies[i], keys[i], fps[i], fences[i], once, *this);
        } catch (...) {
            if (!answers.first_error) answers.first_error = std::current_exception();
            answers.replies[i].reset();
        }
    }
    if (answers.first_error) {
        // A failure of the batch, thrown as claim() would throw it: first release what it won.
        for (std::size_t i = 0; i < keys.size(); ++i) {
            if (!answers.replies[i] || claims[i].status != ClaimStatus::claimed || claims[i].existing) continue;
            try {
                release(keys[i], fences[i]);
            } catch (const error&) {
                // Left in progress with a fence nobody holds: the reconciler resolves it.
            }
        }
        std::rethrow_exception(answers.first_error);
    }
    return claims;
}

void RedisStore::save(const Key& key, Fence fence, std::string_view result) {
    Impl& m = *impl_;
    m.check_size(result);
    m.counters.saves.fetch_add(1, std::memory_order_relaxed);
    const std::string fence_text = std::to_string(fence);
    const bool saved = m.fenced_write("save", [&](Connection& conn) {
        const Impl::Names n = m.names(key);
        Impl::append_script(conn, redis::kSave, {n.record, m.index_key}, {fence_text, result, n.member});
    });
    if (!saved) throw lease_lost("idem: save refused: fence " + fence_text + " no longer owns the key");
}

std::vector<SaveStatus> RedisStore::save_batch(std::span<const SaveRequest> saves) {
    Impl& m = *impl_;
    std::vector<SaveStatus> statuses(saves.size(), SaveStatus::too_large);
    std::vector<std::size_t> sent;
    for (std::size_t i = 0; i < saves.size(); ++i) {
        if (saves[i].result.size() <= m.options.max_result_bytes) sent.push_back(i);
    }
    if (sent.empty()) return statuses;
    m.counters.saves.fetch_add(sent.size(), std::memory_order_relaxed);
    m.with_connection("save_batch", [&](Connection& conn, int) {
        std::vector<std::string> fences;
        fences.reserve(sent.size());
        for (std::size_t i : sent) {
            fences.push_back(std::to_string(saves[i].fence));
            Impl::append_script(conn, redis::kSave, {m.record_key(saves[i].key), m.index_key},
                                {fences.back(), saves[i].result, member_of(saves[i].key)});
        }
        m.append_wait(conn);
        std::exception_ptr first_error;
        for (std::size_t j = 0; j < sent.size(); ++j) {
            try {
                Reply reply = m.script_reply(conn, "save_batch");
                if (redis::integer_of(*reply) < 0) {
                    throw corrupt_record("idem: save_batch: a Redis key holds a hash idem did not write");
                }
                statuses[sent[j]] = redis::integer_of(*reply) == 1 ? SaveStatus::saved : SaveStatus::lease_lost;
            } catch (const Impl::noscript&) {
                throw;
            } catch (...) {
                if (conn.broken()) throw;
                if (!first_error) first_error = std::current_exception();
            }
        }
        m.read_wait(conn, "save_batch");
        if (first_error) std::rethrow_exception(first_error);
        return 0;
    });
    return statuses;
}

void RedisStore::release(const Key& key, Fence fence) {
    Impl& m = *impl_;
    m.counters.releases.fetch_add(1, std::memory_order_relaxed);
    const std::string fence_text = std::to_string(fence);
    const bool released = m.with_connection("release", [&](Connection& conn, int attempt) {
        Impl::append_script(conn, redis::kRelease, {m.record_key(key), m.index_key}, {fence_text, member_of(key)});
        m.append_wait(conn);
        Reply reply = m.script_reply(conn, "release");
        m.read_wait(conn, "release");
        if (redis::integer_of(*reply) == 1) return true;
        // A retry: our first delete may have landed (and someone may have claimed since).
        if (attempt > 1 && detail::release_landed(m.read_record(conn, key), fence)) return true;
        return false;
    });
    if (!released) throw lease_lost("idem: release refused: fence " + fence_text + " no longer owns the key");
}

void RedisStore::extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) {
    Impl& m = *impl_;
    const std::string fence_text = std::to_string(fence);
    const bool done = m.fenced_write("extend_lease", [&](Connection& conn) {
        Impl::append_script(conn, redis::kExtend, {m.record_key(key), m.index_key},
                            {fence_text, std::to_string(lease.count()), member_of(key)});
    });
    if (!done) throw lease_lost("idem: extend_lease refused: fence " + fence_text + " no longer owns the key");
}

void RedisStore::record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) {
    Impl& m = *impl_;
    const std::string fence_text = std::to_string(fence);
    const bool done = m.fenced_write("record_phase", [&](Connection& conn) {
        Impl::append_script(conn, redis::kPhase, {m.record_key(key)}, {fence_text, phase, data});
    });
    if (!done) throw lease_lost("idem: record_phase refused: fence " + fence_text + " no longer owns the key");
}

std::optional<Fence> RedisStore::take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                           bool new_attempt) {
    Impl& m = *impl_;
    const Fence fence = detail::new_fence();
    const bool taken = m.fenced_write("take_over", [&](Connection& conn) {
        Impl::append_script(conn, redis::kTakeOver, {m.record_key(key), m.index_key},
                            {std::to_string(stale_fence), std::to_string(fence), std::to_string(lease.count()),
                             new_attempt ? "1" : "0", member_of(key)});
    });
    if (!taken) return std::nullopt;
    emit(Event::taken_over, &key);
    return fence;
}

std::optional<Record> RedisStore::read(const Key& key) {
    Impl& m = *impl_;
    m.counters.reads.fetch_add(1, std::memory_order_relaxed);
    return m.with_connection("read", [&](Connection& conn, int) { return m.read_record(conn, key); });
}

std::vector<StaleKey> RedisStore::list_stale(std::size_t limit, const ScopeFilter& scopes) {
    Impl& m = *impl_;
    if (limit == 0) return {};
    m.counters.reads.fetch_add(1, std::memory_order_relaxed);
    const char* mode = scopes.kind() == ScopeFilter::Kind::all     ? "a"
                       : scopes.kind() == ScopeFilter::Kind::exact ? "e"
                                                                   : "p";
    Reply reply = m.with_connection("list_stale", [&](Connection& conn, int) {
        Impl::append_script(conn, redis::kListStale, {m.index_key},
                            {m.record_prefix, std::to_string(limit), mode, scopes.text()});
        return m.script_reply(conn, "list_stale");
    });
    const std::size_t n = redis::size_of(*reply);
    if (n == 0 || (n - 1) % 12 != 0) throw database_error("idem: list_stale: unexpected answer from Redis's script");
    const std::int64_t now = redis::integer_of(redis::element(*reply, 0));
    std::vector<StaleKey> stale;
    for (std::size_t i = 1; i < n; i += 12) {
        const std::string_view member = redis::text_of(redis::element(*reply, i));
        std::optional<Key> key;
        try {
            const std::size_t colon = member.find(':');
            const auto scope_len = parse_int<std::size_t>(member.substr(0, colon), "index member");
            if (colon == std::string_view::npos || colon + 1 + scope_len > member.size()) {
                throw corrupt_record("idem: malformed member of Redis's in-progress index");
            }
            key.emplace(std::string(member.substr(colon + 1, scope_len)),
                        std::string(member.substr(colon + 1 + scope_len)));
            auto record = decode_record(*reply, i + 1, now);
            if (!record) throw corrupt_record("idem: a key in Redis's in-progress index has no record");
            if (record->state != RecordState::in_progress) continue;
            stale.push_back(StaleKey{std::move(*key), std::move(*record)});
        } catch (const error& e) {
            const std::string detail = fmt::format("list_stale: {}", detail::without_prefix(e.what()));
            emit(Event::reconcile_failed, key ? &*key : nullptr, {}, 1, detail);
        }
    }
    return stale;
}

std::size_t RedisStore::purge_expired(std::size_t, std::size_t) { return 0; }

StoreStats RedisStore::stats() const {
    const auto& c = impl_->counters;
    StoreStats s;
    s.round_trips = c.round_trips.load(std::memory_order_relaxed);
    s.claims = c.claims.load(std::memory_order_relaxed);
    s.claims_won = c.claims_won.load(std::memory_order_relaxed);
    s.saves = c.saves.load(std::memory_order_relaxed);
    s.releases = c.releases.load(std::memory_order_relaxed);
    s.reads = c.reads.load(std::memory_order_relaxed);
    s.retries = c.retries.load(std::memory_order_relaxed);
    s.connections_opened = impl_->pool.opened.load(std::memory_order_relaxed);
    s.connections_discarded = impl_->pool.discarded.load(std::memory_order_relaxed);
    return s;
}

std::size_t RedisStore::max_result_bytes() const noexcept { return impl_->options.max_result_bytes; }

std::vector<std::string> RedisStore::warnings() const {
    std::lock_guard lock(impl_->warnings_mutex);
    return impl_->warnings;
}

const RedisOptions& RedisStore::options() const noexcept { return impl_->options; }

}  // namespace idem
