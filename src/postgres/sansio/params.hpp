// What a statement is sent with (internal): its definition, its parameters in binary format, and
// its place in a pipeline.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace idem::pg {

/// A type's object identifier in PostgreSQL's catalog (libpq's Oid).
using Oid = unsigned int;

/// A statement known to every connection of a store: its SQL and parameter types.
struct StatementDef {
    std::string name;  ///< prepared statement name; empty: always sent unnamed (utility statements)
    std::string sql;
    std::vector<Oid> param_types;
};

namespace oid {
constexpr Oid int2 = 21, int4 = 23, int8 = 20, text = 25, bytea = 17;
constexpr Oid int2_array = 1005, int8_array = 1016, text_array = 1009, bytea_array = 1001;
}  // namespace oid

/// Parameters of one execution, all sent in binary format (text values are their UTF-8 bytes).
/// Up to kCapacity parameters, stored inline: building the parameters of a claim allocates nothing.
class Params {
public:
    static constexpr int kCapacity = 12;  // idem's widest statement has 7

    Params() = default;
    Params(const Params&) = delete;  // values_ may point into numbers_
    Params& operator=(const Params&) = delete;

    Params& text(std::string_view s) { return raw(s); }
    Params& bytes(std::string_view s) { return raw(s); }
    Params& int2(std::int16_t v) { return number(static_cast<std::uint64_t>(static_cast<std::uint16_t>(v)), 2); }
    Params& int8(std::int64_t v) { return number(static_cast<std::uint64_t>(v), 8); }
    Params& int4(std::int32_t v) { return number(static_cast<std::uint64_t>(static_cast<std::uint32_t>(v)), 4); }
    /// A text-format parameter (the server parses it by the statement's parameter type), or NULL.
    Params& text_format(std::optional<std::string_view> s);
    /// A one-dimensional array without NULLs, in binary format; the array is copied.
    Params& text_array(const std::vector<std::string_view>& items) { return array(oid::text, items); }
    Params& bytea_array(const std::vector<std::string_view>& items) { return array(oid::bytea, items); }
    Params& int2_array(const std::vector<std::int16_t>& items);
    Params& int8_array(const std::vector<std::int64_t>& items);

    [[nodiscard]] int size() const noexcept { return size_; }
    const char* const* values() const noexcept { return values_.data(); }
    const int* lengths() const noexcept { return lengths_.data(); }
    const int* formats() const noexcept { return formats_.data(); }

private:
    // Text and bytes are referenced, not copied: they must outlive the run() that sends them.
    Params& raw(std::string_view s) {
        // libpq never reads a zero-length binary value, but wants a non-null pointer for "not NULL".
        return push(s.data() != nullptr ? s.data() : "", static_cast<int>(s.size()), 1);
    }
    Params& push(const char* value, int length, int format) {
        if (size_ == kCapacity) too_many();
        const auto i = static_cast<std::size_t>(size_++);
        values_[i] = value;
        lengths_[i] = length;
        formats_[i] = format;
        return *this;
    }
    [[noreturn]] static void too_many();
    Params& number(std::uint64_t v, int width);
    Params& array(Oid element, const std::vector<std::string_view>& items);
    // Only [0, size_) is ever read: the arrays are left uninitialised, so that a Params costs no
    // stores beyond the parameters it holds (one is built for every statement).
    int size_ = 0;
    std::array<const char*, kCapacity> values_;
    std::array<int, kCapacity> lengths_;
    std::array<int, kCapacity> formats_;
    std::array<std::array<char, 8>, kCapacity> numbers_;  // big-endian numbers, by parameter index
    std::vector<std::unique_ptr<std::string>> owned_;     // encoded arrays (stable addresses)
};

/// One statement of a pipeline: which definition, with which parameters.
struct Step {
    const StatementDef* def;
    Params* params;
    bool sync_after = true;  ///< close the segment (own transaction) after this statement
    int result_format = 1;   ///< 1 binary (idem's own statements), 0 text
};

}  // namespace idem::pg
