#include "params.hpp"

#include <bit>
#include <cstring>
#include <stdexcept>

namespace idem::pg {

// ---- Params ---------------------------------------------------------------------------------------

void Params::too_many() { throw std::logic_error("idem: too many statement parameters"); }

Params& Params::text_format(std::optional<std::string_view> s) {
    if (!s) return push(nullptr, 0, 0);
    return push(s->data() != nullptr ? s->data() : "", static_cast<int>(s->size()), 0);
}

namespace {
void put_be(std::string& out, std::uint64_t v, int width) {
    for (int i = width - 1; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
}  // namespace

Params& Params::array(Oid element, const std::vector<std::string_view>& items) {
    // Binary array: ndim, has-nulls flag, element type, then per dimension size and lower bound,
    // then per element its length and bytes.
    std::string& a = *owned_.emplace_back(std::make_unique<std::string>());
    std::size_t size = 20;
    for (auto item : items) size += 4 + item.size();
    a.reserve(size);
    put_be(a, 1, 4);
    put_be(a, 0, 4);
    put_be(a, element, 4);
    put_be(a, items.size(), 4);
    put_be(a, 1, 4);
    for (auto item : items) {
        put_be(a, item.size(), 4);
        a.append(item);
    }
    return raw(a);
}

Params& Params::int2_array(const std::vector<std::int16_t>& items) {
    std::string bytes;
    for (auto v : items) put_be(bytes, static_cast<std::uint16_t>(v), 2);
    std::vector<std::string_view> views;
    for (std::size_t i = 0; i < items.size(); ++i) views.emplace_back(bytes.data() + 2 * i, 2);
    return array(oid::int2, views);
}

Params& Params::int8_array(const std::vector<std::int64_t>& items) {
    std::string bytes;
    for (auto v : items) put_be(bytes, static_cast<std::uint64_t>(v), 8);
    std::vector<std::string_view> views;
    for (std::size_t i = 0; i < items.size(); ++i) views.emplace_back(bytes.data() + 8 * i, 8);
    return array(oid::int8, views);
}

Params& Params::number(std::uint64_t v, int width) {
    if (size_ == kCapacity) too_many();
    auto& buf = numbers_[static_cast<std::size_t>(size_)];
    // Big-endian: the low `width` bytes of v, most significant first (one bswap, no byte loop).
    std::uint64_t be = v << (8 * (8 - width));
    if constexpr (std::endian::native == std::endian::little) be = __builtin_bswap64(be);
    std::memcpy(buf.data(), &be, sizeof be);
    return push(buf.data(), width, 1);
}

}  // namespace idem::pg
