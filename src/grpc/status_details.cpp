// idem::grpc::retry_status: a status whose details are a google.rpc.Status carrying a
// google.rpc.RetryInfo — what clients read from grpc-status-details-bin.
//
// The messages are written field by field in protobuf's wire format rather than from generated
// code: google/rpc/*.proto is not shipped with Debian's gRPC, and a second generated definition of
// google.rpc.Status in the same program as the application's own (googleapis) would be a
// descriptor-pool conflict at start-up. The field numbers are googleapis':
//   google.rpc.Status    { int32 code = 1; string message = 2; repeated google.protobuf.Any details = 3; }
//   google.protobuf.Any  { string type_url = 1; bytes value = 2; }
//   google.rpc.RetryInfo { google.protobuf.Duration retry_delay = 1; }
//   google.protobuf.Duration { int64 seconds = 1; int32 nanos = 2; }
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <cstdint>
#include <string>

#include "idem/grpc/detail.hpp"

namespace idem::grpc {
namespace {

using google::protobuf::io::CodedOutputStream;
using google::protobuf::io::StringOutputStream;

enum Wire : std::uint32_t { varint = 0, length_delimited = 2 };

// One message's bytes, written by `fill`.
template <class Fill>
std::string message(Fill fill) {
    std::string bytes;
    {
        StringOutputStream stream(&bytes);
        CodedOutputStream out(&stream);
        fill(out);
    }
    return bytes;
}

void varint_field(CodedOutputStream& out, std::uint32_t field, std::uint64_t value) {
    if (value == 0) return;  // proto3: a default value is not written
    out.WriteTag(field << 3 | varint);
    out.WriteVarint64(value);
}

void bytes_field(CodedOutputStream& out, std::uint32_t field, const std::string& value) {
    out.WriteTag(field << 3 | length_delimited);
    out.WriteVarint32(static_cast<std::uint32_t>(value.size()));
    out.WriteString(value);
}

}  // namespace

::grpc::Status retry_status(::grpc::StatusCode code, const std::string& text, std::chrono::milliseconds retry_delay) {
    const auto ms = retry_delay.count() < 0 ? 0 : retry_delay.count();
    const std::string duration = message([&](CodedOutputStream& out) {
        varint_field(out, 1, static_cast<std::uint64_t>(ms / 1000));
        varint_field(out, 2, static_cast<std::uint64_t>((ms % 1000) * 1000000));
    });
    const std::string retry_info = message([&](CodedOutputStream& out) { bytes_field(out, 1, duration); });
    const std::string any = message([&](CodedOutputStream& out) {
        bytes_field(out, 1, "type.googleapis.com/google.rpc.RetryInfo");
        bytes_field(out, 2, retry_info);
    });
    const std::string status = message([&](CodedOutputStream& out) {
        varint_field(out, 1, static_cast<std::uint64_t>(code));
        if (!text.empty()) bytes_field(out, 2, text);
        bytes_field(out, 3, any);
    });
    return {code, text, status};
}

}  // namespace idem::grpc
