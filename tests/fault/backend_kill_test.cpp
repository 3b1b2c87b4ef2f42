// Fault scenario 1 — backends killed: pg_terminate_backend on random idem connections, 20 rounds,
// under load from 8 client threads. Guarantee: no duplicate effect, every answer byte-identical to
// the stored response, the pool heals, keys in doubt are resolved by one reconciler sweep.
// The scenario itself is fault::backend_kill_scenario (scenarios.hpp), shared with idem::asio's.
#include "scenarios.hpp"

using namespace fault;

TEST_CASE("scenario 1: backends terminated under load", "[fault][backend_kill]") {
    backend_kill_scenario(blocking_driver());
}
