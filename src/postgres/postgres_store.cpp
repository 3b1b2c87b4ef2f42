// PostgresStore (include/idem/postgres_store.hpp): construction, the single-key calls and the
// counters. The state and the drivers are store_impl.hpp.
#include "idem/postgres_store.hpp"

#include <thread>
#include <utility>

#include "sansio/runner.hpp"
#include "store_impl.hpp"

namespace idem {

PostgresStore::PostgresStore(std::string conninfo, PostgresOptions options) : impl_(std::make_unique<Impl>()) {
    Impl& m = *impl_;
    if (options.pool_size == 0) throw config_error("idem: pool_size must be at least 1");
    if (options.claim_attempts < 1) throw config_error("idem: claim_attempts must be at least 1");
    if (options.statement_timeout.count() <= 0 || options.lock_timeout.count() <= 0) {
        throw config_error("idem: statement_timeout and lock_timeout must be positive");
    }
    if (options.lock_timeout >= options.statement_timeout) {
        throw config_error("idem: lock_timeout must be shorter than statement_timeout");
    }
    if (options.default_lease.count() <= 0 || options.default_retention.count() <= 0) {
        throw config_error("idem: default_lease and default_retention must be positive");
    }
    detail::check_sealing(options.sealing);
    if (options.generations) {
        const auto length = options.generations->length;
        // The shortest length at which maintenance keeps up under load (docs/design.md,
        // "Generations": each retirement is a DETACH … CONCURRENTLY, which waits for older transactions).
        if (length < std::chrono::seconds(1) || length > std::chrono::hours(24 * 30)) {
            throw config_error("idem: generations.length must be between 1 s and 30 days");
        }
        if (options.generations->ahead < 1) throw config_error("idem: generations.ahead must be at least 1");
    }
    m.table = pg::TableName::parse(options.table);
    m.defs = pg::statements(m.table, pg::generation_of(options));
    m.settings = pg::ConnectSettings{std::move(conninfo),       options.application_name, options.connect_timeout,
                                     options.statement_timeout, options.lock_timeout,     options.prepared_statements,
                                     options.session_options};
    m.options = std::move(options);
    // Deadlines are kept to within one tick (they are statement_timeout + lock_timeout + 1 s away).
    m.watchdog = std::make_unique<pg::Watchdog>(std::chrono::milliseconds(50));
    m.settings.watchdog = m.watchdog.get();
    m.claim_groups = std::make_unique<pg::Combiner>(Impl::kGroupsInFlight);
    m.save_groups = std::make_unique<pg::Combiner>(Impl::kGroupsInFlight);
    m.pool = std::make_unique<pg::Pool>(
        m.options.pool_size, m.options.pool_wait, m.options.health_check_after,
        [&m] { return std::make_unique<pg::Connection>(m.settings, m.defs); },
        [&m](pg::Connection& conn) {
            try {
                Params none;
                return m.run_one(conn, pg::kPing, none)[0].ok();
            } catch (const error&) {
                return false;
            }
        },
        [&m](bool opened) { (opened ? m.counters().opened : m.counters().discarded).fetch_add(1); });
}

PostgresStore::~PostgresStore() = default;

const PostgresOptions& PostgresStore::options() const noexcept { return impl_->options; }

std::size_t PostgresStore::max_result_bytes() const noexcept { return impl_->options.max_result_bytes; }

Fingerprint PostgresStore::key_fingerprint(const Fingerprint& fp) const {
    return detail::keyed(impl_->options.fingerprint_secret, fp);
}

Claim PostgresStore::claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options) {
    // One fence for every attempt: after a broken connection, the retry recognises its own claim.
    // Keyed here, once: every attempt, a group's statement and the found row's classification use it.
    return claim_with_fence(key, key_fingerprint(fp), options, detail::new_fence());
}

// The blocking driver of pg::run_claim (sansio/runner.hpp): each call does its I/O on this thread
// and returns its answer.
struct PostgresStore::Impl::ClaimDriver {
    template <class T>
    using Task = pg::Immediate<T>;
    using Next = pg::ClaimMachine::Next;

    PostgresStore::Impl& m;
    const PostgresStore& store;
    Claim& out;
    // Group commit takes the first attempt only (one round trip), and only when no pooled
    // connection is free (Impl::free_connection); whatever follows (retries, an expired record,
    // resume, wait) goes alone. Not from inside this store's own in-transaction effect: that call
    // must not wait behind a group (acquire() says why).
    bool grouped;
    std::optional<FirstTry> free;  // the first attempt's connection, when taken before

    std::optional<Next> first_attempt(const pg::ClaimCall& c, pg::ClaimMachine& machine) {
        if (!grouped) return std::nullopt;
        free.emplace(m.free_connection());
        if (free->found()) return std::nullopt;
        pg::ClaimSlot slot;
        slot.key = &c.key, slot.fp = &c.fp, slot.fence = c.fence, slot.lease = c.lease, slot.retention = c.retention,
        slot.out = &out;
        (void)m.claim_in_group(slot, *free->deadline);
        if (auto after = pg::after_group(machine, slot)) {
            // The group was the first attempt: whatever follows waits for a connection afresh
            // (pool_wait from then), not to the deadline of the wait in the group's queue.
            free.reset();
            return after;
        }
        // A group's failed statement counts as an attempt: going alone after it is a retry, with a
        // wait for a connection of its own. Nothing sent: the first attempt's wait goes on to the
        // same deadline.
        if (slot.sent) {
            tally(pg::Tally::retry);
            free->deadline.reset();
        }
        return std::nullopt;
    }
    pg::StepResults round_trip(const pg::ClaimCall& c) {
        if (!free) return m.claim_round_trip(c.key, c.fp, c.fence, c.lease, c.retention);
        FirstTry first(std::move(*free));  // the first round trip only
        free.reset();
        return m.claim_round_trip(c.key, c.fp, c.fence, c.lease, c.retention, nullptr, std::move(first));
    }
    template <class Op>
    Op& drive(const char* what, Op& op) {
        return m.drive(what, op);
    }
    Next wait_for_save(const pg::ClaimCall& c, pg::ClaimMachine& machine) { return m.wait_for_save(c.key, machine); }
    static pg::Done pause(std::chrono::milliseconds d) {
        std::this_thread::sleep_for(d);
        return {};
    }
    void tally(pg::Tally t) noexcept {
        auto& c = m.counters();
        (t == pg::Tally::claim       ? c.claims
         : t == pg::Tally::claim_won ? c.claims_won
                                     : c.retries)
            .fetch_add(1, std::memory_order_relaxed);
    }
    void taken_over(const Key& key) const { store.emit(Event::taken_over, &key); }
};

Claim PostgresStore::claim_with_fence(const Key& key, const Fingerprint& fp, const ClaimOptions& options, Fence fence) {
    Impl& m = *impl_;
    // Every path fills and returns this one object (so it is built in the caller's Claim: a
    // replay decodes its row straight into it, with no Record moved or copied on the way out).
    Claim out;
    const pg::ClaimCall call{key, fp, fence, options.lease.value_or(m.options.default_lease),
                             options.retention.value_or(m.options.default_retention)};
    pg::ClaimMachine machine(out, fence, fp, options, m.options.claim_attempts, m.options.max_retry_after);
    Impl::ClaimDriver driver{m, *this, out, m.options.group_commit && in_effect_of != &m, std::nullopt};
    pg::run_claim(driver, call, machine).get();
    detail::open_claim(m.options.sealing, m.options.table, key, out);
    return out;
}

void PostgresStore::save(const Key& key, Fence fence, std::string_view result) {
    Impl& m = *impl_;
    detail::check_result_size(result, m.options.max_result_bytes);
    std::string sealed;
    save_stored(key, fence, detail::seal_result(m.options.sealing, m.options.table, key, fence, result, sealed));
}

void PostgresStore::save_stored(const Key& key, Fence fence, std::string_view result) {
    Impl& m = *impl_;
    m.counters().saves.fetch_add(1, std::memory_order_relaxed);
    // Group commit: the first attempt may share one UPDATE with concurrent saves, when no pooled
    // connection is free (see claim()).
    bool group_sent = false;  // the group's statement may have committed this save before it failed
    const bool group_commit = m.options.group_commit && in_effect_of != &m;
    Impl::FirstTry free = group_commit ? m.free_connection() : Impl::FirstTry();
    if (group_commit && !free.found()) {
        pg::SaveSlot slot;
        slot.key = &key, slot.fence = fence, slot.result = result;
        (void)m.save_in_group(slot, *free.deadline);
        if (pg::saved_by_group(slot)) {
            if (slot.waiters) m.wake_waiters(key);
            return;
        }
        group_sent = slot.sent;
        if (group_sent) {  // a retry (see claim())
            m.counters().retries.fetch_add(1, std::memory_order_relaxed);
            free.deadline.reset();
        }
    }
    m.save_alone(key, fence, result, group_sent, std::move(free));
}

void PostgresStore::release(const Key& key, Fence fence) {
    Impl& m = *impl_;
    m.counters().releases.fetch_add(1, std::memory_order_relaxed);
    pg::ReleaseOp op(key, fence);
    m.drive("release", op);
}

void PostgresStore::extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) {
    Impl& m = *impl_;
    auto op = pg::OwnedWriteOp::extend_lease(key, fence, lease);
    m.drive(op.what(), op);
}

void PostgresStore::record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) {
    Impl& m = *impl_;
    auto op = pg::OwnedWriteOp::record_phase(key, fence, phase, data);
    m.drive(op.what(), op);
}

std::optional<Fence> PostgresStore::take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                              bool new_attempt) {
    const Fence fence = detail::new_fence();
    if (!impl_->take_over(key, stale_fence, fence, lease, new_attempt)) return std::nullopt;
    emit(Event::taken_over, &key);
    return fence;
}

std::optional<Record> PostgresStore::read(const Key& key) {
    Impl& m = *impl_;
    m.counters().reads.fetch_add(1, std::memory_order_relaxed);
    pg::ReadOp op(key);
    std::optional<Record> record = std::move(m.drive("read", op).record());
    detail::open_record(m.options.sealing, m.options.table, key, record);
    return record;
}

PoolStats PostgresStore::pool_stats() const {
    PoolStats s = impl_->pool->stats();
    // Callers that group commit queues found no connection free either: they wait for one too.
    s.waiters += impl_->claim_groups->queued() + impl_->save_groups->queued();
    return s;
}

GroupCommitStats PostgresStore::group_commit_stats() const {
    GroupCommitStats g;
    for (const auto& c : impl_->counter_shards) c.add_to(g);
    impl_->largest.add_to(g);
    return g;
}

StoreStats PostgresStore::stats() const {
    StoreStats s;
    for (const auto& c : impl_->counter_shards) c.add_to(s);
    return s;
}

}  // namespace idem
