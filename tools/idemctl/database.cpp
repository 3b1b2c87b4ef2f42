// tools/idemctl/database.cpp — idemctl's libpq session (see database.hpp).
#include "database.hpp"

#include "cli.hpp"
#include "conninfo.hpp"
#include "failure.hpp"

#include <fmt/format.h>
#include <libpq-fe.h>
#include <array>
#include <cctype>
#include <string_view>

namespace idemctl {
namespace {

std::string trimmed(const char* message) {
    std::string s = message ? message : "";
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
}

// PostgreSQL's and libpq's (English) words for a connection refused for good — a missing or wrong
// password, no such role or database, a bad connection option — matched in any case; anything
// else (no server, a timeout) may heal.
bool permanent_connect_failure(std::string_view message) {
    std::string lower(message);
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    constexpr std::array<std::string_view, 7> kPermanent{
        "authentication failed", "does not exist", "no pg_hba.conf entry", "permission denied", "no password supplied",
        "for connection option", "invalid"};
    for (const auto m : kPermanent) {
        if (lower.find(m) != std::string::npos) return true;
    }
    return false;
}

}  // namespace

Rows::Rows(pg_result* result) : result_(result, &PQclear) {}

int Rows::count() const noexcept { return PQntuples(result_.get()); }

bool Rows::is_null(int row, int column) const noexcept { return PQgetisnull(result_.get(), row, column) != 0; }

std::string Rows::text(int row, int column) const {
    return std::string(PQgetvalue(result_.get(), row, column),
                       static_cast<std::size_t>(PQgetlength(result_.get(), row, column)));
}

std::optional<std::string> Rows::optional_text(int row, int column) const {
    if (is_null(row, column)) return std::nullopt;
    return text(row, column);
}

std::int64_t Rows::integer(int row, int column) const {
    return is_null(row, column) ? 0 : std::stoll(text(row, column));
}

bool Rows::boolean(int row, int column) const noexcept {
    return !is_null(row, column) && PQgetvalue(result_.get(), row, column)[0] == 't';
}

Database::Database(const std::string& conninfo) : conninfo_(conninfo) {
    require_parsable(conninfo);
    // The conninfo comes last and is expanded: what it says takes precedence over these defaults.
    const std::array<const char*, 4> keys{"connect_timeout", "application_name", "dbname", nullptr};
    const std::array<const char*, 4> values{"5", "idemctl", conninfo.c_str(), nullptr};
    conn_.reset(PQconnectdbParams(keys.data(), values.data(), 1), &PQfinish);
    if (!conn_) throw ToolError(Exit::unavailable, "out of memory creating a PostgreSQL connection");
    if (PQstatus(conn_.get()) != CONNECTION_OK) {
        const std::string message = trimmed(PQerrorMessage(conn_.get()));
        const bool permanent = permanent_connect_failure(message);
        throw ToolError(
            permanent ? Exit::config : Exit::unavailable,
            fmt::format("{} ({}): cannot connect to PostgreSQL: {}",
                        permanent ? "configuration error" : "database unavailable", redacted(conninfo_), message));
    }
    PQsetNoticeProcessor(
        conn_.get(), [](void*, const char*) {}, nullptr);
}

Rows Database::query(const std::string& sql, const std::vector<std::optional<std::string>>& params,
                     const std::string& table) {
    std::vector<const char*> values;
    values.reserve(params.size());
    for (const auto& p : params) values.push_back(p ? p->c_str() : nullptr);
    PGresult* result = PQexecParams(conn_.get(), sql.c_str(), static_cast<int>(values.size()), nullptr, values.data(),
                                    nullptr, nullptr, 0);
    const ExecStatusType status = result ? PQresultStatus(result) : PGRES_FATAL_ERROR;
    if (status == PGRES_TUPLES_OK || status == PGRES_COMMAND_OK) return Rows(result);
    const char* field = result ? PQresultErrorField(result, PG_DIAG_SQLSTATE) : nullptr;
    const std::string sqlstate = field ? field : "";
    const std::string message = trimmed(result ? PQresultErrorMessage(result) : PQerrorMessage(conn_.get()));
    PQclear(result);
    if (sqlstate == "42P01") {
        throw ToolError(Exit::config,
                        fmt::format("table {} does not exist (create it: PostgresStore::ensure_schema(), "
                                    "or docs/schema.sql; or name another with --table)",
                                    table),
                        sqlstate);
    }
    const Exit exit =
        sqlstate.empty() || PQstatus(conn_.get()) != CONNECTION_OK ? Exit::unavailable : exit_for(sqlstate, message);
    if (exit == Exit::config) {
        throw ToolError(Exit::config, fmt::format("configuration error ({}): {}", table, message), sqlstate);
    }
    if (exit == Exit::unavailable) {
        throw ToolError(Exit::unavailable, fmt::format("database unavailable ({}): {}", redacted(conninfo_), message),
                        sqlstate);
    }
    throw ToolError(Exit::failure, fmt::format("the database refused a statement ({}): {}", sqlstate, message),
                    sqlstate);
}

}  // namespace idemctl
