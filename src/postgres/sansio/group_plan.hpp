// The group plans of group commit, apart from their I/O (internal): the members of a group → their
// rows and the statements of one round trip → each member's answer.
//
// A member is one caller's first attempt (a ClaimSlot, a SaveSlot). A plan takes the members of a
// group, puts them in key order (concurrent groups and batches lock shared keys in one order),
// says which steps to send, and writes each member's answer from what came back. PostgresStore's
// group commit (callers gathered by pg::Combiner, one thread each) and idem::asio's (a queue on the
// store's strand) send the same plans; they differ only in how members are gathered and how the
// answers are waited for. Not thread-safe: one driver runs a plan; the members wait meanwhile.
#pragma once

#include <array>
#include <chrono>
#include <exception>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "columns.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"
#include "machine.hpp"
#include "params.hpp"
#include "result.hpp"
#include "rows.hpp"
#include "sqlstate.hpp"

namespace idem::pg {

/// One claim's first attempt in a group, and the group's answer to it.
struct ClaimSlot {
    const Key* key = nullptr;
    const Fingerprint* fp = nullptr;
    Fence fence = 0;
    std::chrono::milliseconds lease{0};
    std::chrono::seconds retention{0};
    Claim* out = nullptr;  ///< `found`: the record read is decoded into out->existing
    /// alone: the member sends its own round trip (with its fence it recognises whatever the
    /// group committed); plain: the group was this member alone, `plain` holds its [INSERT,
    /// SELECT] answers; won / found / absent: as if its [INSERT, SELECT] had said so; error: its
    /// call throws `error`.
    enum class Got { alone, plain, won, found, absent, error } got = Got::alone;
    StepResults plain;
    std::exception_ptr error;  ///< the member's own copy (see own_copy)
    /// alone: the group's statements were sent (going alone is a retry); false: nothing was sent
    /// for it, and its first attempt is still to come.
    bool sent = false;
};

/// What the claim does after its group answered: the machine's next step, or nullopt when the
/// member sends its own round trip (Got::alone). Throws the member's error (Got::error).
[[nodiscard]] std::optional<ClaimMachine::Next> after_group(ClaimMachine& machine, ClaimSlot& slot);

/// The claims of a group in one round trip. One member: the single-key [INSERT, SELECT | Sync];
/// more: pg::ClaimRowsPlan in the table's layout. The slots (and the keys and fingerprints they
/// point at) must outlive the plan; the plan is never moved once its steps are sent.
class ClaimGroupPlan {
public:
    ClaimGroupPlan(const std::vector<StatementDef>& defs, Layout layout, std::span<ClaimSlot* const> slots);
    ClaimGroupPlan(const ClaimGroupPlan&) = delete;
    ClaimGroupPlan& operator=(const ClaimGroupPlan&) = delete;

    [[nodiscard]] std::span<const Step> steps() const noexcept;
    /// Explicit transaction blocks were sent: after the round trip, a failed one must be rolled back.
    [[nodiscard]] bool blocks() const noexcept { return rows_plan_ && rows_plan_->blocks(); }
    /// Independent transactions in the round trip (the answer deadline grows with them).
    [[nodiscard]] std::size_t segments() const noexcept { return rows_plan_ ? rows_plan_->segments() : 1; }
    [[nodiscard]] std::size_t size() const noexcept { return slots_.size(); }

    /// Writes every member's answer from the round trip's.
    void read(StepResults res) const;
    /// The round trip failed, or its answer was lost: every member goes alone.
    void all_alone() const noexcept;

private:
    std::vector<ClaimSlot*> slots_;  // in key order
    std::vector<ClaimRow> rows_;
    std::optional<ClaimRowsPlan> rows_plan_;
    Params ins_, sel_;
    std::array<Step, 2> one_{};
};

/// Every member of `slots` gets `got` (and its own copy of `e`).
void answer_all(std::span<ClaimSlot* const> slots, ClaimSlot::Got got, const std::exception_ptr& e = nullptr);

/// One save's first attempt in a group, and the group's answer to it.
struct SaveSlot {
    const Key* key = nullptr;
    Fence fence = 0;
    std::string_view result;
    /// alone: the member saves by itself (pg::SaveOp, with `sent`); saved; lost: its fence no
    /// longer owns the key.
    enum class Got { alone, saved, lost } got = Got::alone;
    bool waiters = false;  ///< saved: someone waits for this key (NOTIFY it)
    bool sent = false;     ///< alone: the group's statement may have committed this save
};

/// Whether the group saved it (then `waiters` says whether to NOTIFY); false: the member saves
/// alone. Throws lease_lost when the group found that its fence no longer owns the key.
[[nodiscard]] bool saved_by_group(const SaveSlot& slot);

/// The saves of a group in one round trip. A key or fence twice would make one UPDATE ambiguous
/// (one row, two answers): the second is not sent and goes alone, after the group, as a
/// concurrent save of it would. One member sent: the single-key UPDATE; more: pg::SaveRowsPlan in
/// the table's layout (a save is one statement per segment, never a block). The constructor marks
/// the members it sends `sent`.
class SaveGroupPlan {
public:
    SaveGroupPlan(const std::vector<StatementDef>& defs, Layout layout, std::span<SaveSlot* const> slots);
    SaveGroupPlan(const SaveGroupPlan&) = delete;
    SaveGroupPlan& operator=(const SaveGroupPlan&) = delete;

    [[nodiscard]] std::span<const Step> steps() const noexcept;
    [[nodiscard]] std::size_t segments() const noexcept { return rows_plan_ ? rows_plan_->segments() : 1; }
    /// The members sent, in key order.
    [[nodiscard]] std::span<SaveSlot* const> sent() const noexcept { return sent_; }

    /// Writes the answer of every member sent. A member whose statement failed (nothing of it
    /// committed) goes alone.
    void read(StepResults res) const;
    /// The round trip failed, or its answer was lost: every member goes alone (`sent` says which
    /// may have been saved).
    void all_alone() const noexcept;

private:
    std::vector<SaveSlot*> sent_;
    std::vector<SaveRow> rows_;
    std::optional<SaveRowsPlan> rows_plan_;
    Params one_params_;
    Step one_{};
};

/// A member's own copy of a group's exception, message and all. In PostgresStore each member
/// rethrows, catches and destroys its exception on its own thread; an exception object, or a
/// std::runtime_error message, shared between threads is reference-counted inside libstdc++, out of
/// ThreadSanitizer's sight.
[[nodiscard]] std::exception_ptr own_copy(const std::exception_ptr& e);

}  // namespace idem::pg
