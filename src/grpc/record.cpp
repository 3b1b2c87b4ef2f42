// codec<idem::grpc::detail::StoredCall>: the stored record of a gRPC call (docs/grpc.md, "Record
// format").
//
// Layout, big-endian lengths (the ByteWriter of the other codecs):
//   "IDG" | version u8 (1) | code u32 (0..16) | message str32 | details str32 | reply str32 |
//   trailer count u32 | (name str32, value str32)*
// A record of another version, a code outside gRPC's, a trailer gRPC would refuse to send, a
// truncated record or trailing bytes are
// corrupt_record: the call is answered INTERNAL and the handler never runs again for the key.
#include <stdexcept>
#include <string>

#include "bytes.hpp"
#include "idem/grpc/detail.hpp"
#include "idem/grpc/record.hpp"

#include <google/protobuf/message.h>

namespace idem {
namespace {
constexpr std::string_view kMagic = "IDG";
constexpr char kVersion = 1;
}  // namespace

std::string codec<grpc::detail::StoredCall>::encode(const grpc::detail::StoredCall& call) {
    detail::ByteWriter w;
    std::size_t size = kMagic.size() + 1 + 20 + call.message.size() + call.details.size() + call.reply.size();
    for (const auto& [name, value] : call.trailers) size += 8 + name.size() + value.size();
    w.reserve(size);
    w.raw(kMagic);
    w.raw(std::string_view(&kVersion, 1));
    w.u32(static_cast<std::uint32_t>(call.code));
    w.str32(call.message);
    w.str32(call.details);
    w.str32(call.reply);
    w.u32(static_cast<std::uint32_t>(call.trailers.size()));
    for (const auto& [name, value] : call.trailers) {
        w.str32(name);
        w.str32(value);
    }
    return w.take();
}

grpc::detail::StoredCall codec<grpc::detail::StoredCall>::decode(std::string_view bytes) {
    detail::ByteReader r(bytes, "stored gRPC call");
    if (r.raw(kMagic.size()) != kMagic) r.fail("not a gRPC call record");
    if (r.raw(1)[0] != kVersion) r.fail("unknown record version");
    grpc::detail::StoredCall call;
    const std::uint32_t code = r.u32();
    if (code > static_cast<std::uint32_t>(grpc::detail::kLastStatusCode)) r.fail("status code out of range");
    call.code = static_cast<int>(code);
    call.message = std::string(r.str32());
    call.details = std::string(r.str32());
    call.reply = std::string(r.str32());
    const std::uint32_t trailers = r.u32();
    // Each entry needs at least 8 bytes: a larger count is corrupt, not a huge allocation.
    if (trailers > r.remaining() / 8) r.fail("trailer count past the end");
    call.trailers.reserve(trailers);
    for (std::uint32_t i = 0; i < trailers; ++i) {
        std::string name(r.str32());
        std::string value(r.str32());
        // Sent as stored on a replay: one gRPC refuses would abort the process there.
        try {
            grpc::detail::check_trailer(name, value);
        } catch (const std::invalid_argument&) {
            r.fail("a trailer gRPC refuses");
        }
        call.trailers.emplace_back(std::move(name), std::move(value));
    }
    r.expect_end();
    return call;
}

namespace grpc {

StoredCall stored_call(const ::grpc::Status& status, const google::protobuf::Message& reply, Metadata trailers) {
    const int code = static_cast<int>(status.error_code());
    if (code < 0 || code > detail::kLastStatusCode) {
        throw std::invalid_argument("idem::grpc::stored_call: status code " + std::to_string(code) +
                                    " is outside gRPC's 0..16");
    }
    for (const auto& [name, value] : trailers) detail::check_trailer(name, value);
    return StoredCall{code, status.error_message(), status.error_details(),
                      status.ok() ? reply.SerializeAsString() : std::string(), std::move(trailers)};
}

}  // namespace grpc

}  // namespace idem
