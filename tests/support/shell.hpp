// tests/support/shell.hpp — command lines for std::system in tests (not part of idem).
#pragma once

#include <string>

namespace idem_test {

/// `s` as one sh word: inside single quotes, each single quote of `s` written '\''.
inline std::string shell_quote(const std::string& s) {
    std::string out = "'";
    for (char c : s) {
        if (c == '\'') {
            out += "'\\''";
        } else {
            out += c;
        }
    }
    return out + "'";
}

}  // namespace idem_test
