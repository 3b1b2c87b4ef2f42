// The statements of many keys at once — batches and group commits — apart from their I/O (internal).
//
// A plan builds the steps of one round trip for a set of rows, shaped by the table's layout (one
// node: array statements in one transaction; a Citus-distributed table: one-shard segments, by
// scope or by key, never a two-phase commit), and reads the answers back. PostgresStore's batches
// and group commit, and idem::asio's group commit, send the same plans; they differ only in how
// they wait for the answers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "columns.hpp"
#include "idem/key.hpp"
#include "idem/store.hpp"
#include "params.hpp"
#include "result.hpp"
#include "sqlstate.hpp"

namespace idem::pg {

/// How the table is laid out (docs/scale-out.md).
enum class Layout { plain, by_scope, by_key };

/// The step whose error is the segment [begin, end)'s: the statement that failed (the others were
/// skipped or rolled back with it); -1 when the segment committed.
[[nodiscard]] int segment_failure(const StepResults& res, std::size_t begin, std::size_t end) noexcept;

struct ClaimRow {
    std::string_view scope, key, digest;
    std::int16_t alg;
    Fence fence;
    std::int64_t lease_ms, retention_s;
};
using RowRef = std::pair<const PGresult*, int>;
using KeyRef = std::pair<std::string_view, std::string_view>;  // (scope, key)

struct ClaimAnswers {
    StepResults res;
    // The first failed statement of the claims (index in res), -1 when every claim segment
    // committed; row_failed says whose segment it was: nothing of a failed segment committed.
    int write_failure = -1;
    std::vector<bool> row_failed;
    int read_failure = -1;           // index in res: the read failed (claims may have committed)
    std::unordered_set<Fence> won;   // fences the INSERTs returned: committed at their Sync
    std::map<KeyRef, RowRef> found;  // rows read, by (scope, key); views into `res`
};

/// Claims `rows` (sorted by key, keys distinct) and reads what stands at each key afterwards, in
/// one round trip: [claims | Sync | read | Sync] on one node. On a distributed table every claim
/// segment stays on one shard — one per scope (by scope: [BEGIN, INSERT…, COMMIT | Sync]) or one
/// per key (by key: [INSERT | Sync]) — so that none is a multi-shard (two-phase) commit, whose
/// outcome a broken connection would leave in doubt until Citus recovers it. The rows (and the
/// strings they view) must outlive the plan.
class ClaimRowsPlan {
public:
    ClaimRowsPlan(const std::vector<StatementDef>& defs, Layout layout, std::span<const ClaimRow> rows);
    ClaimRowsPlan(const ClaimRowsPlan&) = delete;
    ClaimRowsPlan& operator=(const ClaimRowsPlan&) = delete;

    [[nodiscard]] std::span<const Step> steps() const noexcept { return steps_; }
    /// Explicit transaction blocks were sent: after the round trip, a failed one must be rolled back.
    [[nodiscard]] bool blocks() const noexcept { return blocks_; }
    /// Independent transactions in the round trip (the answer deadline grows with them).
    [[nodiscard]] std::size_t segments() const noexcept { return segments_; }
    [[nodiscard]] ClaimAnswers read(StepResults res) const;

private:
    std::size_t rows_;
    std::deque<Params> params_;  // stable addresses: the steps point at them
    std::vector<Step> steps_;
    std::vector<std::size_t> first_step_of_;  // per row: where its segment starts in steps
    Params none_;
    std::size_t write_steps_ = 1;  // the statements of the claims; the read's follow
    std::size_t segments_ = 1;
    bool blocks_ = false;
};

/// What a group commit's answers say to one member (row j of the plan): its own call goes on as if
/// its [INSERT, SELECT] had answered won / found (the record decoded into `existing`) / absent; or
/// it goes alone with its fence (its segment failed, or there was no read to answer from: nothing,
/// or only its own claim, committed); or error (its row could not be decoded: corrupt_record).
enum class MemberAnswer { alone, won, found, absent, error };
[[nodiscard]] MemberAnswer claim_member_answer(const ClaimAnswers& a, std::size_t j, Fence fence, const Key& key,
                                               std::optional<Record>& existing, std::exception_ptr& error);

struct SaveRow {
    std::string_view scope, key, result;
    Fence fence;
};
struct SaveAnswers {
    StepResults res;
    int failure = -1;                       // index in res: the first failed statement
    std::vector<bool> row_failed;           // its segment failed: this row was not saved
    std::unordered_map<Fence, bool> saved;  // fence → waiters, for every row saved
};

/// Saves `rows` (sorted by key; keys and fences distinct), one round trip: one UPDATE for all on one
/// node (one transaction). On a distributed table one single-statement segment per scope (by scope)
/// or per key (by key), each on one shard and committed on its own (never a two-phase commit; a
/// failed segment fails only its rows).
class SaveRowsPlan {
public:
    SaveRowsPlan(const std::vector<StatementDef>& defs, Layout layout, std::span<const SaveRow> rows);
    SaveRowsPlan(const SaveRowsPlan&) = delete;
    SaveRowsPlan& operator=(const SaveRowsPlan&) = delete;

    [[nodiscard]] std::span<const Step> steps() const noexcept { return steps_; }
    [[nodiscard]] std::size_t segments() const noexcept { return steps_.size(); }
    [[nodiscard]] SaveAnswers read(StepResults res) const;

private:
    std::size_t rows_;
    std::deque<Params> params_;
    std::vector<Step> steps_;
    std::vector<std::size_t> step_of_;  // per row: its statement
};

}  // namespace idem::pg
