// tools/idemctl/failure.hpp — how idemctl ends for a statement the database refused: as the library
// classifies the same SQLSTATE (idem::pg::failure_kind), so that idemctl's exit code and the
// library's exception never disagree on one server error.
#pragma once

#include <string_view>

#include "cli.hpp"
#include "postgres/sansio/sqlstate.hpp"

namespace idemctl {

/// Exit::config for a configuration error, Exit::unavailable for an outage, Exit::failure else.
[[nodiscard]] inline Exit exit_for(std::string_view sqlstate, std::string_view message) noexcept {
    switch (idem::pg::failure_kind(sqlstate, message)) {
        case idem::pg::FailureKind::configuration: return Exit::config;
        case idem::pg::FailureKind::unavailable: return Exit::unavailable;
        case idem::pg::FailureKind::refused: break;
    }
    return Exit::failure;
}

}  // namespace idemctl
