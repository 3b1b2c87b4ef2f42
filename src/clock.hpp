// The clock of every timeout, retry window and poll, and how a test moves it (internal).
#pragma once

#include <chrono>

namespace idem::detail {

using SteadyClock = std::chrono::steady_clock;
/// Where an I/O-free algorithm reads the time: SteadyClock::now, or a test's clock.
using SteadyNow = SteadyClock::time_point (*)() noexcept;

}  // namespace idem::detail
