// idem/response.hpp — what is stored for a key, and how user types become bytes (codec<T>).
//
// Response{status, body, headers} is the built-in result for HTTP-style handlers. The body is raw
// bytes (std::string may hold NUL and non-UTF-8 bytes); a replay gives back exactly the bytes stored,
// in the same order, headers included.
//
// To store your own result type T, specialise idem::codec<T>:
//
//     template <> struct idem::codec<Receipt> {
//         static std::string encode(const Receipt& r);      // any bytes
//         static Receipt decode(std::string_view bytes);    // throw idem::corrupt_record on bad input
//     };
//
// execute_once uses codec<R> where R is what the effect returns. Encoding is deterministic, so a
// replay decodes to an equal value. Built in: Response and std::string (stored as is).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace idem {

/// An HTTP-shaped result (status, body bytes, headers), stored and replayed byte for byte.
struct Response {
    /// Header fields in order, duplicates kept.
    using Headers = std::vector<std::pair<std::string, std::string>>;

    Response() = default;
    /// A response with this status, body and headers.
    Response(int status_code, std::string body_bytes = {}, Headers header_list = {})
        : status(status_code), body(std::move(body_bytes)), headers(std::move(header_list)) {}

    /// HTTP status code.
    int status = 200;
    /// Body bytes (any bytes, NUL included).
    std::string body;
    /// Header fields, in order.
    Headers headers;

    friend bool operator==(const Response&, const Response&) = default;
};

/// Primary template: specialise it for your result types (see above).
template <class T>
struct codec;

template <>
/// How a Response is stored: versioned, length-prefixed binary.
struct codec<Response> {
    /// Versioned, length-prefixed binary layout; see src/response.cpp.
    static std::string encode(const Response& response);
    /// Throws corrupt_record on anything that is not a complete encoding.
    static Response decode(std::string_view bytes);
};

template <>
/// A std::string result is stored as its bytes, unchanged.
struct codec<std::string> {
    /// The bytes themselves.
    static std::string encode(const std::string& value) { return value; }
    /// The bytes themselves.
    static std::string decode(std::string_view bytes) { return std::string(bytes); }
};

}  // namespace idem
