// A request's header values percent-decoded as cpp-httplib 0.11 decodes them (internal to
// idem::http; percent_decode_header_value in include/idem/http.hpp is the public part).
#pragma once

#include <string>
#include <vector>

#include "idem/http.hpp"

namespace idem::http {

/// Holds the decoded copy of a request's header values while a view of them is in use.
class DecodedRequest {
public:
    /// `request` with every header value decoded and exact_header_values = false: what
    /// cpp-httplib's adapter would have given for the same bytes. Valid while this object and
    /// `request` live, until the next call.
    const Request& of(const Request& request);

private:
    std::vector<std::string> values_;
    Request view_;
};

}  // namespace idem::http
