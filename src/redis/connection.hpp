// A hiredis connection and a small pool of them (internal to idem::redis).
//
// A Connection sends commands in pipelines: append() queues one, read() waits for the oldest
// answer (replies come back in the order the commands were sent). Every failure is typed the
// way RedisStore reports it: I/O errors and timeouts are store_unavailable and leave the connection
// broken (it is never reused: an answer may still be on its way); refusals by the server are
// classified by their error code (see throw_error_reply).
//
// Thread-safety: a Connection is used by one thread at a time (the pool hands it out); the Pool is
// thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "idem/redis/store.hpp"

struct redisContext;
struct redisReply;

namespace idem::redis {

struct ReplyDeleter {
    void operator()(redisReply* reply) const noexcept;
};
/// One answer, owned.
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

/// What a reply is, without hiredis's header.
enum class ReplyType { string, array, integer, nil, status, error, other };
[[nodiscard]] ReplyType type_of(const redisReply& reply) noexcept;
[[nodiscard]] std::string_view text_of(const redisReply& reply) noexcept;  ///< string, status, error
[[nodiscard]] long long integer_of(const redisReply& reply) noexcept;
[[nodiscard]] std::size_t size_of(const redisReply& reply) noexcept;  ///< array elements
[[nodiscard]] const redisReply& element(const redisReply& reply, std::size_t i) noexcept;

/// Throws the idem error for an error reply to `what` (the first word of a Redis error is its code):
/// NOAUTH / WRONGPASS / NOPERM → config_error; a passing refusal (passing_refusal()) →
/// store_unavailable; WRONGTYPE → corrupt_record; anything else → database_error. `where` names
/// the server (never its password).
[[noreturn]] void throw_error_reply(std::string_view message, std::string_view what, std::string_view where);

/// Whether an error reply is a state of the server's that passes without anyone changing a setting:
/// LOADING / BUSY / READONLY / OOM / MASTERDOWN / TRYAGAIN / CLUSTERDOWN / NOREPLICAS / MISCONF.
[[nodiscard]] bool passing_refusal(std::string_view message) noexcept;

/// A time stored as Unix ms, as a system_clock time_point. Beyond what that can hold (about ±292
/// years around 1970, in nanoseconds) it is data idem did not write: corrupt_record naming `what`
/// ("a Redis record", "a Redis cache entry").
[[nodiscard]] std::chrono::system_clock::time_point time_from_unix_ms(std::int64_t ms, std::string_view what);

/// Where the options point, for messages: "unix socket /p" or "127.0.0.1:6379".
[[nodiscard]] std::string location(const RedisOptions& options);

class Connection {
public:
    /// Connects, authenticates and selects the database, all within connect_timeout; then every
    /// wait for an answer is bounded by command_timeout. Throws store_unavailable (cannot connect,
    /// timed out) or config_error (authentication refused, bad database).
    explicit Connection(const RedisOptions& options);
    ~Connection();
    Connection(const Connection&) = delete;
    Connection& operator=(const Connection&) = delete;

    /// Queues one command (binary-safe arguments); nothing is sent until read().
    void append(std::span<const std::string_view> args);
    void append(std::initializer_list<std::string_view> args) {
        append(std::span<const std::string_view>(args.begin(), args.size()));
    }
    /// Sends what is queued and waits for the next answer. An error reply is returned, not thrown
    /// (the caller knows what it means); I/O failures and timeouts throw store_unavailable and
    /// break the connection.
    [[nodiscard]] Reply read(std::string_view what);

    [[nodiscard]] bool broken() const noexcept { return broken_; }
    /// Whether it may go back to the pool: not broken, and no answer still owed to a command sent
    /// (one left unread would be taken for the answer to the next command).
    [[nodiscard]] bool reusable() const noexcept { return !broken_ && owed_ == 0; }
    /// Script name → SHA1, as loaded on this connection's server (see RedisStore).
    std::vector<std::string> script_shas;

private:
    // Sends what append() queued (see connection.cpp: without SIGPIPE).
    void flush(std::string_view what);

    redisContext* context_ = nullptr;
    std::string where_;
    bool broken_ = false;
    std::size_t owed_ = 0;  // commands appended whose answers were not read yet
};

/// At most `size` connections, opened lazily by `open`; a caller waits up to `wait` for one (then
/// pool_timeout). Waiting callers are served first come, first served: a connection given back
/// while someone waits goes to the longest waiter, and a new caller queues behind every waiter, so a
/// thread that gives back and acquires again in a loop cannot starve the others. A connection that
/// is not reusable() (broken, or owed an answer) is closed when given back, and its place goes to
/// the longest waiter, who opens a new one.
class Pool {
public:
    using Opener = std::function<std::unique_ptr<Connection>()>;
    Pool(std::size_t size, std::chrono::milliseconds wait, Opener open);
    ~Pool();

    class Lease {
    public:
        Lease(Pool& pool, std::unique_ptr<Connection> conn) noexcept : pool_(&pool), conn_(std::move(conn)) {}
        Lease(Lease&& other) noexcept : pool_(other.pool_), conn_(std::move(other.conn_)) {}
        Lease& operator=(Lease&&) = delete;
        ~Lease() {
            if (conn_) pool_->give_back(std::move(conn_));
        }
        Connection& operator*() const noexcept { return *conn_; }
        Connection* operator->() const noexcept { return conn_.get(); }
        /// Closes the connection instead of giving it back (its state is unknown).
        void discard() noexcept;

    private:
        Pool* pool_;
        std::unique_ptr<Connection> conn_;
    };

    /// An idle connection, a new one, or one given back within the wait. Throws pool_timeout, or
    /// what opening a connection throws.
    [[nodiscard]] Lease acquire();
    /// Closes every idle connection (after a failure that suggests the server restarted).
    void drop_idle() noexcept;
    /// Callers waiting in acquire() now.
    [[nodiscard]] std::size_t waiting() const;

    std::atomic<std::uint64_t> opened{0};
    std::atomic<std::uint64_t> discarded{0};

private:
    // One caller blocked in acquire(), on its own stack; give_back serves it under the mutex (and
    // notifies it there: it may return, destroying this, as soon as the mutex is free).
    struct Waiter {
        std::condition_variable served;
        std::unique_ptr<Connection> conn;  // a connection handed over
        bool may_open = false;             // or a place reserved for it to open one
    };

    void give_back(std::unique_ptr<Connection> conn) noexcept;
    // Opens a connection in a place already counted in open_count_; gives the place up on failure.
    Lease open_reserved();
    // A place is free (a connection closed, or an open failed): to the longest waiter, if any.
    // Requires mutex_.
    void free_place_locked() noexcept;

    std::size_t size_;
    std::chrono::milliseconds wait_;
    Opener open_;
    mutable std::mutex mutex_;
    std::vector<std::unique_ptr<Connection>> idle_;  // empty whenever waiters_ is not
    std::deque<Waiter*> waiters_;                    // oldest first
    std::size_t open_count_ = 0;
};

}  // namespace idem::redis
