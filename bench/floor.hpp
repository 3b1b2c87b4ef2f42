// The floor: what idem's statements cost with no library in between.
//
// One FloorClient is one libpq connection, in pipeline mode, with the SAME three statements
// prepared under the same names and parameter types as PostgresStore (the SQL text is a copy of
// src/postgres/sql.cpp; bench/main.cpp checks at start-up that the copy still matches), binary
// parameters and results. A call sends exactly what the library sends:
//   claim:  INSERT … ON CONFLICT DO NOTHING RETURNING | Sync | SELECT … | Sync   (one round trip)
//   save:   UPDATE … | Sync                                                      (one round trip)
// Not thread-safe: one client per thread.
#pragma once

#include <libpq-fe.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace bench {

/// The statements' SQL for `quoted_table` (already quoted, as PostgresStore quotes it).
struct FloorSql {
    std::string claim;   ///< idem_claim: $1 scope, $2 key, $3 fingerprint, $4 alg, $5 fence, $6 lease ms, $7 retention s
    std::string select;  ///< idem_select: $1 scope, $2 key
    std::string save;    ///< idem_save: $1 scope, $2 key, $3 fence, $4 result
    std::vector<Oid> claim_types, select_types, save_types;  ///< as PostgresStore prepares them
    std::string claim_name, select_name, save_name;          ///< idem_claim_<fnv1a(table)>, ...
};
FloorSql floor_sql(const std::string& quoted_table);

/// `"name"` — how PostgresStore quotes a plain table name.
std::string quote_ident(const std::string& name);

/// Session settings PostgresStore puts in `options` (timeouts); the floor uses the same.
std::string idem_session_options();

/// libpq's blocking PQconnectdbParams with the user's conninfo expanded from dbname; throws.
PGconn* connect_or_throw(const std::string& conninfo, const char* application_name, const std::string& options);

class FloorClient {
public:
    enum class Answer { claimed, completed, in_progress, other };

    FloorClient(const std::string& conninfo, const std::string& table);
    ~FloorClient();
    FloorClient(const FloorClient&) = delete;
    FloorClient& operator=(const FloorClient&) = delete;

    /// The claim pipeline: one round trip. Throws std::runtime_error on any failure.
    Answer claim(std::string_view scope, std::string_view key, std::string_view fingerprint, std::int16_t alg,
                 std::int64_t fence, std::int64_t lease_ms, std::int64_t retention_s);
    /// The save UPDATE: one round trip; true when the fence still owned the key.
    bool save(std::string_view scope, std::string_view key, std::int64_t fence, std::string_view result);

    [[nodiscard]] std::uint64_t round_trips() const noexcept { return round_trips_; }

private:
    PGresult* next();  // PQgetResult, never NULL here (throws)
    void expect_end();
    void expect_end_and_sync();
    [[noreturn]] void fail(const std::string& what);

    PGconn* conn_;
    FloorSql sql_;
    std::uint64_t round_trips_ = 0;
};

}  // namespace bench
