// http_listener.hpp — payments-server's HTTP/1.1 server on Boost.Beast: a coroutine per connection
// (keep-alive), at most max_connections served at once, and a graceful stop.
//
// Not part of idem. Thread-safety: none; construct it, then call start() and stop() on the
// executor it was given (one event-loop thread runs it all).
#pragma once

#include "idem/response.hpp"

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/string_body.hpp>

#include <chrono>
#include <cstddef>
#include <functional>
#include <set>
#include <string>
#include <string_view>

namespace payments {

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;

struct HttpListenerOptions {
    /// Connections served at once; a connection beyond them waits in the listen backlog.
    std::size_t max_connections = 128;
    /// Larger request bodies are answered 413 (and the connection closed).
    std::size_t body_limit = 64 * 1024;
    /// An idle keep-alive connection is closed after this; so is one whose request takes longer
    /// to arrive.
    std::chrono::seconds keep_alive{5};
    /// A connection whose answer is not written within this (a client that stops reading) is
    /// closed, so that it holds its slot, and stop(), no longer than this.
    std::chrono::seconds write_timeout{5};
    /// Where the listener's own errors go (a handler that threw: 500).
    std::function<void(std::string_view)> log;
};

class HttpListener {
public:
    /// The answer to one request. It may throw: the client then gets 500 {"error":"internal_error"}.
    using Handler = std::function<boost::asio::awaitable<idem::Response>(const HttpRequest&)>;

    /// Binds host:port (port 0: a free port) with the largest listen backlog. Throws
    /// boost::system::system_error when it cannot.
    HttpListener(boost::asio::any_io_executor executor, const std::string& host, unsigned short port,
                 HttpListenerOptions options, Handler handler);

    /// The port bound.
    [[nodiscard]] unsigned short port() const;
    /// Starts accepting connections.
    void start();
    /// Stops accepting and closes idle connections; a request being served is answered (with
    /// Connection: close, within write_timeout) and its connection then closed. The executor then
    /// runs out of this listener's work.
    void stop();

private:
    boost::asio::awaitable<void> accept_loop();
    boost::asio::awaitable<void> session(boost::asio::ip::tcp::socket socket);

    boost::asio::any_io_executor executor_;
    boost::asio::ip::tcp::acceptor acceptor_;
    HttpListenerOptions options_;
    Handler handler_;
    boost::asio::steady_timer slot_freed_;
    std::set<boost::beast::tcp_stream*> idle_;
    std::size_t active_ = 0;
    bool stopping_ = false;
};

}  // namespace payments
