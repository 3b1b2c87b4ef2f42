// A plain connection of its own for DDL, maintenance and catalog questions (internal): used by
// PostgresStore's administration (admin.cpp) and the maintenance of generations (generations.cpp).
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "connect.hpp"
#include "connection.hpp"
#include "idem/errors.hpp"
#include "sansio/admin_sql.hpp"
#include "sansio/sqlstate.hpp"

namespace idem::pg {

/// A plain (non-pipelined) connection: simple-protocol statements, one at a time, each failure a
/// typed idem error. Not thread-safe.
class AdminSession {
public:
    AdminSession(const pg::ConnectSettings& settings, const char* what) : what_(what) {
        const std::string timeout =
            std::to_string(std::max<long long>(2, (settings.connect_timeout.count() + 999) / 1000));
        const char* keys[] = {"dbname", "connect_timeout", "application_name", nullptr};
        const char* values[] = {settings.conninfo.c_str(), timeout.c_str(), settings.application_name.c_str(), nullptr};
        conn_.reset(PQconnectdbParams(keys, values, 1));
        if (!conn_)
            throw store_unavailable(std::string("idem: ") + what + ": out of memory creating a PostgreSQL connection");
        if (PQstatus(conn_.get()) != CONNECTION_OK) pg::throw_connect_error(PQerrorMessage(conn_.get()));
        pg::quiet_notices(conn_.get());
    }

    /// Runs one statement (text parameters $1..$n); throws config_error / store_unavailable /
    /// database_error as the SQLSTATE says.
    pg::ResultPtr exec(const std::string& sql, const std::vector<std::string>& params = {}) {
        std::vector<const char*> args;
        for (const auto& p : params) args.push_back(p.c_str());
        pg::ResultPtr r(params.empty() ? PQexec(conn_.get(), sql.c_str())
                                       : PQexecParams(conn_.get(), sql.c_str(), static_cast<int>(args.size()), nullptr,
                                                      args.data(), nullptr, nullptr, 0));
        const auto status = r ? PQresultStatus(r.get()) : PGRES_FATAL_ERROR;
        if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
            const char* state = r ? PQresultErrorField(r.get(), PG_DIAG_SQLSTATE) : nullptr;
            const std::string sqlstate = state ? state : "";
            std::string msg = std::string("idem: ") + what_ + " failed: " + PQerrorMessage(conn_.get());
            while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
            if (sqlstate.empty()) throw store_unavailable(msg);  // the connection failed
            pg::throw_database_error(std::move(msg), sqlstate);
        }
        return r;
    }

    /// The first column of the first row, or nullopt for no row or NULL.
    std::optional<std::string> value(const std::string& sql, const std::vector<std::string>& params = {}) {
        auto r = exec(sql, params);
        if (PQntuples(r.get()) < 1 || PQgetisnull(r.get(), 0, 0)) return std::nullopt;
        return std::string(PQgetvalue(r.get(), 0, 0));
    }

    /// The citus extension's version in this database, or nullopt.
    std::optional<std::string> citus_version() { return value(kCitusVersionSql); }
    /// On a Citus node: whether it is a worker (its group is not the coordinator's, 0).
    bool citus_worker() { return value(kCitusWorkerSql) == "t"; }
    /// On a Citus node: the table's distribution column, or nullopt (not distributed, or a
    /// reference / single-shard table, whose partkey is NULL).
    std::optional<std::string> distribution_column(const std::string& qualified) {
        return value(kDistributionColumnSql, {qualified});
    }
    void refuse_worker() {
        if (citus_version() && citus_worker()) {
            throw config_error(std::string("idem: ") + what_ +
                               ": connected to a Citus worker node; run it against the coordinator (DDL on a "
                               "worker would create tables that only that node sees)");
        }
    }

private:
    const char* what_;
    pg::ConnPtr conn_;
};

}  // namespace idem::pg
