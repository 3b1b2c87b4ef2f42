#include "connection.hpp"

#include <boost/asio/bind_cancellation_slot.hpp>
#include <boost/asio/cancellation_signal.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "../postgres/sansio/sql.hpp"

namespace idem::asio::detail {

namespace net = boost::asio;
using pg::Clock;

AsyncConnection::AsyncConnection(Strand strand, const pg::ConnectSettings& settings,
                                 std::span<const pg::StatementDef> defs, std::shared_ptr<PoolGauges> gauges)
    : strand_(std::move(strand)),
      settings_(settings),
      defs_(defs),
      socket_(strand_),
      deadline_timer_(strand_),
      gauges_(std::move(gauges)) {
    account();
}

// socket_ closes our duplicate; conn_ (PQfinish) libpq's.
AsyncConnection::~AsyncConnection() {
    if (gauges_) gauges_->move(counted_, {});
}

void AsyncConnection::account() noexcept {
    if (!gauges_) return;
    const PoolGauges::Part now{!broken_, !broken_ && opened_ && fifo_.empty()};
    gauges_->move(counted_, now);
    counted_ = now;
}

void AsyncConnection::watch_socket() {
    // The event loop watches a duplicate of libpq's descriptor, never libpq's own: libpq closes
    // its socket by itself when the server goes away, and the number is then reused by the next
    // connection opened — which a registration under that number, removed later, would silence,
    // so that connect would wait out its whole connect_timeout. Our duplicate keeps its number
    // until we close it.
    const int fd = PQsocket(conn_.get());
    if (fd < 0) pg::throw_connect_error(PQerrorMessage(conn_.get()));
    // The same socket? (by identity: a new socket may get the number of the one libpq closed)
    struct stat ours {
    }, theirs{};
    if (socket_.is_open() && ::fstat(fd, &theirs) == 0 && ::fstat(socket_.native_handle(), &ours) == 0 &&
        ours.st_ino == theirs.st_ino && ours.st_dev == theirs.st_dev) {
        return;
    }
    boost::system::error_code ignored;
    if (socket_.is_open()) socket_.close(ignored);
    const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (copy < 0)
        throw store_unavailable(std::string("idem: cannot watch the PostgreSQL socket: ") + std::strerror(errno));
    socket_.assign(copy);
}

// Asio re-arms a descriptor's events on every wait, and keeps write interest once a write wait
// added it: a writable socket (almost always) would then wake the event loop once more on every
// read wait, for nothing. So after writing waits have ended and while no wait is pending (release()
// would abort one), the descriptor is registered afresh, for reading only: after connecting, and
// when the reader stops (a write always ends first: its request's answer is still to come).
std::string AsyncConnection::forget_write_interest() noexcept {
    if (!write_interest_ || reading_ || writing_ || broken_ || !socket_.is_open()) return {};
    write_interest_ = false;
    boost::system::error_code ec;
    const int fd = socket_.release();
    socket_.assign(fd, ec);
    if (!ec) return {};
    ::close(fd);  // not ours to watch any more: the connection is failed
    std::string problem = "idem: cannot watch the PostgreSQL socket: " + ec.message();
    fail(std::make_exception_ptr(pg::connection_broken(problem)));
    return problem;
}

net::awaitable<void> AsyncConnection::open() {
    const pg::ConnectParams params(settings_);
    conn_.reset(PQconnectStartParams(params.keys(), params.values(), 1));
    if (!conn_) throw store_unavailable("idem: out of memory creating a PostgreSQL connection");
    if (PQstatus(conn_.get()) == CONNECTION_BAD) pg::throw_connect_error(PQerrorMessage(conn_.get()));
    // libpq enforces connect_timeout only in its blocking connect: here a timer does.
    const auto deadline = Clock::now() + settings_.connect_timeout;
    net::steady_timer timer(strand_);
    PostgresPollingStatusType poll = PGRES_POLLING_WRITING;
    for (;;) {
        if (poll == PGRES_POLLING_OK) break;
        if (poll == PGRES_POLLING_FAILED) pg::throw_connect_error(PQerrorMessage(conn_.get()));
        watch_socket();  // (libpq's socket changes when it moves on to the next host or address)
        // The timer's handler may run after this wait ended (it fired just as the socket did):
        // then it must not touch the connection, which may be open, or gone, by then.
        struct Wait {
            bool waiting = true;
            bool timed_out = false;
        };
        auto wait = std::make_shared<Wait>();
        timer.expires_at(deadline);
        timer.async_wait([weak = weak_from_this(), wait](const boost::system::error_code& ec) {
            if (ec || !wait->waiting) return;
            wait->timed_out = true;
            if (auto self = weak.lock()) {
                boost::system::error_code ignored;
                self->socket_.cancel(ignored);
            }
        });
        boost::system::error_code ec;
        if (poll != PGRES_POLLING_READING) write_interest_ = true;
        co_await socket_.async_wait(
            poll == PGRES_POLLING_READING ? net::posix::stream_descriptor::wait_read
                                          : net::posix::stream_descriptor::wait_write,
            // (the pool's connection, whoever asked for it: a caller's cancellation does not end it)
            net::bind_cancellation_slot(net::cancellation_slot(), net::redirect_error(net::use_awaitable, ec)));
        wait->waiting = false;
        timer.cancel();
        if (wait->timed_out) throw store_unavailable("idem: cannot connect to PostgreSQL: timeout expired");
        if (ec) throw store_unavailable("idem: cannot connect to PostgreSQL: " + ec.message());
        poll = PQconnectPoll(conn_.get());
    }
    pg::configure_connected(conn_.get());
    if (std::string problem = forget_write_interest(); !problem.empty()) throw store_unavailable(problem);
    // All statements prepared, and "is Citus installed?" asked, in one round trip.
    std::vector<bool> sync_after;
    for (const auto& def : defs_) {
        if (def.name.empty() || !settings_.prepared_statements) continue;
        if (PQsendPrepare(conn_.get(), def.name.c_str(), def.sql.c_str(), static_cast<int>(def.param_types.size()),
                          def.param_types.data()) != 1) {
            fail_now("PQsendPrepare");
        }
        sync_after.push_back(false);
    }
    const pg::StatementDef& citus = defs_[pg::kCitusInstalled];
    if (PQsendQueryParams(conn_.get(), citus.sql.c_str(), 0, nullptr, nullptr, nullptr, nullptr, 1) != 1 ||
        PQpipelineSync(conn_.get()) != 1) {
        fail_now("PQsendQueryParams");
    }
    sync_after.push_back(true);
    flush();
    pg::StepResults answers =
        co_await exchange(std::move(sync_after), Clock::now() + settings_.statement_timeout + std::chrono::seconds(1));
    std::size_t i = 0;
    for (const auto& def : defs_) {
        if (def.name.empty() || !settings_.prepared_statements) continue;
        if (answers[i].failed) {
            try {
                pg::check_prepared(answers[i].result.get(), def);
            } catch (const pg::connection_broken&) {
                broken_ = true;
                account();
                throw;
            }
        }
        ++i;
    }
    const pg::StepResult& installed = answers[i];
    if (!installed.ok()) {
        pg::throw_database_error("idem: cannot ask whether Citus is installed: " + installed.message(),
                                 std::string(installed.sqlstate()));
    }
    citus_ = pg::get_bool(installed.result.get(), 0, 0);
    opened_ = true;
    account();
}

void AsyncConnection::send(const pg::Step& step) {
    if (auto failed = pg::queue_step(conn_.get(), step, settings_.prepared_statements)) fail_now(*failed);
}

net::awaitable<pg::StepResults> AsyncConnection::run(std::span<const pg::Step> steps, Clock::time_point deadline) {
    if (broken_) throw pg::connection_broken("idem: connection already broken");
    if (steps.empty() || !steps.back().sync_after) throw std::logic_error("idem: pipeline must end with a Sync");
    std::vector<bool> sync_after;
    sync_after.reserve(steps.size());
    // libpq copies the parameters into its output buffer: the caller's Params may go after this.
    for (const pg::Step& step : steps) {
        send(step);
        sync_after.push_back(step.sync_after);
    }
    flush();
    co_return co_await exchange(std::move(sync_after), deadline);
}

net::awaitable<pg::StepResults> AsyncConnection::exchange(std::vector<bool> sync_after, Clock::time_point deadline) {
    // The statements are sent; wait for their answers. Never cancelled from outside: a request
    // ends by its answers or by the connection's failure (its deadline included).
    return net::async_initiate<decltype(net::use_awaitable), void(std::exception_ptr, pg::StepResults)>(
        [this](auto handler, std::vector<bool> flags, Clock::time_point until) {
            enqueue(std::move(flags), until, Handler(std::move(handler)));
        },
        net::use_awaitable, std::move(sync_after), deadline);
}

void AsyncConnection::enqueue(std::vector<bool> sync_after, Clock::time_point deadline, Handler handler) {
    if (broken_) {
        net::post(strand_, [h = std::move(handler)]() mutable {
            std::move(h)(std::make_exception_ptr(pg::connection_broken("idem: connection already broken")),
                         pg::StepResults());
        });
        return;
    }
    const bool was_idle = fifo_.empty();
    fifo_.push_back(
        Pending{pg::PipelineAnswers(sync_after.size()), std::move(sync_after), deadline, std::move(handler)});
    if (!reading_) {
        reading_ = true;
        read_more();
    } else {
        // libpq reads whenever a send or flush finds the socket full: answers may already wait in
        // its buffer, with nothing left on the socket to wake the reader.
        drain();
    }
    account();
    // One deadline loop at most: a loop whose cancelled wait has not come back yet is still
    // running, and a second one would cancel its wait and be cancelled by it, over and over,
    // spinning a core until the next request.
    if (was_idle && !timing_) {
        timing_ = true;
        time_head();
    }
}

void AsyncConnection::flush() {
    const int r = PQflush(conn_.get());
    if (r < 0) fail_now("PQflush");
    drain();  // (answers of earlier requests PQflush may have read)
    if (r == 1 && !writing_) {
        writing_ = true;
        net::co_spawn(strand_, write_loop(shared_from_this()), net::detached);
    }
}

net::awaitable<void> AsyncConnection::write_loop(std::shared_ptr<AsyncConnection> self) {
    (void)self;  // keeps the connection alive while the loop runs
    // The socket did not take everything at once: finish when it is writable again. (The reader
    // keeps consuming input meanwhile, so the server is never stuck writing to us.)
    while (!broken_) {
        const int r = PQflush(conn_.get());
        drain();  // PQflush reads the answers that arrived while the socket was full
        if (broken_) break;
        if (r == 0) break;
        if (r < 0) {
            fail(std::make_exception_ptr(pg::connection_broken("idem: PostgreSQL connection failed (PQflush): " +
                                                               pg::trim(PQerrorMessage(conn_.get())))));
            break;
        }
        boost::system::error_code ec;
        write_interest_ = true;
        co_await socket_.async_wait(net::posix::stream_descriptor::wait_write,
                                    net::redirect_error(net::use_awaitable, ec));
        if (ec && !broken_) {
            fail(std::make_exception_ptr(pg::connection_broken("idem: PostgreSQL connection failed: " + ec.message())));
        }
    }
    writing_ = false;
}

// The reader and the deadline are plain handler chains, not coroutines: each busy period of a
// connection would otherwise spawn two coroutines (their frames, work guards and first dispatch).
void AsyncConnection::read_more() {
    drain();  // what libpq has already read (a send or flush reads when the socket is full)
    if (broken_ || fifo_.empty()) {
        reading_ = false;
        (void)forget_write_interest();  // (a failure fails the connection)
        return;
    }
    // (the handler holds the connection alive while the wait is pending)
    socket_.async_wait(net::posix::stream_descriptor::wait_read,
                       [self = shared_from_this()](const boost::system::error_code& ec) { self->on_readable(ec); });
}

void AsyncConnection::on_readable(const boost::system::error_code& ec) {
    if (broken_) {
        reading_ = false;
        return;
    }
    if (ec) {
        fail(std::make_exception_ptr(pg::connection_broken("idem: PostgreSQL connection failed: " + ec.message())));
        reading_ = false;
        return;
    }
    if (PQconsumeInput(conn_.get()) != 1) {
        fail(std::make_exception_ptr(pg::connection_broken("idem: PostgreSQL connection failed (PQconsumeInput): " +
                                                           pg::trim(PQerrorMessage(conn_.get())))));
        reading_ = false;
        return;
    }
    read_more();
}

// Waits for the head's deadline while requests are pending (an idle connection keeps no timer:
// io_context::run() may return); woken early (the FIFO moved on, or emptied), it looks again.
// Deadlines grow along the FIFO, so the head's is the next to pass.
void AsyncConnection::time_head() {
    if (broken_ || fifo_.empty()) {
        timing_ = false;
        return;
    }
    const auto until = fifo_.front().deadline;
    if (Clock::now() >= until) {
        fail(std::make_exception_ptr(
            pg::connection_broken("idem: PostgreSQL did not answer in time (statement_timeout)")));
        timing_ = false;
        return;
    }
    deadline_timer_.expires_at(until);
    deadline_timer_.async_wait([self = shared_from_this()](const boost::system::error_code&) { self->time_head(); });
}

void AsyncConnection::drain() {
    try {
        while (!fifo_.empty() && PQisBusy(conn_.get()) == 0) {
            pg::ResultPtr r(PQgetResult(conn_.get()));
            Pending& head = fifo_.front();
            const bool sync_after = head.sync_after[head.answers.index()];
            if (!head.answers.feed(std::move(r), sync_after)) continue;
            Pending done = std::move(head);
            fifo_.pop_front();
            if (fifo_.empty()) deadline_timer_.cancel();  // nothing left to time
            net::post(strand_, [h = std::move(done.handler), answers = done.answers.take()]() mutable {
                std::move(h)(nullptr, std::move(answers));
            });
        }
    } catch (const pg::pipeline_surprise& e) {
        fail(std::make_exception_ptr(pg::connection_broken(std::string("idem: PostgreSQL connection failed (") +
                                                           e.what() + "): " + pg::trim(PQerrorMessage(conn_.get())))));
    } catch (const pg::connection_broken&) {
        fail(std::current_exception());
    }
    account();
}

void AsyncConnection::fail_now(const std::string& what) {
    auto error = std::make_exception_ptr(pg::connection_broken("idem: PostgreSQL connection failed (" + what +
                                                               "): " + pg::trim(PQerrorMessage(conn_.get()))));
    fail(error);
    std::rethrow_exception(error);
}

void AsyncConnection::close(const std::string& why) noexcept {
    fail(std::make_exception_ptr(pg::connection_broken(why)));
}

void AsyncConnection::fail(std::exception_ptr error) noexcept {
    broken_ = true;
    std::deque<Pending> pending = std::move(fifo_);
    fifo_.clear();
    for (Pending& p : pending) {
        net::post(strand_, [h = std::move(p.handler), error]() mutable { std::move(h)(error, pg::StepResults()); });
    }
    boost::system::error_code ignored;
    deadline_timer_.cancel();
    if (socket_.is_open()) socket_.close(ignored);  // ends the loops' waits; libpq keeps its own descriptor
    account();
}

}  // namespace idem::asio::detail
