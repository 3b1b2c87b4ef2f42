// What a statement answered, as the I/O-free core reads it (internal).
//
// The core never includes libpq: a result is an opaque libpq PGresult owned by ResultPtr, read
// through the accessors of columns.hpp. The drivers (../connection.hpp, ../../asio/connection.hpp)
// fill StepResults from the wire (../pipeline.hpp); the core's unit tests fill them with results made
// by hand. ../results.cpp implements the accessors over libpq.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

extern "C" {
struct pg_result;  // libpq's PGresult
}

namespace idem::pg {

using PGresult = ::pg_result;
using Clock = std::chrono::steady_clock;

/// Frees a result (PQclear).
struct ResultDeleter {
    void operator()(PGresult* result) const noexcept;
};
using ResultPtr = std::unique_ptr<PGresult, ResultDeleter>;

/// The number of rows of a result (PQntuples), and of columns (PQnfields).
[[nodiscard]] int result_rows(const PGresult* r) noexcept;
[[nodiscard]] int result_columns(const PGresult* r) noexcept;

/// The answer to one Step: a result (TUPLES_OK/COMMAND_OK), or the error result with its SQLSTATE,
/// or "aborted", or "rolled back". Small on purpose (16 bytes): it is moved around on every call;
/// the error's message is read from the result only when someone asks.
///
/// ok() means the statement ran AND nothing later in its segment (up to its Sync, the implicit
/// transaction's commit) failed: a statement whose transaction rolled back is never ok(), so a
/// caller cannot act on an INSERT's row that a failed read or COMMIT after it undid.
struct StepResult {
    ResultPtr result;          ///< the statement's result (on failure: the error result, if any); else null
    bool failed = false;       ///< the statement (or its segment's COMMIT) failed: sqlstate(), message()
    bool aborted = false;      ///< skipped because an earlier statement of its segment failed
    bool rolled_back = false;  ///< ran, but a later statement or the COMMIT of its segment failed

    /// Marks the statement failed with `sqlstate` (five characters; anything else reads as XX000).
    void fail(std::string_view sqlstate) noexcept {
        failed = true;
        code_ = {};
        if (sqlstate.size() == code_.size()) sqlstate.copy(code_.data(), code_.size());
    }
    [[nodiscard]] bool ok() const noexcept { return !failed && !aborted && !rolled_back; }
    [[nodiscard]] int rows() const noexcept { return result && !failed ? result_rows(result.get()) : 0; }
    /// Empty when the statement succeeded or was skipped; "XX000" for an error without one.
    [[nodiscard]] std::string_view sqlstate() const noexcept {
        if (!failed) return {};
        return code_[0] != '\0' ? std::string_view(code_.data(), code_.size()) : std::string_view("XX000");
    }
    /// The error's message (the server's, trimmed), or why the statement did not count.
    [[nodiscard]] std::string message() const;

private:
    std::array<char, 5> code_{};
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

}  // namespace idem::pg
