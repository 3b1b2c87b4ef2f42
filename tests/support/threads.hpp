// tests/support/threads.hpp — run a body on several threads that start together.
#pragma once

#include <cstddef>
#include <exception>
#include <latch>
#include <thread>
#include <vector>

namespace idem_test {

/// Runs body(t) for t in [0, n) on n threads released together by a latch, joins them all, then
/// rethrows the first exception any of them threw (so a failed REQUIRE or an idem error inside a
/// thread fails the test instead of terminating the process).
template <class Body>
void run_threads(int n, Body&& body) {
    std::latch start(n);
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(n));
    for (int t = 0; t < n; ++t) {
        threads.emplace_back([&, t] {
            try {
                start.arrive_and_wait();
                body(t);
            } catch (...) {
                errors[static_cast<std::size_t>(t)] = std::current_exception();
            }
        });
    }
    for (auto& th : threads) th.join();
    for (auto& e : errors) {
        if (e) std::rethrow_exception(e);
    }
}

}  // namespace idem_test
