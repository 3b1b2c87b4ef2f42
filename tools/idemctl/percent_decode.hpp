// tools/idemctl/percent_decode.hpp — the key an HTTP adapter over cpp-httplib stores for a key a
// client sent.
//
// cpp-httplib 0.11 percent-decodes every header value while parsing (but Location's), before idem
// sees it: a client's Idempotency-Key "k%41" is stored as "kA", while the Beast adapter stores
// "k%41" exactly. idemctl show looks up this decoded form when the key as given has no record.
#pragma once

#include <string>
#include <string_view>

namespace idemctl {

/// `text` decoded exactly as cpp-httplib 0.11 decodes a header value (detail::decode_url(text,
/// false)): "%XX" (two hex digits, either case) is that byte; "%uXXXX" (four hex digits) is that
/// code point in UTF-8, and nothing for a surrogate (U+D800..U+DFFF); a '%' starting neither stays
/// as it is; '+' stays '+'. The result may hold any byte (NUL, malformed UTF-8). Never throws but
/// std::bad_alloc.
[[nodiscard]] std::string percent_decode_like_httplib(std::string_view text);

}  // namespace idemctl
