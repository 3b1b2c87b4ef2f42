// The stored record's codec and the RetryInfo status details, without a server.
#include <catch2/catch.hpp>

#include <string>

#include "google/rpc/status.pb.h"
#include "idem/grpc.hpp"

using idem::grpc::detail::StoredCall;

TEST_CASE("grpc record: every field round-trips byte for byte", "[grpc][record]") {
    StoredCall call{9,
                    "card declined",
                    std::string("\x08\x09\0x", 4),
                    std::string("\0reply\xff", 7),
                    {{"decline-code", "insufficient_funds"}, {"receipt-bin", std::string("\0\x01", 2)}}};
    const std::string bytes = idem::codec<StoredCall>::encode(call);
    CHECK(bytes.substr(0, 4) == std::string("IDG\x01", 4));
    const StoredCall back = idem::codec<StoredCall>::decode(bytes);
    CHECK(back.code == 9);
    CHECK(back.message == call.message);
    CHECK(back.details == call.details);
    CHECK(back.reply == call.reply);
    CHECK(back.trailers == call.trailers);
    CHECK(idem::codec<StoredCall>::encode(back) == bytes);
}

TEST_CASE("grpc record: anything but a complete version-1 record is corrupt_record", "[grpc][record]") {
    const std::string good = idem::codec<StoredCall>::encode(StoredCall{0, "", "", "r", {{"a", "b"}}});
    for (std::size_t n = 0; n < good.size(); ++n) {
        CHECK_THROWS_AS(idem::codec<StoredCall>::decode(good.substr(0, n)), idem::corrupt_record);
    }
    CHECK_THROWS_AS(idem::codec<StoredCall>::decode(good + "x"), idem::corrupt_record);
    std::string v2 = good;
    v2[3] = '\x02';
    CHECK_THROWS_AS(idem::codec<StoredCall>::decode(v2), idem::corrupt_record);
    std::string code17 = good;
    code17[7] = '\x11';
    CHECK_THROWS_AS(idem::codec<StoredCall>::decode(code17), idem::corrupt_record);
}

TEST_CASE("grpc: retry_status carries a google.rpc.Status with a google.rpc.RetryInfo", "[grpc][record]") {
    const ::grpc::Status status =
        idem::grpc::retry_status(::grpc::StatusCode::ABORTED, "in progress", std::chrono::milliseconds(2750));
    CHECK(status.error_code() == ::grpc::StatusCode::ABORTED);
    google::rpc::Status details;
    REQUIRE(details.ParseFromString(status.error_details()));
    CHECK(details.code() == static_cast<int>(::grpc::StatusCode::ABORTED));
    CHECK(details.message() == "in progress");
    REQUIRE(details.details_size() == 1);
    CHECK(details.details(0).type_url() == "type.googleapis.com/google.rpc.RetryInfo");
    google::rpc::RetryInfo info;
    REQUIRE(details.details(0).UnpackTo(&info));
    CHECK(info.retry_delay().seconds() == 2);
    CHECK(info.retry_delay().nanos() == 750000000);
}
