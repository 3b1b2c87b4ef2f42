// The decisions of PostgresStore's operations, apart from their I/O (internal).
//
// One claim, save or release decides the same way whether its statements went through the blocking
// pool (PostgresStore) or through a non-blocking connection on an event loop (idem::asio): one
// runner (runner.hpp) feeds the answers of their round trips into the code here and has the
// store's driver do what it says next. So there is one
// copy of the rules — which answer means "won", "ours from a lost answer", "busy, try again",
// "retry on a fresh connection" — and the stores differ only in how they wait.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <optional>
#include <string_view>

#include "../../poll_schedule.hpp"
#include "../../retry_policy.hpp"
#include "columns.hpp"
#include "idem/errors.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"
#include "params.hpp"
#include "result.hpp"
#include "sqlstate.hpp"

namespace idem::pg {

/// serialization_failure, deadlock_detected, lock_not_available (lock_timeout while waiting on a
/// concurrent, uncommitted claim of the same key): a claim tries again.
[[nodiscard]] bool claim_retryable(std::string_view sqlstate) noexcept;

/// Throws the idem error for a failed statement ("idem: <what> failed: <message>", by SQLSTATE).
[[noreturn]] void throw_statement_error(const StepResult& r, const char* what);

/// Parameters of the claim INSERT and of the expired re-claim ($1..$7).
void add_claim_params(Params& p, const Key& key, const Fingerprint& fp, Fence fence, std::chrono::milliseconds lease,
                      std::chrono::seconds retention);

/// A write only the fence holder of an in-progress key may make (extend_lease, record_phase):
/// throws the statement's error, or lease_lost when no row was changed.
void expect_owned(const StepResults& res, const char* what, Fence fence);

/// What the answer to a save's UPDATE (kSave) says.
enum class SaveAnswer {
    saved,         ///< done; notify_waiters() tells whether someone waits for it
    check_record,  ///< not updated, after an attempt whose answer was lost: read the record (save_landed)
    lost,          ///< not updated: the fence lost the key (throw lease_lost)
};
/// `resent`: an earlier attempt of this very save may have landed (a retry, or a group's statement).
/// Throws the statement's error.
[[nodiscard]] SaveAnswer save_answer(const StepResults& res, bool resent, bool& notify_waiters);
[[noreturn]] void throw_save_lost(Fence fence);

/// A take_over's answer (kTakeOver): the record taken over, or nullopt when another taker won or,
/// on a resend, the first attempt's answer was lost (then read the record: take_over_landed).
[[nodiscard]] std::optional<Record> take_over_answer(const StepResults& res, std::chrono::milliseconds lease);

/// What a re-claim of an expired record (kReclaimExpired) came to.
enum class ReclaimAnswer {
    won,   ///< this call re-claimed the key
    lost,  ///< another caller re-claimed it first: read it again
    /// A concurrent re-claimer holds the row past lock_timeout, or moved it to another generation,
    /// or a deadlock victim (55P03, 40001, 40P01): as a busy claim, tried again, then in_progress.
    busy,
};

/// How PostgresStore and idem::asio go on after a failed attempt of one operation: another attempt
/// on a fresh connection, after a pause, or the caller's error. The schedule is detail::RetryPolicy's
/// (retry_policy.hpp); this sorts PostgreSQL's failures into its kinds: a broken connection
/// (claim_attempts in all), a failed connect (the server is away: retried only within
/// `keep_trying`), a serialization failure or deadlock (40001, 40P01: claim_attempts, or
/// `keep_trying`). Any other error goes to the caller as it is.
class Retrier {
public:
    /// `now`: the clock of the `keep_trying` window (a test's, to step through it).
    Retrier(int claim_attempts, Clock::duration keep_trying, detail::SteadyNow now = &Clock::now) noexcept
        : policy_(claim_attempts, keep_trying, now) {}

    struct Next {
        std::chrono::milliseconds pause{0};  ///< wait this long, then try again
        bool broken = false;                 ///< the connection broke (the pool should suspect its idle ones)
    };
    /// Called with the attempt's exception: returns how to go on, or throws the error the caller
    /// gets (store_unavailable naming `what`, or the original exception). When the connection broke,
    /// `on_broken` runs first, also before giving up: a server that restarted broke every idle
    /// connection too, and neither the retry nor the next call should pick one of them.
    Next after_failure(const std::exception_ptr& failure, const char* what,
                       const std::function<void()>& on_broken = {});
    /// 1 for the first attempt; more means an earlier attempt may have committed.
    [[nodiscard]] int attempt() const noexcept { return policy_.attempt(); }

private:
    detail::RetryPolicy policy_;
};

/// The claim's decisions. Every path fills one Claim object (the caller's, so a replay decodes its
/// row straight into it). pg::run_claim (runner.hpp) loops over a driver: do what the last answer
/// asks next, feed its answer back, until done; in-transaction mode and batches feed it too.
class ClaimMachine {
public:
    enum class Next {
        round_trip,       ///< [INSERT, SELECT]: claim or read; answer with on_round_trip()
        reclaim_expired,  ///< kReclaimExpired (the record is past its retention); answer with on_reclaimed()
        take_over,        ///< resume mode: take over stale_fence(); answer with on_taken_over()
        wait,             ///< ClaimOptions::wait: wait for the owner's save until wait_until(), then on_waited()
        done,             ///< result() is the answer
    };

    /// `now`: the clock of the wait (ClaimOptions::wait) and its polls (a test's, to step through it).
    ClaimMachine(Claim& out, Fence fence, const Fingerprint& fp, const ClaimOptions& options, int claim_attempts,
                 std::chrono::milliseconds max_retry_after, detail::SteadyNow now = &Clock::now) noexcept;

    /// The answers of [INSERT, SELECT] (the blocking store's group commit delivers the same pair).
    /// Throws the statement's error when nothing of the attempt committed and no retry helps.
    Next on_round_trip(StepResults& res);
    /// The same answers, already classified by a group commit: the INSERT won; a record was read
    /// into the Claim's `existing`; nothing was found (`conflicted`: after a retryable failure).
    Next on_won() { return step(), claimed(); }
    Next on_found() { return step(), found(); }
    Next on_absent(bool conflicted);
    /// The key is busy and the caller answers at once instead of trying again (in-transaction
    /// mode's TransactionOptions::lock_wait passed): in_progress, retry after max_retry_after.
    Next on_busy();
    Next on_reclaimed(ReclaimAnswer answer);
    Next on_taken_over(std::optional<Record> taken);
    /// `still_waiting`: the wait ended with a reason to read again (a save was announced, or a poll
    /// is due); false answers in_progress now.
    Next on_waited(bool still_waiting);
    /// The answer of a poll while waiting (kWaitPoll for stale_fence()): wait (the attempt still
    /// runs, the wait has time left), round_trip (something changed: read the record and decide
    /// again) or done (in_progress: the wait is over). Throws the statement's error.
    Next on_polled(const StepResults& res);
    /// When the wait should read the key again (a poll): detail::PollSchedule, never past
    /// wait_until(). Each call moves on one step.
    [[nodiscard]] Clock::time_point next_poll() noexcept { return polls_.next(); }

    /// Before the next round trip, after a conflict: a jittered pause (zero: go at once).
    [[nodiscard]] std::chrono::milliseconds pause() const noexcept { return pause_; }
    /// The last on_round_trip() asked for another attempt (a retry, for the counters).
    [[nodiscard]] bool retrying() const noexcept { return retrying_; }
    /// done: this call won the key (claimed); took_over(): by a resume-mode takeover.
    [[nodiscard]] bool won() const noexcept { return out_.status == ClaimStatus::claimed; }
    [[nodiscard]] bool took_over() const noexcept { return took_over_; }
    [[nodiscard]] Fence stale_fence() const noexcept { return out_.existing ? out_.existing->fence : 0; }
    [[nodiscard]] Clock::time_point wait_until() const noexcept { return polls_.end(); }

private:
    void step() noexcept { retrying_ = false, pause_ = {}; }
    Next claimed(std::optional<Record> taken = std::nullopt);
    Next busy();
    Next found();
    Claim& out_;
    const Fence fence_;
    const Fingerprint& fp_;
    const bool resume_stale_;
    const int claim_attempts_;
    const std::chrono::milliseconds max_retry_after_;
    const detail::SteadyNow now_;
    int failures_ = 0;
    std::chrono::milliseconds pause_{0};
    bool retrying_ = false;
    bool took_over_ = false;
    detail::PollSchedule polls_;  // its end: the wait's (ClaimOptions::wait), or the epoch without one
};

}  // namespace idem::pg
