#include "ops.hpp"

#include "../../resend_rules.hpp"
#include "machine.hpp"
#include "record.hpp"

namespace idem::pg {

namespace {

void bind_key(Params& p, const Key& key) { p.text(key.scope()).text(key.value()); }

// The answer of a kSelect: the record, or nullopt. Throws the statement's error.
std::optional<Record> read_answer(const StepResults& res) {
    if (!res[0].ok()) throw_statement_error(res[0], "read");
    if (res[0].rows() == 0) return std::nullopt;
    return parse_record(res[0].result.get(), 0);
}

}  // namespace

ClaimRoundTrip::ClaimRoundTrip(const std::vector<StatementDef>& defs, Shape shape, const Key& key,
                               const Fingerprint& fp, Fence fence, std::chrono::milliseconds lease,
                               std::chrono::seconds retention)
    : shape_(shape) {
    add_claim_params(insert_, key, fp, fence, lease, retention);
    bind_key(select_, key);
    // One Sync for the whole round trip: one send() and one transaction per claim.
    if (shape == Shape::pipeline) {
        steps_[0] = {&defs[kClaimInsert], &insert_, false};
        steps_[1] = {&defs[kSelect], &select_};
        count_ = 2;
        return;
    }
    steps_[0] = {&defs[kBegin], &none_, false};
    steps_[1] = {&defs[kClaimInsert], &insert_, false};
    steps_[2] = {&defs[kSelect], &select_, false};
    steps_[3] = {&defs[kCommit], &none_, true};
    steps_[4] = {&defs[kRollback], &none_, true};
    count_ = shape == Shape::block ? 4 : 5;
}

StepResults ClaimRoundTrip::answers(StepResults all) const {
    if (shape_ == Shape::pipeline) return all;
    StepResults two(2);
    two[0] = std::move(all[0].failed ? all[0] : all[1]);
    two[1] = std::move(all[3].failed ? all[3] : all[2]);
    return two;
}

void ReclaimExpiredOp::bind(Params& p) const { add_claim_params(p, key_, fp_, fence_, lease_, retention_); }

bool ReclaimExpiredOp::feed(const StepResults& res) {
    if (!res[0].ok()) {
        // With generations the re-claim moves the row into the current generation, where a newer
        // claim of the key may have been written meanwhile: one that did not see the expired row,
        // whose generation was being retired (DETACH … CONCURRENTLY). That claim won the key
        // (unique_violation, nothing of ours written): read again.
        if (res[0].sqlstate() == "23505") {
            answer_ = ReclaimAnswer::lost;
            return true;
        }
        // Waiting on a concurrent re-claimer's row (an in-transaction one holds it for its effect)
        // is the key being busy, as for the claim's INSERT, not an outage.
        if (!claim_retryable(res[0].sqlstate())) throw_statement_error(res[0], "claim (expired)");
        answer_ = ReclaimAnswer::busy;
        return true;
    }
    answer_ = res[0].rows() == 1 ? ReclaimAnswer::won : ReclaimAnswer::lost;
    return true;
}

void ReadOp::bind(Params& p) const { bind_key(p, key_); }

bool ReadOp::feed(const StepResults& res) {
    record_ = read_answer(res);
    return true;
}

void SaveOp::bind(Params& p) const {
    bind_key(p, key_);
    if (!reading_) p.int8(fence_).bytes(result_);
}

bool SaveOp::feed(const StepResults& res) {
    if (reading_) {
        // The answer that said whether anyone waits was lost: waiters find the save by polling.
        waiters_ = false;
        if (detail::save_landed(read_answer(res), fence_, result_)) return true;
        throw_save_lost(fence_);
    }
    switch (save_answer(res, attempt_ > 1 || resent_, waiters_)) {
        case SaveAnswer::saved: return true;
        case SaveAnswer::check_record: reading_ = true; return false;
        case SaveAnswer::lost: break;
    }
    throw_save_lost(fence_);
}

void ReleaseOp::bind(Params& p) const {
    bind_key(p, key_);
    if (!reading_) p.int8(fence_);
}

bool ReleaseOp::feed(const StepResults& res) {
    if (!reading_) {
        if (!res[0].ok()) throw_statement_error(res[0], "release");
        if (res[0].rows() == 1) return true;
        if (attempt_ > 1) {
            reading_ = true;  // our first DELETE may have landed (and someone may have claimed since)
            return false;
        }
    } else if (detail::release_landed(read_answer(res), fence_)) {
        return true;
    }
    throw lease_lost("idem: release refused: fence " + std::to_string(fence_) + " no longer owns the key");
}

void TakeOverOp::bind(Params& p) const {
    bind_key(p, key_);
    if (!reading_) p.int8(stale_).int8(fresh_).int8(lease_.count()).int4(new_attempt_ ? 1 : 0);
}

bool TakeOverOp::feed(const StepResults& res) {
    if (reading_) {
        auto record = read_answer(res);
        if (detail::take_over_landed(record, fresh_)) taken_ = std::move(record);
        return true;
    }
    taken_ = take_over_answer(res, lease_);
    if (taken_ || attempt_ == 1) return true;
    reading_ = true;  // after a lost answer, finding `fresh` in place means we won
    return false;
}

void OwnedWriteOp::bind(Params& p) const {
    bind_key(p, key_);
    p.int8(fence_);
    if (stmt_ == kExtendLease) {
        p.int8(lease_.count());
    } else {
        p.text(phase_).bytes(data_);
    }
}

bool OwnedWriteOp::feed(const StepResults& res) {
    expect_owned(res, what_, fence_);
    return true;
}

std::string notify_payload(const TableName& t, const Key& key) {
    return (t.schema.empty() ? t.table : t.schema + "." + t.table) + '\x1f' + key.scope() + '\x1f' + key.value();
}

}  // namespace idem::pg
