// idem/version.hpp — the library version.
#pragma once

#define IDEM_VERSION_MAJOR 1
#define IDEM_VERSION_MINOR 0
#define IDEM_VERSION_PATCH 0

namespace idem {
/// The library version, "MAJOR.MINOR.PATCH" (as IDEM_VERSION_MAJOR, _MINOR, _PATCH).
inline constexpr const char* version_string = "1.0.0";
}  // namespace idem
