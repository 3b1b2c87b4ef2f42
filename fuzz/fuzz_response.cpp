// Fuzz target: codec<Response> on its own.
//
// 1. The raw input as stored bytes: decode gives a Response or throws corrupt_record; a decoded
//    Response re-encodes to exactly the input (the v1 layout is canonical).
// 2. A Response built from the input (status, headers, body with any bytes): encode then decode
//    gives an equal Response (replays are byte-identical).
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include "fuzz_support.hpp"
#include "idem/errors.hpp"
#include "idem/response.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string raw(reinterpret_cast<const char*>(data), size);
    try {
        const idem::Response r = idem::codec<idem::Response>::decode(raw);
        const std::string again = idem::codec<idem::Response>::encode(r);
        FUZZ_CHECK(again == raw, "decode/encode not canonical: %s", idem_fuzz::hex(raw).c_str());
    } catch (const idem::corrupt_record&) {
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "decode threw something other than corrupt_record: %s", e.what());
    }

    idem_fuzz::Reader in(data, size);
    idem::Response built;
    built.status = static_cast<int>(static_cast<std::int32_t>(static_cast<std::uint32_t>(in.u64())));
    const std::size_t headers = in.u8() % 8;
    for (std::size_t i = 0; i < headers; ++i) {
        std::string name = in.bytes(in.u8());
        std::string value = in.bytes(in.u8());
        built.headers.emplace_back(std::move(name), std::move(value));
    }
    built.body = in.rest();
    const std::string enc = idem::codec<idem::Response>::encode(built);
    try {
        FUZZ_CHECK(idem::codec<idem::Response>::decode(enc) == built, "encode/decode round trip changed the response");
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "decode refused its own encoding: %s", e.what());
    }
    return 0;
}
