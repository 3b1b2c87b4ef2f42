// Fault scenario 3 — lost acknowledgement: a wire-protocol proxy on loopback (proxy.hpp) between
// idem and PostgreSQL cuts the connection right after the claim INSERT or the save UPDATE was sent
// and committed, before its answer reaches idem. Guarantee: the retry (same fence, fresh
// connection) recognises its own committed write, so the caller is told the one true outcome, a
// later retry replays the same bytes, and the effect runs exactly once. Needs the Unix socket of
// scripts/with-postgres.sh's cluster (IDEM_PG_HOST/IDEM_PG_PORT). The scenario itself is
// fault::lost_ack_scenario (scenarios.hpp), shared with idem::asio's.
#include "scenarios.hpp"

using namespace fault;

TEST_CASE("scenario 3: acknowledgements lost on the wire", "[fault][lost_ack]") {
    const bool prepared = GENERATE(true, false);
    lost_ack_scenario(blocking_driver(), prepared);
}
