// --seal-check: what sealed responses (idem/sealing.hpp) cost the client per call.
#pragma once

#include <idem/idem.hpp>

#include <cstdint>
#include <string>

#include "admin.hpp"
#include "options.hpp"

namespace bench {

/// Client CPU per call (µs, this thread's CPU time) of new calls and replays through execute_once,
/// 1 thread, with results of --seal-check bytes, on PostgresStores with sealing off and on in
/// alternating rounds; and seal() / open_sealed() of one such result on their own. Prints it.
void seal_check(const Options& o, Admin& admin, Tables& tables, const std::string& prefix, std::uint64_t seed);

}  // namespace bench
