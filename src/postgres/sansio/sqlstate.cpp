#include "sqlstate.hpp"

namespace idem::pg {

bool is_connection_sqlstate(std::string_view s) noexcept {
    // 08: connection exception; 57P01-57P05: admin/crash shutdown, cannot connect now, idle timeouts.

    // 25006: read-only transaction — we reached a standby (after a failover); reconnect to find
    // the writer (target_session_attrs=read-write in the conninfo).
    return s.starts_with("08") || s.starts_with("57P") || s == "25006";
}

std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
}

bool is_configuration_sqlstate(std::string_view s) noexcept {
    // 28: invalid authorization; 3D000 no such database; 3F000 no such schema; 42501 permission
    // denied; 42P01 / 42703 / 42704 no such table / column / object. None heals by retrying.
    return s.starts_with("28") || s == "3D000" || s == "3F000" || s == "42501" || s == "42P01" || s == "42703" ||
           s == "42704";
}

namespace {

// idem's own messages that SQLSTATE alone does not tell apart.
constexpr std::string_view kNeedsReadCommitted = "idem: generations need READ COMMITTED";
constexpr std::string_view kNoPartition = "no partition of relation";

}  // namespace

FailureKind failure_kind(std::string_view sqlstate, std::string_view message) noexcept {
    if (is_configuration_sqlstate(sqlstate)) return FailureKind::configuration;
    // The table's layout and the store's PostgresOptions::generations disagree: a plain store's
    // ON CONFLICT (scope, key) on a partitioned table (42P10), a generational store's function
    // missing on a plain table (42883).
    if (sqlstate == "42P10" || sqlstate == "42883") return FailureKind::configuration;
    // The server runs transactions above READ COMMITTED by default: a generational claim refuses.
    if (sqlstate == "0A000" && message.find(kNeedsReadCommitted) != std::string_view::npos) {
        return FailureKind::configuration;
    }
    // No generation covers the time of the claim: maintenance has fallen behind, and it heals when
    // purge_expired() creates the generation.
    if (sqlstate == "23514" && message.find(kNoPartition) != std::string_view::npos) return FailureKind::unavailable;
    // Timeouts (statement, lock), cancels, resource exhaustion, a server going away: the database
    // is there (or will be) but cannot serve us now.
    if (sqlstate == "57014" || sqlstate == "55P03" || sqlstate.starts_with("53") || is_connection_sqlstate(sqlstate)) {
        return FailureKind::unavailable;
    }
    return FailureKind::refused;
}

void throw_database_error(std::string message, const std::string& sqlstate) {
    switch (failure_kind(sqlstate, message)) {
        case FailureKind::configuration:
            if (sqlstate == "42P01") {
                message += " (create idem's table: call PostgresStore::ensure_schema())";
            } else if (sqlstate == "42P10" || sqlstate == "42883") {
                message +=
                    " (the table's layout does not match PostgresOptions::generations: call ensure_schema() with "
                    "the store's options)";
            } else if (sqlstate == "0A000") {
                message += " (set default_transaction_isolation to 'read committed' for idem's role)";
            }
            throw config_error(message, sqlstate);
        case FailureKind::unavailable:
            if (sqlstate == "23514") {
                message +=
                    " (no generation covers now: purge_expired() creates them ahead; run it more often than "
                    "generations.ahead x generations.length)";
            }
            throw store_unavailable(message, sqlstate);
        case FailureKind::refused: break;
    }
    throw database_error(message, sqlstate);
}

namespace {

// The verdict of one connection attempt (one host's part of libpq's message), or empty.
std::string_view attempt_failure_sqlstate(std::string_view message) noexcept {
    struct Pattern {
        std::string_view text, sqlstate;
    };
    static constexpr Pattern patterns[] = {
        {"password authentication failed", "28P01"},
        {"no password supplied", "28P01"},
        {"no pg_hba.conf entry", "28000"},
        {"pg_hba.conf rejects connection", "28000"},
        {"Peer authentication failed for user", "28000"},
        {"certificate authentication failed for user", "28000"},
        {"is not permitted to log in", "28000"},
        {"permission denied for database", "42501"},
        // TLS: the server's certificate does not verify (an unknown CA, expired, another host's
        // name), or the server offers no TLS where sslmode requires it. Retrying meets the same
        // certificate and the same server settings.
        {"SSL error: certificate verify failed", "28000"},
        {"does not match host name", "28000"},
        {"server does not support SSL, but SSL was required", "28000"},
        // TLS: the client's own files (sslrootcert, sslcert, sslkey) missing or unusable.
        {"could not read root certificate file", "22023"},
        {"certificate present, but not private key file", "22023"},
        {"has group or world access", "22023"},
    };
    if (message.find("root certificate file \"") != std::string_view::npos &&
        message.find("\" does not exist") != std::string_view::npos) {
        return "22023";
    }
    if (message.find("FATAL:  database \"") != std::string_view::npos &&
        message.find("\" does not exist") != std::string_view::npos) {
        return "3D000";
    }
    if (message.find("FATAL:  role \"") != std::string_view::npos &&
        message.find("\" does not exist") != std::string_view::npos) {
        return "28000";
    }
    for (const Pattern& p : patterns) {
        if (message.find(p.text) != std::string_view::npos) return p.sqlstate;
    }
    return {};
}

}  // namespace

std::string connect_failure_sqlstate(std::string_view message) noexcept {
    // libpq gives no SQLSTATE for a failed connection attempt, only the server's message. These are
    // PostgreSQL's (English) texts for the failures that no retry heals; anything else — refused,
    // timed out, starting up, too many clients, or a server speaking another language — stays an
    // outage (store_unavailable). Only verdicts the server reaches on its own count: an LDAP,
    // RADIUS, PAM, GSSAPI or ident failure reads the same whether the password was wrong or the
    // authentication service is down, so it stays an outage.
    //
    // libpq's own verdict on the conninfo, before any connection (its messages begin with it).
    static constexpr std::string_view malformed[] = {
        "invalid connection option",     "invalid integer value",
        "invalid port number",           "missing \"=\" after",
        "unterminated quoted string",    "invalid URI",
        "invalid sslmode value",         "invalid gssencmode value",
        "invalid channel_binding value", "invalid target_session_attrs value",
    };
    for (std::string_view m : malformed) {
        if (message.starts_with(m)) return "22023";  // invalid_parameter_value
    }
    // Several hosts (a Patroni pair): libpq reports one "connection to server … failed: …" per
    // host tried. Permanent only if every host's verdict is: one host that refused for good while
    // another is only restarting is an outage.
    constexpr std::string_view kAttempt = "connection to server ";
    std::string_view first;
    for (std::size_t at = message.find(kAttempt); at != std::string_view::npos;) {
        const std::size_t next = message.find(kAttempt, at + kAttempt.size());
        const std::string_view verdict = attempt_failure_sqlstate(message.substr(at, next - at));
        if (verdict.empty()) return {};
        if (first.empty()) first = verdict;
        at = next;
    }
    return std::string(first.empty() ? attempt_failure_sqlstate(message) : first);
}

void throw_connect_error(const std::string& libpq_message) {
    std::string message = "idem: cannot connect to PostgreSQL: " + trim(libpq_message);
    const std::string sqlstate = connect_failure_sqlstate(libpq_message);
    if (!sqlstate.empty()) throw config_error(message + " (a configuration error: check the conninfo)", sqlstate);
    throw store_unavailable(message);
}

}  // namespace idem::pg
