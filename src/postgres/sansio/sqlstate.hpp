// Which idem error a PostgreSQL failure is (internal): by SQLSTATE for a statement's error, by
// libpq's message for a failed connection attempt (libpq keeps no SQLSTATE for it).
#pragma once

#include <string>
#include <string_view>

#include "idem/errors.hpp"

namespace idem::pg {

/// The connection failed (closed, reset, timed out, server shutting down). The statement's effect is
/// unknown; the caller discards the connection and may retry on a fresh one.
class connection_broken : public store_unavailable {
public:
    using store_unavailable::store_unavailable;
};

/// SQLSTATEs after which the connection cannot be trusted (shutdown, connection exceptions).
bool is_connection_sqlstate(std::string_view sqlstate) noexcept;

/// SQLSTATEs of permanent misconfiguration: authentication, no such database / schema / table /
/// column, permission denied. Retrying never helps; reported as config_error.
bool is_configuration_sqlstate(std::string_view sqlstate) noexcept;

/// What a failed statement means for its caller: one decision, by SQLSTATE (and, for two cases
/// of idem's own, the message), for the library (throw_database_error) and idemctl.
enum class FailureKind {
    configuration,  ///< permanent until the deployment changes (config_error)
    unavailable,    ///< the database is there, or will be, but cannot serve now (store_unavailable)
    refused,        ///< anything else the database refused (database_error)
};
[[nodiscard]] FailureKind failure_kind(std::string_view sqlstate, std::string_view message) noexcept;

/// Throws the idem exception for a database error, as failure_kind() says: config_error (with a
/// hint for the causes idem knows: a missing table says to call ensure_schema()),
/// store_unavailable, or database_error. `message` starts with "idem: ".
[[noreturn]] void throw_database_error(std::string message, const std::string& sqlstate);

/// The SQLSTATE of a failed connection attempt, recognised from libpq's message (libpq keeps no
/// SQLSTATE for it): 3D000, 28000 (also TLS: a server certificate that does not verify, no TLS
/// where sslmode requires it), 28P01, 42501, 22023 (a malformed conninfo, an unusable TLS file) —
/// or empty (an outage, an authentication service that may be down, or a message not recognised).
std::string connect_failure_sqlstate(std::string_view libpq_message) noexcept;

/// Throws config_error for a permanent connect failure (connect_failure_sqlstate), else
/// store_unavailable.
[[noreturn]] void throw_connect_error(const std::string& libpq_message);

/// Strips the trailing newline libpq puts on its messages.
std::string trim(std::string s);

}  // namespace idem::pg
