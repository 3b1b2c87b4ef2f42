#include "pool.hpp"

#include <optional>
#include <string>

namespace idem::pg {

Lease::~Lease() {
    if (pool_ && conn_) pool_->give_back(std::move(conn_));
}

Pool::Pool(std::size_t size, std::chrono::milliseconds wait, std::chrono::milliseconds health_check_after,
           Factory factory, Ping ping, Event event)
    : size_(size),
      wait_(wait),
      health_check_after_(health_check_after),
      factory_(std::move(factory)),
      ping_(std::move(ping)),
      event_(std::move(event)) {}

Pool::~Pool() = default;

Lease Pool::acquire() {
    std::optional<Clock::time_point> deadline;  // read the clock only if we have to wait
    for (;;) {
        std::unique_ptr<Connection> conn;
        Clock::time_point suspect_before;
        {
            std::unique_lock lock(mutex_);
            if (idle_.empty() && open_ >= size_ && !deadline) deadline = Clock::now() + wait_;
            while (idle_.empty() && open_ >= size_) {
                if (returned_.wait_until(lock, *deadline) == std::cv_status::timeout && idle_.empty() &&
                    open_ >= size_) {
                    throw pool_timeout("idem: no PostgreSQL connection free within " +
                                       std::to_string(wait_.count()) + " ms (pool_size " +
                                       std::to_string(size_) + ")");
                }
            }
            suspect_before = suspect_before_;
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
            } else {
                ++open_;  // reserve the slot, open outside the lock
            }
        }
        if (!conn) {
            try {
                conn = factory_();
            } catch (...) {
                std::lock_guard lock(mutex_);
                --open_;
                returned_.notify_one();
                throw;
            }
            event_(true);
            return Lease(this, std::move(conn));
        }
        // Health check only for connections idle long enough to have been cut by a firewall,
        // a restart or an idle timeout; a failed one is closed and we try again.
        const bool suspect = conn->last_used() < suspect_before;
        if ((!suspect && Clock::now() - conn->last_used() < health_check_after_) || ping_(*conn)) {
            return Lease(this, std::move(conn));
        }
        give_back(std::move(conn));  // broken: closed and slot freed
    }
}

void Pool::suspect_idle() noexcept {
    std::lock_guard lock(mutex_);
    suspect_before_ = Clock::now();
}

void Pool::give_back(std::unique_ptr<Connection> conn) noexcept {
    const bool broken = conn->broken();
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
