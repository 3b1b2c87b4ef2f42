#include "http_listener.hpp"

#include "idem/http/beast.hpp"
#include "payment.hpp"

#include <boost/asio/as_tuple.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>

#include <exception>
#include <utility>

namespace payments {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using asio::use_awaitable;
using asio::ip::tcp;

HttpListener::HttpListener(asio::any_io_executor executor, const std::string& host, unsigned short port,
                           HttpListenerOptions options, Handler handler)
    : executor_(executor),
      acceptor_(executor),
      options_(std::move(options)),
      handler_(std::move(handler)),
      slot_freed_(executor, asio::steady_timer::time_point::max()) {
    const tcp::endpoint endpoint(asio::ip::make_address(host), port);
    acceptor_.open(endpoint.protocol());
    acceptor_.set_option(tcp::acceptor::reuse_address(true));
    acceptor_.bind(endpoint);
    acceptor_.listen(asio::socket_base::max_listen_connections);
}

unsigned short HttpListener::port() const { return acceptor_.local_endpoint().port(); }

void HttpListener::start() { asio::co_spawn(executor_, accept_loop(), asio::detached); }

void HttpListener::stop() {
    stopping_ = true;
    boost::system::error_code ignored;
    acceptor_.close(ignored);
    slot_freed_.cancel();
    for (beast::tcp_stream* stream : idle_) stream->cancel();
}

asio::awaitable<void> HttpListener::accept_loop() {
    while (!stopping_) {
        while (active_ >= options_.max_connections && !stopping_) {
            boost::system::error_code ignored;
            slot_freed_.expires_at(asio::steady_timer::time_point::max());
            co_await slot_freed_.async_wait(asio::redirect_error(use_awaitable, ignored));
        }
        if (stopping_) break;
        auto [ec, socket] = co_await acceptor_.async_accept(asio::as_tuple(use_awaitable));
        if (stopping_) break;
        if (ec) {
            // Out of file descriptors, or a connection reset before it was accepted: try again
            // shortly rather than spinning.
            if (options_.log) options_.log("accept: " + ec.message());
            asio::steady_timer pause(executor_, std::chrono::milliseconds(50));
            co_await pause.async_wait(asio::as_tuple(use_awaitable));
            continue;
        }
        boost::system::error_code ignored;
        socket.set_option(tcp::no_delay(true), ignored);
        ++active_;
        asio::co_spawn(executor_, session(std::move(socket)), [this](const std::exception_ptr&) {
            --active_;
            slot_freed_.cancel();
        });
    }
}

asio::awaitable<void> HttpListener::session(tcp::socket socket) {
    beast::tcp_stream stream(std::move(socket));
    beast::flat_buffer buffer;
    while (!stopping_) {
        http::request_parser<http::string_body> parser;
        parser.body_limit(options_.body_limit);
        stream.expires_after(options_.keep_alive);
        idle_.insert(&stream);
        auto [ec, n] = co_await http::async_read(stream, buffer, parser, asio::as_tuple(use_awaitable));
        idle_.erase(&stream);
        if (ec == http::error::end_of_stream || ec == beast::error::timeout || ec == asio::error::operation_aborted ||
            ec == asio::error::connection_reset || ec == asio::error::eof) {
            break;
        }
        stream.expires_never();
        if (ec) {  // unreadable request: say so and close
            const int status = ec == http::error::body_limit ? 413 : ec == http::error::header_limit ? 431 : 400;
            const idem::Response problem{status,
                                         error_body(status == 413 ? "payload_too_large" : "bad_request"),
                                         {{"Content-Type", "application/json"}}};
            auto res = idem::http::beast::to_beast(problem, 11, false);
            stream.expires_after(options_.write_timeout);
            co_await http::async_write(stream, res, asio::as_tuple(use_awaitable));
            break;
        }
        const HttpRequest req = parser.release();
        idem::Response answer;
        try {
            answer = co_await handler_(req);
        } catch (const std::exception& e) {
            if (options_.log) options_.log(std::string("unhandled: ") + e.what());
            answer = idem::Response{500, error_body("internal_error"), {{"Content-Type", "application/json"}}};
        }
        auto res = idem::http::beast::to_beast(answer, req.version(), req.keep_alive() && !stopping_);
        stream.expires_after(options_.write_timeout);
        auto [write_ec, written] = co_await http::async_write(stream, res, asio::as_tuple(use_awaitable));
        if (write_ec || !res.keep_alive()) break;
    }
    boost::system::error_code ignored;
    stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
}

}  // namespace payments
