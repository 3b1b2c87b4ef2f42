#include "connect.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "sansio/sqlstate.hpp"

namespace idem::pg {

void quiet_notices(PGconn* conn) noexcept {
    PQsetNoticeProcessor(
        conn, [](void*, const char*) {}, nullptr);
}

namespace {

// The user's own `options`: the conninfo's, else libpq's default (PGOPTIONS, or the options of the
// PGSERVICE entry). Passing `options` as a keyword replaces those defaults, hence the lookup. A
// service named inside the conninfo is not read here (no libpq call does): PGOPTIONS stands in for
// it, which is what libpq uses when that entry sets no options; its own options are the
// conninfo's to repeat.
std::string user_options(const std::string& conninfo) {
    std::string user;
    bool given = false, service = false;
    if (PQconninfoOption* opts = PQconninfoParse(conninfo.c_str(), nullptr)) {
        for (PQconninfoOption* o = opts; o->keyword != nullptr; ++o) {
            if (o->val == nullptr) continue;
            if (std::strcmp(o->keyword, "options") == 0) {
                user = o->val;
                given = true;
            } else if (std::strcmp(o->keyword, "service") == 0) {
                service = true;
            }
        }
        PQconninfoFree(opts);
    }
    if (given) return user;
    if (service) {
        const char* env = std::getenv("PGOPTIONS");
        return env != nullptr ? env : "";
    }
    if (PQconninfoOption* defaults = PQconndefaults()) {
        for (PQconninfoOption* o = defaults; o->keyword != nullptr; ++o) {
            if (std::strcmp(o->keyword, "options") == 0 && o->val != nullptr) user = o->val;
        }
        PQconninfoFree(defaults);
    }
    return user;
}

// Merges our session settings after the user's own options (later -c settings win).
std::string session_options(const ConnectSettings& settings) {
    const std::string user = user_options(settings.conninfo);
    // enable_seqscan=off: every statement idem prepares is a primary-key lookup. A table ANALYZEd
    // while (nearly) empty makes the cached generic plans of those lookups sequential scans, and
    // they stay cached while the table grows — until the next ANALYZE, each claim reads the whole
    // table. Off, the planner takes
    // the index whatever the statistics say. list_stale, which must scan, turns it back on.
    std::string ours =
        "-c enable_seqscan=off -c statement_timeout=" + std::to_string(settings.statement_timeout.count()) +
        " -c lock_timeout=" + std::to_string(settings.lock_timeout.count()) +
        // a claim never runs inside an open transaction; this is a safety net
        " -c idle_in_transaction_session_timeout=" +
        std::to_string(std::max<long long>(settings.statement_timeout.count() * 2, 1000));
    return user.empty() ? ours : user + " " + ours;
}

}  // namespace

ConnectParams::ConnectParams(const ConnectSettings& settings)
    : timeout_(std::to_string(
          std::max<long long>(2, (settings.connect_timeout.count() + 999) / 1000))),  // libpq: seconds, min 2
      options_(settings.session_options ? session_options(settings) : std::string()) {
    // The user's conninfo is expanded from "dbname"; the keywords after it take precedence.
    keys_ = {"dbname", "connect_timeout", "application_name", settings.session_options ? "options" : nullptr, nullptr};
    values_ = {settings.conninfo.c_str(), timeout_.c_str(), settings.application_name.c_str(), options_.c_str(),
               nullptr};
}

void configure_connected(PGconn* conn) {
    quiet_notices(conn);
    if (PQsetnonblocking(conn, 1) != 0 || PQenterPipelineMode(conn) != 1) {
        throw store_unavailable("idem: cannot enter pipeline mode: " + trim(PQerrorMessage(conn)));
    }
}

void check_prepared(const PGresult* r, const StatementDef& def) {
    if (PQresultStatus(r) == PGRES_COMMAND_OK) return;
    const char* field = PQresultErrorField(r, PG_DIAG_SQLSTATE);
    const std::string state = field ? field : "";
    // The backend went away while we prepared (terminated, shutting down): a broken
    // connection, retried on a fresh one like any other — not a statement's error.
    if (is_connection_sqlstate(state)) {
        throw connection_broken(
            "idem: PostgreSQL closed the connection while preparing: " + trim(PQresultErrorMessage(r)), state);
    }
    // (a missing table is a config_error that says to run ensure_schema(); a lock or
    // statement timeout while preparing, the table being locked, is unavailable now)
    throw_database_error("idem: cannot prepare " + def.name + ": " + trim(PQresultErrorMessage(r)), state);
}

}  // namespace idem::pg
