// tools/idemctl/database.hpp — idemctl's own libpq session, for what the library's API does not
// offer (list, stats): one blocking connection, parameterised statements only (PQexecParams).
//
// Errors are ToolErrors with idemctl's exit codes: a connection that fails for good (failed
// authentication, no such database or role, refused by pg_hba.conf) is Exit::config, any other
// failure to connect Exit::unavailable; a statement refused because the table, a column or a
// privilege is missing is Exit::config, a lost connection or a timeout Exit::unavailable, anything
// else Exit::failure. Messages name the database by its redacted conninfo (conninfo.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

struct pg_conn;
struct pg_result;

namespace idemctl {

/// The rows of one statement; values are text (libpq's text format).
class Rows {
public:
    explicit Rows(pg_result* result);

    [[nodiscard]] int count() const noexcept;
    [[nodiscard]] bool is_null(int row, int column) const noexcept;
    /// The value as text; "" for NULL.
    [[nodiscard]] std::string text(int row, int column) const;
    /// The value as text, or nullopt for NULL.
    [[nodiscard]] std::optional<std::string> optional_text(int row, int column) const;
    /// The value as an integer (0 for NULL).
    [[nodiscard]] std::int64_t integer(int row, int column) const;
    /// A boolean column ('t' / 'f'); false for NULL.
    [[nodiscard]] bool boolean(int row, int column) const noexcept;

private:
    std::shared_ptr<pg_result> result_;
};

class Database {
public:
    /// Connects (connect_timeout 5 s unless the conninfo says otherwise; application_name idemctl).
    /// Throws ToolError (Exit::config or Exit::unavailable).
    explicit Database(const std::string& conninfo);

    /// Runs `sql` with text parameters $1..$n (nullopt: SQL NULL). `table` names the table in
    /// messages. Throws ToolError.
    Rows query(const std::string& sql, const std::vector<std::optional<std::string>>& params, const std::string& table);

private:
    std::string conninfo_;
    std::shared_ptr<pg_conn> conn_;
};

}  // namespace idemctl
