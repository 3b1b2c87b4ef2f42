// server_log.hpp — payments-server's log: one line per call on stderr, "<prefix>: <parts…>".
// Thread-safe (the event loop and the reconciler thread both write).
#pragma once

#include <iostream>
#include <mutex>
#include <string>
#include <utility>

namespace payments {
namespace detail {
inline std::mutex& log_mutex() {
    static std::mutex mutex;
    return mutex;
}
inline std::string& log_prefix() {
    static std::string prefix = "payments-server";
    return prefix;
}
}  // namespace detail

/// What every later line starts with (the server sets "payments-server[PORT]" once it listens).
inline void set_log_prefix(std::string prefix) {
    std::lock_guard lock(detail::log_mutex());
    detail::log_prefix() = std::move(prefix);
}

/// Writes the parts, streamed one after another, as one line.
template <class... Parts>
void log(const Parts&... parts) {
    std::lock_guard lock(detail::log_mutex());
    std::cerr << detail::log_prefix() << ": ";
    (std::cerr << ... << parts);
    std::cerr << std::endl;
}

}  // namespace payments
