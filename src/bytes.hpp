// Big-endian length-prefixed byte encoding shared by the codecs (internal).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "idem/errors.hpp"

namespace idem::detail {

class ByteWriter {
public:
    void u32(std::uint32_t v) { put(v, 4); }
    void u64(std::uint64_t v) { put(v, 8); }
    void raw(std::string_view s) { out_.append(s); }
    void str32(std::string_view s) {
        u32(static_cast<std::uint32_t>(s.size()));
        raw(s);
    }
    std::string take() { return std::move(out_); }
    void reserve(std::size_t n) { out_.reserve(n); }

private:
    void put(std::uint64_t v, int n) {
        for (int i = n - 1; i >= 0; --i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    }
    std::string out_;
};

/// Reads what ByteWriter wrote; any overrun throws corrupt_record naming `what`.
class ByteReader {
public:
    ByteReader(std::string_view in, const char* what) : in_(in), what_(what) {}

    std::uint32_t u32() { return static_cast<std::uint32_t>(get(4)); }
    std::uint64_t u64() { return get(8); }
    std::string_view raw(std::size_t n) {
        need(n);
        auto s = in_.substr(pos_, n);
        pos_ += n;
        return s;
    }
    std::string_view str32() { return raw(u32()); }
    [[nodiscard]] std::size_t remaining() const { return in_.size() - pos_; }
    void expect_end() const {
        if (remaining() != 0) fail("trailing bytes");
    }
    [[noreturn]] void fail(const std::string& why) const {
        throw corrupt_record(std::string("idem: corrupt ") + what_ + ": " + why);
    }

private:
    void need(std::size_t n) const {
        if (n > remaining()) fail("truncated");
    }
    std::uint64_t get(int n) {
        need(static_cast<std::size_t>(n));
        std::uint64_t v = 0;
        for (int i = 0; i < n; ++i) v = (v << 8) | static_cast<std::uint8_t>(in_[pos_++]);
        return v;
    }
    std::string_view in_;
    const char* what_;
    std::size_t pos_ = 0;
};

}  // namespace idem::detail
