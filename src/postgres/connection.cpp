#include "connection.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "../process.hpp"

namespace idem::pg {

Connection::Connection(const ConnectSettings& settings, std::span<const StatementDef> defs)
    : generation_(detail::fork_generation()), prepared_(settings.prepared_statements) {
    const ConnectParams params(settings);
    conn_.reset(PQconnectdbParams(params.keys(), params.values(), 1));
    if (!conn_) throw store_unavailable("idem: out of memory creating a PostgreSQL connection");
    if (PQstatus(conn_.get()) != CONNECTION_OK) throw_connect_error(PQerrorMessage(conn_.get()));
    configure_connected(conn_.get());
    last_used_ = Clock::now();
    if (prepared_ && !defs.empty()) prepare(settings, defs);
    // Watched only once complete: a constructor that throws never leaves a pointer behind.
    if (settings.watchdog != nullptr) {
        fd_ = PQsocket(conn_.get());
        watchdog_ = settings.watchdog;
        watchdog_->watch(this);
    }
}

Connection::~Connection() {
    if (watchdog_ != nullptr) watchdog_->forget(this);  // before PQfinish closes the socket
}

void Connection::abandon_in_child() noexcept {
    if (!conn_) return;
    if (const int fd = PQsocket(conn_.get()); fd >= 0) ::close(fd);
    (void)conn_.release();
    watchdog_ = nullptr;
    broken_ = true;
}

void Connection::prepare(const ConnectSettings& settings, std::span<const StatementDef> defs) {
    // All statements prepared in one round trip.
    const auto deadline = Clock::now() + settings.statement_timeout + std::chrono::seconds(1);
    for (const auto& def : defs) {
        if (def.name.empty()) continue;
        if (PQsendPrepare(conn_.get(), def.name.c_str(), def.sql.c_str(), static_cast<int>(def.param_types.size()),
                          def.param_types.data()) != 1) {
            fail("PQsendPrepare");
        }
    }
    if (PQpipelineSync(conn_.get()) != 1) fail("PQpipelineSync");
    flush(deadline);
    for (std::size_t i = 0; i < defs.size(); ++i) {
        if (defs[i].name.empty()) continue;
        ResultPtr r = next_result(deadline);
        if (!r) fail("no answer to PREPARE");
        try {
            check_prepared(r.get(), defs[i]);
        } catch (const connection_broken&) {
            broken_ = true;
            throw;
        }
        if (next_result(deadline)) fail("unexpected extra result after PREPARE");
    }
    ResultPtr sync = next_result(deadline);
    if (!sync || PQresultStatus(sync.get()) != PGRES_PIPELINE_SYNC) fail("PREPARE pipeline not synced");
}

void Connection::fail(const std::string& what) {
    if (overdue_.load(std::memory_order_acquire)) fail_overdue();  // the watchdog cut it: say why
    broken_ = true;
    throw connection_broken("idem: PostgreSQL connection failed (" + what + "): " + trim(PQerrorMessage(conn_.get())));
}

void Connection::fail_overdue() {
    broken_ = true;
    throw connection_broken("idem: PostgreSQL did not answer in time (statement_timeout)");
}

void Connection::wait(short events, Clock::time_point deadline) {
    const int fd = PQsocket(conn_.get());
    if (fd < 0) fail("no socket");
    for (;;) {
        if (overdue_.load(std::memory_order_acquire)) fail_overdue();
        // Rounded up: truncated, the last fraction of a millisecond before the deadline would spin in
        // poll(fd, 0), once per poll interval of a wait.
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
        if (left.count() <= 0) fail_overdue();
        pollfd p{fd, events, 0};
        // Watched: no timeout (no kernel timer per wait); the watchdog wakes us past the deadline.
        const bool watched = watchdog_ != nullptr && waiting_until_.load(std::memory_order_relaxed) != 0;
        const int n = ::poll(&p, 1, watched ? -1 : static_cast<int>(std::min<long long>(left.count(), 1000)));
        if (overdue_.load(std::memory_order_acquire)) fail_overdue();
        if (n > 0) return;
        if (n < 0 && errno != EINTR) fail(std::string("poll: ") + std::strerror(errno));
    }
}

void Connection::expire_if_overdue(Clock::time_point now) noexcept {
    const Clock::rep until = waiting_until_.load(std::memory_order_acquire);
    if (until == 0 || now.time_since_epoch().count() <= until || overdue_.load(std::memory_order_relaxed)) return;
    overdue_.store(true, std::memory_order_release);
    // The socket stays open (only the owner closes it, after forget()); shutting it down makes the
    // owner's poll return and every later read fail.
    ::shutdown(fd_, SHUT_RDWR);
}

void Connection::flush(Clock::time_point deadline) {
    for (;;) {
        const int r = PQflush(conn_.get());
        if (r == 0) return;
        if (r < 0) fail("PQflush");
        // The server may be blocked writing to us: read while waiting to write.
        wait(POLLIN | POLLOUT, deadline);
        if (PQconsumeInput(conn_.get()) != 1) fail("PQconsumeInput");
    }
}

ResultPtr Connection::next_result(Clock::time_point deadline) {
    if (watchdog_ != nullptr && waiting_until_.load(std::memory_order_relaxed) != 0) {
        // Watched: let PQgetResult wait (poll without a timeout, inside libpq) — the watchdog's
        // shutdown() ends that wait past the deadline. One call per result instead of
        // PQisBusy + poll + PQconsumeInput + PQgetResult, each of which re-parses the input.
        ResultPtr r(PQgetResult(conn_.get()));
        if (overdue_.load(std::memory_order_acquire)) fail_overdue();
        if (PQstatus(conn_.get()) == CONNECTION_BAD) {
            // The server's own reason (57P01 admin shutdown...) is reported by run(); a lost
            // socket has none.
            if (!r || PQresultErrorField(r.get(), PG_DIAG_SQLSTATE) == nullptr) fail("connection lost");
            broken_ = true;
        }
        return r;
    }
    while (PQisBusy(conn_.get())) {
        wait(POLLIN, deadline);
        if (PQconsumeInput(conn_.get()) != 1) fail("PQconsumeInput");
    }
    return ResultPtr(PQgetResult(conn_.get()));
}

void Connection::send(const Step& step) {
    if (auto failed = queue_step(conn_.get(), step, prepared_)) fail(*failed);
}

bool Connection::wait_notification(std::string_view channel, std::string_view payload, Clock::time_point deadline) {
    if (generation_ != detail::fork_generation()) refuse_in_child();
    for (;;) {
        if (PQconsumeInput(conn_.get()) != 1) fail("PQconsumeInput");
        while (PGnotify* n = PQnotifies(conn_.get())) {
            const bool match = channel == n->relname && payload == n->extra;
            PQfreemem(n);
            if (match) return true;
        }
        if (Clock::now() >= deadline) return false;
        const int fd = PQsocket(conn_.get());
        if (fd < 0) fail("no socket");
        // Rounded up: truncated, the last fraction of a millisecond before the deadline would spin in
        // poll(fd, 0), once per poll interval of a wait.
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, static_cast<int>(std::clamp<long long>(left.count(), 0, 1000))) < 0 && errno != EINTR) {
            fail(std::string("poll: ") + std::strerror(errno));
        }
    }
}

void Connection::refuse_in_child() {
    // A connection leased when the process forked (fork() inside an in-transaction effect, whose
    // child goes on): the session is the parent's. Nothing may be sent on it from here.
    abandon_in_child();
    throw config_error(
        "idem: a PostgreSQL connection of this store was used in a fork()ed child (it is the parent's "
        "session): create a new store in the child");
}

StepResults Connection::run(std::span<const Step> steps, Clock::time_point deadline) {
    if (steps.empty()) {
        if (generation_ != detail::fork_generation()) refuse_in_child();
        if (broken_) throw connection_broken("idem: connection already broken");
        return {};
    }
    send_pipeline(steps, deadline);
    return receive_pipeline(steps, deadline);
}

void Connection::send_pipeline(std::span<const Step> steps, Clock::time_point deadline) {
    if (generation_ != detail::fork_generation()) refuse_in_child();
    if (broken_) throw connection_broken("idem: connection already broken");
    if (steps.empty() || !steps.back().sync_after) throw std::logic_error("idem: pipeline must end with a Sync");
    // Publish the deadline for the watchdog for the whole exchange; receive_pipeline withdraws it.
    waiting_until_.store(deadline.time_since_epoch().count(), std::memory_order_release);
    try {
        for (const Step& step : steps) send(step);
        flush(deadline);
    } catch (...) {
        waiting_until_.store(0, std::memory_order_release);
        broken_ = true;  // part of the pipeline may have gone out: its answers would be read by the next user
        throw;
    }
}

StepResults Connection::receive_pipeline(std::span<const Step> steps, Clock::time_point deadline) {
    // The deadline send_pipeline published is withdrawn however this ends.
    struct Watched {
        std::atomic<Clock::rep>& until;
        ~Watched() { until.store(0, std::memory_order_release); }
    } watched{waiting_until_};
    PipelineAnswers answers(steps.size());
    try {
        while (!answers.feed(next_result(deadline), steps[answers.index()].sync_after)) {
        }
    } catch (const pipeline_surprise& e) {
        fail(e.what());
    } catch (const connection_broken&) {
        if (overdue_.load(std::memory_order_acquire)) fail_overdue();
        broken_ = true;
        throw;
    } catch (...) {
        broken_ = true;  // answers left unread (out of memory): they would be read by the next user
        throw;
    }
    StepResults out = answers.take();
    last_used_ = Clock::now();
    return out;
}

void Connection::abandon_exchange() noexcept {
    waiting_until_.store(0, std::memory_order_release);
    broken_ = true;
}

}  // namespace idem::pg
