// lease_keeper.hpp — a heartbeat for a claim whose effect may outlast its lease.
//
// payments-server's reconciler takes over a key whose lease has passed: it belongs to a request
// that is gone (crashed, or ended with an unknown gateway outcome). A request still waiting for the
// gateway — which may start a charge up to 5 s after the request arrived and answer 2 s later — or
// still saving its answer is not gone, and a lease shorter than that would let the reconciler take
// its key: the request's save then meets lease_lost and its client a 409 for a payment that went
// through. So from its effect until its save, a request extends its lease every quarter lease — up
// to the moment by which its gateway call has ended one way or the other: a request still busy
// after that is treated as gone, and the reconciler's rules settle its key.
//
// Not part of idem. Thread-safety: none. Made and destroyed on the executor it runs on (the
// server's one event-loop thread).
#pragma once

#include "idem/asio/store.hpp"
#include "idem/errors.hpp"
#include "idem/key.hpp"

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

namespace payments {

class LeaseKeeper {
public:
    using Log = std::function<void(std::string_view)>;
    using Clock = std::chrono::steady_clock;

    /// Extends (key, fence)'s lease to `lease` from now every `lease / 4`, on `executor`, until
    /// destroyed; no beat is sent after `until`. A beat that fails (the store unreachable, a
    /// connection lost) is logged and the next one tries again; lease_lost (another attempt owns
    /// the key) ends the beats.
    LeaseKeeper(boost::asio::any_io_executor executor, idem::asio::AsyncPostgresStore& store, idem::Key key,
                idem::Fence fence, std::chrono::milliseconds lease, Clock::time_point until, Log log)
        : state_(std::make_shared<State>(executor)) {
        boost::asio::co_spawn(executor, beat(state_, store, std::move(key), fence, lease, until, std::move(log)),
                              boost::asio::detached);
    }
    /// No beat starts after this. One in flight ends on its own: it can only extend a key still in
    /// progress under this fence, and a save that came first has ended that.
    ~LeaseKeeper() {
        state_->stopped = true;
        state_->timer.cancel();
    }
    LeaseKeeper(const LeaseKeeper&) = delete;
    LeaseKeeper& operator=(const LeaseKeeper&) = delete;

private:
    struct State {
        explicit State(boost::asio::any_io_executor executor) : timer(std::move(executor)) {}
        boost::asio::steady_timer timer;
        bool stopped = false;
    };

    static boost::asio::awaitable<void> beat(std::shared_ptr<State> state, idem::asio::AsyncPostgresStore& store,
                                             idem::Key key, idem::Fence fence, std::chrono::milliseconds lease,
                                             Clock::time_point until, Log log) {
        const auto every = std::max(lease / 4, std::chrono::milliseconds(1));
        while (!state->stopped) {
            state->timer.expires_after(every);
            boost::system::error_code ec;
            co_await state->timer.async_wait(boost::asio::redirect_error(boost::asio::use_awaitable, ec));
            if (state->stopped || Clock::now() > until) co_return;
            try {
                co_await store.co_extend_lease(key, fence, lease);
            } catch (const idem::lease_lost&) {
                co_return;  // another attempt owns the key: nothing left to keep
            } catch (const std::exception& e) {
                if (log) log("lease heartbeat of key '" + key.value() + "': " + e.what());
            }
        }
    }

    std::shared_ptr<State> state_;
};

}  // namespace payments
