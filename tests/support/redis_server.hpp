// tests/support/redis_server.hpp — a throwaway redis-server per test (not part of idem).
//
//   idem_test::RedisServer server;                        // appendonly yes, appendfsync always
//   idem::RedisStore store{server.store_options()};
//   server.kill9(); server.start();                       // crash and AOF replay
//
// Each server gets a fresh private directory (/tmp/idem-redis-XXXXXX, or under $IDEM_TEST_REDIS_DIR;
// 0700, owned by the `redis` user when the tests run as root) holding its unix socket
// (redis.sock, the only listener unless extra_args asks for a --port), its AOF (appendonlydir/),
// its log (redis.log) and the server's own stdout/stderr (stdout.log). As root, redis-server runs as
// `redis` (setgid/setuid in the forked child). Many servers may run at once (ctest -j): nothing is
// shared but /tmp.
//
// No process is left behind: the destructor (in the process that made the server, not in a forked
// child's copy) stops the server (SIGTERM, SIGCONT for a paused one, SIGKILL after 10 s) and
// removes the directory; a server started from the process's main thread also dies with it
// (PR_SET_PDEATHSIG: the signal follows the thread that forked, so a server started from another
// thread does not get it, or it would die with that thread).
//
// power_loss preloads tests/redis/power_loss.c (IDEM_REDIS_POWER_LOSS_SHIM): the server's AOF
// writes reach the kernel only at fsync, so kill9() loses exactly what a machine crash would.
//
// Needs IDEM_REDIS_SERVER (the redis-server binary; tests/redis/CMakeLists.txt's IDEM_REDIS_DEFS).
#pragma once

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "idem/redis/store.hpp"

#ifndef IDEM_REDIS_SERVER
#error "IDEM_REDIS_SERVER (the path of redis-server) must be defined: see tests/redis/CMakeLists.txt"
#endif

extern char** environ;

namespace idem_test {

/// Sends one command (RESP array of bulk strings) to the server at `socket` and returns the first
/// line of its answer without the CRLF ("+PONG", "-ERR ...", ":1", "$3", "*2"), plus, for a bulk
/// string, "\n" and its bytes. For the tests' own look behind the store's back; throws
/// std::runtime_error when the server cannot be reached or does not answer within `timeout`.
/// A connected unix socket to `socket`, closed when it goes out of scope; throws std::runtime_error.
class UnixConnection {
public:
    explicit UnixConnection(const std::string& socket) : fd_(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
        if (fd_ < 0) throw std::runtime_error("socket(): " + std::string(std::strerror(errno)));
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        if (socket.size() >= sizeof(addr.sun_path)) {
            ::close(fd_);
            throw std::runtime_error("unix socket path too long: " + socket);
        }
        std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
        if (::connect(fd_, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
            const std::string why = std::strerror(errno);
            ::close(fd_);
            throw std::runtime_error("connect(" + socket + "): " + why);
        }
    }
    ~UnixConnection() { ::close(fd_); }
    UnixConnection(const UnixConnection&) = delete;
    UnixConnection& operator=(const UnixConnection&) = delete;
    [[nodiscard]] int fd() const noexcept { return fd_; }

private:
    int fd_;
};

inline std::string redis_command(const std::string& socket, const std::vector<std::string>& args,
                                 std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
    const UnixConnection conn(socket);
    const int fd = conn.fd();
    std::string out = "*" + std::to_string(args.size()) + "\r\n";
    for (const auto& a : args) out += "$" + std::to_string(a.size()) + "\r\n" + a + "\r\n";
    for (std::size_t sent = 0; sent < out.size();) {
        const ssize_t n = ::send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            throw std::runtime_error("redis_command: send: " + std::string(std::strerror(errno)));
        }
        sent += static_cast<std::size_t>(n);
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string in;
    auto complete = [&]() -> bool {
        const auto eol = in.find("\r\n");
        if (eol == std::string::npos) return false;
        if (in[0] != '$') return true;
        const long long len = std::stoll(in.substr(1, eol - 1));
        return len < 0 || in.size() >= eol + 2 + static_cast<std::size_t>(len) + 2;
    };
    while (!complete()) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) throw std::runtime_error("redis_command: no answer from " + socket);
        pollfd p{fd, POLLIN, 0};
        const int r = ::poll(&p, 1, static_cast<int>(left.count()));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) continue;
        char buf[4096];
        const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) throw std::runtime_error("redis_command: connection closed by " + socket);
        in.append(buf, static_cast<std::size_t>(n));
    }
    const auto eol = in.find("\r\n");
    std::string answer = in.substr(0, eol);
    if (in[0] == '$' && answer != "$-1") {
        const auto len = static_cast<std::size_t>(std::stoll(in.substr(1, eol - 1)));
        answer += "\n" + in.substr(eol + 2, len);
    }
    return answer;
}

/// A TCP port on 127.0.0.1 that was free a moment ago (the kernel's choice; another process may
/// take it before it is used), for a replica that needs a TCP listener.
inline int free_tcp_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    REQUIRE(::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0);
    socklen_t len = sizeof(addr);
    REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    ::close(fd);
    return ntohs(addr.sin_port);
}

struct RedisServerOptions {
    std::string appendfsync = "always";  // "always" | "everysec" | "no"
    bool appendonly = true;
    bool power_loss = false;                // LD_PRELOAD the power-loss shim (tests/redis/power_loss.c)
    std::vector<std::string> extra_args{};  // more redis-server arguments, e.g. {"--maxmemory","1mb"}
};

class RedisServer {
public:
    /// Makes the directory, starts the server and waits until it answers PING (else FAIL()).
    explicit RedisServer(RedisServerOptions options = {}) : options_(std::move(options)) {
        const char* base = std::getenv("IDEM_TEST_REDIS_DIR");
        std::string templ = std::string(base && *base ? base : "/tmp") + "/idem-redis-XXXXXX";
        if (::mkdtemp(templ.data()) == nullptr) FAIL("RedisServer: mkdtemp(" << templ << "): " << std::strerror(errno));
        dir_ = templ;
        socket_ = dir_ + "/redis.sock";
        ::chmod(dir_.c_str(), 0700);
        if (::geteuid() == 0) {
            const passwd* pw = ::getpwnam("redis");
            if (pw == nullptr) {
                remove_dir();
                FAIL("RedisServer: the tests run as root but there is no `redis` user to run redis-server as");
            }
            uid_ = pw->pw_uid;
            gid_ = pw->pw_gid;
            if (::chown(dir_.c_str(), uid_, gid_) != 0) {
                const std::string why = std::strerror(errno);
                remove_dir();
                FAIL("RedisServer: chown(" << dir_ << ", redis): " << why);
            }
            as_redis_ = true;
        }
#ifdef IDEM_REDIS_POWER_LOSS_SHIM
        shim_ = IDEM_REDIS_POWER_LOSS_SHIM;
#endif
        if (options_.power_loss && shim_.empty()) {
            remove_dir();
            FAIL("RedisServer: power_loss needs IDEM_REDIS_POWER_LOSS_SHIM (tests/redis/CMakeLists.txt)");
        }
        if (options_.power_loss) {
            // A copy in the server's own directory: the build tree may be unreadable for the
            // `redis` user (a 0700 checkout), and ld.so ignores a preload it cannot open, silently.
            const std::string copy = dir_ + "/power_loss.so";
            std::error_code ec;
            std::filesystem::copy_file(shim_, copy, std::filesystem::copy_options::overwrite_existing, ec);
            if (ec || ::chmod(copy.c_str(), 0755) != 0 || (as_redis_ && ::chown(copy.c_str(), uid_, gid_) != 0)) {
                remove_dir();
                FAIL("RedisServer: cannot copy the power-loss shim " << shim_ << " to " << copy);
            }
            shim_ = copy;
        }
        try {
            start();
        } catch (...) {
            stop_quietly();
            remove_dir();
            throw;
        }
    }

    ~RedisServer() {
        if (::getpid() != owner_) return;  // a forked child's copy: the server is the parent's
        stop_quietly();
        remove_dir();
    }
    RedisServer(const RedisServer&) = delete;
    RedisServer& operator=(const RedisServer&) = delete;

    [[nodiscard]] const std::string& socket() const { return socket_; }
    [[nodiscard]] const std::string& dir() const { return dir_; }
    [[nodiscard]] const RedisServerOptions& options() const { return options_; }
    /// The running server's pid, or -1 when it is not running.
    [[nodiscard]] pid_t pid() const { return pid_; }

    /// The store's options for this server: its unix socket, and the durability its persistence
    /// keeps (appendfsync always → fsync_always, everysec → fsync_everysec; no AOF, or
    /// appendfsync no → unchecked).
    [[nodiscard]] idem::RedisOptions store_options() const {
        idem::RedisOptions o;
        o.unix_socket = socket_;
        if (!options_.appendonly) {
            o.durability = idem::RedisDurability::unchecked;
        } else if (options_.appendfsync == "always") {
            o.durability = idem::RedisDurability::fsync_always;
        } else if (options_.appendfsync == "everysec") {
            o.durability = idem::RedisDurability::fsync_everysec;
        } else {
            o.durability = idem::RedisDurability::unchecked;
        }
        return o;
    }

    /// Starts the server on this directory and configuration (its AOF is replayed) and waits until
    /// it answers PING (30 s), else FAIL() with the log's tail.
    void start() {
        if (pid_ > 0) FAIL("RedisServer::start: already running (pid " << pid_ << ")");
        std::error_code ec;
        std::filesystem::remove(socket_, ec);  // a killed server leaves its socket file
        std::filesystem::remove(loaded_path(), ec);
        spawn();
        wait_ready();
        // The shim says it is in the server (its constructor writes this file): without it, a
        // crash test would pass for the wrong reason.
        if (options_.power_loss && !std::filesystem::exists(loaded_path())) {
            FAIL("RedisServer: redis-server runs without the power-loss shim " << shim_ << "\n" << log_tail());
        }
    }

    /// SIGKILL and wait: a process crash (with power_loss, a machine crash for the AOF).
    void kill9() {
        if (pid_ <= 0) return;
        ::kill(pid_, SIGKILL);
        reap();
    }

    /// SIGTERM and wait: a clean shutdown (Redis flushes and fsyncs its AOF).
    void stop() {
        if (pid_ <= 0) return;
        ::kill(pid_, SIGTERM);
        ::kill(pid_, SIGCONT);  // a paused server handles SIGTERM only once it runs
        if (!wait_exit(std::chrono::seconds(30))) {
            ::kill(pid_, SIGKILL);
            reap();
            FAIL("RedisServer::stop: redis-server did not exit within 30 s of SIGTERM (killed)\n" << log_tail());
        }
    }

    /// With power_loss: from now on the server's fsyncs pass nothing to the disk (and report
    /// success), as when the machine dies before its next fsync; a kill9() then loses everything
    /// written since. Only meaningful for appendfsync everysec (always fsyncs before it answers).
    void hold_fsyncs() {
        if (!options_.power_loss) FAIL("RedisServer::hold_fsyncs needs power_loss");
        std::ofstream(hold_path()).put('1');
    }
    /// The server's fsyncs reach the disk again.
    void release_fsyncs() {
        std::error_code ec;
        std::filesystem::remove(hold_path(), ec);
    }

    /// SIGSTOP: the server stops answering (connections stay open).
    void pause() {
        if (pid_ > 0) ::kill(pid_, SIGSTOP);
    }
    /// SIGCONT.
    void resume() {
        if (pid_ > 0) ::kill(pid_, SIGCONT);
    }

    /// The file whose existence holds the shim's fsyncs (tests/redis/power_loss.c, held()).
    [[nodiscard]] std::string hold_path() const { return dir_ + "/power_loss.hold"; }
    /// The file the shim writes when it is loaded into the server.
    [[nodiscard]] std::string loaded_path() const { return dir_ + "/power_loss.loaded"; }

    /// The last `lines` lines of redis.log and stdout.log (for failure messages).
    [[nodiscard]] std::string log_tail(std::size_t lines = 30) const {
        std::string out;
        for (const char* name : {"redis.log", "stdout.log"}) {
            std::ifstream in(dir_ + "/" + name);
            std::vector<std::string> all;
            for (std::string line; std::getline(in, line);) all.push_back(line);
            out += std::string("--- ") + dir_ + "/" + name + " (last lines)\n";
            for (std::size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += all[i] + "\n";
        }
        return out;
    }

    /// One command to this server (see redis_command).
    std::string command(const std::vector<std::string>& args,
                        std::chrono::milliseconds timeout = std::chrono::seconds(5)) const {
        return redis_command(socket_, args, timeout);
    }

private:
    void spawn() {
        // Everything the child needs is made before fork(): between fork and exec a multi-threaded
        // parent's child may only make async-signal-safe calls.
        std::vector<std::string> args = {
            IDEM_REDIS_SERVER,
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--unixsocket",
            socket_,
            "--unixsocketperm",
            "777",
            "--dir",
            dir_,
            "--daemonize",
            "no",
            "--logfile",
            dir_ + "/redis.log",
            "--save",
            "",
            "--appendonly",
            options_.appendonly ? "yes" : "no",
            "--appendfsync",
            options_.appendfsync,
            "--appenddirname",
            "appendonlydir",
        };
        args.insert(args.end(), options_.extra_args.begin(), options_.extra_args.end());
        std::vector<char*> argv;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);

        std::vector<std::string> env;
        for (char** e = environ; *e != nullptr; ++e) {
            if (std::strncmp(*e, "LD_PRELOAD=", 11) != 0) env.emplace_back(*e);
        }
        if (options_.power_loss) {
            env.push_back("LD_PRELOAD=" + shim_);
            env.push_back("IDEM_POWER_LOSS_HOLD=" + hold_path());
            env.push_back("IDEM_POWER_LOSS_LOADED=" + loaded_path());
        }
        std::vector<char*> envp;
        for (auto& e : env) envp.push_back(e.data());
        envp.push_back(nullptr);

        const std::string out_path = dir_ + "/stdout.log";
        const pid_t parent = ::getpid();
        const bool main_thread = ::syscall(SYS_gettid) == parent;
        const bool as_redis = as_redis_;
        const uid_t uid = uid_;
        const gid_t gid = gid_;

        const pid_t child = ::fork();
        if (child < 0) FAIL("RedisServer: fork(): " << std::strerror(errno));
        if (child == 0) {
            if (as_redis) {
                if (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) ::_exit(126);
            }
            if (main_thread) {
                ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // after setuid, which clears it
                if (::getppid() != parent) ::_exit(125);
            }
            ::setpgid(0, 0);  // not in the test's process group: a terminal's ^C goes to the test only
            // Other tests' sockets and pipes must not live on in the server.
            if (::syscall(SYS_close_range, 3U, ~0U, 0U) != 0) {
                for (int fd = 3; fd < 4096; ++fd) ::close(fd);
            }
            const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
            const int devnull = ::open("/dev/null", O_RDONLY);
            if (out >= 0) {
                ::dup2(out, 1);
                ::dup2(out, 2);
            }
            if (devnull >= 0) ::dup2(devnull, 0);
            ::execve(argv[0], argv.data(), envp.data());
            ::_exit(127);
        }
        pid_ = child;
    }

    void wait_ready() {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        std::string last = "(no answer yet)";
        while (std::chrono::steady_clock::now() < deadline) {
            int status = 0;
            const pid_t r = ::waitpid(pid_, &status, WNOHANG);
            if (r == pid_) {
                pid_ = -1;
                FAIL("RedisServer: redis-server exited while starting (status " << status_text(status) << ")\n"
                                                                                << log_tail());
            }
            try {
                last = redis_command(socket_, {"PING"}, std::chrono::seconds(2));
                if (last == "+PONG") return;
            } catch (const std::exception& e) {
                last = e.what();
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        ::kill(pid_, SIGKILL);
        reap();
        FAIL("RedisServer: redis-server did not answer PING within 30 s (last: " << last << ")\n" << log_tail());
    }

    static std::string status_text(int status) {
        if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
        if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
        return std::to_string(status);
    }

    void reap() {
        if (pid_ <= 0) return;
        while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
        }
        pid_ = -1;
    }

    bool wait_exit(std::chrono::milliseconds bound) {
        const auto deadline = std::chrono::steady_clock::now() + bound;
        while (std::chrono::steady_clock::now() < deadline) {
            const pid_t r = ::waitpid(pid_, nullptr, WNOHANG);
            if (r == pid_ || (r < 0 && errno == ECHILD)) {
                pid_ = -1;
                return true;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        return false;
    }

    void stop_quietly() noexcept {
        if (pid_ <= 0) return;
        ::kill(pid_, SIGTERM);
        ::kill(pid_, SIGCONT);
        if (!wait_exit(std::chrono::seconds(10))) {
            ::kill(pid_, SIGKILL);
            reap();
        }
    }

    void remove_dir() noexcept {
        std::error_code ec;
        if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
    }

    RedisServerOptions options_;
    std::string dir_;
    std::string socket_;
    std::string shim_;
    bool as_redis_ = false;
    uid_t uid_ = 0;
    gid_t gid_ = 0;
    pid_t pid_ = -1;
    pid_t owner_ = ::getpid();  // the process that started the server (and alone may stop it)
};

/// A primary on a free TCP port (a replica needs one) and a replica of it, started and waited for
/// until the replication link is online (60 s, else FAIL()). `replica_args` are more arguments of
/// the replica's, e.g. {"--replica-read-only", "no"}.
struct ReplicatedRedis {
    explicit ReplicatedRedis(std::vector<std::string> replica_args = {})
        : port(free_tcp_port()),
          primary(RedisServerOptions{.extra_args = {"--port", std::to_string(port)}}),
          replica(RedisServerOptions{.extra_args = with_replicaof(port, std::move(replica_args))}) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        for (;;) {
            const std::string info = primary.command({"INFO", "replication"});
            if (info.find("connected_slaves:1") != std::string::npos && info.find("state=online") != std::string::npos)
                break;
            if (std::chrono::steady_clock::now() >= deadline)
                FAIL("ReplicatedRedis: the replica did not come online within 60 s\n" << replica.log_tail());
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
    }
    int port;
    RedisServer primary;
    RedisServer replica;

private:
    static std::vector<std::string> with_replicaof(int port, std::vector<std::string> more) {
        std::vector<std::string> args{"--replicaof", "127.0.0.1", std::to_string(port)};
        args.insert(args.end(), more.begin(), more.end());
        return args;
    }
};

}  // namespace idem_test
