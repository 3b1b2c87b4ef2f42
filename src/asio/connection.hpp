// One non-blocking libpq connection in pipeline mode, driven by an Asio event loop (internal).
//
// (Handlers are completed by a post to the strand, never inside the call that found the answer.)
//
// Requests are sent the moment they are made (PQsendQueryPrepared into libpq's buffer, flushed
// as far as the socket takes it) and answered in order: a FIFO of pending requests, each with its
// own PipelineAnswers (the same rules as the blocking Connection::run). A reader (a chain of
// socket waits) waits for the socket to be readable and hands each result to the request at the
// head of the FIFO; a writer coroutine finishes flushes the socket did not take at once. A timer
// enforces the head's deadline. Any failure — a lost socket, a protocol surprise, the deadline, the server's own
// "terminating connection" — breaks the connection and fails every pending request with
// connection_broken (their statements' effects are unknown; the store retries them like the
// blocking store does).
//
// Every member runs on the strand given to the constructor. The connection keeps its share of the
// store's PoolGauges (open, idle) up to date as it opens, takes requests, answers them and breaks.
#pragma once

#include <boost/asio/any_completion_handler.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include <cstddef>
#include <deque>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "../postgres/connect.hpp"
#include "../postgres/handles.hpp"
#include "../postgres/pipeline.hpp"
#include "pool_gauges.hpp"

namespace idem::asio::detail {

using Strand = boost::asio::strand<boost::asio::any_io_executor>;

class AsyncConnection : public std::enable_shared_from_this<AsyncConnection> {
public:
    /// Counted open in `gauges` (if any) from now until it breaks or goes.
    AsyncConnection(Strand strand, const pg::ConnectSettings& settings, std::span<const pg::StatementDef> defs,
                    std::shared_ptr<PoolGauges> gauges = nullptr);
    ~AsyncConnection();
    AsyncConnection(const AsyncConnection&) = delete;
    AsyncConnection& operator=(const AsyncConnection&) = delete;

    /// Connects (bounded by connect_timeout), enters pipeline mode and prepares the statements.
    /// Throws store_unavailable or config_error (as the blocking Connection does).
    boost::asio::awaitable<void> open();

    /// Sends `steps` now (the parameters are copied by libpq before this returns its awaitable's
    /// first suspension) and completes with their answers, or throws connection_broken.
    boost::asio::awaitable<pg::StepResults> run(std::span<const pg::Step> steps, pg::Clock::time_point deadline);

    [[nodiscard]] bool broken() const noexcept { return broken_; }
    [[nodiscard]] bool citus() const noexcept { return citus_; }
    [[nodiscard]] PGconn* native() const noexcept { return conn_.get(); }
    /// Requests sent and not yet answered.
    [[nodiscard]] std::size_t pending() const noexcept { return fifo_.size(); }
    /// Breaks the connection: every pending request fails with connection_broken(`why`).
    void close(const std::string& why) noexcept;

private:
    using Handler = boost::asio::any_completion_handler<void(std::exception_ptr, pg::StepResults)>;
    struct Pending {
        pg::PipelineAnswers answers;
        std::vector<bool> sync_after;
        pg::Clock::time_point deadline;
        Handler handler;
    };

    void watch_socket();
    // While no wait is pending: watch the socket for reading only. Returns what went wrong (the
    // connection is then failed), or an empty string.
    [[nodiscard]] std::string forget_write_interest() noexcept;
    void send(const pg::Step& step);
    void enqueue(std::vector<bool> sync_after, pg::Clock::time_point deadline, Handler handler);
    void flush();
    void drain();
    void fail(std::exception_ptr error) noexcept;
    [[noreturn]] void fail_now(const std::string& what);
    void account() noexcept;  // brings this connection's share of gauges_ up to date
    void read_more();         // the reader: drains, then waits for the socket while requests are pending
    void on_readable(const boost::system::error_code& ec);
    void time_head();  // the deadline: times the head request while requests are pending
    boost::asio::awaitable<void> write_loop(std::shared_ptr<AsyncConnection> self);
    boost::asio::awaitable<pg::StepResults> exchange(std::vector<bool> sync_after, pg::Clock::time_point deadline);

    Strand strand_;
    const pg::ConnectSettings& settings_;
    std::span<const pg::StatementDef> defs_;
    pg::ConnPtr conn_;
    boost::asio::posix::stream_descriptor socket_;
    boost::asio::steady_timer deadline_timer_;
    std::deque<Pending> fifo_;
    bool broken_ = false;
    bool reading_ = false;
    bool writing_ = false;
    bool timing_ = false;
    bool write_interest_ = false;  // a write wait left socket_ registered for writing too
    bool citus_ = false;           // socket_ holds our duplicate of libpq's descriptor (watch_socket)
    bool opened_ = false;          // open() succeeded
    std::shared_ptr<PoolGauges> gauges_;
    PoolGauges::Part counted_;  // this connection's share of gauges_ now
};

}  // namespace idem::asio::detail
