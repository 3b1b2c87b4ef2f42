// tests/http/raw_http.hpp — a raw HTTP/1.1 client over a socket: any bytes in any header, so NUL,
// duplicates and 10 MB headers reach the server as sent. No HTTP library: a test that only sends
// requests includes this, not cpp-httplib.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace http_test {

struct Raw {
    std::string method = "POST";
    std::string target;
    std::vector<std::pair<std::string, std::string>> headers;
    std::string body;
};

struct Wire {
    int status = 0;  // 0: no answer (the connection closed)
    std::vector<std::pair<std::string, std::string>> headers;
    std::string body;

    [[nodiscard]] std::size_t count(const std::string& name) const {
        std::size_t n = 0;
        for (const auto& h : headers) n += strcasecmp(h.first.c_str(), name.c_str()) == 0 ? 1 : 0;
        return n;
    }
    [[nodiscard]] std::string header(const std::string& name) const {
        for (const auto& h : headers) {
            if (strcasecmp(h.first.c_str(), name.c_str()) == 0) return h.second;
        }
        return {};
    }
    [[nodiscard]] bool replayed() const { return header("Idempotent-Replayed") == "true"; }
};

/// Sends `request` on a new connection (Connection: close) and reads the whole answer.
inline Wire exchange(int port, const Raw& request) {
    std::string bytes = request.method + " " + request.target + " HTTP/1.1\r\nHost: 127.0.0.1\r\n";
    for (const auto& [name, value] : request.headers) bytes += name + ": " + value + "\r\n";
    bytes += "Content-Length: " + std::to_string(request.body.size()) + "\r\nConnection: close\r\n\r\n";
    bytes += request.body;

    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error("socket");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port));
    inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        ::close(fd);
        throw std::runtime_error("connect");
    }
    // Writing and reading alternate: a server may answer (and close) before reading everything.
    std::string in;
    std::size_t sent = 0;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (;;) {
        pollfd p{fd, static_cast<short>(POLLIN | (sent < bytes.size() ? POLLOUT : 0)), 0};
        if (std::chrono::steady_clock::now() > until) break;
        if (::poll(&p, 1, 1000) <= 0) continue;
        if (p.revents & POLLIN) {
            char buf[65536];
            const ssize_t n = ::read(fd, buf, sizeof buf);
            if (n <= 0) break;
            in.append(buf, static_cast<std::size_t>(n));
        } else if (p.revents & POLLOUT) {
            const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
            if (n <= 0) {
                sent = bytes.size();  // the server closed its side: read what it said
            } else {
                sent += static_cast<std::size_t>(n);
            }
        } else if (p.revents & (POLLERR | POLLHUP)) {
            break;
        }
    }
    ::close(fd);

    Wire wire;
    const auto head_end = in.find("\r\n\r\n");
    if (head_end == std::string::npos || in.compare(0, 9, "HTTP/1.1 ") != 0) return wire;
    wire.status = std::atoi(in.c_str() + 9);
    std::size_t at = in.find("\r\n") + 2;
    while (at < head_end) {
        const auto eol = in.find("\r\n", at);
        const std::string line = in.substr(at, eol - at);
        const auto colon = line.find(':');
        std::string value = line.substr(colon + 1);
        while (!value.empty() && value.front() == ' ') value.erase(0, 1);
        wire.headers.emplace_back(line.substr(0, colon), value);
        at = eol + 2;
    }
    wire.body = in.substr(head_end + 4);
    return wire;
}

}  // namespace http_test
