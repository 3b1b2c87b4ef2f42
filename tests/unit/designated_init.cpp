// Compiled (not run) with the tests, under -Wall -Wextra -Werror: every public option and value struct
// of idem can be written with designated initializers naming only some of its members, without
// GCC's -Wmissing-field-initializers. A member added without a default member initializer fails
// this build. tests/CMakeLists.txt: idem_designated_init_check.
#include <idem/idem.hpp>
#include <idem/pool_stats.hpp>
#if defined(IDEM_CHECK_ASIO)
#include <idem/asio.hpp>
#endif
#if __has_include(<idem/prometheus.hpp>)
#include <idem/prometheus.hpp>
#define IDEM_CHECK_PROMETHEUS 1
#endif
#if defined(IDEM_CHECK_REDIS)
#include <idem/redis/replay_cache.hpp>
#include <idem/redis/store.hpp>
#endif
#if defined(IDEM_CHECK_GRPC)
#include <idem/grpc.hpp>
#endif

#include <chrono>
#include <string_view>

namespace {

using namespace std::chrono_literals;

[[maybe_unused]] void designated_initializers() {
    const idem::Key key{"scope", "value"};
    const idem::Fingerprint fp = idem::fingerprint(std::string_view{"request"});

    [[maybe_unused]] const idem::ClaimOptions claim{.lease = std::chrono::seconds(5)};
    [[maybe_unused]] const idem::ClaimOptions claim_wait{.retention = 60s, .wait = 100ms};
    [[maybe_unused]] const idem::PostgresOptions postgres{.pool_size = 4};
    [[maybe_unused]] const idem::PostgresOptions postgres_table{.table = "billing.idem_keys"};
    [[maybe_unused]] const idem::MemoryStoreOptions memory{.max_result_bytes = 1024};
    [[maybe_unused]] const idem::ReplayCacheOptions cache{.max_bytes = 1u << 20};
    [[maybe_unused]] const idem::ReconcilerOptions reconciler{.batch = 10};
    [[maybe_unused]] const idem::ReconcilerOptions reconciler_scope{.scopes = idem::ScopeFilter::exact("s")};
    [[maybe_unused]] const idem::Message message{.key = key, .fingerprint = fp};
    [[maybe_unused]] const idem::BatchEntry<idem::Response> entry{.outcome = idem::BatchOutcome::executed};
    [[maybe_unused]] const idem::Claim claimed{.status = idem::ClaimStatus::claimed};
    [[maybe_unused]] const idem::Record record{.state = idem::RecordState::completed};
    [[maybe_unused]] const idem::StoreStats stats{.round_trips = 2};
    [[maybe_unused]] const idem::ReplayCacheStats cache_stats{.hits = 1};
    [[maybe_unused]] const idem::PoolStats pool{.size = 8};
    [[maybe_unused]] const idem::EventInfo event{.event = idem::Event::executed};
    [[maybe_unused]] const idem::SaveRequest save{.key = key, .fence = 1};
    [[maybe_unused]] const idem::StaleKey stale{.key = key};
    [[maybe_unused]] const idem::Deployment deployment{.citus = true};
    [[maybe_unused]] const idem::http::FingerprintPolicy fingerprint{
        .body = idem::http::FingerprintPolicy::Body::canonical_json};
    [[maybe_unused]] const idem::http::Route route{.key_required = false};
    [[maybe_unused]] const idem::http::Route route_claim{.claim = {.lease = 10s}};
    [[maybe_unused]] const idem::http::Problem problem{.status = 400};
    [[maybe_unused]] const idem::http::Header header{.name = "Idempotency-Key"};
    [[maybe_unused]] const idem::http::Request request{.method = "POST"};
    [[maybe_unused]] const idem::Reconciler::Failure failure{.key = key, .error_type = "lease_lost"};
    [[maybe_unused]] const idem::Reconciler::Sweep sweep{.listed = 1};
    [[maybe_unused]] const idem::Transaction::Rows rows{.affected = 1};
    [[maybe_unused]] const idem::PostgresStore::TransactionOutcome outcome{.retry_after = 1ms};
#if defined(IDEM_CHECK_PROMETHEUS)
    [[maybe_unused]] const idem::PrometheusOptions prometheus{.buckets = {0.1, 1.0}};
#endif
#if defined(IDEM_CHECK_REDIS)
    [[maybe_unused]] const idem::RedisOptions redis{.port = 6380};
    [[maybe_unused]] const idem::RedisReplayCacheOptions redis_cache{.pause_after_error = 2s};
#endif
#if defined(IDEM_CHECK_ASIO)
    [[maybe_unused]] const idem::asio::AsyncOptions async{.deadline = 2s};
    [[maybe_unused]] const idem::asio::AsyncOptions async_claim{.claim = {.wait = 1s}};
#endif
#if defined(IDEM_CHECK_GRPC)
    [[maybe_unused]] const idem::grpc::MethodOptions grpc_field{.key_field = "request_id"};
    [[maybe_unused]] const idem::grpc::MethodOptions grpc_claim{.claim = {.wait = 1s}};
#endif
}

}  // namespace
