#include "pool.hpp"

#include <algorithm>
#include <optional>
#include <string>

#include "../process.hpp"

namespace idem::pg {

Lease::~Lease() {
    if (pool_ && conn_) pool_->give_back(std::move(conn_));
}

Pool::Pool(std::size_t size, std::chrono::milliseconds wait, std::chrono::milliseconds health_check_after,
           Factory factory, Ping ping, Event event)
    : size_(size),
      generation_(detail::fork_generation()),
      wait_(wait),
      health_check_after_(health_check_after),
      factory_(std::move(factory)),
      ping_(std::move(ping)),
      event_(std::move(event)),
      parked_(std::make_unique<Slot[]>(size)) {}

Pool::~Pool() {
    for (std::size_t i = 0; i < size_; ++i) delete parked_[i].conn.exchange(nullptr);
}

Pool::Slot& Pool::own_slot() noexcept { return parked_[detail::thread_index() % size_]; }

std::unique_ptr<Connection> Pool::take_parked() noexcept {
    for (std::size_t i = 0; i < size_; ++i) {
        std::atomic<Connection*>& slot = parked_[i].conn;
        // Look before writing the line. seq_cst, like the waiters_ increment before it: a parker
        // whose CAS this load misses is then certain to see the increment and wake us.
        if (slot.load(std::memory_order_seq_cst) == nullptr) continue;
        if (Connection* c = slot.exchange(nullptr, std::memory_order_seq_cst)) return std::unique_ptr<Connection>(c);
    }
    return nullptr;
}

Lease Pool::acquire(std::optional<Clock::time_point> deadline) { return *take(true, deadline); }

std::optional<Lease> Pool::try_acquire() {
    if (blocked_now_.load(std::memory_order_relaxed) != 0) return std::nullopt;
    return take(false, std::nullopt);
}

std::optional<Lease> Pool::take(bool wait, std::optional<Clock::time_point> deadline) {
    // Counted in this thread's slot: its line is written by the exchange below anyway.
    own_slot().acquires.fetch_add(1, std::memory_order_relaxed);
    // The time this acquire spends blocked, recorded once however it ends (a lease, a timeout, a
    // failed connect); the clock is read around the blocking waits only.
    struct WaitRecord {
        Pool& pool;
        Clock::duration total{0};
        bool waited = false;
        explicit WaitRecord(Pool& p) noexcept : pool(p) {}
        WaitRecord(const WaitRecord&) = delete;
        WaitRecord& operator=(const WaitRecord&) = delete;
        ~WaitRecord() {
            if (waited) pool.record_wait(total);
        }
    } waiting{*this};
    // `deadline` unset: pool_wait from the moment we first have to wait (the clock is read only then)
    for (;;) {
        // The common path: this thread's own parked connection, one atomic exchange, no lock.
        std::unique_ptr<Connection> conn(own_slot().conn.exchange(nullptr, std::memory_order_acquire));
        if (!conn) {
            std::unique_lock lock(mutex_);
            for (;;) {
                if (!idle_.empty()) {
                    // Ours if idle (a scan of at most pool_size entries), else the most recent one.
                    const auto self = std::this_thread::get_id();
                    std::size_t pick = idle_.size() - 1;
                    for (std::size_t i = idle_.size(); i-- > 0;) {
                        if (idle_[i].last_thread == self) {
                            pick = i;
                            break;
                        }
                    }
                    conn = std::move(idle_[pick].conn);
                    if (pick != idle_.size() - 1) idle_[pick] = std::move(idle_.back());
                    idle_.pop_back();
                    break;
                }
                // Announce ourselves before looking at the slots: a give_back that parks after our
                // look then sees us and wakes us (both sides seq_cst; see give_back).
                waiters_.fetch_add(1, std::memory_order_seq_cst);
                conn = take_parked();
                if (conn || open_ < size_) {
                    waiters_.fetch_sub(1, std::memory_order_relaxed);
                    if (!conn) ++open_;  // reserve the slot, open outside the lock
                    break;
                }
                if (!wait) {
                    waiters_.fetch_sub(1, std::memory_order_relaxed);
                    own_slot().acquires.fetch_sub(1, std::memory_order_relaxed);
                    return std::nullopt;
                }
                if (!deadline) deadline = Clock::now() + wait_;
                ++blocked_;
                blocked_now_.store(blocked_, std::memory_order_relaxed);
                const Clock::time_point began = Clock::now();
                const bool timed_out = returned_.wait_until(lock, *deadline) == std::cv_status::timeout;
                waiting.total += Clock::now() - began;
                waiting.waited = true;
                --blocked_;
                blocked_now_.store(blocked_, std::memory_order_relaxed);
                waiters_.fetch_sub(1, std::memory_order_relaxed);
                if (timed_out && idle_.empty() && open_ >= size_) {
                    conn = take_parked();
                    if (conn) break;
                    timeouts_.fetch_add(1, std::memory_order_relaxed);
                    throw pool_timeout("idem: no PostgreSQL connection free within " + std::to_string(wait_.count()) +
                                       " ms (pool_size " + std::to_string(size_) + ")");
                }
            }
        }
        if (!conn) {
            try {
                conn = factory_();
            } catch (...) {
                {
                    std::lock_guard lock(mutex_);
                    --open_;
                }
                returned_.notify_one();
                throw;
            }
            event_(true);
            return std::optional<Lease>(std::in_place, this, std::move(conn));
        }
        // Health check only for connections idle long enough to have been cut by a firewall,
        // a restart or an idle timeout; a failed one is closed and we try again.
        const Clock::time_point suspect_before{Clock::duration(suspect_before_.load(std::memory_order_acquire))};
        const bool suspect = conn->last_used() < suspect_before;
        if (!suspect && Clock::now() - conn->last_used() < health_check_after_) {
            return std::optional<Lease>(std::in_place, this, std::move(conn));
        }
        bool healthy = false;
        try {
            healthy = ping_(*conn);
        } catch (...) {  // (out of memory...) not known to be healthy: same as a failed ping
        }
        if (healthy) return std::optional<Lease>(std::in_place, this, std::move(conn));
        // A failed ping, whatever its cause, discards the connection (a statement error on a
        // live one would otherwise send it back to its slot and out again unchecked).
        conn->mark_broken();
        give_back(std::move(conn));  // closed and its place freed
    }
}

void Pool::record_wait(Clock::duration waited) noexcept {
    waits_.record(std::chrono::duration_cast<std::chrono::nanoseconds>(waited));
}

PoolStats Pool::stats() const {
    PoolStats s;
    s.size = size_;
    std::uint64_t acquires = 0;
    for (std::size_t i = 0; i < size_; ++i) acquires += parked_[i].acquires.load(std::memory_order_relaxed);
    waits_.add_to(s);
    s.acquires = std::max(acquires, s.waited);  // (relaxed loads: never fewer acquires than waits)
    s.timeouts = timeouts_.load(std::memory_order_relaxed);
    std::lock_guard lock(mutex_);
    std::size_t parked = 0;
    for (std::size_t i = 0; i < size_; ++i) {
        if (parked_[i].conn.load(std::memory_order_relaxed) != nullptr) ++parked;
    }
    s.open = open_;
    s.idle = std::min(open_, idle_.size() + parked);
    s.waiters = blocked_;
    return s;
}

void Pool::abandon_in_child() noexcept {
    for (std::size_t i = 0; i < size_; ++i) {
        if (Connection* c = parked_[i].conn.exchange(nullptr)) {
            c->abandon_in_child();
            delete c;
        }
    }
    if (!mutex_.try_lock()) return;  // held at the fork by a thread that is gone: leak the idle list
    for (Idle& idle : idle_) {
        if (idle.conn) idle.conn->abandon_in_child();
    }
    idle_.clear();
    mutex_.unlock();
}

void Pool::suspect_idle() noexcept {
    suspect_before_.store(Clock::now().time_since_epoch().count(), std::memory_order_release);
}

void Pool::give_back(std::unique_ptr<Connection> conn) noexcept {
    if (detail::fork_generation() != generation_) {
        // A lease held across fork(), ending in the child: the parent's session. Nothing is sent
        // on it and no lock is taken (its holder at the fork may be gone); the pool is not told.
        conn->abandon_in_child();
        return;
    }
    const bool broken = conn->broken();
    if (!broken) {
        // Park it in this thread's slot if the slot is free: no lock.
        Connection* expected = nullptr;
        if (own_slot().conn.compare_exchange_strong(expected, conn.get(), std::memory_order_seq_cst)) {
            (void)conn.release();
            // A caller that found nothing may be about to wait (it counted itself in waiters_
            // before looking at the slots): wake it. Taking the mutex first means it either has
            // not looked yet (and will find this connection) or already waits (and is woken).
            if (waiters_.load(std::memory_order_seq_cst) > 0) {
                { std::lock_guard lock(mutex_); }
                returned_.notify_one();
            }
            return;
        }
    }
    if (broken) conn.reset();  // PQfinish outside the lock
    {
        std::lock_guard lock(mutex_);
        if (broken) {
            --open_;
        } else {
            idle_.push_back(Idle{std::this_thread::get_id(), std::move(conn)});
        }
    }
    returned_.notify_one();
    if (broken) {
        try {
            event_(false);
        } catch (...) {
        }
    }
}

}  // namespace idem::pg
