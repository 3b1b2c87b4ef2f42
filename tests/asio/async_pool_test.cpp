// tests/asio/async_pool_test.cpp — AsyncPostgresStore's connections: pool_stats() and its
// idem_pool_* series (open, in use (open - idle) and waiting requests, under real load on a real
// PostgreSQL (claims held by a table lock) and while a connection is being opened (a server that
// never answers)), and what an idle connection asks of the event loop.
#include "idem/asio.hpp"
#include "idem/idem.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "test_env.hpp"

#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sys/epoll.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace net = boost::asio;
using namespace std::chrono_literals;
using idem_test::PgConn;

namespace {

/// An io_context run by one thread, stopped and joined at the end.
struct Loop {
    net::io_context io;
    std::optional<net::executor_work_guard<net::io_context::executor_type>> work{io.get_executor()};
    std::thread runner{[this] { io.run(); }};
    ~Loop() {
        work.reset();
        runner.join();
    }
};

/// Waits (at most 30 s) until `done()`; returns whether it came.
template <class F>
bool eventually(F done) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (!done()) {
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(5ms);
    }
    return true;
}

std::string line(const std::string& name, std::size_t value) {
    return "\n" + name + " " + std::to_string(value) + "\n";
}

}  // namespace

TEST_CASE("async pool_stats: 10 claims and a read held by a table lock on 2 connections: 2 open, 2 in use, 9 waiting",
          "[asio][metrics]") {
    IDEM_NOT_ON_CITUS("the table lock and pg_stat_activity are the coordinator's");
    const std::string url = idem_test::require_db();
    const std::string table = idem_test::unique_name("idem_async_pool");
    const std::string app = idem_test::unique_name("idem_async_pool_app");
    idem_test::DropTable drop(url, table);
    idem::PostgresOptions o;
    o.table = table;
    o.pool_size = 2;
    o.application_name = app;
    o.lock_timeout = 60s;  // the claims wait on the lock below, however slow the machine
    o.statement_timeout = 90s;
    // Unprepared statements: a connection's PREPARE of the INSERT would wait on the lock too, and
    // the connection would stay "being opened"; only the claims must wait here.
    o.prepared_statements = false;
    Loop loop;
    std::optional<idem::asio::AsyncPostgresStore> store;
    store.emplace(loop.io.get_executor(), url, o);
    store->blocking().ensure_schema();
    auto metrics = std::make_shared<idem::PrometheusObserver>();
    metrics->set_pool_source([&store] { return store->pool_stats(); });

    idem::PoolStats s = store->pool_stats();  // before any request: nothing open
    CHECK(s.size == 2);
    CHECK(s.open == 0);
    CHECK(s.idle == 0);
    CHECK(s.waiters == 0);
    CHECK(s.acquires == 0);

    PgConn locker(url);
    locker.exec("BEGIN");
    locker.exec("LOCK TABLE " + table + " IN ACCESS EXCLUSIVE MODE");
    // 10 claims at once: the first goes out alone and waits on the lock; the other 9 queue for the
    // next group (group commit: one claim transaction in flight). A read, outside that bound,
    // goes out on the second connection and waits on the lock too.
    std::vector<std::future<idem::Claim>> claims;
    for (int i = 0; i < 10; ++i) {
        claims.push_back(store->async_claim(idem::Key("pool", "k" + std::to_string(i)), idem::fingerprint("p"), {},
                                            net::use_future));
    }
    auto read = store->async_read(idem::Key("pool", "r"), net::use_future);
    PgConn admin(url);
    // Until the first claim and the read wait on the lock, and every claim was sent or queued.
    REQUIRE(eventually([&] {
        return admin.scalar(
                   "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND "
                   "wait_event_type = 'Lock'",
                   {app}) == 2 &&
               store->pool_stats().waiters == 9;
    }));
    s = store->pool_stats();
    CHECK(s.open == 2);
    CHECK(s.idle == 0);  // both in use: 2 - 0
    CHECK(s.waiters == 9);
    CHECK(s.timeouts == 0);
    CHECK(s.acquires >= 2);  // the claim sent alone and the read, at least
    std::string text = metrics->render();
    CHECK(text.find(line("idem_pool_connections_max", 2)) != std::string::npos);
    CHECK(text.find(line("idem_pool_connections_open", 2)) != std::string::npos);
    CHECK(text.find(line("idem_pool_connections_idle", 0)) != std::string::npos);
    CHECK(text.find(line("idem_pool_waiters", 9)) != std::string::npos);

    locker.exec("COMMIT");
    for (auto& claim : claims) CHECK(claim.get().status == idem::ClaimStatus::claimed);
    CHECK_FALSE(read.get());  // (no row "r")
    // Every answer is in: both connections idle, nobody waiting. (A request's connection is idle
    // once its answer arrived, before the caller's completion runs.)
    s = store->pool_stats();
    CHECK(s.open == 2);
    CHECK(s.idle == 2);
    CHECK(s.waiters == 0);
    CHECK(s.acquires >= 3);  // and one for the group that carried the 9 queued
    CHECK(s.waited <= 2);    // only a request that found every connection still being opened waits
    CHECK(s.waits_within.back() == s.waited);
    CHECK(s.acquires >= s.waited);
    text = metrics->render();
    CHECK(text.find(line("idem_pool_connections_idle", 2)) != std::string::npos);
    CHECK(text.find(line("idem_pool_waiters", 0)) != std::string::npos);
    CHECK(text.find(line("idem_pool_acquires_total", s.acquires)) != std::string::npos);
    CHECK(admin.scalar("SELECT count(*) FROM " + table) == 10);

    metrics->set_pool_source({});
    store.reset();
}

TEST_CASE("async pool_stats: a connection being opened is open and not idle; its waiters are counted",
          "[asio][metrics]") {
    // A server that accepts the TCP connection and never answers: the connection stays "being
    // opened" until connect_timeout, or until the listener goes.
    const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(lfd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(lfd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(lfd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    REQUIRE(::listen(lfd, 16) == 0);
    const std::string conninfo = "host=127.0.0.1 port=" + std::to_string(ntohs(a.sin_port)) +
                                 " dbname=none user=none sslmode=disable gssencmode=disable";
    idem::PostgresOptions o;
    o.table = "idem_never_reached";
    o.pool_size = 1;
    o.connect_timeout = 60s;
    Loop loop;
    std::optional<idem::asio::AsyncPostgresStore> store;
    store.emplace(loop.io.get_executor(), conninfo, o);
    // The first claim opens the only connection; the other two are over group commit's bound (a
    // transaction per connection): queued. A read (outside that bound) finds the pool full of
    // connections being opened and waits for one.
    std::vector<std::future<idem::Claim>> claims;
    for (int i = 0; i < 3; ++i) {
        claims.push_back(store->async_claim(idem::Key("pool", "k" + std::to_string(i)), idem::fingerprint("p"), {},
                                            net::use_future));
    }
    auto read = store->async_read(idem::Key("pool", "r"), net::use_future);
    REQUIRE(eventually([&] { return store->pool_stats().waiters == 3; }));
    idem::PoolStats s = store->pool_stats();
    CHECK(s.size == 1);
    CHECK(s.open == 1);
    CHECK(s.idle == 0);
    CHECK(s.waiters == 3);
    CHECK(s.acquires == 2);  // the opener's and the read's; the queued claims have not asked yet
    CHECK(s.waited == 0);    // the read is still waiting: counted when its wait ends

    ::shutdown(lfd, SHUT_RDWR);
    ::close(lfd);  // the pending connection is reset, and no new one gets through
    for (auto& claim : claims) CHECK_THROWS_AS(claim.get(), idem::store_unavailable);
    CHECK_THROWS_AS(read.get(), idem::store_unavailable);
    s = store->pool_stats();
    CHECK(s.open == 0);
    CHECK(s.idle == 0);
    CHECK(s.waiters == 0);
    CHECK(s.waited >= 1);  // the read's wait, ended by the failed connection
    CHECK(s.waits_within.back() == s.waited);
    store.reset();
}

namespace {

/// Every descriptor that an epoll instance of this process watches and that is a socket, with the
/// events it is registered for (/proc/self/fdinfo of each epoll descriptor).
std::vector<std::pair<int, unsigned>> watched_sockets() {
    namespace fs = std::filesystem;
    std::vector<std::pair<int, unsigned>> out;
    for (const auto& entry : fs::directory_iterator("/proc/self/fd")) {
        std::error_code ec;
        if (fs::read_symlink(entry.path(), ec).string() != "anon_inode:[eventpoll]") continue;
        std::ifstream info("/proc/self/fdinfo/" + entry.path().filename().string());
        for (std::string text; std::getline(info, text);) {
            // "tfd:       12 events:       19 data: ..."
            std::istringstream in(text);
            std::string tag, events_tag;
            int fd = -1;
            unsigned events = 0;
            if (!(in >> tag >> fd >> events_tag >> std::hex >> events) || tag != "tfd:") continue;
            const auto target = fs::read_symlink("/proc/self/fd/" + std::to_string(fd), ec).string();
            if (target.rfind("socket:", 0) == 0) out.emplace_back(fd, events);
        }
    }
    return out;
}

}  // namespace

TEST_CASE("async: an idle connection is watched for reading only, after connecting and after large writes",
          "[asio][pool]") {
    // The event loop re-arms a descriptor's events on every wait; one still registered for
    // writing, and writable, wakes the loop once more on every round trip, for nothing. Connecting
    // waits for writability, and so does a request larger than the socket takes at once.
    const std::string url = idem_test::require_db();
    const std::string table = idem_test::unique_name("idem_async_watch");
    net::io_context io;
    idem::PostgresOptions o;
    o.table = table;
    o.pool_size = 2;
    {
        idem::asio::AsyncPostgresStore store(io.get_executor(), url, o);
        store.blocking().ensure_schema();
        const std::string big(4u << 20, 'x');  // larger than a socket's buffer
        int executed = 0;
        for (int i = 0; i < 6; ++i) {
            idem::asio::async_execute_once(
                store, idem::Key("async-watch", "k" + std::to_string(i)), idem::fingerprint("x"),
                [&, i] {
                    return idem::Response{200, i % 2 == 0 ? big : std::string("small")};
                },
                [&](std::exception_ptr e, idem::Result<idem::Response> r) {
                    if (!e && r.outcome() == idem::Outcome::executed) ++executed;
                });
        }
        io.run();
        REQUIRE(executed == 6);
        const auto watched = watched_sockets();
        REQUIRE(!watched.empty());
        REQUIRE(watched.size() == store.pool_stats().open);  // (nothing else here uses a socket)
        for (const auto& [fd, events] : watched) {
            INFO("descriptor " << fd << ", events 0x" << std::hex << events);
            CHECK((events & EPOLLIN) != 0);
            CHECK((events & EPOLLOUT) == 0);
        }
    }
    PgConn(url).exec("DROP TABLE IF EXISTS " + table);
}
