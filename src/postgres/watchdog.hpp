// The deadlines of a store's blocking connections, kept by one thread (internal).
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stop_token>
#include <thread>
#include <vector>

namespace idem::pg {

class Connection;

/// Enforces the deadlines of a store's connections without a timer per wait.
///
/// Waiting for an answer with poll(timeout) arms a high-resolution timer in the kernel for every
/// wait, and cancels it when the answer comes first — on a virtual machine each of those can be a
/// trap to the hypervisor. Instead a watched connection waits with no timeout and publishes its deadline; one thread
/// per store looks every `tick` and shuts down the socket of a connection past its deadline, which
/// wakes the wait (the connection then throws "did not answer in time" and is discarded). Deadlines
/// are thus kept to within one tick. Thread-safe.
class Watchdog {
public:
    explicit Watchdog(std::chrono::milliseconds tick);
    ~Watchdog();
    Watchdog(const Watchdog&) = delete;
    Watchdog& operator=(const Watchdog&) = delete;

    void watch(Connection* conn);
    void forget(Connection* conn) noexcept;

private:
    void run(std::stop_token stop);
    const std::chrono::milliseconds tick_;
    std::mutex mutex_;
    std::condition_variable_any wake_;
    std::vector<Connection*> watched_;
    std::jthread thread_;  // last: started after everything it uses
};

}  // namespace idem::pg
