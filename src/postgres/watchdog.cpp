#include "watchdog.hpp"

#include <algorithm>

#include "connection.hpp"

namespace idem::pg {

Watchdog::Watchdog(std::chrono::milliseconds tick)
    : tick_(tick), thread_([this](std::stop_token stop) { run(stop); }) {}

Watchdog::~Watchdog() {
    thread_.request_stop();
    wake_.notify_all();
}  // thread_ joins here, before the members it uses go

void Watchdog::watch(Connection* conn) {
    std::lock_guard lock(mutex_);
    watched_.push_back(conn);
}

void Watchdog::forget(Connection* conn) noexcept {
    std::lock_guard lock(mutex_);
    std::erase(watched_, conn);
}

void Watchdog::run(std::stop_token stop) {
    std::unique_lock lock(mutex_);
    while (!stop.stop_requested()) {
        wake_.wait_for(lock, stop, tick_, [] { return false; });
        const auto now = Clock::now();
        // Under the mutex: forget() cannot return, so no connection is destroyed, while we look.
        for (Connection* conn : watched_) conn->expire_if_overdue(now);
    }
}

}  // namespace idem::pg
