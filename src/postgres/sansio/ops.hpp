// PostgresStore's single-key operations, apart from their I/O (internal).
//
// Each operation is an object that says which statement to send next and is fed what came back;
// it does no I/O and holds no connection. pg::run_op (runner.hpp) runs every operation over a
// driver — the blocking store's (a pooled connection, one thread) or idem::asio's (a pipelined
// connection, a coroutine) — inside the driver's retry loop (Retrier), once per attempt:
//
//     op.start(attempt);                  // 1, then 2, 3 … on a fresh connection after a failure
//     do { Params p; op.bind(p); res = <run op.statement() with p, alone>; } while (!op.feed(res));
//     … op's result accessor …
//
// feed() returns true when the operation is done, false when it wants statement() sent next (a
// read-back after a resend), and throws the caller's error (statement failures as idem errors,
// lease_lost). The claim's decisions are the ClaimMachine's (machine.hpp), run by pg::run_claim;
// its statements are ClaimRoundTrip and ReclaimExpiredOp here; groups and batches are the plans of rows.hpp. Not
// thread-safe; an operation refers to the key and the bytes (result, phase, data) it
// was given, which must outlive it.
#pragma once

#include <array>
#include <chrono>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "columns.hpp"
#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"
#include "machine.hpp"
#include "params.hpp"
#include "result.hpp"
#include "sql.hpp"
#include "sqlstate.hpp"

namespace idem::pg {

/// A claim's one round trip for one key, whose two answers ClaimMachine::on_round_trip reads:
///   pipeline  [INSERT, SELECT | Sync]: one implicit transaction, committed when the Sync's answer
///             arrives. The SELECT is a statement of its own, so under READ COMMITTED it takes a new
///             snapshot and sees a conflicting claim that committed while the INSERT waited for it
///             (one statement could not: docs/design.md); under REPEATABLE READ that case is a
///             40001 from the INSERT, retried.
///   block     [BEGIN, INSERT, SELECT, COMMIT | Sync], wherever Citus is installed: Citus does not
///             take a pipeline's implicit transaction for a transaction block and commits the
///             INSERT on its shard at once, so a claim whose read failed would leave its row behind;
///             the block makes the INSERT commit or roll back with the read, as on one node. After
///             a failure the block is still open: the driver rolls it back (Shape::block), or sends
///             the ROLLBACK in the same round trip (Shape::block_then_rollback: requests of other
///             callers follow on a pipelined connection; outside a block it is a mere warning).
/// answers() maps a block's answers back onto [INSERT, SELECT]: a failed BEGIN onto the INSERT, a
/// failed COMMIT onto the SELECT (as Connection::run reports a failed implicit commit). The key and
/// fingerprint must outlive the plan, which must not move (its steps point into it).
class ClaimRoundTrip {
public:
    enum class Shape { pipeline, block, block_then_rollback };

    ClaimRoundTrip(const std::vector<StatementDef>& defs, Shape shape, const Key& key, const Fingerprint& fp,
                   Fence fence, std::chrono::milliseconds lease, std::chrono::seconds retention);
    ClaimRoundTrip(const ClaimRoundTrip&) = delete;
    ClaimRoundTrip& operator=(const ClaimRoundTrip&) = delete;

    [[nodiscard]] std::span<const Step> steps() const noexcept { return {steps_.data(), count_}; }
    /// The answers as [INSERT, SELECT].
    [[nodiscard]] StepResults answers(StepResults all) const;
    /// Shape::block_then_rollback: whether the ROLLBACK left the connection outside a failed block
    /// (false: close the connection, the requests behind this one would run in the block).
    [[nodiscard]] static bool rolled_back(const StepResults& all) noexcept { return all[4].ok(); }

private:
    Shape shape_;
    Params insert_, select_, none_;
    std::array<Step, 5> steps_{};
    std::size_t count_ = 0;
};

/// The claim of a key whose record is past its retention (kReclaimExpired): won() when this call
/// got it.
class ReclaimExpiredOp {
public:
    ReclaimExpiredOp(const Key& key, const Fingerprint& fp, Fence fence, std::chrono::milliseconds lease,
                     std::chrono::seconds retention) noexcept
        : key_(key), fp_(fp), fence_(fence), lease_(lease), retention_(retention) {}
    void start(int) noexcept { answer_ = ReclaimAnswer::lost; }
    [[nodiscard]] Stmt statement() const noexcept { return kReclaimExpired; }
    void bind(Params& p) const;
    bool feed(const StepResults& res);
    [[nodiscard]] ReclaimAnswer answer() const noexcept { return answer_; }

private:
    const Key& key_;
    const Fingerprint& fp_;
    const Fence fence_;
    const std::chrono::milliseconds lease_;
    const std::chrono::seconds retention_;
    ReclaimAnswer answer_ = ReclaimAnswer::lost;
};

/// The record of a key (kSelect), or nullopt.
class ReadOp {
public:
    explicit ReadOp(const Key& key) noexcept : key_(key) {}
    void start(int) noexcept { record_.reset(); }
    [[nodiscard]] Stmt statement() const noexcept { return kSelect; }
    void bind(Params& p) const;
    bool feed(const StepResults& res);
    [[nodiscard]] std::optional<Record>& record() noexcept { return record_; }

private:
    const Key& key_;
    std::optional<Record> record_;
};

/// The one-row UPDATE of a save (kSave). `resent`: an earlier statement (a group's) may already
/// have saved it. Done: waiters() tells whether a caller waits for the key (NOTIFY it).
class SaveOp {
public:
    SaveOp(const Key& key, Fence fence, std::string_view result, bool resent) noexcept
        : key_(key), fence_(fence), result_(result), resent_(resent) {}
    void start(int attempt) noexcept { attempt_ = attempt, reading_ = false, waiters_ = false; }
    [[nodiscard]] Stmt statement() const noexcept { return reading_ ? kSelect : kSave; }
    void bind(Params& p) const;
    bool feed(const StepResults& res);
    [[nodiscard]] bool waiters() const noexcept { return waiters_; }

private:
    const Key& key_;
    const Fence fence_;
    const std::string_view result_;
    const bool resent_;
    int attempt_ = 1;
    bool reading_ = false;
    bool waiters_ = false;
};

/// The delete of an in-progress key by its owner (kRelease).
class ReleaseOp {
public:
    ReleaseOp(const Key& key, Fence fence) noexcept : key_(key), fence_(fence) {}
    void start(int attempt) noexcept { attempt_ = attempt, reading_ = false; }
    [[nodiscard]] Stmt statement() const noexcept { return reading_ ? kSelect : kRelease; }
    void bind(Params& p) const;
    bool feed(const StepResults& res);

private:
    const Key& key_;
    const Fence fence_;
    int attempt_ = 1;
    bool reading_ = false;
};

/// A stale claim (fence `stale`, lease passed) given the fence `fresh` (kTakeOver). Done: taken()
/// is the record taken over, or nullopt when another taker won.
class TakeOverOp {
public:
    TakeOverOp(const Key& key, Fence stale, Fence fresh, std::chrono::milliseconds lease, bool new_attempt) noexcept
        : key_(key), stale_(stale), fresh_(fresh), lease_(lease), new_attempt_(new_attempt) {}
    void start(int attempt) noexcept { attempt_ = attempt, reading_ = false, taken_.reset(); }
    [[nodiscard]] Stmt statement() const noexcept { return reading_ ? kSelect : kTakeOver; }
    void bind(Params& p) const;
    bool feed(const StepResults& res);
    [[nodiscard]] std::optional<Record>& taken() noexcept { return taken_; }

private:
    const Key& key_;
    const Fence stale_, fresh_;
    const std::chrono::milliseconds lease_;
    const bool new_attempt_;
    int attempt_ = 1;
    bool reading_ = false;
    std::optional<Record> taken_;
};

/// A write only the fence holder of an in-progress key may make: extend_lease (kExtendLease) or
/// record_phase (kRecordPhase). lease_lost when the fence no longer owns the key.
class OwnedWriteOp {
public:
    static OwnedWriteOp extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) noexcept {
        return OwnedWriteOp(kExtendLease, "extend_lease", key, fence, lease, {}, {});
    }
    static OwnedWriteOp record_phase(const Key& key, Fence fence, std::string_view phase,
                                     std::string_view data) noexcept {
        return OwnedWriteOp(kRecordPhase, "record_phase", key, fence, {}, phase, data);
    }
    void start(int) noexcept {}
    [[nodiscard]] Stmt statement() const noexcept { return stmt_; }
    [[nodiscard]] const char* what() const noexcept { return what_; }
    void bind(Params& p) const;
    bool feed(const StepResults& res);

private:
    OwnedWriteOp(Stmt stmt, const char* what, const Key& key, Fence fence, std::chrono::milliseconds lease,
                 std::string_view phase, std::string_view data) noexcept
        : stmt_(stmt), what_(what), key_(key), fence_(fence), lease_(lease), phase_(phase), data_(data) {}
    const Stmt stmt_;
    const char* const what_;
    const Key& key_;
    const Fence fence_;
    const std::chrono::milliseconds lease_;
    const std::string_view phase_, data_;
};

/// The payload of the NOTIFY that wakes callers waiting for a saved key (kNotify; a waiter's LISTEN
/// compares it): the table, the scope and the key, separated by \x1f, which a key cannot hold, so
/// the payload is unambiguous.
[[nodiscard]] std::string notify_payload(const TableName& table, const Key& key);

/// That NOTIFY; its answer is not looked at (waiters also poll).
class NotifyOp {
public:
    NotifyOp(const TableName& table, const Key& key) : payload_(notify_payload(table, key)) {}
    void start(int) noexcept {}
    [[nodiscard]] Stmt statement() const noexcept { return kNotify; }
    void bind(Params& p) const { p.text(payload_); }
    bool feed(const StepResults&) noexcept { return true; }

private:
    std::string payload_;
};

}  // namespace idem::pg
