#include "connection.hpp"

// sds.h declares its functions without C linkage for C++, and hiredis.h includes it outside its own
// extern "C": it is included first, here, inside one.
extern "C" {
#include <hiredis/sds.h>
}
#include <hiredis/hiredis.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <fmt/format.h>
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include "idem/errors.hpp"

namespace idem::redis {
namespace {

timeval to_timeval(std::chrono::milliseconds ms) {
    timeval tv{};
    tv.tv_sec = static_cast<decltype(tv.tv_sec)>(ms.count() / 1000);
    tv.tv_usec = static_cast<decltype(tv.tv_usec)>((ms.count() % 1000) * 1000);
    return tv;
}

bool starts_with_code(std::string_view message, std::string_view code) {
    return message.size() >= code.size() && message.substr(0, code.size()) == code &&
           (message.size() == code.size() || message[code.size()] == ' ');
}

}  // namespace

void ReplyDeleter::operator()(redisReply* reply) const noexcept {
    if (reply != nullptr) freeReplyObject(reply);
}

ReplyType type_of(const redisReply& reply) noexcept {
    switch (reply.type) {
        case REDIS_REPLY_STRING: return ReplyType::string;
        case REDIS_REPLY_ARRAY: return ReplyType::array;
        case REDIS_REPLY_INTEGER: return ReplyType::integer;
        case REDIS_REPLY_NIL: return ReplyType::nil;
        case REDIS_REPLY_STATUS: return ReplyType::status;
        case REDIS_REPLY_ERROR: return ReplyType::error;
        default: return ReplyType::other;
    }
}

std::string_view text_of(const redisReply& reply) noexcept {
    if (reply.str == nullptr) return {};
    return {reply.str, reply.len};
}

long long integer_of(const redisReply& reply) noexcept { return reply.integer; }

std::size_t size_of(const redisReply& reply) noexcept { return reply.type == REDIS_REPLY_ARRAY ? reply.elements : 0; }

const redisReply& element(const redisReply& reply, std::size_t i) noexcept { return *reply.element[i]; }

void throw_error_reply(std::string_view message, std::string_view what, std::string_view where) {
    const std::string text = fmt::format("idem: {}: Redis at {} answered: {}", what, where, message);
    for (const char* code : {"NOAUTH", "WRONGPASS", "NOPERM"}) {
        if (starts_with_code(message, code)) throw config_error(text);
    }
    // "ERR invalid password" (servers before 6) and "ERR AUTH <password> called without any
    // password configured" are refusals of the configuration, not outages.
    if (message.find("password") != std::string_view::npos && starts_with_code(message, "ERR")) {
        throw config_error(text);
    }
    if (passing_refusal(message)) throw store_unavailable(text);
    if (starts_with_code(message, "WRONGTYPE")) throw corrupt_record(text);
    throw database_error(text);
}

bool passing_refusal(std::string_view message) noexcept {
    for (const char* code :
         {"LOADING", "BUSY", "READONLY", "OOM", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "NOREPLICAS", "MISCONF"}) {
        if (starts_with_code(message, code)) return true;
    }
    return false;
}

std::chrono::system_clock::time_point time_from_unix_ms(std::int64_t ms, std::string_view what) {
    using SysClock = std::chrono::system_clock;
    constexpr std::int64_t kLimit =
        std::chrono::duration_cast<std::chrono::milliseconds>(SysClock::duration::max()).count() - 1;
    if (ms > kLimit || ms < -kLimit) throw corrupt_record(fmt::format("idem: {} holds a time out of range", what));
    return SysClock::time_point(std::chrono::milliseconds(ms));
}

std::string location(const RedisOptions& options) {
    if (!options.unix_socket.empty()) return "unix socket " + options.unix_socket;
    return fmt::format("{}:{}", options.host, options.port);
}

Connection::Connection(const RedisOptions& options) : where_(location(options)) {
    const timeval connect_tv = to_timeval(options.connect_timeout);
    context_ = options.unix_socket.empty() ? redisConnectWithTimeout(options.host.c_str(), options.port, connect_tv)
                                           : redisConnectUnixWithTimeout(options.unix_socket.c_str(), connect_tv);
    if (context_ == nullptr) throw store_unavailable("idem: connect: out of memory for a Redis context");
    if (context_->err != 0) {
        const std::string reason = context_->errstr;
        redisFree(context_);
        context_ = nullptr;
        throw store_unavailable(fmt::format("idem: connect: cannot reach Redis at {}: {}", where_, reason));
    }
    // The handshake is bounded by connect_timeout too; every later wait by command_timeout.
    if (redisSetTimeout(context_, connect_tv) != REDIS_OK) {
        redisFree(context_);
        context_ = nullptr;
        throw store_unavailable(fmt::format("idem: connect: cannot set a timeout on {}", where_));
    }
    try {
        const std::string db = std::to_string(options.database);
        std::size_t queued = 0;
        // A username alone still authenticates: an ACL user made with `nopass` takes any password,
        // and without AUTH the connection would act as `default`, with its rights instead.
        if (!options.username.empty()) {
            append({"AUTH", options.username, options.password});
            ++queued;
        } else if (!options.password.empty()) {
            append({"AUTH", options.password});
            ++queued;
        }
        if (options.database != 0) {
            append({"SELECT", db});
            ++queued;
        }
        for (std::size_t i = 0; i < queued; ++i) {
            Reply reply = read("connect");
            if (type_of(*reply) == ReplyType::error) throw_error_reply(text_of(*reply), "connect", where_);
        }
        if (redisSetTimeout(context_, to_timeval(options.command_timeout)) != REDIS_OK) {
            throw store_unavailable(fmt::format("idem: connect: cannot set a timeout on {}", where_));
        }
    } catch (const database_error& e) {
        // SELECT of a database the server does not have: permanent.
        redisFree(context_);
        context_ = nullptr;
        throw config_error(e.what());
    } catch (...) {
        redisFree(context_);
        context_ = nullptr;
        throw;
    }
}

Connection::~Connection() {
    if (context_ != nullptr) redisFree(context_);
}

void Connection::append(std::span<const std::string_view> args) {
    // Every command idem sends has a few arguments: no heap for them (a batch appends many).
    constexpr std::size_t kInline = 16;
    std::array<const char*, kInline> argv_inline{};
    std::array<std::size_t, kInline> lengths_inline{};
    std::vector<const char*> argv_heap;
    std::vector<std::size_t> lengths_heap;
    const char** argv = argv_inline.data();
    std::size_t* lengths = lengths_inline.data();
    if (args.size() > kInline) {
        argv_heap.resize(args.size());
        lengths_heap.resize(args.size());
        argv = argv_heap.data();
        lengths = lengths_heap.data();
    }
    for (std::size_t i = 0; i < args.size(); ++i) {
        argv[i] = args[i].data();
        lengths[i] = args[i].size();
    }
    if (redisAppendCommandArgv(context_, static_cast<int>(args.size()), argv, lengths) != REDIS_OK) {
        broken_ = true;
        throw store_unavailable(
            fmt::format("idem: cannot queue a command for Redis at {}: {}", where_, context_->errstr));
    }
    ++owed_;
}

Reply Connection::read(std::string_view what) {
    if (broken_)
        throw store_unavailable(fmt::format("idem: {}: the connection to Redis at {} is broken", what, where_));
    flush(what);
    void* raw = nullptr;
    if (redisGetReply(context_, &raw) != REDIS_OK || raw == nullptr) {
        broken_ = true;
        const bool timed_out = context_->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK);
        throw store_unavailable(fmt::format("idem: {}: {} Redis at {}{}{}", what,
                                            timed_out ? "no answer within command_timeout from" : "lost", where_,
                                            timed_out ? "" : ": ", timed_out ? "" : context_->errstr));
    }
    if (owed_ > 0) --owed_;
    return Reply(static_cast<redisReply*>(raw));
}

// hiredis sends what is queued with write(2), so a write to a peer that has gone would raise
// SIGPIPE, whose default action ends the process — and a library must not change the process's
// signal handling. So the queued bytes are sent here with send(MSG_NOSIGNAL), and redisGetReply
// finds nothing left to write: it only reads, which never raises SIGPIPE. The socket's send timeout
// (redisSetTimeout) bounds each send as it bounds hiredis's own writes.
void Connection::flush(std::string_view what) {
    const std::size_t size = sdslen(context_->obuf);
    std::size_t sent = 0;
    while (sent < size) {
        const ssize_t n = ::send(context_->fd, context_->obuf + sent, size - sent, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            broken_ = true;
            const bool timed_out = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
            throw store_unavailable(fmt::format(
                "idem: {}: {} Redis at {}{}{}", what, timed_out ? "could not send within command_timeout to" : "lost",
                where_, timed_out ? "" : ": ", timed_out ? "" : std::strerror(n < 0 ? errno : EPIPE)));
        }
        sent += static_cast<std::size_t>(n);
    }
    if (size > 0) {
        // As hiredis does once its buffer is written: a fresh, empty one.
        sdsfree(context_->obuf);
        context_->obuf = sdsempty();
        if (context_->obuf == nullptr) {
            broken_ = true;
            throw store_unavailable(fmt::format("idem: {}: out of memory for a Redis buffer", what));
        }
    }
}

Pool::Pool(std::size_t size, std::chrono::milliseconds wait, Opener open)
    : size_(size), wait_(wait), open_(std::move(open)) {}

Pool::~Pool() = default;

void Pool::Lease::discard() noexcept {
    if (!conn_) return;
    pool_->discarded.fetch_add(1, std::memory_order_relaxed);
    conn_.reset();
    std::lock_guard lock(pool_->mutex_);
    pool_->free_place_locked();
}

Pool::Lease Pool::acquire() {
    std::unique_lock lock(mutex_);
    if (waiters_.empty()) {
        if (!idle_.empty()) {
            auto conn = std::move(idle_.back());
            idle_.pop_back();
            return Lease(*this, std::move(conn));
        }
        if (open_count_ < size_) {
            ++open_count_;
            lock.unlock();
            return open_reserved();
        }
    }
    Waiter me;
    waiters_.push_back(&me);
    const auto deadline = std::chrono::steady_clock::now() + wait_;
    if (!me.served.wait_until(lock, deadline, [&] { return me.conn != nullptr || me.may_open; })) {
        // Not served, so still queued (serving removes a waiter, under the mutex we hold).
        waiters_.erase(std::find(waiters_.begin(), waiters_.end(), &me));
        throw pool_timeout(fmt::format("idem: every one of the {} pooled Redis connections stayed busy for {} ms",
                                       size_, wait_.count()));
    }
    if (me.conn) return Lease(*this, std::move(me.conn));
    lock.unlock();
    return open_reserved();
}

Pool::Lease Pool::open_reserved() {
    try {
        auto conn = open_();
        opened.fetch_add(1, std::memory_order_relaxed);
        return Lease(*this, std::move(conn));
    } catch (...) {
        std::lock_guard lock(mutex_);
        free_place_locked();
        throw;
    }
}

void Pool::free_place_locked() noexcept {
    if (waiters_.empty()) {
        --open_count_;
        return;
    }
    Waiter* next = waiters_.front();
    waiters_.pop_front();
    next->may_open = true;  // the place stays counted: it is theirs
    next->served.notify_one();
}

void Pool::give_back(std::unique_ptr<Connection> conn) noexcept {
    if (!conn->reusable()) {
        discarded.fetch_add(1, std::memory_order_relaxed);
        conn.reset();  // closed outside the lock
        std::lock_guard lock(mutex_);
        free_place_locked();
        return;
    }
    std::lock_guard lock(mutex_);
    if (waiters_.empty()) {
        idle_.push_back(std::move(conn));
        return;
    }
    Waiter* next = waiters_.front();
    waiters_.pop_front();
    next->conn = std::move(conn);
    next->served.notify_one();
}

void Pool::drop_idle() noexcept {
    std::vector<std::unique_ptr<Connection>> dropped;
    {
        std::lock_guard lock(mutex_);
        dropped.swap(idle_);
        open_count_ -= dropped.size();
        discarded.fetch_add(dropped.size(), std::memory_order_relaxed);
    }
    // (closed here, outside the lock; nobody waits while connections are idle)
}

std::size_t Pool::waiting() const {
    std::lock_guard lock(mutex_);
    return waiters_.size();
}

}  // namespace idem::redis
