// One libpq connection in pipeline mode, and the RAII owners around it (internal).
//
// Every statement goes through Connection::run(): statements are sent in segments, each segment
// closed by its own Sync (so each segment is its own implicit transaction), all flushed together and
// answered in ONE round trip. Waits are bounded by a deadline on the socket (poll), so a dead server
// or a lost network becomes an error, never a hang. A connection that failed mid-pipeline is marked
// broken and must be discarded: its protocol state is unknown.
#pragma once

#include <libpq-fe.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "connect.hpp"
#include "handles.hpp"
#include "pipeline.hpp"
#include "sansio/columns.hpp"
#include "sansio/params.hpp"
#include "sansio/sqlstate.hpp"
#include "watchdog.hpp"

namespace idem::pg {

class Connection {
public:
    /// Connects (bounded by connect_timeout), enters pipeline mode and prepares `defs`.
    /// Throws store_unavailable.
    Connection(const ConnectSettings& settings, std::span<const StatementDef> defs);
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;
    ~Connection();

    /// Sends every step, flushes once, and reads every answer before `deadline`.
    /// Throws connection_broken (connection unusable afterwards) — never for a statement's own error,
    /// which comes back in its StepResult. When a statement or the COMMIT at a segment's Sync fails,
    /// the statements before it in that segment come back rolled_back (their effects are undone),
    /// and a failed COMMIT is reported as the failure of the segment's last statement.
    /// In a fork()ed child of the process that opened it: sends nothing, abandons the connection
    /// (abandon_in_child) and throws config_error (a lease held across fork(), e.g. in-transaction mode).
    StepResults run(std::span<const Step> steps, Clock::time_point deadline);

    /// run() in two halves, for a pipeline sent by one thread and read by another (group commit's
    /// relay): send_pipeline() sends every step and flushes (throws connection_broken, and marks the
    /// connection broken, when that fails); receive_pipeline() reads the answers of exactly those
    /// steps, as run() does. Between the two the connection carries unread answers: whoever holds it
    /// must receive them, or abandon_exchange() (the connection is then discarded, never reused).
    void send_pipeline(std::span<const Step> steps, Clock::time_point deadline);
    StepResults receive_pipeline(std::span<const Step> steps, Clock::time_point deadline);
    void abandon_exchange() noexcept;

    /// Waits until a notification on `channel` whose payload is `payload` arrives, or `deadline`.
    /// Returns whether it arrived. Other notifications are dropped.
    bool wait_notification(std::string_view channel, std::string_view payload, Clock::time_point deadline);

    /// In a fork()ed child: lets go of the parent's session without a word to the server. Closes
    /// this process's copy of the socket (the parent's session goes on) and leaks the libpq handle
    /// (PQfinish would send the server a Terminate on the parent's behalf); the watchdog is not told
    /// (its thread does not exist in the child). The connection is unusable afterwards.
    void abandon_in_child() noexcept;

    /// Marks the connection unusable (its state is unknown after an interrupted exchange).
    void mark_broken() noexcept { broken_ = true; }
    [[nodiscard]] bool broken() const noexcept { return broken_; }
    /// The raw handle, for in-transaction mode's users.
    [[nodiscard]] PGconn* native() const noexcept { return conn_.get(); }
    [[nodiscard]] Clock::time_point last_used() const noexcept { return last_used_; }

    /// Called by the Watchdog: past the published deadline, shut the socket down (wakes the wait).
    void expire_if_overdue(Clock::time_point now) noexcept;

private:
    [[noreturn]] void fail(const std::string& what);
    void send(const Step& step);
    void flush(Clock::time_point deadline);
    void wait(short events, Clock::time_point deadline);
    ResultPtr next_result(Clock::time_point deadline);

    [[noreturn]] void fail_overdue();
    [[noreturn]] void refuse_in_child();  // abandon_in_child(), then config_error
    void prepare(const ConnectSettings& settings, std::span<const StatementDef> defs);

    ConnPtr conn_;
    // The process that opened the session (detail::fork_generation): run() refuses in any other.
    const std::uint64_t generation_;
    bool prepared_;
    bool broken_ = false;
    Clock::time_point last_used_;
    Watchdog* watchdog_ = nullptr;  // set once the connection is complete and watched
    int fd_ = -1;
    std::atomic<Clock::rep> waiting_until_{0};  // deadline of the exchange in progress; 0: none
    std::atomic<bool> overdue_{false};          // the watchdog shut the socket down
};

}  // namespace idem::pg
