#include "group_plan.hpp"

#include <algorithm>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include "sql.hpp"

namespace idem::pg {

namespace {

template <class E>
std::exception_ptr fresh(const E& x) {
    return std::make_exception_ptr(E(std::string(x.what()), std::string(x.sqlstate())));
}

template <class Slot>
std::vector<Slot*> in_key_order(std::span<Slot* const> slots) {
    std::vector<Slot*> sorted(slots.begin(), slots.end());
    std::sort(sorted.begin(), sorted.end(), [](const Slot* a, const Slot* b) { return *a->key < *b->key; });
    return sorted;
}

}  // namespace

std::exception_ptr own_copy(const std::exception_ptr& e) {
    if (!e) return e;
    try {
        std::rethrow_exception(e);
    } catch (const connection_broken& x) {
        return fresh(x);
    } catch (const pool_timeout& x) {
        return fresh(x);
    } catch (const store_unavailable& x) {
        return fresh(x);
    } catch (const config_error& x) {
        return fresh(x);
    } catch (const database_error& x) {
        return fresh(x);
    } catch (const corrupt_record& x) {
        return fresh(x);
    } catch (const lease_lost& x) {
        return fresh(x);
    } catch (const error& x) {
        return fresh(x);
    } catch (const std::bad_alloc&) {
        return std::make_exception_ptr(std::bad_alloc());
    } catch (const std::exception& x) {
        return std::make_exception_ptr(std::runtime_error(std::string(x.what())));
    } catch (...) {
        return std::make_exception_ptr(std::runtime_error("idem: unknown exception in a claim group"));
    }
}

// ---- claims -------------------------------------------------------------------------------------------

std::optional<ClaimMachine::Next> after_group(ClaimMachine& machine, ClaimSlot& slot) {
    switch (slot.got) {
        case ClaimSlot::Got::plain: return machine.on_round_trip(slot.plain);
        case ClaimSlot::Got::won: return machine.on_won();
        case ClaimSlot::Got::found: return machine.on_found();
        case ClaimSlot::Got::absent: return machine.on_absent(false);
        case ClaimSlot::Got::error: std::rethrow_exception(slot.error);
        case ClaimSlot::Got::alone: break;
    }
    return std::nullopt;
}

void answer_all(std::span<ClaimSlot* const> slots, ClaimSlot::Got got, const std::exception_ptr& e) {
    for (ClaimSlot* c : slots) c->got = got, c->error = own_copy(e);
}

ClaimGroupPlan::ClaimGroupPlan(const std::vector<StatementDef>& defs, Layout layout, std::span<ClaimSlot* const> slots)
    : slots_(in_key_order(slots)) {
    if (slots_.size() == 1 && layout == Layout::plain) {  // exactly the single-key statements
        const ClaimSlot& c = *slots_[0];
        add_claim_params(ins_, *c.key, *c.fp, c.fence, c.lease, c.retention);
        sel_.text(c.key->scope()).text(c.key->value());
        one_ = {Step{&defs[kClaimInsert], &ins_, false}, Step{&defs[kSelect], &sel_}};
        return;
    }
    rows_.reserve(slots_.size());
    for (const ClaimSlot* c : slots_) {
        rows_.push_back({c->key->scope(), c->key->value(), c->fp->bytes(),
                         static_cast<std::int16_t>(c->fp->algorithm()), c->fence, c->lease.count(),
                         c->retention.count()});
    }
    // On one node [claims | Sync | read | Sync]: the claims commit at the first Sync, the read
    // takes its own snapshot (as the single-key round trip's does).
    rows_plan_.emplace(defs, layout, rows_);
}

std::span<const Step> ClaimGroupPlan::steps() const noexcept {
    if (rows_plan_) return rows_plan_->steps();
    return one_;
}

void ClaimGroupPlan::read(StepResults res) const {
    if (!rows_plan_) {
        slots_[0]->plain = std::move(res);
        slots_[0]->got = ClaimSlot::Got::plain;
        return;
    }
    const ClaimAnswers a = rows_plan_->read(std::move(res));
    for (std::size_t j = 0; j < slots_.size(); ++j) {
        ClaimSlot* c = slots_[j];
        std::exception_ptr error;
        switch (claim_member_answer(a, j, c->fence, *c->key, c->out->existing, error)) {
            case MemberAnswer::alone: c->got = ClaimSlot::Got::alone; break;
            case MemberAnswer::won: c->got = ClaimSlot::Got::won; break;
            case MemberAnswer::found: c->got = ClaimSlot::Got::found; break;
            case MemberAnswer::absent: c->got = ClaimSlot::Got::absent; break;
            case MemberAnswer::error: c->got = ClaimSlot::Got::error, c->error = own_copy(error); break;
        }
    }
}

void ClaimGroupPlan::all_alone() const noexcept {
    for (ClaimSlot* c : slots_) {
        c->got = ClaimSlot::Got::alone, c->error = nullptr;
        c->out->existing.reset();  // a record decoded before the failure is read again alone
    }
}

// ---- saves --------------------------------------------------------------------------------------------

bool saved_by_group(const SaveSlot& slot) {
    if (slot.got == SaveSlot::Got::lost) throw_save_lost(slot.fence);
    return slot.got == SaveSlot::Got::saved;
}

SaveGroupPlan::SaveGroupPlan(const std::vector<StatementDef>& defs, Layout layout, std::span<SaveSlot* const> slots) {
    const std::vector<SaveSlot*> ms = in_key_order(slots);
    std::unordered_set<Fence> fences;
    for (std::size_t j = 0; j < ms.size(); ++j) {
        ms[j]->got = SaveSlot::Got::alone;
        if ((j > 0 && *ms[j]->key == *ms[j - 1]->key) || !fences.insert(ms[j]->fence).second) continue;
        sent_.push_back(ms[j]);
    }
    if (sent_.size() == 1) {  // alone: the single-key UPDATE
        const SaveSlot& v = *sent_[0];
        one_params_.text(v.key->scope()).text(v.key->value()).int8(v.fence).bytes(v.result);
        one_ = Step{&defs[kSave], &one_params_};
    } else {
        rows_.reserve(sent_.size());
        for (const SaveSlot* v : sent_) rows_.push_back({v->key->scope(), v->key->value(), v->result, v->fence});
        rows_plan_.emplace(defs, layout, rows_);
    }
    for (SaveSlot* v : sent_) v->sent = true;
}

std::span<const Step> SaveGroupPlan::steps() const noexcept {
    if (rows_plan_) return rows_plan_->steps();
    return std::span(&one_, 1);
}

void SaveGroupPlan::read(StepResults res) const {
    if (!rows_plan_) {
        SaveSlot& v = *sent_[0];
        if (!res[0].ok()) return;  // it goes alone (a 40001 is retried there, ...)
        const PGresult* r = res[0].result.get();
        v.got = result_rows(r) == 1 ? SaveSlot::Got::saved : SaveSlot::Got::lost;
        if (v.got == SaveSlot::Got::saved) v.waiters = get_bool(r, 0, 0);
        return;
    }
    const SaveAnswers a = rows_plan_->read(std::move(res));
    for (std::size_t j = 0; j < sent_.size(); ++j) {
        SaveSlot* v = sent_[j];
        if (a.row_failed[j]) continue;  // nothing of its statement committed: it goes alone
        const auto it = a.saved.find(v->fence);
        v->got = it != a.saved.end() ? SaveSlot::Got::saved : SaveSlot::Got::lost;
        if (it != a.saved.end()) v->waiters = it->second;
    }
}

void SaveGroupPlan::all_alone() const noexcept {
    for (SaveSlot* v : sent_) v->got = SaveSlot::Got::alone;
}

}  // namespace idem::pg
