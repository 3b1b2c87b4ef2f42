// tests/http/http_support.hpp — the raw HTTP client (raw_http.hpp) and an in-process cpp-httplib
// server.
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <stdexcept>
#include <thread>

#include "raw_http.hpp"

namespace http_test {

/// A cpp-httplib server on 127.0.0.1 (free port), every method and path going to `handler`.
class Server {
public:
    explicit Server(std::function<void(const httplib::Request&, httplib::Response&)> handler,
                    std::size_t max_body = 1u << 20) {
        server_.set_payload_max_length(max_body);
        server_.new_task_queue = [] { return new httplib::ThreadPool(16); };
        server_.Post(".*", handler);
        server_.Get(".*", handler);
        server_.Put(".*", handler);
        port_ = server_.bind_to_any_port("127.0.0.1");
        if (port_ <= 0) throw std::runtime_error("bind");
        thread_ = std::thread([this] { server_.listen_after_bind(); });
        while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ~Server() {
        server_.stop();
        thread_.join();
    }
    Server(const Server&) = delete;
    Server& operator=(const Server&) = delete;

    [[nodiscard]] int port() const noexcept { return port_; }

private:
    httplib::Server server_;
    int port_ = -1;
    std::thread thread_;
};

}  // namespace http_test
