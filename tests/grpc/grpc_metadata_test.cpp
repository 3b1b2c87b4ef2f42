// Bad key metadata over real gRPC: each case is INVALID_ARGUMENT from idem (or refused by gRPC
// before the server sees it), the handler never runs and the table holds nothing for the tenant.
#include <catch2/catch.hpp>

#include <string>

#include "grpc_harness.hpp"

using grpc_test::Answer;
using grpc_test::charge;
using grpc_test::Harness;
using Code = ::grpc::StatusCode;

TEST_CASE("grpc: malformed idempotency-key metadata is INVALID_ARGUMENT and stores nothing", "[grpc][metadata]") {
    Harness h;
    struct Case {
        const char* what;
        grpc_test::Metadata metadata;
        const char* message;  // what the status message says
    };
    const std::string tenant = Harness::tenant("badmeta");
    // clang-format off
    const Case cases[] = {
        {"two entries",      {{"idempotency-key", "a"}, {"idempotency-key", "b"}},        "several"},
        {"a -bin entry",     {{"idempotency-key-bin", "a"}},                               "not 'idempotency-key-bin'"},
        {"-bin and ASCII",   {{"idempotency-key", "a"}, {"idempotency-key-bin", "a"}},    "not 'idempotency-key-bin'"},
        {"a 10 KB key",      {{"idempotency-key", std::string(10 * 1024, 'k')}},          "1 to 255 bytes"},
        {"a 256-byte key",   {{"idempotency-key", std::string(256, 'k')}},                "1 to 255 bytes"},
        {"an empty key",     {{"idempotency-key", ""}},                                    "1 to 255 bytes"},
    };
    // clang-format on
    for (const Case& c : cases) {
        INFO(c.what);
        for (const grpc_test::Api api : grpc_test::apis()) {
            grpc_test::Metadata metadata = c.metadata;
            metadata.emplace_back("x-tenant", tenant);
            const Answer a = h.call("Charge", metadata, charge(100), api);
            CHECK(a.status.error_code() == Code::INVALID_ARGUMENT);
            CHECK_THAT(a.status.error_message(), Catch::Contains(c.message));
        }
    }
    CHECK(h.rows(tenant) == 0);
    CHECK(h.effects.runs("a") == 0);
}

TEST_CASE("grpc: non-printable and non-UTF-8 key values are refused", "[grpc][metadata]") {
    // gRPC's C++ client aborts the process rather than send such a value (validate_metadata), so
    // the check that defends against other clients is tested on its own.
    for (const std::string& key : {std::string("k\x01y"), std::string("k\xff"), std::string("k\x7f"),
                                   std::string("\xc3\xa9t\xc3\xa9"), std::string("k\0y", 3), std::string("k\ny")}) {
        const auto fault = idem::grpc::detail::metadata_key_fault("idempotency-key", key);
        REQUIRE(fault.has_value());
        CHECK_THAT(*fault, Catch::Contains("printable ASCII"));
    }
    CHECK_FALSE(idem::grpc::detail::metadata_key_fault("idempotency-key", "a b~!\"#").has_value());
    CHECK(idem::grpc::detail::metadata_key_fault("idempotency-key", "").has_value());
    CHECK(idem::grpc::detail::metadata_key_fault("idempotency-key", std::string(256, 'k')).has_value());
    CHECK_FALSE(idem::grpc::detail::metadata_key_fault("idempotency-key", std::string(255, 'k')).has_value());
}
