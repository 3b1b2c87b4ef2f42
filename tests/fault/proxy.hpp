// tests/fault/proxy.hpp — a PostgreSQL wire-protocol proxy on loopback that loses acknowledgements.
//
// Listens on 127.0.0.1:<ephemeral>, forwards each client to the cluster's Unix socket, and parses
// both byte streams into protocol messages (type byte + int32 length; untyped startup packets
// first). When armed for a statement (a Bind of the prepared statement "idem_save", or a Parse
// whose SQL contains a fragment, for unnamed statements), it cuts a connection that sends it:
//   after_reply  forwards the batch up to the Sync after it, waits until the server answered every
//                Sync (the statement committed), drops those answers and closes both sides: the
//                acknowledgement is lost, the effect in the database is not.
//   before_send  closes both sides instead of forwarding the batch: the request is lost.
// silence() turns it into a black hole, as a network that drops every packet: nothing more is
// forwarded either way, and new connections are accepted and never answered.
// Clients must connect with sslmode=disable gssencmode=disable (no TLS to look into).
// IDEM_FAULT_DEBUG=1 in the environment prints every connection and cut to stderr.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace fault {

class Proxy {
public:
    enum class Mode { after_reply, before_send };

    struct Target {
        std::vector<std::string> statements;     // prepared statement names in a Bind, e.g. "idem_save"
        std::vector<std::string> sql_fragments;  // or fragments of the SQL of a Parse (unnamed statements)
    };

    explicit Proxy(std::string unix_socket_path) : server_path_(std::move(unix_socket_path)) {
        listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
        if (listen_fd_ < 0) throw std::runtime_error("proxy: socket failed");
        int one = 1;
        ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        addr.sin_port = 0;
        if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listen_fd_, 64) != 0) {
            ::close(listen_fd_);
            throw std::runtime_error("proxy: bind/listen on 127.0.0.1 failed");
        }
        socklen_t len = sizeof addr;
        ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
        port_ = ntohs(addr.sin_port);
        acceptor_ = std::thread([this] { accept_loop(); });
    }

    ~Proxy() {
        stop_ = true;
        if (acceptor_.joinable()) acceptor_.join();
        std::list<std::thread> threads;
        {
            std::lock_guard lock(mutex_);
            threads.swap(threads_);
        }
        for (auto& t : threads) t.join();
        for (const int fd : held_) ::close(fd);
        ::close(listen_fd_);
    }
    Proxy(const Proxy&) = delete;
    Proxy& operator=(const Proxy&) = delete;

    [[nodiscard]] int port() const { return port_; }

    /// Cut the next `count` connections that send `target` (count 0: disarm).
    void arm(Target target, int count, Mode mode) {
        std::lock_guard lock(mutex_);
        target_ = std::move(target);
        armed_ = count;
        mode_ = mode;
        probability_ = 0;
    }
    /// Cut each message matching `target` with probability p (mode chosen at random), until
    /// disarmed.
    void random(Target target, double p, unsigned seed) {
        std::lock_guard lock(mutex_);
        target_ = std::move(target);
        armed_ = 0;
        probability_ = p;
        rng_.seed(seed);
    }
    void disarm() { arm({}, 0, Mode::after_reply); }
    /// From now on nothing is forwarded and new connections are held unanswered (until destroyed).
    void silence() { silent_ = true; }

    void note(std::string line) {
        if (std::getenv("IDEM_FAULT_DEBUG")) std::fprintf(stderr, "proxy: %s\n", line.c_str());
        std::lock_guard lock(mutex_);
        log_.push_back(std::move(line));
        if (log_.size() > 12) log_.pop_front();
    }

    [[nodiscard]] int cuts() const { return cuts_.load(); }
    /// What the last cuts did (for diagnostics), newest last.
    [[nodiscard]] std::string log() const {
        std::lock_guard lock(mutex_);
        std::string out;
        for (const auto& line : log_) out += line + "\n";
        return out;
    }
    [[nodiscard]] int cuts_after_reply() const { return cuts_after_reply_.load(); }
    [[nodiscard]] int connections() const { return connections_.load(); }

private:
    // A decision for one matching message: no cut, or cut in a mode.
    bool decide(Mode& mode) {
        std::lock_guard lock(mutex_);
        if (armed_ > 0) {
            --armed_;
            mode = mode_;
            return true;
        }
        if (probability_ > 0) {
            std::uniform_real_distribution<double> u(0, 1);
            if (u(rng_) < probability_) {
                mode = u(rng_) < 0.7 ? Mode::after_reply : Mode::before_send;
                return true;
            }
        }
        return false;
    }

    bool matches(char type, const std::string& body) {
        std::lock_guard lock(mutex_);
        if (armed_ == 0 && probability_ == 0) return false;
        const auto p = body.find('\0');
        if (p == std::string::npos) return false;
        if (type == 'B') {  // Bind: portal\0 statement\0 ...
            const auto q = body.find('\0', p + 1);
            if (q == std::string::npos) return false;
            const std::string statement = body.substr(p + 1, q - p - 1);
            for (const auto& s : target_.statements) {
                // idem names its statements per table: "<name>_<8 hex digits>".
                if (statement == s || (statement.size() == s.size() + 9 && statement.rfind(s + "_", 0) == 0))
                    return true;
            }
            return false;
        }
        if (type == 'P') {             // Parse: statement\0 query\0 ... (unnamed statements carry their SQL)
            if (p != 0) return false;  // named: a PREPARE at connect time, not an execution
            for (const auto& f : target_.sql_fragments) {
                if (body.find(f, p + 1) != std::string::npos) return true;
            }
        }
        return false;
    }

    void accept_loop() {
        while (!stop_) {
            pollfd p{listen_fd_, POLLIN, 0};
            if (::poll(&p, 1, 100) <= 0) continue;
            const int client = ::accept(listen_fd_, nullptr, nullptr);
            if (client < 0) continue;
            if (silent_) {  // a black hole: the client waits for an answer that never comes
                std::lock_guard lock(mutex_);
                held_.push_back(client);
                continue;
            }
            const int server = ::socket(AF_UNIX, SOCK_STREAM, 0);
            sockaddr_un addr{};
            addr.sun_family = AF_UNIX;
            std::strncpy(addr.sun_path, server_path_.c_str(), sizeof addr.sun_path - 1);
            if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
                if (server >= 0) ::close(server);
                ::close(client);
                continue;
            }
            ++connections_;
            note("accepted fd " + std::to_string(client));
            std::lock_guard lock(mutex_);
            threads_.emplace_back([this, client, server] { pump(client, server); });
        }
    }

    static bool write_all(int fd, const char* data, std::size_t n) {
        while (n > 0) {
            const ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL);
            if (w < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN) {
                    pollfd p{fd, POLLOUT, 0};
                    ::poll(&p, 1, 100);
                    continue;
                }
                return false;
            }
            data += w;
            n -= static_cast<std::size_t>(w);
        }
        return true;
    }

    static std::uint32_t be32(const std::string& s, std::size_t at) {
        return (static_cast<std::uint32_t>(static_cast<unsigned char>(s[at])) << 24) |
               (static_cast<std::uint32_t>(static_cast<unsigned char>(s[at + 1])) << 16) |
               (static_cast<std::uint32_t>(static_cast<unsigned char>(s[at + 2])) << 8) |
               static_cast<std::uint32_t>(static_cast<unsigned char>(s[at + 3]));
    }

    // One client: forwards both ways, parsing messages; cuts when told to.
    void pump(int client, int server) {
        std::string from_client, from_server;
        bool startup = true;    // client side: untyped startup packets until the StartupMessage
        long expected_rfq = 1;  // ReadyForQuery answers owed by the server: 1 after startup, +1 per Sync/Query
        long rfq_seen = 0;
        bool cutting = false;  // after_reply: target sent, waiting for the answers to drop
        bool sync_after_target = false;
        auto cut_deadline = std::chrono::steady_clock::now();
        bool open = true;
        while (open && !stop_) {
            if (silent_) {  // nothing read, nothing forwarded: both sides wait
                std::this_thread::sleep_for(std::chrono::milliseconds(10));
                continue;
            }
            const bool read_client = !cutting || !sync_after_target;
            pollfd p[2] = {{client, static_cast<short>(read_client ? POLLIN : 0), 0}, {server, POLLIN, 0}};
            const int n = ::poll(p, 2, 10);
            if (cutting && rfq_seen >= expected_rfq && sync_after_target) break;  // committed and answered
            if (cutting && std::chrono::steady_clock::now() > cut_deadline) break;
            if (n <= 0) continue;
            char buf[65536];
            if (read_client && (p[0].revents & (POLLIN | POLLHUP | POLLERR))) {
                const ssize_t r = ::recv(client, buf, sizeof buf, 0);
                if (r <= 0) break;
                from_client.append(buf, static_cast<std::size_t>(r));
                // Forward whole messages only; decide per message.
                std::string out;
                std::size_t at = 0;
                bool cut_now = false;
                while (true) {
                    if (startup) {
                        if (from_client.size() - at < 8) break;
                        const std::uint32_t len = be32(from_client, at);
                        if (len < 8 || from_client.size() - at < len) break;
                        const std::uint32_t code = be32(from_client, at + 4);
                        out.append(from_client, at, len);
                        at += len;
                        if (code == 196608) startup = false;  // protocol 3.0 StartupMessage
                        continue;
                    }
                    if (from_client.size() - at < 5) break;
                    const char type = from_client[at];
                    const std::uint32_t len = be32(from_client, at + 1);
                    if (from_client.size() - at < 1 + static_cast<std::size_t>(len)) break;
                    const std::string body = from_client.substr(at + 5, len - 4);
                    if (!cutting && matches(type, body)) {
                        Mode mode = Mode::after_reply;
                        if (decide(mode)) {
                            note("cutting fd " + std::to_string(client) + " at '" + std::string(1, type) + "' rfq " +
                                 std::to_string(rfq_seen) + "/" + std::to_string(expected_rfq));
                            ++cuts_;
                            if (mode == Mode::before_send) {
                                cut_now = true;
                                break;
                            }
                            ++cuts_after_reply_;
                            cutting = true;
                            cut_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
                        }
                    }
                    if (type == 'S' || type == 'Q') {
                        ++expected_rfq;
                        if (cutting) sync_after_target = true;
                    }
                    out.append(from_client, at, 1 + len);
                    at += 1 + len;
                    if (cutting && sync_after_target) break;  // forward nothing after the target's Sync
                }
                from_client.erase(0, at);
                if (cut_now) break;
                if (!out.empty() && !write_all(server, out.data(), out.size())) break;
            }
            if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
                const ssize_t r = ::recv(server, buf, sizeof buf, 0);
                if (r <= 0) break;
                from_server.append(buf, static_cast<std::size_t>(r));
                std::size_t at = 0;
                while (from_server.size() - at >= 5) {
                    const std::uint32_t len = be32(from_server, at + 1);
                    if (from_server.size() - at < 1 + static_cast<std::size_t>(len)) break;
                    if (from_server[at] == 'Z') ++rfq_seen;
                    at += 1 + len;
                }
                // Forward whole messages (dropped while cutting: the acknowledgement is lost).
                if (!cutting && at > 0 && !write_all(client, from_server.data(), at)) open = false;
                from_server.erase(0, at);
            }
        }
        if (cutting) {
            note("cut fd " + std::to_string(client) + " after reply: syncs answered " + std::to_string(rfq_seen) + "/" +
                 std::to_string(expected_rfq) + (sync_after_target ? "" : " (target's Sync never came)"));
        }
        ::shutdown(client, SHUT_RDWR);
        ::shutdown(server, SHUT_RDWR);
        ::close(client);
        ::close(server);
    }

    std::string server_path_;
    int listen_fd_ = -1;
    int port_ = 0;
    std::atomic<bool> stop_{false};
    std::atomic<bool> silent_{false};
    std::vector<int> held_;  // connections accepted while silent (mutex_)
    std::thread acceptor_;
    mutable std::mutex mutex_;
    std::list<std::thread> threads_;
    std::list<std::string> log_;
    Target target_;
    int armed_ = 0;
    Mode mode_ = Mode::after_reply;
    double probability_ = 0;
    std::mt19937 rng_;
    std::atomic<int> cuts_{0};
    std::atomic<int> cuts_after_reply_{0};
    std::atomic<int> connections_{0};
};

}  // namespace fault
