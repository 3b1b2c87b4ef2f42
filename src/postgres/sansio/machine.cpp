#include "machine.hpp"

#include <algorithm>
#include <string>

#include "../../store_rules.hpp"
#include "record.hpp"

namespace idem::pg {

using detail::jitter;

bool claim_retryable(std::string_view sqlstate) noexcept {
    return sqlstate == "40001" || sqlstate == "40P01" || sqlstate == "55P03";
}

void throw_statement_error(const StepResult& r, const char* what) {
    throw_database_error(std::string("idem: ") + what + " failed: " + r.message(), std::string(r.sqlstate()));
}

void add_claim_params(Params& p, const Key& key, const Fingerprint& fp, Fence fence, std::chrono::milliseconds lease,
                      std::chrono::seconds retention) {
    p.text(key.scope())
        .text(key.value())
        .bytes(fp.bytes())
        .int2(static_cast<std::int16_t>(fp.algorithm()))
        .int8(fence)
        .int8(lease.count())
        .int8(retention.count());
}

void expect_owned(const StepResults& res, const char* what, Fence fence) {
    if (!res[0].ok()) throw_statement_error(res[0], what);
    if (res[0].rows() != 1) {
        throw lease_lost(std::string("idem: ") + what + " refused: fence " + std::to_string(fence) +
                         " no longer owns the key");
    }
}

SaveAnswer save_answer(const StepResults& res, bool resent, bool& notify_waiters) {
    if (!res[0].ok()) throw_statement_error(res[0], "save");
    if (res[0].rows() == 1) {
        notify_waiters = get_bool(res[0].result.get(), 0, 0);
        return SaveAnswer::saved;
    }
    // Not updated: either an earlier attempt of this very save landed before its answer was lost
    // (a retry finds its own bytes in place), or the fence lost the key.
    return resent ? SaveAnswer::check_record : SaveAnswer::lost;
}

void throw_save_lost(Fence fence) {
    throw lease_lost("idem: save refused: fence " + std::to_string(fence) + " no longer owns the key");
}

std::optional<Record> take_over_answer(const StepResults& res, std::chrono::milliseconds lease) {
    if (!res[0].ok()) throw_statement_error(res[0], "take_over");
    if (res[0].rows() != 1) return std::nullopt;
    Record taken = parse_record(res[0].result.get(), 0);
    taken.read_at = taken.lease_until - lease;  // the statement's now() (sql.cpp, kTakeOver)
    return taken;
}

// ---- Retrier ----------------------------------------------------------------------------------------

Retrier::Next Retrier::after_failure(const std::exception_ptr& failure, const char* what,
                                     const std::function<void()>& on_broken) {
    using Failure = detail::RetryPolicy::Failure;
    std::string message, sqlstate;
    Failure kind = Failure::unreachable;
    try {
        std::rethrow_exception(failure);
    } catch (const connection_broken& e) {
        message = detail::without_prefix(e.what()), sqlstate = e.sqlstate(), kind = Failure::broken;
    } catch (const pool_timeout&) {
        throw;  // already waited its bound
    } catch (const store_unavailable& e) {
        message = detail::without_prefix(e.what()), sqlstate = e.sqlstate();  // could not connect (restart, failover)
    } catch (const database_error& e) {
        // Every operation that comes here is one single-statement write or read: PostgreSQL rolled
        // it back whole, so it is safe to send again. Under a REPEATABLE READ or SERIALIZABLE
        // default even a one-row UPDATE can be chosen as the victim, and a save must not fail for
        // it — its effect has already run.
        if (e.sqlstate() != "40001" && e.sqlstate() != "40P01") throw;
        kind = Failure::conflict;
    }
    if (kind == Failure::broken && on_broken) on_broken();
    const auto pause = policy_.after(kind);
    if (!pause) {
        if (kind == Failure::conflict) std::rethrow_exception(failure);
        throw store_unavailable(std::string("idem: ") + what + ": " + message, sqlstate);
    }
    return {*pause, kind == Failure::broken};
}

// ---- ClaimMachine -----------------------------------------------------------------------------------

ClaimMachine::ClaimMachine(Claim& out, Fence fence, const Fingerprint& fp, const ClaimOptions& options,
                           int claim_attempts, std::chrono::milliseconds max_retry_after,
                           detail::SteadyNow now) noexcept
    : out_(out),
      fence_(fence),
      fp_(fp),
      resume_stale_(options.resume_stale),
      claim_attempts_(claim_attempts),
      max_retry_after_(max_retry_after),
      now_(now),
      polls_(options.wait > Clock::duration::zero() ? now() + options.wait : Clock::time_point{}, now) {}

ClaimMachine::Next ClaimMachine::claimed(std::optional<Record> taken) {
    out_.status = ClaimStatus::claimed;
    out_.fence = fence_;
    out_.existing = std::move(taken);
    out_.retry_after = {};
    out_.taken_over_fence = 0;
    return Next::done;
}

ClaimMachine::Next ClaimMachine::on_round_trip(StepResults& res) {
    step();
    const StepResult& inserted = res[0];
    const StepResult& selected = res[1];
    // ok() holds only when the whole segment committed: an INSERT whose read (or COMMIT) failed
    // afterwards was rolled back with it and is never taken for a claim.
    const StepResult* failure = res.first_failure();
    if (inserted.ok() && inserted.rows() == 1) return claimed();
    if (failure != nullptr && !claim_retryable(failure->sqlstate())) {
        // Nothing of this attempt committed. A cancel, a timeout or a shortage is store_unavailable,
        // a missing privilege config_error: fn is not called either way.
        // (a failed COMMIT is reported on the read, the segment's last statement: "claim" for both)
        throw_statement_error(*failure, "claim");
    }
    if (failure == nullptr && selected.rows() == 1) {
        parse_record(selected.result.get(), 0, out_.existing.emplace());
        return found();
    }
    return on_absent(failure != nullptr);
}

ClaimMachine::Next ClaimMachine::on_absent(bool conflicted) {
    step();
    // Nothing to read: the conflicting claim was released or rolled back in between, or we timed
    // out waiting for a concurrent uncommitted claim. Try again; past the bound, tell the caller the
    // key is busy — never a generic failure.
    if (++failures_ >= claim_attempts_) return busy();
    retrying_ = true;
    if (conflicted) pause_ = std::chrono::milliseconds(jitter(10u * static_cast<unsigned>(failures_)));
    return Next::round_trip;
}

ClaimMachine::Next ClaimMachine::on_busy() {
    step();
    return busy();
}

ClaimMachine::Next ClaimMachine::busy() {
    out_.status = ClaimStatus::in_progress;
    out_.fence = 0;
    out_.existing.reset();
    out_.retry_after = max_retry_after_;
    return Next::done;
}

ClaimMachine::Next ClaimMachine::found() {
    Record& record = *out_.existing;
    if (record.fence == fence_ && record.state == RecordState::in_progress) {
        return claimed();  // ours, from an attempt whose answer was lost with its connection
    }
    // Past retention: claim it again with a conditional UPDATE (one winner).
    if (record.expired) return Next::reclaim_expired;
    out_.status = claim_status(record, fp_);
    out_.fence = 0;
    if (out_.status != ClaimStatus::in_progress) return Next::done;
    if (resume_stale_ && record.lease_expired) return Next::take_over;
    if (now_() < polls_.end()) return Next::wait;
    return on_waited(false);
}

ClaimMachine::Next ClaimMachine::on_reclaimed(ReclaimAnswer answer) {
    step();
    if (answer == ReclaimAnswer::won) return claimed();
    if (answer == ReclaimAnswer::busy) return on_absent(true);
    out_.existing.reset();
    return Next::round_trip;  // someone else re-claimed it first: read again
}

ClaimMachine::Next ClaimMachine::on_taken_over(std::optional<Record> taken) {
    step();
    if (taken) {
        took_over_ = true;
        const Fence stale = stale_fence();
        const Next next = claimed(std::move(taken));
        out_.taken_over_fence = stale;
        return next;
    }
    out_.existing.reset();
    return Next::round_trip;  // another retry or a reconciler took it
}

ClaimMachine::Next ClaimMachine::on_waited(bool still_waiting) {
    step();
    if (still_waiting) {
        out_.existing.reset();
        return Next::round_trip;
    }
    // (a waiter that could not get a connection of its own answers in_progress right away)
    out_.retry_after =
        detail::retry_after_hint(out_.existing->lease_until, std::chrono::system_clock::now(), max_retry_after_);
    return Next::done;
}

ClaimMachine::Next ClaimMachine::on_polled(const StepResults& res) {
    step();
    if (!res[0].ok()) throw_statement_error(res[0], "wait");
    // No row: saved, released, or taken over since we looked. A passed lease matters to resume mode
    // only (found() takes the key over). Either way the claim's round trip reads and decides again.
    if (res[0].rows() == 0 || (resume_stale_ && get_bool(res[0].result.get(), 0, 0))) {
        out_.existing.reset();
        return Next::round_trip;
    }
    if (now_() < polls_.end()) return Next::wait;
    return on_waited(false);
}

}  // namespace idem::pg
