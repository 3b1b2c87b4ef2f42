// The --cases LIST of idem-bench's command lines (bench/postgres/options.cpp,
// bench/redis/options.cpp): comma-separated case names, each one a case_name() of the store's Case.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "util.hpp"

namespace bench {

/// The cases that `list` names, in its order, each name matched against case_name() of the
/// `known` cases. nullopt when a name matches none of them; `unknown` is then that name.
template <class Case, std::size_t N>
std::optional<std::vector<Case>> parse_cases(const std::string& list, const std::array<Case, N>& known,
                                             std::string& unknown) {
    std::vector<Case> cases;
    for (const auto& name : split(list)) {
        const auto it = std::find_if(known.begin(), known.end(), [&](Case c) { return name == case_name(c); });
        if (it == known.end()) {
            unknown = name;
            return std::nullopt;
        }
        cases.push_back(*it);
    }
    return cases;
}

}  // namespace bench
