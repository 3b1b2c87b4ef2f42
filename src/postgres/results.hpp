// What a pipeline answers (internal): one StepResult per statement, read from libpq's results by
// the same rules for the blocking and the asynchronous connection.
#pragma once

#include <libpq-fe.h>

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "handles.hpp"
#include "sqlstate.hpp"

namespace idem::pg {

/// The answer to one Step: a result (TUPLES_OK/COMMAND_OK), or the error result with its SQLSTATE,
/// or "aborted", or "rolled back". Small on purpose (16 bytes): it is moved around on every call;
/// the error's SQLSTATE and message are read from the PGresult only when someone asks.
///
/// ok() means the statement ran AND nothing later in its segment (up to its Sync, the implicit
/// transaction's commit) failed: a statement whose transaction rolled back is never ok(), so a
/// caller cannot act on an INSERT's row that a failed read or COMMIT after it undid.
struct StepResult {
    ResultPtr result;          ///< the statement's result (on failure: the error result); else null
    bool failed = false;       ///< the statement (or its segment's COMMIT) failed: sqlstate(), message()
    bool aborted = false;      ///< skipped because an earlier statement of its segment failed
    bool rolled_back = false;  ///< ran, but a later statement or the COMMIT of its segment failed

    [[nodiscard]] bool ok() const noexcept { return !failed && !aborted && !rolled_back; }
    [[nodiscard]] int rows() const noexcept { return result && !failed ? PQntuples(result.get()) : 0; }
    /// Empty when the statement succeeded or was skipped; "XX000" for an error without one.
    [[nodiscard]] std::string_view sqlstate() const noexcept;
    [[nodiscard]] std::string message() const;
};

/// The answers to one pipeline, in Step order. Up to kInline of them live inside the object: a
/// claim's two answers (replay path) cost no allocation.
class StepResults {
public:
    static constexpr std::size_t kInline = 4;

    StepResults() noexcept = default;
    explicit StepResults(std::size_t n) : heap_(n > kInline ? std::make_unique<StepResult[]>(n) : nullptr), size_(n) {}

    [[nodiscard]] std::size_t size() const noexcept { return size_; }
    /// The first statement that failed (its error is the segment's), or null when none did.
    [[nodiscard]] const StepResult* first_failure() const noexcept {
        for (const StepResult& r : *this) {
            if (r.failed) return &r;
        }
        return nullptr;
    }
    [[nodiscard]] StepResult& operator[](std::size_t i) noexcept { return data()[i]; }
    [[nodiscard]] const StepResult& operator[](std::size_t i) const noexcept { return data()[i]; }
    [[nodiscard]] StepResult* begin() noexcept { return data(); }
    [[nodiscard]] StepResult* end() noexcept { return data() + size_; }
    [[nodiscard]] const StepResult* begin() const noexcept { return data(); }
    [[nodiscard]] const StepResult* end() const noexcept { return data() + size_; }

private:
    [[nodiscard]] StepResult* data() noexcept { return heap_ ? heap_.get() : inline_.data(); }
    [[nodiscard]] const StepResult* data() const noexcept { return heap_ ? heap_.get() : inline_.data(); }

    std::array<StepResult, kInline> inline_;
    std::unique_ptr<StepResult[]> heap_;
    std::size_t size_ = 0;
};

/// The answers of a pipeline did not follow the protocol (a result missing, an extra one, a Sync
/// out of place): the connection is unusable. what() is the bare reason; the connection adds
/// libpq's own message.
class pipeline_surprise : public connection_broken {
public:
    using connection_broken::connection_broken;
};

/// Turns the results libpq hands back for one pipeline into StepResults, one PGresult at a time.
/// Shared by Connection::run (blocking) and the asynchronous connection of idem::asio, so both read
/// a pipeline's answers by the same rules:
///   per statement: its result (or PIPELINE_ABORTED), then NULL; per segment: a PIPELINE_SYNC,
///   preceded by an error result and a NULL when the implicit transaction's COMMIT failed.
/// When a statement or its segment's COMMIT fails, the statements before it in the segment come back
/// rolled_back, and a failed COMMIT is reported as the failure of the segment's last statement.
class PipelineAnswers {
public:
    explicit PipelineAnswers(std::size_t steps) : out_(steps) {}

    /// Feeds the next PGresult (null included). `sync_after` is that of step index(). Returns true
    /// once every answer is in. Throws connection_broken on a protocol surprise or when the server
    /// closed the session (57P01, ...): the connection is unusable afterwards.
    bool feed(ResultPtr r, bool sync_after);
    /// The step whose answer comes next.
    [[nodiscard]] std::size_t index() const noexcept { return i_; }
    [[nodiscard]] bool complete() const noexcept { return i_ == out_.size(); }
    [[nodiscard]] StepResults take() noexcept { return std::move(out_); }

private:
    enum class Expect { result, null, sync, null_after_commit_error };
    void take_error(StepResult& step, ResultPtr r);
    void close_segment();
    StepResults out_;
    std::size_t i_ = 0;        // current step
    std::size_t segment_ = 0;  // first step of the current segment
    Expect expect_ = Expect::result;
};

}  // namespace idem::pg
