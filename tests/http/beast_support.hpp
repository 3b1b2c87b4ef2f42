// tests/http/beast_support.hpp — an in-process Boost.Beast HTTP/1.1 server for the conformance
// table: one io_context thread, a coroutine per connection (keep-alive), every request going to an
// asynchronous dispatch (idem::http::async_respond over AsyncPostgresStore). The same loop as
// examples/beast-http, with a 1 MB body limit (the table sends 128 KB bodies).
#pragma once

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <functional>
#include <stdexcept>
#include <thread>
#include <utility>

#include "idem/http/beast.hpp"

namespace http_test {

class BeastServer {
public:
    using Dispatch = std::function<boost::asio::awaitable<idem::Response>(const idem::http::Request&)>;

    /// `io` is run by this server's thread; make the stores on io.get_executor() first.
    BeastServer(boost::asio::io_context& io, Dispatch dispatch)
        : io_(io), dispatch_(std::move(dispatch)), acceptor_(io, {boost::asio::ip::make_address("127.0.0.1"), 0}) {
        boost::asio::co_spawn(io_, listen(), boost::asio::detached);
        thread_ = std::thread([this] { io_.run(); });
    }
    ~BeastServer() {
        io_.stop();
        thread_.join();
    }
    BeastServer(const BeastServer&) = delete;
    BeastServer& operator=(const BeastServer&) = delete;

    [[nodiscard]] int port() const { return acceptor_.local_endpoint().port(); }

private:
    boost::asio::awaitable<void> listen() {
        for (;;) {
            auto socket = co_await acceptor_.async_accept(boost::asio::use_awaitable);
            boost::asio::co_spawn(io_, session(std::move(socket)), boost::asio::detached);
        }
    }

    boost::asio::awaitable<void> session(boost::asio::ip::tcp::socket socket) {
        namespace http = boost::beast::http;
        using boost::asio::as_tuple;
        using boost::asio::use_awaitable;
        boost::beast::tcp_stream stream(std::move(socket));
        boost::beast::flat_buffer buffer;
        for (;;) {
            http::request_parser<http::string_body> parser;
            parser.body_limit(1u << 20);
            auto [ec, n] = co_await http::async_read(stream, buffer, parser, as_tuple(use_awaitable));
            if (ec == http::error::end_of_stream) break;
            if (ec) {
                const int status = ec == http::error::body_limit ? 413 : ec == http::error::header_limit ? 431 : 400;
                co_await http::async_write(stream, idem::http::beast::to_beast({status, ec.message()}, 11, false),
                                           as_tuple(use_awaitable));
                break;
            }
            const auto req = parser.release();
            const idem::http::Request view = idem::http::beast::view(req);
            auto res = idem::http::beast::to_beast(co_await dispatch_(view), req);
            auto [write_ec, written] = co_await http::async_write(stream, res, as_tuple(use_awaitable));
            if (write_ec || !res.keep_alive()) break;
        }
        boost::system::error_code ignored;
        stream.socket().shutdown(boost::asio::ip::tcp::socket::shutdown_send, ignored);
    }

    boost::asio::io_context& io_;
    Dispatch dispatch_;
    boost::asio::ip::tcp::acceptor acceptor_;
    std::thread thread_;
};

}  // namespace http_test
