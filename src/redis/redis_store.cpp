// RedisStore (include/idem/redis/store.hpp): construction and the single-key calls. The state and
// the driver are store_impl.hpp; claim_batch and save_batch are batch.cpp.
#include "store_impl.hpp"

namespace idem {

namespace {

void check_options(const RedisOptions& o) {
    auto bad = [](const std::string& what) { throw config_error("idem: RedisOptions: " + what); };
    if (o.pool_size == 0) bad("pool_size must be at least 1");
    if (o.unix_socket.empty() && o.host.empty()) bad("set host or unix_socket");
    if (o.unix_socket.empty() && (o.port <= 0 || o.port > 65535)) bad("port must be 1 to 65535");
    if (o.database < 0) bad("database must be 0 or more");
    if (o.key_prefix.empty()) bad("key_prefix must not be empty (it keeps idem's keys apart from others)");
    if (o.connect_timeout.count() <= 0 || o.command_timeout.count() <= 0) bad("timeouts must be positive");
    if (o.save_retry_window.count() < 0) bad("save_retry_window must be 0 or more");
    if (o.default_lease.count() <= 0) bad("default_lease must be positive");
    if (o.default_retention.count() <= 0) bad("default_retention must be positive");
    // Redis keeps values up to 512 MiB; a sealed result is seal_overhead bytes longer.
    const std::size_t most = (512u << 20) - (o.sealing.keyring ? seal_overhead : 0);
    if (o.max_result_bytes == 0 || o.max_result_bytes > most) {
        bad(o.sealing.keyring ? "max_result_bytes must be 1 byte to 512 MiB less seal_overhead (sealing is on)"
                              : "max_result_bytes must be 1 byte to 512 MiB");
    }
    if (o.wait_replicas < 0) bad("wait_replicas must be 0 or more");
    detail::check_sealing(o.sealing);
    if (o.wait_replicas > 0 && o.wait_replicas_timeout.count() <= 0) bad("wait_replicas_timeout must be positive");
    if (o.wait_replicas > 0 && o.wait_replicas_timeout >= o.command_timeout) {
        bad("wait_replicas_timeout must be shorter than command_timeout (else every WAIT times out client-side)");
    }
}

}  // namespace

RedisStore::RedisStore(RedisOptions options) {
    check_options(options);
    impl_ = std::make_unique<Impl>(std::move(options));
}

RedisStore::~RedisStore() = default;

Fingerprint RedisStore::key_fingerprint(const Fingerprint& fp) const {
    return detail::keyed(impl_->options.fingerprint_secret, fp);
}

Claim RedisStore::claim(const Key& key, const Fingerprint& plain, const ClaimOptions& options) {
    Impl& m = *impl_;
    const Fingerprint fp = key_fingerprint(plain);  // RedisOptions::fingerprint_secret
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
        // Resume mode on a stale record written before the fingerprint secret (fa 1): the script
        // did not compare it (it never sees the plain digest); claim_status() here found it the same
        // request, so take it over by its fence, with this claim's fence.
        if (claim.status == ClaimStatus::in_progress && options.resume_stale && claim.existing &&
            claim.existing->lease_expired && claim.existing->fingerprint.algorithm() != fp.algorithm()) {
            const auto lease = options.lease.value_or(m.options.default_lease);
            const Fence stale = claim.existing->fence;
            const bool taken = m.fenced_write("claim", [&](Connection& conn) {
                Impl::append_script(
                    conn, redis::kTakeOver, {m.record_key(key), m.index_key},
                    {std::to_string(stale), std::to_string(fence), std::to_string(lease.count()), "1", member_of(key)});
            });
            if (!taken) continue;  // another caller took it or it moved on: read it again
            m.counters.claims_won.fetch_add(1, std::memory_order_relaxed);
            emit(Event::taken_over, &key);
            Record& record = *claim.existing;
            record.fence = fence;
            ++record.attempt;
            record.lease_until = record.read_at + lease;  // by Redis's clock, as the script counts it
            record.lease_expired = false;
            claim = Claim{ClaimStatus::claimed, fence, std::move(claim.existing), {}, stale};
        }
        detail::open_claim(m.options.sealing, m.options.key_prefix, key, claim);
        if (claim.status != ClaimStatus::in_progress) return claim;
        // ClaimOptions::wait: poll until the running attempt saves (no notifications here).
        if (std::chrono::steady_clock::now() >= polls.end()) return claim;
        std::this_thread::sleep_until(polls.next());
    }
}

void RedisStore::save(const Key& key, Fence fence, std::string_view result) {
    Impl& m = *impl_;
    m.check_size(result);
    // Sealed once: a resent save carries the same bytes, which the script recognises as its own.
    std::string sealed;
    result = detail::seal_result(m.options.sealing, m.options.key_prefix, key, fence, result, sealed);
    m.counters.saves.fetch_add(1, std::memory_order_relaxed);
    const std::string fence_text = std::to_string(fence);
    // The effect ran: within save_retry_window the save rides out an outage (the script
    // recognises its own earlier write).
    const bool saved = m.fenced_write(
        "save",
        [&](Connection& conn) {
            const Impl::Names n = m.names(key);
            Impl::append_script(conn, redis::kSave, {n.record, m.index_key}, {fence_text, result, n.member});
        },
        m.options.save_retry_window);
    if (!saved) throw lease_lost("idem: save refused: fence " + fence_text + " no longer owns the key");
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
    std::optional<Record> record =
        m.with_connection("read", [&](Connection& conn, int) { return m.read_record(conn, key); });
    detail::open_record(m.options.sealing, m.options.key_prefix, key, record);
    return record;
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
