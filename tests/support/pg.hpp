// tests/support/pg.hpp — a tiny RAII libpq helper for tests (not part of idem).
//
// Tests use it to look at the database behind idem's back: count rows, create and drop tables,
// terminate backends. Every failure throws std::runtime_error with libpq's message.
#pragma once

#include "test_env.hpp"

#include <libpq-fe.h>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace idem_test {

/// A PGresult that frees itself.
class PgResult {
public:
    explicit PgResult(PGresult* result) : result_(result, &PQclear) {}

    [[nodiscard]] int rows() const { return PQntuples(result_.get()); }
    [[nodiscard]] bool is_null(int row, int col) const { return PQgetisnull(result_.get(), row, col) != 0; }
    [[nodiscard]] std::string text(int row, int col) const {
        return std::string(PQgetvalue(result_.get(), row, col),
                           static_cast<std::size_t>(PQgetlength(result_.get(), row, col)));
    }
    [[nodiscard]] long long integer(int row, int col) const { return std::stoll(text(row, col)); }
    [[nodiscard]] PGresult* get() const { return result_.get(); }

private:
    std::unique_ptr<PGresult, decltype(&PQclear)> result_;
};

/// One libpq connection (blocking, autocommit).
class PgConn {
public:
    explicit PgConn(const std::string& conninfo) : conn_(PQconnectdb(conninfo.c_str()), &PQfinish) {
        if (!conn_ || PQstatus(conn_.get()) != CONNECTION_OK) {
            throw std::runtime_error("test libpq connect failed: " +
                                     std::string(conn_ ? PQerrorMessage(conn_.get()) : "out of memory"));
        }
        // Keep test output clean of NOTICE/WARNING chatter ("table ... does not exist, skipping").
        PQsetNoticeProcessor(
            conn_.get(), [](void*, const char*) {}, nullptr);
    }

    /// Runs `sql` with text parameters $1..$n; throws unless it succeeded.
    PgResult exec(const std::string& sql, const std::vector<std::string>& params = {}) {
        std::vector<const char*> values;
        values.reserve(params.size());
        for (const auto& p : params) values.push_back(p.c_str());
        PgResult result(PQexecParams(conn_.get(), sql.c_str(), static_cast<int>(values.size()), nullptr, values.data(),
                                     nullptr, nullptr, 0));
        const auto status = PQresultStatus(result.get());
        if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
            throw std::runtime_error("test SQL failed: " + sql + ": " + PQerrorMessage(conn_.get()));
        }
        return result;
    }

    /// First column of the first row as an integer.
    long long scalar(const std::string& sql, const std::vector<std::string>& params = {}) {
        auto result = exec(sql, params);
        if (result.rows() != 1) throw std::runtime_error("test SQL returned no single row: " + sql);
        return result.integer(0, 0);
    }

    [[nodiscard]] PGconn* get() const { return conn_.get(); }

private:
    std::unique_ptr<PGconn, decltype(&PQfinish)> conn_;
};

/// Drops one of idem's tables (and everything depending on it) and its row in
/// idem_schema_version, at the end of a test. Never throws: the server may be down (disruptive
/// tests), and the throwaway cluster goes anyway.
inline void drop_idem_table(const std::string& conninfo, const std::string& table) noexcept {
    try {
        PgConn conn(conninfo);
        conn.exec("DROP TABLE IF EXISTS " + table + " CASCADE");
        conn.exec("DELETE FROM idem_schema_version WHERE table_name = $1", {table});
    } catch (...) {
    }
}

/// Drops a table (and everything depending on it) when it goes out of scope.
class DropTable {
public:
    DropTable(std::string conninfo, std::string table) : conninfo_(std::move(conninfo)), table_(std::move(table)) {}
    ~DropTable() {
        try {
            PgConn(conninfo_).exec("DROP TABLE IF EXISTS " + table_ + " CASCADE");
        } catch (...) {  // the server may be down (disruptive tests): leave it to the throwaway cluster
        }
    }
    DropTable(const DropTable&) = delete;
    DropTable& operator=(const DropTable&) = delete;

private:
    std::string conninfo_;
    std::string table_;
};

}  // namespace idem_test
