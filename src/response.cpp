#include "idem/response.hpp"

#include "bytes.hpp"

namespace idem {
namespace {
// Layout v1: "IDR1" | status i32 | header count u32 | (name str32, value str32)* | body u64 + bytes.
// A new layout gets a new magic; decode keeps reading the old ones.
constexpr std::string_view kMagic = "IDR1";
}  // namespace

std::string codec<Response>::encode(const Response& response) {
    detail::ByteWriter w;
    std::size_t size = kMagic.size() + 16 + response.body.size();
    for (const auto& [name, value] : response.headers) size += 8 + name.size() + value.size();
    w.reserve(size);
    w.raw(kMagic);
    w.u32(static_cast<std::uint32_t>(response.status));
    w.u32(static_cast<std::uint32_t>(response.headers.size()));
    for (const auto& [name, value] : response.headers) {
        w.str32(name);
        w.str32(value);
    }
    w.u64(response.body.size());
    w.raw(response.body);
    return w.take();
}

Response codec<Response>::decode(std::string_view bytes) {
    detail::ByteReader r(bytes, "stored response");
    if (r.raw(kMagic.size()) != kMagic) r.fail("unknown layout");
    Response response;
    response.status = static_cast<int>(static_cast<std::int32_t>(r.u32()));
    const std::uint32_t headers = r.u32();
    // Each header needs at least 8 bytes: a count larger than that is corrupt, not a huge allocation.
    if (headers > r.remaining() / 8) r.fail("header count past the end");
    response.headers.reserve(headers);
    for (std::uint32_t i = 0; i < headers; ++i) {
        std::string name(r.str32());
        std::string value(r.str32());
        response.headers.emplace_back(std::move(name), std::move(value));
    }
    const std::uint64_t body = r.u64();
    if (body != r.remaining()) r.fail("body length does not match");
    response.body = std::string(r.raw(static_cast<std::size_t>(body)));
    return response;
}

}  // namespace idem
