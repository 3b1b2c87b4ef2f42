// idem/version.hpp — the library version.
#pragma once

#define IDEM_VERSION_MAJOR 0
#define IDEM_VERSION_MINOR 1
#define IDEM_VERSION_PATCH 0

namespace idem {
inline constexpr const char* version_string = "0.1.0";
}  // namespace idem
