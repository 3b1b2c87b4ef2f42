// AsyncPostgresStore (include/idem/asio/store.hpp): the public calls, and the single-key
// operations they run on the strand. The state and the driver are store_impl.hpp.
#include "store_impl.hpp"

#include <tuple>

namespace idem::asio {

// The Asio driver of pg::run_claim (sansio/runner.hpp): each call is a coroutine on the store's
// strand, suspended while its round trip is in flight.
struct AsyncPostgresStore::Impl::ClaimDriver {
    template <class T>
    using Task = net::awaitable<T>;
    using Next = pg::ClaimMachine::Next;

    Impl& m;
    Claim& out;

    // The first attempt may share a transaction with concurrent claims (group commit), or wait for
    // its turn to go alone.
    net::awaitable<std::optional<Next>> first_attempt(const pg::ClaimCall& c, pg::ClaimMachine& machine) {
        ClaimMember me;
        me.key = &c.key, me.fp = &c.fp, me.fence = c.fence, me.lease = c.lease, me.retention = c.retention;
        me.out = &out;
        co_await m.claim_first(me);
        co_return pg::after_group(machine, me);
    }
    net::awaitable<pg::StepResults> round_trip(const pg::ClaimCall& c) {
        return m.with_connection<pg::StepResults>("claim", [this, &c](AsyncConnection& conn, int) {
            return m.claim_round_trip(conn, c.key, c.fp, c.fence, c.lease, c.retention);
        });
    }
    template <class Op>
    net::awaitable<void> drive(const char* what, Op& op) {
        return m.drive(what, op);
    }
    // No LISTEN here (it would hold a connection per waiter): the key is polled, 20 ms at first,
    // then up to 200 ms apart, until the wait's end (the machine's schedule, as PostgresStore's
    // wait_strategy poll). The call's cancellation (or deadline) ends the wait: in_progress now.
    static net::awaitable<Next> wait_for_save(const pg::ClaimCall&, pg::ClaimMachine& machine) {
        const auto left = machine.wait_until() - Clock::now();
        const auto state = co_await net::this_coro::cancellation_state;
        if (left <= Clock::duration::zero() || state.cancelled() != net::cancellation_type::none) {
            co_return machine.on_waited(false);
        }
        // (rounded up: a poll due at the deadline reads after it, and so answers)
        co_await pause_for(std::chrono::ceil<std::chrono::milliseconds>(machine.next_poll() - Clock::now()));
        co_return machine.on_waited(true);
    }
    static net::awaitable<void> pause(std::chrono::milliseconds d) { return pause_for(d); }
    void tally(pg::Tally t) const noexcept {
        auto& c = m.counters;
        count(t == pg::Tally::claim ? c.claims : t == pg::Tally::claim_won ? c.claims_won : c.retries);
    }
    void taken_over(const Key& key) const { m.owner->emit(Event::taken_over, &key); }
};

net::awaitable<Claim> AsyncPostgresStore::Impl::claim_on_strand(const Key& key, const Fingerprint& plain,
                                                                const ClaimOptions& options_) {
    // Keyed once (PostgresOptions::fingerprint_secret), as PostgresStore::claim does: the shared
    // transaction, every retry and the found row's classification use it.
    const Fingerprint fp = idem::detail::keyed(options.fingerprint_secret, plain);
    // One fence for every attempt: after a broken connection, the retry recognises its own claim.
    const Fence fence = idem::detail::new_fence();
    Claim out;
    const pg::ClaimCall call{key, fp, fence, options_.lease.value_or(options.default_lease),
                             options_.retention.value_or(options.default_retention)};
    pg::ClaimMachine machine(out, fence, fp, options_, options.claim_attempts, options.max_retry_after);
    ClaimDriver driver{*this, out};
    co_await pg::run_claim(driver, call, machine);
    co_return out;
}

net::awaitable<std::optional<Record>> AsyncPostgresStore::Impl::take_over_on_strand(const Key& key, Fence stale,
                                                                                    Fence fresh,
                                                                                    std::chrono::milliseconds lease,
                                                                                    bool new_attempt) {
    pg::TakeOverOp op(key, stale, fresh, lease, new_attempt);
    co_await drive("take_over", op);
    co_return std::move(op.taken());
}

net::awaitable<void> AsyncPostgresStore::Impl::save_on_strand(const Key& key, Fence fence, std::string_view result) {
    idem::detail::check_result_size(result, options.max_result_bytes);
    // Sealed once: every attempt below, and the recognition of an earlier one's write, use these bytes.
    std::string sealed;
    result = idem::detail::seal_result(options.sealing, options.table, key, fence, result, sealed);
    count(counters.saves);
    // save_retry_window counts from here: a group's attempt is part of it.
    const auto until = Clock::now() + options.save_retry_window;
    SaveMember me;
    me.key = &key, me.fence = fence, me.result = result;
    bool waiters = false;
    if (co_await save_first(me) && pg::saved_by_group(me)) {
        waiters = me.waiters;
    } else {
        waiters = co_await save_alone(key, fence, result, me.sent, me.turn, until);
    }
    if (waiters) co_await notify_waiters(key);
}

// A save by itself: [UPDATE | Sync], retried until `until` (the save's start + save_retry_window;
// an attempt under way then ends by its own deadline). `resent`: a group's
// statement may already have committed it. Its first attempt holds a transaction slot (`counted`:
// launch_groups counted it when its turn came); a save that cannot reach the server gives the slot
// back and keeps trying outside the bound, so the claims behind it hear at once that the server is
// away instead of waiting out the window.
net::awaitable<bool> AsyncPostgresStore::Impl::save_alone(const Key& key, Fence fence, std::string_view result,
                                                          bool resent, bool counted, Clock::time_point until) {
    struct Slot {
        Impl& m;
        bool held = true;
        void give_back() {
            if (!held) return;
            held = false;
            --m.saves_in_flight;
            m.launch_groups();
        }
        ~Slot() { give_back(); }
    } slot{*this};
    if (!counted) ++saves_in_flight;
    try {
        pg::SaveOp op(key, fence, result, resent);
        co_await drive("save", op, Clock::duration::zero(), until);
        co_return op.waiters();
    } catch (const store_unavailable&) {
        if (options.save_retry_window <= std::chrono::milliseconds::zero() || Clock::now() >= until) throw;
    }
    slot.give_back();
    pg::SaveOp op(key, fence, result, /*resent=*/true);  // the first attempt may have committed
    co_await drive("save", op, until - Clock::now());
    co_return op.waiters();
}

// A blocking store's caller waits for this key (ClaimOptions::wait): NOTIFY it. Best effort — a
// waiter also wakes at its deadline and re-reads.
net::awaitable<void> AsyncPostgresStore::Impl::notify_waiters(const Key& key) {
    try {
        pg::NotifyOp op(table, key);
        co_await drive("notify", op);
    } catch (const error&) {
    }
}

net::awaitable<void> AsyncPostgresStore::Impl::release_on_strand(const Key& key, Fence fence) {
    count(counters.releases);
    pg::ReleaseOp op(key, fence);
    co_await drive("release", op);
}

void AsyncPostgresStore::Impl::publish_queued() noexcept {
    gauges->queued.store(claim_queue.size() + save_queue.size(), std::memory_order_relaxed);
}

// ---- AsyncPostgresStore ---------------------------------------------------------------------------------

AsyncPostgresStore::AsyncPostgresStore(net::any_io_executor executor, std::string conninfo, PostgresOptions options)
    : impl_(std::make_shared<Impl>(std::move(executor), std::move(conninfo), std::move(options))) {
    impl_->owner = this;
}

AsyncPostgresStore::~AsyncPostgresStore() = default;

AsyncPostgresStore::executor_type AsyncPostgresStore::get_executor() const noexcept { return impl_->strand; }
const PostgresOptions& AsyncPostgresStore::options() const noexcept { return impl_->options; }
PostgresStore& AsyncPostgresStore::blocking() { return impl_->blocking; }
std::size_t AsyncPostgresStore::max_result_bytes() const noexcept { return impl_->options.max_result_bytes; }
Fingerprint AsyncPostgresStore::key_fingerprint(const Fingerprint& fp) const {
    return impl_->blocking.key_fingerprint(fp);
}

void AsyncPostgresStore::set_replay_cache(std::shared_ptr<ReplayCache> cache) noexcept {
    impl_->replay_cache.store(std::move(cache));
}

std::shared_ptr<ReplayCache> AsyncPostgresStore::replay_cache() const noexcept { return impl_->replay_cache.load(); }

// Each coroutine keeps the Impl alive while it runs (a copy of impl_ in its frame).
net::awaitable<Claim> AsyncPostgresStore::co_claim(Key key, Fingerprint fp, ClaimOptions options) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    // The replay cache (src/replay_rules.hpp, as CachedStore): it holds opened records, so a hit
    // answers as the database's opened answer below would.
    const std::shared_ptr<ReplayCache> cache = impl->replay_cache.load();
    ReplayTier::time_point asked_at{};
    if (cache) {
        if (const auto hit = cache->find(key)) {
            Claim claim = idem::detail::from_cache(*hit, key_fingerprint(fp));
            idem::detail::drop_mismatch_result(impl->options.sealing, claim);
            co_return claim;
        }
        asked_at = cache->now();  // before the database is asked (replay_rules.hpp)
    }
    Claim claim = co_await impl->claim_on_strand(key, fp, options);
    idem::detail::open_claim(impl->options.sealing, impl->options.table, key, claim);
    if (cache && idem::detail::cacheable(claim)) cache->insert(key, *claim.existing, asked_at);
    co_return claim;
}

net::awaitable<void> AsyncPostgresStore::co_save(Key key, Fence fence, std::string result) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    co_await impl->save_on_strand(key, fence, result);
}

net::awaitable<void> AsyncPostgresStore::co_release(Key key, Fence fence) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    co_await impl->release_on_strand(key, fence);
}

net::awaitable<void> AsyncPostgresStore::co_extend_lease(Key key, Fence fence, std::chrono::milliseconds lease) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    co_await impl->owned_write(pg::OwnedWriteOp::extend_lease(key, fence, lease));
}

net::awaitable<void> AsyncPostgresStore::co_record_phase(Key key, Fence fence, std::string phase, std::string data) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    co_await impl->owned_write(pg::OwnedWriteOp::record_phase(key, fence, phase, data));
}

net::awaitable<std::optional<Fence>> AsyncPostgresStore::co_take_over(Key key, Fence stale_fence,
                                                                      std::chrono::milliseconds lease,
                                                                      bool new_attempt) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    const Fence fence = idem::detail::new_fence();
    if (!co_await impl->take_over_on_strand(key, stale_fence, fence, lease, new_attempt)) co_return std::nullopt;
    emit(Event::taken_over, &key);
    co_return fence;
}

net::awaitable<std::optional<Record>> AsyncPostgresStore::co_read(Key key) {
    co_await net::this_coro::throw_if_cancelled(false);  // an idem error or an answer, never operation_aborted
    auto impl = impl_;
    impl->count(impl->counters.reads);
    pg::ReadOp op(key);
    co_await impl->drive("read", op);
    std::optional<Record> record = std::move(op.record());
    idem::detail::open_record(impl->options.sealing, impl->options.table, key, record);
    co_return record;
}

namespace {
// The blocking interface runs the asynchronous operation and waits for it on the calling thread:
// never on the store's own strand, where the operation could not run while we wait.
void refuse_on_own_executor(const AsyncPostgresStore::executor_type& strand) {
    if (strand.running_in_this_thread()) {
        throw config_error(
            "idem: a blocking call of AsyncPostgresStore was made on the store's own executor, "
            "where it would wait for itself: co_await the co_ / async_ forms there");
    }
}
}  // namespace

Claim AsyncPostgresStore::claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options) {
    refuse_on_own_executor(impl_->strand);
    return async_claim(key, fp, options, net::use_future).get();
}

void AsyncPostgresStore::save(const Key& key, Fence fence, std::string_view result) {
    refuse_on_own_executor(impl_->strand);
    async_save(key, fence, std::string(result), net::use_future).get();
}

void AsyncPostgresStore::release(const Key& key, Fence fence) {
    refuse_on_own_executor(impl_->strand);
    async_release(key, fence, net::use_future).get();
}

void AsyncPostgresStore::extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) {
    refuse_on_own_executor(impl_->strand);
    async_extend_lease(key, fence, lease, net::use_future).get();
}

void AsyncPostgresStore::record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) {
    refuse_on_own_executor(impl_->strand);
    async_record_phase(key, fence, std::string(phase), std::string(data), net::use_future).get();
}

std::optional<Fence> AsyncPostgresStore::take_over(const Key& key, Fence stale_fence, std::chrono::milliseconds lease,
                                                   bool new_attempt) {
    refuse_on_own_executor(impl_->strand);
    return async_take_over(key, stale_fence, lease, new_attempt, net::use_future).get();
}

std::optional<Record> AsyncPostgresStore::read(const Key& key) {
    refuse_on_own_executor(impl_->strand);
    return async_read(key, net::use_future).get();
}

std::vector<StaleKey> AsyncPostgresStore::list_stale(std::size_t limit, const ScopeFilter& scopes) {
    return impl_->blocking.list_stale(limit, scopes);
}

std::size_t AsyncPostgresStore::count_stale(const ScopeFilter& scopes) { return impl_->blocking.count_stale(scopes); }

std::size_t AsyncPostgresStore::purge_expired(std::size_t batch_size, std::size_t max_batches) {
    return impl_->blocking.purge_expired(batch_size, max_batches);
}

StoreStats AsyncPostgresStore::stats() const {
    StoreStats s = impl_->blocking.stats();
    impl_->counters.add_to(s);
    return s;
}

PoolStats AsyncPostgresStore::pool_stats() const {
    const detail::PoolGauges& g = *impl_->gauges;
    PoolStats s;
    s.size = impl_->options.pool_size;
    std::tie(s.open, s.idle) = g.open_idle();
    s.waiters = g.opening_waiters.load(std::memory_order_relaxed) + g.queued.load(std::memory_order_relaxed);
    g.waits.add_to(s);
    s.acquires = std::max(g.acquires.load(std::memory_order_relaxed), s.waited);  // (relaxed: never fewer)
    return s;
}

GroupCommitStats AsyncPostgresStore::group_commit_stats() const {
    GroupCommitStats g = impl_->blocking.group_commit_stats();
    impl_->counters.add_to(g);
    impl_->largest.add_to(g);
    return g;
}

}  // namespace idem::asio
