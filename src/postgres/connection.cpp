#include "connection.hpp"

#include "../common.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace idem::pg {

// ---- Params ---------------------------------------------------------------------------------------

void Params::too_many() { throw std::logic_error("idem: too many statement parameters"); }

Params& Params::text_format(std::optional<std::string_view> s) {
    if (!s) return push(nullptr, 0, 0);
    return push(s->data() != nullptr ? s->data() : "", static_cast<int>(s->size()), 0);
}

namespace {
void put_be(std::string& out, std::uint64_t v, int width) {
    for (int i = width - 1; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
}  // namespace

Params& Params::array(Oid element, const std::vector<std::string_view>& items) {
    // Binary array: ndim, has-nulls flag, element type, then per dimension size and lower bound,
    // then per element its length and bytes.
    std::string& a = *owned_.emplace_back(std::make_unique<std::string>());
    std::size_t size = 20;
    for (auto item : items) size += 4 + item.size();
    a.reserve(size);
    put_be(a, 1, 4);
    put_be(a, 0, 4);
    put_be(a, element, 4);
    put_be(a, items.size(), 4);
    put_be(a, 1, 4);
    for (auto item : items) {
        put_be(a, item.size(), 4);
        a.append(item);
    }
    return raw(a);
}

Params& Params::int2_array(const std::vector<std::int16_t>& items) {
    std::string bytes;
    for (auto v : items) put_be(bytes, static_cast<std::uint16_t>(v), 2);
    std::vector<std::string_view> views;
    for (std::size_t i = 0; i < items.size(); ++i) views.emplace_back(bytes.data() + 2 * i, 2);
    return array(oid::int2, views);
}

Params& Params::int8_array(const std::vector<std::int64_t>& items) {
    std::string bytes;
    for (auto v : items) put_be(bytes, static_cast<std::uint64_t>(v), 8);
    std::vector<std::string_view> views;
    for (std::size_t i = 0; i < items.size(); ++i) views.emplace_back(bytes.data() + 8 * i, 8);
    return array(oid::int8, views);
}

Params& Params::number(std::uint64_t v, int width) {
    if (size_ == kCapacity) too_many();
    auto& buf = numbers_[static_cast<std::size_t>(size_)];
    // Big-endian: the low `width` bytes of v, most significant first (one bswap, no byte loop).
    std::uint64_t be = v << (8 * (8 - width));
    if constexpr (std::endian::native == std::endian::little) be = __builtin_bswap64(be);
    std::memcpy(buf.data(), &be, sizeof be);
    return push(buf.data(), width, 1);
}

// ---- binary result columns --------------------------------------------------------------------------

std::uint64_t get_be(const PGresult* r, int row, int col, int width) {
    // A NULL reads as length 0, which no width here allows: two libpq calls, not three.
    if (PQgetlength(r, row, col) != width) {
        throw corrupt_record("idem: unexpected NULL or width in column " + std::to_string(col));
    }
    // Big-endian, `width` ≤ 8 bytes: load into one end of a word, one byte swap.
    const auto n = static_cast<std::size_t>(width);
    std::uint64_t v = 0;
    std::memcpy(reinterpret_cast<char*>(&v) + (std::endian::native == std::endian::little ? 0 : 8 - n),
                PQgetvalue(r, row, col), n);
    if constexpr (std::endian::native == std::endian::little) v = __builtin_bswap64(v) >> (8 * (8 - n));
    return v;
}

std::int64_t get_int8(const PGresult* r, int row, int col) { return static_cast<std::int64_t>(get_be(r, row, col, 8)); }
std::int32_t get_int4(const PGresult* r, int row, int col) {
    return static_cast<std::int32_t>(static_cast<std::uint32_t>(get_be(r, row, col, 4)));
}
std::int16_t get_int2(const PGresult* r, int row, int col) {
    return static_cast<std::int16_t>(static_cast<std::uint16_t>(get_be(r, row, col, 2)));
}
std::string_view get_bytes(const PGresult* r, int row, int col) {
    return {PQgetvalue(r, row, col), static_cast<std::size_t>(PQgetlength(r, row, col))};
}
bool is_null(const PGresult* r, int row, int col) { return PQgetisnull(r, row, col) != 0; }
bool get_bool(const PGresult* r, int row, int col) { return get_be(r, row, col, 1) != 0; }

std::chrono::system_clock::time_point get_timestamptz(const PGresult* r, int row, int col) {
    return timestamptz_from_pg(get_int8(r, row, col));
}

std::chrono::system_clock::time_point timestamptz_from_pg(std::int64_t us) noexcept {
    // Binary timestamptz: microseconds since 2000-01-01 00:00:00 UTC (integer datetimes);
    // INT64_MAX / INT64_MIN are 'infinity' / '-infinity'. system_clock counts nanoseconds here, so
    // values beyond its range (±292 years around 1970) are clamped instead of overflowing.
    using namespace std::chrono;
    using tp = system_clock::time_point;
    constexpr std::int64_t pg_epoch_unix_us = 946684800LL * 1000000LL;
    // Both bounds in PostgreSQL's epoch; the range is not symmetric around it (the epochs differ
    // by 30 years), so each side gets its own limit.
    constexpr std::int64_t max_us = duration_cast<microseconds>(tp::duration::max()).count() - pg_epoch_unix_us;
    constexpr std::int64_t min_us = duration_cast<microseconds>(tp::duration::min()).count() - pg_epoch_unix_us;
    if (us > max_us) return tp::max();
    if (us < min_us) return tp::min();
    return tp(duration_cast<tp::duration>(microseconds(us + pg_epoch_unix_us)));
}

void quiet_notices(PGconn* conn) noexcept {
    PQsetNoticeProcessor(
        conn, [](void*, const char*) {}, nullptr);
}

bool is_connection_sqlstate(std::string_view s) noexcept {
    // 08: connection exception; 57P01-57P05: admin/crash shutdown, cannot connect now, idle timeouts.

    // 25006: read-only transaction — we reached a standby (after a failover); reconnect to find
    // the writer (target_session_attrs=read-write in the conninfo).
    return s.starts_with("08") || s.starts_with("57P") || s == "25006";
}

// ---- Connection -------------------------------------------------------------------------------------

std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
}

namespace {

// Merges our session settings into the user's own `options` (if the conninfo has any).
std::string session_options(const ConnectSettings& settings) {
    std::string user;
    if (PQconninfoOption* opts = PQconninfoParse(settings.conninfo.c_str(), nullptr)) {
        for (PQconninfoOption* o = opts; o->keyword != nullptr; ++o) {
            if (std::strcmp(o->keyword, "options") == 0 && o->val != nullptr) user = o->val;
        }
        PQconninfoFree(opts);
    }
    // enable_seqscan=off: every statement idem prepares is a primary-key lookup. A table ANALYZEd
    // while (nearly) empty makes the cached generic plans of those lookups sequential scans, and
    // they stay cached while the table grows — until the next ANALYZE, each claim reads the whole
    // table (measured: 1 ms and 5,000 rows read per lookup at 5,000 rows). Off, the planner takes
    // the index whatever the statistics say. list_stale, which must scan, turns it back on.
    std::string ours =
        "-c enable_seqscan=off -c statement_timeout=" + std::to_string(settings.statement_timeout.count()) +
        " -c lock_timeout=" + std::to_string(settings.lock_timeout.count()) +
        // a claim never runs inside an open transaction; this is a safety net
        " -c idle_in_transaction_session_timeout=" +
        std::to_string(std::max<long long>(settings.statement_timeout.count() * 2, 1000));
    return user.empty() ? ours : user + " " + ours;
}

}  // namespace

bool is_configuration_sqlstate(std::string_view s) noexcept {
    // 28: invalid authorization; 3D000 no such database; 3F000 no such schema; 42501 permission
    // denied; 42P01 / 42703 / 42704 no such table / column / object. None heals by retrying.
    return s.starts_with("28") || s == "3D000" || s == "3F000" || s == "42501" || s == "42P01" || s == "42703" ||
           s == "42704";
}

void throw_database_error(std::string message, const std::string& sqlstate) {
    if (sqlstate == "42P01") message += " (create idem's table: call PostgresStore::ensure_schema())";
    if (is_configuration_sqlstate(sqlstate)) throw config_error(message, sqlstate);
    // Timeouts (statement, lock), cancels, resource exhaustion, a server going away: the database
    // is there (or will be) but cannot serve us now.
    if (sqlstate == "57014" || sqlstate == "55P03" || sqlstate.starts_with("53") || is_connection_sqlstate(sqlstate)) {
        throw store_unavailable(message, sqlstate);
    }
    throw database_error(message, sqlstate);
}

namespace {

// The verdict of one connection attempt (one host's part of libpq's message), or empty.
std::string_view attempt_failure_sqlstate(std::string_view message) noexcept {
    struct Pattern {
        std::string_view text, sqlstate;
    };
    static constexpr Pattern patterns[] = {
        {"password authentication failed", "28P01"},
        {"no password supplied", "28P01"},
        {"no pg_hba.conf entry", "28000"},
        {"pg_hba.conf rejects connection", "28000"},
        {"Peer authentication failed for user", "28000"},
        {"certificate authentication failed for user", "28000"},
        {"is not permitted to log in", "28000"},
        {"permission denied for database", "42501"},
    };
    if (message.find("FATAL:  database \"") != std::string_view::npos &&
        message.find("\" does not exist") != std::string_view::npos) {
        return "3D000";
    }
    if (message.find("FATAL:  role \"") != std::string_view::npos &&
        message.find("\" does not exist") != std::string_view::npos) {
        return "28000";
    }
    for (const Pattern& p : patterns) {
        if (message.find(p.text) != std::string_view::npos) return p.sqlstate;
    }
    return {};
}

}  // namespace

std::string connect_failure_sqlstate(std::string_view message) noexcept {
    // libpq gives no SQLSTATE for a failed connection attempt, only the server's message. These are
    // PostgreSQL's (English) texts for the failures that no retry heals; anything else — refused,
    // timed out, starting up, too many clients, or a server speaking another language — stays an
    // outage (store_unavailable). Only verdicts the server reaches on its own count: an LDAP,
    // RADIUS, PAM, GSSAPI or ident failure reads the same whether the password was wrong or the
    // authentication service is down, so it stays an outage.
    //
    // libpq's own verdict on the conninfo, before any connection (its messages begin with it).
    static constexpr std::string_view malformed[] = {
        "invalid connection option",     "invalid integer value",
        "invalid port number",           "missing \"=\" after",
        "unterminated quoted string",    "invalid URI",
        "invalid sslmode value",         "invalid gssencmode value",
        "invalid channel_binding value", "invalid target_session_attrs value",
    };
    for (std::string_view m : malformed) {
        if (message.starts_with(m)) return "22023";  // invalid_parameter_value
    }
    // Several hosts (a Patroni pair): libpq reports one "connection to server … failed: …" per
    // host tried. Permanent only if every host's verdict is: one host that refused for good while
    // another is only restarting is an outage.
    constexpr std::string_view kAttempt = "connection to server ";
    std::string_view first;
    for (std::size_t at = message.find(kAttempt); at != std::string_view::npos;) {
        const std::size_t next = message.find(kAttempt, at + kAttempt.size());
        const std::string_view verdict = attempt_failure_sqlstate(message.substr(at, next - at));
        if (verdict.empty()) return {};
        if (first.empty()) first = verdict;
        at = next;
    }
    return std::string(first.empty() ? attempt_failure_sqlstate(message) : first);
}

void throw_connect_error(const std::string& libpq_message) {
    std::string message = "idem: cannot connect to PostgreSQL: " + trim(libpq_message);
    const std::string sqlstate = connect_failure_sqlstate(libpq_message);
    if (!sqlstate.empty()) throw config_error(message + " (a configuration error: check the conninfo)", sqlstate);
    throw store_unavailable(message);
}

ConnectParams::ConnectParams(const ConnectSettings& settings)
    : timeout_(std::to_string(
          std::max<long long>(2, (settings.connect_timeout.count() + 999) / 1000))),  // libpq: seconds, min 2
      options_(settings.session_options ? session_options(settings) : std::string()) {
    // The user's conninfo is expanded from "dbname"; the keywords after it take precedence.
    keys_ = {"dbname", "connect_timeout", "application_name", settings.session_options ? "options" : nullptr, nullptr};
    values_ = {settings.conninfo.c_str(), timeout_.c_str(), settings.application_name.c_str(), options_.c_str(),
               nullptr};
}

void configure_connected(PGconn* conn) {
    quiet_notices(conn);
    if (PQsetnonblocking(conn, 1) != 0 || PQenterPipelineMode(conn) != 1) {
        throw store_unavailable("idem: cannot enter pipeline mode: " + trim(PQerrorMessage(conn)));
    }
}

void check_prepared(const PGresult* r, const StatementDef& def) {
    if (PQresultStatus(r) == PGRES_COMMAND_OK) return;
    const char* field = PQresultErrorField(r, PG_DIAG_SQLSTATE);
    const std::string state = field ? field : "";
    // The backend went away while we prepared (terminated, shutting down): a broken
    // connection, retried on a fresh one like any other — not a statement's error.
    if (is_connection_sqlstate(state)) {
        throw connection_broken(
            "idem: PostgreSQL closed the connection while preparing: " + trim(PQresultErrorMessage(r)), state);
    }
    // (a missing table is a config_error that says to run ensure_schema(); a lock or
    // statement timeout while preparing, the table being locked, is unavailable now)
    throw_database_error("idem: cannot prepare " + def.name + ": " + trim(PQresultErrorMessage(r)), state);
}

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

// ---- Watchdog ---------------------------------------------------------------------------------------

Watchdog::Watchdog(std::chrono::milliseconds tick)
    : tick_(tick), thread_([this](std::stop_token stop) { run(stop); }) {}

Watchdog::~Watchdog() {
    thread_.request_stop();
    wake_.notify_all();
}  // thread_ joins here, before the members it uses go

void Watchdog::watch(Connection* conn) {
    std::lock_guard lock(mutex_);
    watched_.push_back(conn);
}

void Watchdog::forget(Connection* conn) noexcept {
    std::lock_guard lock(mutex_);
    std::erase(watched_, conn);
}

void Watchdog::run(std::stop_token stop) {
    std::unique_lock lock(mutex_);
    while (!stop.stop_requested()) {
        wake_.wait_for(lock, stop, tick_, [] { return false; });
        const auto now = Clock::now();
        // Under the mutex: forget() cannot return, so no connection is destroyed, while we look.
        for (Connection* conn : watched_) conn->expire_if_overdue(now);
    }
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
    const StatementDef& def = *step.def;
    const Params& p = *step.params;
    const int ok = prepared_ && !def.name.empty()
                       ? PQsendQueryPrepared(conn_.get(), def.name.c_str(), p.size(), p.values(), p.lengths(),
                                             p.formats(), step.result_format)
                       : PQsendQueryParams(conn_.get(), def.sql.c_str(), p.size(),
                                           def.param_types.empty() ? nullptr : def.param_types.data(), p.values(),
                                           p.lengths(), p.formats(), step.result_format);
    if (ok != 1) fail("send " + def.name);
    if (step.sync_after && PQpipelineSync(conn_.get()) != 1) fail("PQpipelineSync");
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

std::string_view StepResult::sqlstate() const noexcept {
    if (!failed) return {};
    const char* state = result ? PQresultErrorField(result.get(), PG_DIAG_SQLSTATE) : nullptr;
    return state ? std::string_view(state) : std::string_view("XX000");
}

std::string StepResult::message() const {
    if (aborted) return "skipped: an earlier statement of the pipeline failed";
    if (rolled_back) return "rolled back: a later statement of its transaction failed";
    if (!failed || !result) return {};
    return trim(PQresultErrorMessage(result.get()));
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

// ---- PipelineAnswers ---------------------------------------------------------------------------------

void PipelineAnswers::take_error(StepResult& step, ResultPtr r) {
    step.result = std::move(r);
    step.failed = true;
    if (is_connection_sqlstate(step.sqlstate())) {
        throw connection_broken("idem: PostgreSQL closed the connection: " + step.message(),
                                std::string(step.sqlstate()));
    }
}

void PipelineAnswers::close_segment() {
    // A failure anywhere in the segment rolled back the statements before it.
    for (std::size_t f = segment_; f <= i_; ++f) {
        if (!out_[f].failed) continue;
        for (std::size_t j = segment_; j < f; ++j) {
            if (out_[j].ok()) {
                out_[j].result.reset();
                out_[j].rolled_back = true;
            }
        }
        break;
    }
    segment_ = i_ + 1;
}

bool PipelineAnswers::feed(ResultPtr r, bool sync_after) {
    const auto surprise = [](const char* what) { throw pipeline_surprise(what); };
    if (i_ >= out_.size()) surprise("unexpected extra result");
    switch (expect_) {
        case Expect::result:
            if (!r) surprise("missing result");
            switch (PQresultStatus(r.get())) {
                case PGRES_TUPLES_OK:
                case PGRES_COMMAND_OK: out_[i_].result = std::move(r); break;
                case PGRES_PIPELINE_ABORTED: out_[i_].aborted = true; break;
                case PGRES_FATAL_ERROR: take_error(out_[i_], std::move(r)); break;
                default:
                    throw pipeline_surprise(std::string("unexpected result status ") +
                                            PQresStatus(PQresultStatus(r.get())));
            }
            expect_ = Expect::null;
            return false;
        case Expect::null:
        case Expect::null_after_commit_error:
            if (r)
                surprise(expect_ == Expect::null ? "unexpected extra result"
                                                 : "unexpected extra result after a failed commit");
            if (expect_ == Expect::null && !sync_after) {
                ++i_;
                expect_ = Expect::result;
                return i_ == out_.size();
            }
            expect_ = Expect::sync;
            return false;
        case Expect::sync:
            if (r && PQresultStatus(r.get()) == PGRES_FATAL_ERROR) {
                // The COMMIT at the Sync failed (a deferred constraint, a serialization failure): every
                // statement of the segment is undone. Reported as the last statement's failure.
                take_error(out_[i_], std::move(r));
                expect_ = Expect::null_after_commit_error;
                return false;
            }
            if (!r || PQresultStatus(r.get()) != PGRES_PIPELINE_SYNC) surprise("pipeline out of sync");
            close_segment();
            ++i_;
            expect_ = Expect::result;
            return i_ == out_.size();
    }
    return false;
}

}  // namespace idem::pg
