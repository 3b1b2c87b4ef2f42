// The floor: what idem's statements cost with no library in between.
//
// One FloorClient is one libpq connection, in pipeline mode, with the SAME three statements
// prepared under the same names and parameter types as PostgresStore (the SQL text is a copy of
// src/postgres/sql.cpp; bench/postgres/main.cpp checks at start-up that the copy still matches), binary
// parameters and results. A call sends exactly what the library sends:
//   claim:  INSERT … ON CONFLICT DO NOTHING RETURNING | Sync | SELECT … | Sync   (one round trip)
//   save:   UPDATE … | Sync                                                      (one round trip)
// Not thread-safe: one client per thread.
#pragma once

#include <libpq-fe.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace bench {

/// The statements' SQL for `quoted_table` (already quoted, as PostgresStore quotes it).
struct FloorSql {
    std::string claim;  ///< idem_claim: $1 scope, $2 key, $3 fingerprint, $4 alg, $5 fence, $6 lease ms, $7 retention s
    std::string select;                                      ///< idem_select: $1 scope, $2 key
    std::string save;                                        ///< idem_save: $1 scope, $2 key, $3 fence, $4 result
    std::vector<Oid> claim_types, select_types, save_types;  ///< as PostgresStore prepares them
    std::string claim_name, select_name, save_name;          ///< idem_claim_<fnv1a(table)>, ...
    /// The batch statements (claim_batch / save_batch): arrays in, one row per key out.
    std::string claim_batch, select_batch, save_batch;
    std::vector<Oid> claim_batch_types, select_batch_types, save_batch_types;
    std::string claim_batch_name, select_batch_name, save_batch_name;
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

    PGconn* conn_ = nullptr;
    FloorSql sql_;
    std::uint64_t round_trips_ = 0;
};

/// The second floor, "ideal grouping": one connection that issues the library's batch statements
/// by hand for a whole round of calls at once, as perfect group commit would:
///   claim: INSERT … SELECT FROM unnest(arrays) ON CONFLICT DO NOTHING RETURNING fence | Sync |
///          SELECT … FROM unnest(scopes, keys) JOIN table | Sync               (one round trip)
///   save:  UPDATE … FROM unnest(arrays) … RETURNING fence, waiters | Sync    (one round trip)
/// Keys sorted, as PostgresStore sorts a batch. Not thread-safe.
class IdealClient {
public:
    struct Claimed {
        std::size_t inserted = 0, completed = 0, in_progress = 0;
    };

    IdealClient(const std::string& conninfo, const std::string& table);
    ~IdealClient();
    IdealClient(const IdealClient&) = delete;
    IdealClient& operator=(const IdealClient&) = delete;

    /// Claims every key (distinct, sorted) with one fingerprint; fences[i] goes with keys[i].
    Claimed claim(std::string_view scope, const std::vector<std::string>& keys, std::string_view fingerprint,
                  std::int16_t alg, const std::vector<std::int64_t>& fences, std::int64_t lease_ms,
                  std::int64_t retention_s);
    /// Saves `result` for every key its fence still owns; returns how many were saved.
    std::size_t save(std::string_view scope, const std::vector<std::string>& keys,
                     const std::vector<std::int64_t>& fences, std::string_view result);

    [[nodiscard]] std::uint64_t round_trips() const noexcept { return round_trips_; }

private:
    PGresult* next();
    [[noreturn]] void fail(const std::string& what);

    PGconn* conn_ = nullptr;
    FloorSql sql_;
    std::uint64_t round_trips_ = 0;
};

}  // namespace bench
