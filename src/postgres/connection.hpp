// One libpq connection in pipeline mode, and the RAII owners around it (internal).
//
// Every statement goes through Connection::run(): statements are sent in segments, each segment
// closed by its own Sync (so each segment is its own implicit transaction), all flushed together and
// answered in ONE round trip. Waits are bounded by a deadline on the socket (poll), so a dead server
// or a lost network becomes an error, never a hang. A connection that failed mid-pipeline is marked
// broken and must be discarded: its protocol state is unknown.
#pragma once

#include <libpq-fe.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "idem/errors.hpp"

namespace idem::pg {

struct ConnDeleter {
    void operator()(PGconn* conn) const noexcept { PQfinish(conn); }
};
struct ResultDeleter {
    void operator()(PGresult* result) const noexcept { PQclear(result); }
};
using ConnPtr = std::unique_ptr<PGconn, ConnDeleter>;
using ResultPtr = std::unique_ptr<PGresult, ResultDeleter>;

using Clock = std::chrono::steady_clock;

/// The connection failed (closed, reset, timed out, server shutting down). The statement's effect is
/// unknown; the caller discards the connection and may retry on a fresh one.
class connection_broken : public store_unavailable {
public:
    using store_unavailable::store_unavailable;
};

/// A statement known to every connection of a store: its SQL and parameter types.
struct StatementDef {
    std::string name;  ///< prepared statement name; empty: always sent unnamed (utility statements)
    std::string sql;
    std::vector<Oid> param_types;
};

namespace oid {
constexpr Oid int2 = 21, int4 = 23, int8 = 20, text = 25, bytea = 17;
constexpr Oid int2_array = 1005, int8_array = 1016, text_array = 1009, bytea_array = 1001;
}  // namespace oid

/// Parameters of one execution, all sent in binary format (text values are their UTF-8 bytes).
/// Up to kCapacity parameters, stored inline: building the parameters of a claim allocates nothing
/// (a replay's client CPU is mostly libpq and the kernel; allocations here showed in profiles).
class Params {
public:
    static constexpr int kCapacity = 12;  // idem's widest statement has 7

    Params() = default;
    Params(const Params&) = delete;  // values_ may point into numbers_
    Params& operator=(const Params&) = delete;

    Params& text(std::string_view s) { return raw(s); }
    Params& bytes(std::string_view s) { return raw(s); }
    Params& int2(std::int16_t v) { return number(static_cast<std::uint64_t>(static_cast<std::uint16_t>(v)), 2); }
    Params& int8(std::int64_t v) { return number(static_cast<std::uint64_t>(v), 8); }
    Params& int4(std::int32_t v) { return number(static_cast<std::uint64_t>(static_cast<std::uint32_t>(v)), 4); }
    /// A text-format parameter (the server parses it by the statement's parameter type), or NULL.
    Params& text_format(std::optional<std::string_view> s);
    /// A one-dimensional array without NULLs, in binary format; the array is copied.
    Params& text_array(const std::vector<std::string_view>& items) { return array(oid::text, items); }
    Params& bytea_array(const std::vector<std::string_view>& items) { return array(oid::bytea, items); }
    Params& int2_array(const std::vector<std::int16_t>& items);
    Params& int8_array(const std::vector<std::int64_t>& items);

    [[nodiscard]] int size() const noexcept { return size_; }
    const char* const* values() const noexcept { return values_.data(); }
    const int* lengths() const noexcept { return lengths_.data(); }
    const int* formats() const noexcept { return formats_.data(); }

private:
    // Text and bytes are referenced, not copied: they must outlive the run() that sends them.
    Params& raw(std::string_view s) {
        // libpq never reads a zero-length binary value, but wants a non-null pointer for "not NULL".
        return push(s.data() != nullptr ? s.data() : "", static_cast<int>(s.size()), 1);
    }
    Params& push(const char* value, int length, int format) {
        if (size_ == kCapacity) too_many();
        const auto i = static_cast<std::size_t>(size_++);
        values_[i] = value;
        lengths_[i] = length;
        formats_[i] = format;
        return *this;
    }
    [[noreturn]] static void too_many();
    Params& number(std::uint64_t v, int width);
    Params& array(Oid element, const std::vector<std::string_view>& items);
    // Only [0, size_) is ever read: the arrays are left uninitialised (zeroing ~300 bytes per
    // Params showed as `rep stos` at the top of the claim's profile).
    int size_ = 0;
    std::array<const char*, kCapacity> values_;
    std::array<int, kCapacity> lengths_;
    std::array<int, kCapacity> formats_;
    std::array<std::array<char, 8>, kCapacity> numbers_;  // big-endian numbers, by parameter index
    std::vector<std::unique_ptr<std::string>> owned_;     // encoded arrays (stable addresses)
};

/// One statement of a pipeline: which definition, with which parameters.
struct Step {
    const StatementDef* def;
    Params* params;
    bool sync_after = true;  ///< close the segment (own transaction) after this statement
    int result_format = 1;   ///< 1 binary (idem's own statements), 0 text
};

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

class Connection;

/// Enforces the deadlines of a store's connections without a timer per wait.
///
/// Waiting for an answer with poll(timeout) arms a high-resolution timer in the kernel for every
/// wait, and cancels it when the answer comes first — on a virtual machine each of those can be a
/// trap to the hypervisor (measured: ~8 µs of CPU per replay at 4 threads, 15 % of the client's
/// cost). Instead a watched connection waits with no timeout and publishes its deadline; one thread
/// per store looks every `tick` and shuts down the socket of a connection past its deadline, which
/// wakes the wait (the connection then throws "did not answer in time" and is discarded). Deadlines
/// are thus kept to within one tick. Thread-safe.
class Watchdog {
public:
    explicit Watchdog(std::chrono::milliseconds tick);
    ~Watchdog();
    Watchdog(const Watchdog&) = delete;
    Watchdog& operator=(const Watchdog&) = delete;

    void watch(Connection* conn);
    void forget(Connection* conn) noexcept;

private:
    void run(std::stop_token stop);
    const std::chrono::milliseconds tick_;
    std::mutex mutex_;
    std::condition_variable_any wake_;
    std::vector<Connection*> watched_;
    std::jthread thread_;  // last: started after everything it uses
};

struct ConnectSettings {
    std::string conninfo;
    std::string application_name;
    std::chrono::milliseconds connect_timeout;
    std::chrono::milliseconds statement_timeout;
    std::chrono::milliseconds lock_timeout;
    bool prepared_statements = true;
    bool session_options = true;
    Watchdog* watchdog = nullptr;  ///< none: every wait is a poll with a timeout
};

/// The libpq connection parameters for `settings` (the user's conninfo expanded from "dbname",
/// connect_timeout, application_name and idem's session options after it, which take precedence).
class ConnectParams {
public:
    explicit ConnectParams(const ConnectSettings& settings);
    ConnectParams(const ConnectParams&) = delete;
    ConnectParams& operator=(const ConnectParams&) = delete;
    [[nodiscard]] const char* const* keys() const noexcept { return keys_.data(); }
    [[nodiscard]] const char* const* values() const noexcept { return values_.data(); }

private:
    std::string timeout_, options_;
    std::array<const char*, 5> keys_{}, values_{};
};

/// After a connection is established: quiet notices, non-blocking, pipeline mode. Throws store_unavailable.
void configure_connected(PGconn* conn);
/// The answer to one PREPARE: throws connection_broken (session closed), config_error or
/// store_unavailable (by SQLSTATE) when it is not COMMAND_OK.
void check_prepared(const PGresult* r, const StatementDef& def);
/// Strips the trailing newline libpq puts on its messages.
std::string trim(std::string s);

class Connection {
public:
    /// Connects (bounded by connect_timeout), enters pipeline mode and prepares `defs`.
    /// Throws store_unavailable.
    Connection(const ConnectSettings& settings, std::span<const StatementDef> defs);
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;
    ~Connection();

    /// Sends every step, flushes once, and reads every answer before `deadline`.
    /// Throws connection_broken (connection unusable afterwards) — never for a statement's own error,
    /// which comes back in its StepResult. When a statement or the COMMIT at a segment's Sync fails,
    /// the statements before it in that segment come back rolled_back (their effects are undone),
    /// and a failed COMMIT is reported as the failure of the segment's last statement.
    /// In a fork()ed child of the process that opened it: sends nothing, abandons the connection
    /// (abandon_in_child) and throws config_error (a lease held across fork(), e.g. in-transaction mode).
    StepResults run(std::span<const Step> steps, Clock::time_point deadline);

    /// run() in two halves, for a pipeline sent by one thread and read by another (group commit's
    /// relay): send_pipeline() sends every step and flushes (throws connection_broken, and marks the
    /// connection broken, when that fails); receive_pipeline() reads the answers of exactly those
    /// steps, as run() does. Between the two the connection carries unread answers: whoever holds it
    /// must receive them, or abandon_exchange() (the connection is then discarded, never reused).
    void send_pipeline(std::span<const Step> steps, Clock::time_point deadline);
    StepResults receive_pipeline(std::span<const Step> steps, Clock::time_point deadline);
    void abandon_exchange() noexcept;

    /// Waits until a notification on `channel` whose payload is `payload` arrives, or `deadline`.
    /// Returns whether it arrived. Other notifications are dropped.
    bool wait_notification(std::string_view channel, std::string_view payload, Clock::time_point deadline);

    /// In a fork()ed child: lets go of the parent's session without a word to the server. Closes
    /// this process's copy of the socket (the parent's session goes on) and leaks the libpq handle
    /// (PQfinish would send the server a Terminate on the parent's behalf); the watchdog is not told
    /// (its thread does not exist in the child). The connection is unusable afterwards.
    void abandon_in_child() noexcept;

    /// Marks the connection unusable (its state is unknown after an interrupted exchange).
    void mark_broken() noexcept { broken_ = true; }
    [[nodiscard]] bool broken() const noexcept { return broken_; }
    /// The raw handle, for in-transaction mode's users.
    [[nodiscard]] PGconn* native() const noexcept { return conn_.get(); }
    [[nodiscard]] Clock::time_point last_used() const noexcept { return last_used_; }

    /// Called by the Watchdog: past the published deadline, shut the socket down (wakes the wait).
    void expire_if_overdue(Clock::time_point now) noexcept;

private:
    [[noreturn]] void fail(const std::string& what);
    void send(const Step& step);
    void flush(Clock::time_point deadline);
    void wait(short events, Clock::time_point deadline);
    ResultPtr next_result(Clock::time_point deadline);

    [[noreturn]] void fail_overdue();
    [[noreturn]] void refuse_in_child();  // abandon_in_child(), then config_error
    void prepare(const ConnectSettings& settings, std::span<const StatementDef> defs);

    ConnPtr conn_;
    // The process that opened the session (detail::fork_generation): run() refuses in any other.
    const std::uint64_t generation_;
    bool prepared_;
    bool broken_ = false;
    Clock::time_point last_used_;
    Watchdog* watchdog_ = nullptr;  // set once the connection is complete and watched
    int fd_ = -1;
    std::atomic<Clock::rep> waiting_until_{0};  // deadline of the exchange in progress; 0: none
    std::atomic<bool> overdue_{false};          // the watchdog shut the socket down
};

/// A binary fixed-width column (1 ≤ width ≤ 8 bytes, big-endian) as an unsigned number; throws
/// corrupt_record when it is NULL or has another width.
std::uint64_t get_be(const PGresult* r, int row, int col, int width);
/// Reads a binary-format column of row `row`.
std::int64_t get_int8(const PGresult* r, int row, int col);
std::int32_t get_int4(const PGresult* r, int row, int col);
std::int16_t get_int2(const PGresult* r, int row, int col);
std::string_view get_bytes(const PGresult* r, int row, int col);
std::chrono::system_clock::time_point get_timestamptz(const PGresult* r, int row, int col);
/// A binary timestamptz (microseconds since 2000-01-01 UTC) as system_clock time, saturated to
/// time_point::max()/min() beyond its range ('infinity' included).
std::chrono::system_clock::time_point timestamptz_from_pg(std::int64_t us) noexcept;
bool is_null(const PGresult* r, int row, int col);
bool get_bool(const PGresult* r, int row, int col);

/// Silences server NOTICEs ("relation already exists, skipping") that libpq prints to stderr.
void quiet_notices(PGconn* conn) noexcept;

/// SQLSTATEs after which the connection cannot be trusted (shutdown, connection exceptions).
bool is_connection_sqlstate(std::string_view sqlstate) noexcept;

/// SQLSTATEs of permanent misconfiguration: authentication, no such database / schema / table /
/// column, permission denied. Retrying never helps; reported as config_error.
bool is_configuration_sqlstate(std::string_view sqlstate) noexcept;

/// Throws the idem exception for a database error: config_error (is_configuration_sqlstate; a
/// missing table's message says to call ensure_schema()), store_unavailable (timeouts, cancels,
/// resource exhaustion, connection failures), else database_error. `message` starts with "idem: ".
[[noreturn]] void throw_database_error(std::string message, const std::string& sqlstate);

/// The SQLSTATE of a failed connection attempt, recognised from libpq's message (libpq keeps no
/// SQLSTATE for it): 3D000, 28000, 28P01, 42501, 22023 (a malformed conninfo) — or empty (an
/// outage, an authentication service that may be down, or a message not recognised).
std::string connect_failure_sqlstate(std::string_view libpq_message) noexcept;

/// Throws config_error for a permanent connect failure (connect_failure_sqlstate), else
/// store_unavailable.
[[noreturn]] void throw_connect_error(const std::string& libpq_message);

}  // namespace idem::pg
