// tools/idemctl/cli.hpp — idemctl's command line: the exit codes, the parsed options, the help
// text (CLI11 parses the command line and writes the help).
//
// Every option may come before or after the command. Parsing never touches the database: a bad
// command line is exit 2 (Exit::usage) before any connection is made.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace idemctl {

/// idemctl's exit codes (also in `idemctl --help` and docs/reliability.md).
enum class Exit : int {
    ok = 0,
    not_found = 1,    ///< no record for the key
    usage = 2,        ///< bad command line or input (invalid scope/key, duration, fence), or a
                      ///< release that was not confirmed
    unavailable = 3,  ///< the database cannot be reached (or timed out): try again
    fence = 4,        ///< release: the fence does not own the key (lease_lost); nothing changed
    config = 5,       ///< a permanent misconfiguration: no such table/database/role, failed
                      ///< authentication, missing privilege
    failure = 6,      ///< anything else: the database refused a statement, a corrupt record
};

/// A failure idemctl reports: the message (without "idemctl: "), the exit code it ends with and,
/// when the database refused a statement, PostgreSQL's SQLSTATE.
class ToolError : public std::runtime_error {
public:
    ToolError(Exit exit_code, const std::string& message, std::string sqlstate = {})
        : std::runtime_error(message), exit_(exit_code), sqlstate_(std::move(sqlstate)) {}
    [[nodiscard]] Exit exit_code() const noexcept { return exit_; }
    /// PostgreSQL's five-character code, or "" when no statement was refused.
    [[nodiscard]] const std::string& sqlstate() const noexcept { return sqlstate_; }

private:
    Exit exit_;
    std::string sqlstate_;
};

/// Everything the command line said. Options a command does not take are refused by parse().
struct Options {
    std::string command;                 ///< show, list, stats, purge, release, reconcile-report
    std::vector<std::string> arguments;  ///< the command's positional arguments (SCOPE KEY)
    /// --help / --help-all (or a command's --help): the text to print; nothing else is set then.
    std::optional<std::string> help;
    bool json = false;
    bool yes = false;
    bool force = false;  // release: also while the key's lease has not passed
    bool exact = false;  ///< show --exact: never look up the key's percent-decoded form
    /// --db; unset: libpq's environment (PGHOST, PGPORT, PGDATABASE, PGUSER, PGPASSWORD, ...).
    std::string conninfo;
    std::string table;  ///< --table; default: the library's default table
    /// --keyring: a keyring file (idem::Keyring::parse's format) to open sealed results with.
    std::string keyring;
    /// --seal-context: the deployment sealed results are bound to (SealingOptions::context); empty:
    /// the table's name, as the store binds them by default.
    std::string seal_context;
    std::optional<std::int64_t> fence;        ///< release --fence
    std::optional<std::string> scope;         ///< --scope (exact)
    std::optional<std::string> scope_prefix;  ///< --scope-prefix (literal)
    std::optional<std::string> state;         ///< list --state: in_progress, completed, expired
    bool stale = false;                       ///< list --stale
    bool wide = false;  ///< list / reconcile-report --wide: scopes, keys and phases never cut short
    std::optional<std::chrono::seconds> older_than;  ///< list --older-than (by created_at)
    std::size_t limit = 0;                           ///< list / reconcile-report --limit (0: the default)
    std::size_t batch = 1000;                        ///< purge --batch
};

/// Parses argv. Throws ToolError(Exit::usage) with a message naming the offending argument.
[[nodiscard]] Options parse(int argc, const char* const* argv);

/// A duration such as 90s, 10m, 2h or 3d (a positive whole number and one unit). Throws
/// ToolError(Exit::usage).
[[nodiscard]] std::chrono::seconds parse_duration(std::string_view text);

}  // namespace idemctl
