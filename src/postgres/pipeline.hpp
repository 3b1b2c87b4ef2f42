// A pipeline on a libpq connection (internal): how a statement is queued, and how libpq's results
// become one StepResult per statement — the same rules for the blocking and the asynchronous
// connection.
#pragma once

#include <libpq-fe.h>

#include <array>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "handles.hpp"
#include "sansio/params.hpp"
#include "sansio/result.hpp"
#include "sansio/sqlstate.hpp"

namespace idem::pg {

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

/// Queues `step` on `conn` (pipeline mode; the blocking and the asynchronous connection): its
/// prepared statement, or its SQL unnamed when `prepared` is false or the statement has no name;
/// then a Sync when step.sync_after. Returns what failed ("send <name>", "PQpipelineSync"), or
/// nullopt; the connection is unusable after a failure.
[[nodiscard]] std::optional<std::string> queue_step(PGconn* conn, const Step& step, bool prepared);

}  // namespace idem::pg
