// How a connection is opened (internal): the settings, libpq's connection parameters, and what
// is checked and set once the session is up.
#pragma once

#include <libpq-fe.h>

#include <array>
#include <chrono>
#include <string>

#include "sansio/params.hpp"

namespace idem::pg {

class Watchdog;

struct ConnectSettings {
    std::string conninfo;
    std::string application_name;
    std::chrono::milliseconds connect_timeout;
    std::chrono::milliseconds statement_timeout;
    std::chrono::milliseconds lock_timeout;
    bool prepared_statements = true;
    bool session_options = true;
    Watchdog* watchdog = nullptr;  ///< none: every wait is a poll with a timeout
};

/// The libpq connection parameters for `settings` (the user's conninfo expanded from "dbname",
/// connect_timeout, application_name and idem's session options after it, which take precedence).
class ConnectParams {
public:
    explicit ConnectParams(const ConnectSettings& settings);
    ConnectParams(const ConnectParams&) = delete;
    ConnectParams& operator=(const ConnectParams&) = delete;
    [[nodiscard]] const char* const* keys() const noexcept { return keys_.data(); }
    [[nodiscard]] const char* const* values() const noexcept { return values_.data(); }

private:
    std::string timeout_, options_;
    std::array<const char*, 5> keys_{}, values_{};
};

/// After a connection is established: quiet notices, non-blocking, pipeline mode. Throws store_unavailable.
void configure_connected(PGconn* conn);
/// The answer to one PREPARE: throws connection_broken (session closed), config_error or
/// store_unavailable (by SQLSTATE) when it is not COMMAND_OK.
void check_prepared(const PGresult* r, const StatementDef& def);

/// Silences server NOTICEs ("relation already exists, skipping") that libpq prints to stderr.
void quiet_notices(PGconn* conn) noexcept;

}  // namespace idem::pg
