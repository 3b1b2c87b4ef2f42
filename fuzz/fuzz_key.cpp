// Fuzz target: key validation.
//
// Input: a 2-byte split point, then bytes split in two: scope = rest[0, split % (n+1)), value = the
// remainder. idem::Key{scope, value} must either construct or throw idem::invalid_key — nothing
// else — and must agree with an independent reference of the contract (Unicode Table 3-7
// well-formed UTF-8, 1..255 bytes, no control characters). A constructed key keeps its bytes.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

#include "fuzz_support.hpp"
#include "idem/errors.hpp"
#include "idem/key.hpp"

namespace {

// Table 3-7 of the Unicode Standard ("Well-Formed UTF-8 Byte Sequences"), written independently of
// src/key.cpp. Returns the sequence length at s[i], 0 if ill-formed; cp receives the code point.
std::size_t utf8_sequence(std::string_view s, std::size_t i, std::uint32_t& cp) {
    const auto at = [&](std::size_t k) -> int { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : -1; };
    const int b0 = at(0);
    const auto in = [](int b, int lo, int hi) { return b >= lo && b <= hi; };
    if (in(b0, 0x00, 0x7F)) {
        cp = static_cast<std::uint32_t>(b0);
        return 1;
    }
    int lo1 = 0x80, hi1 = 0xBF, n = 0;
    if (in(b0, 0xC2, 0xDF)) n = 2;
    else if (b0 == 0xE0) n = 3, lo1 = 0xA0;
    else if (in(b0, 0xE1, 0xEC) || in(b0, 0xEE, 0xEF)) n = 3;
    else if (b0 == 0xED) n = 3, hi1 = 0x9F;
    else if (b0 == 0xF0) n = 4, lo1 = 0x90;
    else if (in(b0, 0xF1, 0xF3)) n = 4;
    else if (b0 == 0xF4) n = 4, hi1 = 0x8F;
    else return 0;
    if (!in(at(1), lo1, hi1)) return 0;
    for (int k = 2; k < n; ++k) {
        if (!in(at(static_cast<std::size_t>(k)), 0x80, 0xBF)) return 0;
    }
    const std::uint32_t lead_bits[] = {0, 0, 0x1F, 0x0F, 0x07};
    cp = static_cast<std::uint32_t>(b0) & lead_bits[n];
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<std::uint32_t>(at(static_cast<std::size_t>(k))) & 0x3F);
    return static_cast<std::size_t>(n);
}

// Control characters: Unicode general category Cc = U+0000..U+001F and U+007F..U+009F.
// (include/idem/key.hpp lists U+0000..U+001F and U+007F; src/key.cpp also refuses the C1 range
// U+0080..U+009F, which Unicode counts as control characters too.)
bool is_control(std::uint32_t cp) { return cp < 0x20 || (cp >= 0x7F && cp <= 0x9F); }

bool acceptable(std::string_view part) {
    if (part.empty() || part.size() > 255) return false;
    for (std::size_t i = 0; i < part.size();) {
        std::uint32_t cp = 0;
        const std::size_t n = utf8_sequence(part, i, cp);
        if (n == 0 || is_control(cp)) return false;
        i += n;
    }
    return true;
}

// validate_key_part must throw invalid_key exactly when the reference refuses.
void check_part(const std::string& part) {
    bool threw = false;
    try {
        idem::validate_key_part(part, "value");
    } catch (const idem::invalid_key& e) {
        threw = true;
        FUZZ_CHECK(std::string_view(e.what()).starts_with("idem: invalid key value: "), "message: %s", e.what());
        FUZZ_CHECK(e.sqlstate().empty(), "invalid_key with a sqlstate");
    }
    FUZZ_CHECK(threw != acceptable(part), "validate_key_part %s but the reference says %s: %s",
               threw ? "refused" : "accepted", acceptable(part) ? "valid" : "invalid",
               idem_fuzz::hex(part, 300).c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    idem_fuzz::Reader in(data, size);
    const std::size_t split_hint = in.u16();
    const std::string rest = in.rest();
    const std::size_t split = split_hint % (rest.size() + 1);
    const std::string scope = rest.substr(0, split);
    const std::string value = rest.substr(split);

    check_part(scope);
    check_part(value);

    const bool expect_ok = acceptable(scope) && acceptable(value);
    try {
        const idem::Key key(scope, value);
        FUZZ_CHECK(expect_ok, "Key accepted scope=%s value=%s", idem_fuzz::hex(scope, 300).c_str(),
                   idem_fuzz::hex(value, 300).c_str());
        // Invariants of a constructed key: verbatim bytes, 1..255 bytes, UTF-8, no controls.
        FUZZ_CHECK(key.scope() == scope && key.value() == value, "Key changed its bytes");
        for (const std::string* part : {&key.scope(), &key.value()}) {
            FUZZ_CHECK(!part->empty() && part->size() <= idem::Key::max_bytes, "size %zu", part->size());
            FUZZ_CHECK(acceptable(*part), "constructed key part fails the contract");
        }
        const idem::Key copy = key;
        FUZZ_CHECK(copy == key && !(copy < key) && !(key < copy), "Key comparison inconsistent");
    } catch (const idem::invalid_key& e) {
        FUZZ_CHECK(!expect_ok, "Key refused a valid key (%s): scope=%s value=%s", e.what(),
                   idem_fuzz::hex(scope, 300).c_str(), idem_fuzz::hex(value, 300).c_str());
    } catch (const std::exception& e) {
        FUZZ_CHECK(false, "Key threw something other than invalid_key: %s", e.what());
    }
    return 0;
}
