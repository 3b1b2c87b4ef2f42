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

struct Response {
    using Headers = std::vector<std::pair<std::string, std::string>>;

    Response() = default;
    Response(int status_code, std::string body_bytes = {}, Headers header_list = {})
        : status(status_code), body(std::move(body_bytes)), headers(std::move(header_list)) {}

    int status = 200;
    std::string body;
    Headers headers;

    friend bool operator==(const Response&, const Response&) = default;
};

/// Primary template: specialise it for your result types (see above).
template <class T>
struct codec;

template <>
struct codec<Response> {
    /// Versioned, length-prefixed binary layout; see src/response.cpp.
    static std::string encode(const Response& response);
    /// Throws corrupt_record on anything that is not a complete encoding.
    static Response decode(std::string_view bytes);
};

template <>
struct codec<std::string> {
    static std::string encode(const std::string& value) { return value; }
    static std::string decode(std::string_view bytes) { return std::string(bytes); }
};

}  // namespace idem
