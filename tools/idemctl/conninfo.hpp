// tools/idemctl/conninfo.hpp — keeping passwords out of everything idemctl prints.
//
// idemctl's messages may name the database (which one could not be reached) and carry libpq's or
// the library's error text. redacted() is the only form of a conninfo idemctl prints; scrub() is
// applied to every message before it is printed, and replaces any password it knows of (the
// conninfo's own, keyword or URI form, and PGPASSWORD's) wherever the text contains it.
#pragma once

#include <string>
#include <string_view>

namespace idemctl {

/// `conninfo` without its password, as "key=value ..." (libpq's parse of it), or a placeholder:
/// "(libpq environment)" when empty, "(a conninfo libpq cannot parse; not shown)" when libpq
/// refuses it (its parse error could quote a piece of the password).
[[nodiscard]] std::string redacted(const std::string& conninfo);

/// Throws ToolError(Exit::usage) unless libpq can parse `conninfo` (an empty one always can: the
/// environment is used). The message does not quote libpq's, which could quote the password.
void require_parsable(const std::string& conninfo);

/// `message` with every occurrence of a password from `conninfo` or PGPASSWORD replaced by "***".
[[nodiscard]] std::string scrub(std::string message, const std::string& conninfo);

}  // namespace idemctl
