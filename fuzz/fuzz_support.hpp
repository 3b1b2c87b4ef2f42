// Helpers shared by idem's libFuzzer targets: a front-to-back input reader and a check that aborts
// (so libFuzzer records the input as a crash) with a message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#define FUZZ_CHECK(cond, ...)                                                                      \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n  ", __FILE__, __LINE__, #cond); \
            std::fprintf(stderr, __VA_ARGS__);                                                     \
            std::fputc('\n', stderr);                                                              \
            std::abort();                                                                          \
        }                                                                                          \
    } while (0)

namespace idem_fuzz {

/// Reads the fuzz input from the front; past the end it yields zeros / empty strings.
class Reader {
public:
    Reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}

    [[nodiscard]] bool empty() const noexcept { return pos_ >= size_; }
    [[nodiscard]] std::size_t remaining() const noexcept { return empty() ? 0 : size_ - pos_; }

    std::uint8_t u8() { return empty() ? 0 : data_[pos_++]; }
    std::uint16_t u16() { return static_cast<std::uint16_t>((u8() << 8) | u8()); }
    std::uint64_t u64() {
        std::uint64_t v = 0;
        for (int i = 0; i < 8; ++i) v = (v << 8) | u8();
        return v;
    }
    /// Up to n bytes (fewer if the input ends).
    std::string bytes(std::size_t n) {
        if (n > remaining()) n = remaining();
        std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
        pos_ += n;
        return s;
    }
    std::string rest() { return bytes(remaining()); }

private:
    const std::uint8_t* data_;
    std::size_t size_;
    std::size_t pos_ = 0;
};

inline std::string hex(std::string_view s, std::size_t max = 64) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string out;
    for (std::size_t i = 0; i < s.size() && i < max; ++i) {
        const auto b = static_cast<unsigned char>(s[i]);
        out.push_back(digits[b >> 4]);
        out.push_back(digits[b & 0xF]);
    }
    if (s.size() > max) out += "...";
    return out;
}

}  // namespace idem_fuzz
