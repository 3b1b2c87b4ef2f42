#include "floor.hpp"

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <stdexcept>

namespace bench {
namespace {

constexpr Oid kInt2 = 21, kInt8 = 20, kText = 25, kBytea = 17;

std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
}

template <std::size_t N>
void put_be(std::array<char, N>& buf, std::uint64_t v) {
    for (std::size_t i = N; i-- > 0; v >>= 8) buf[i] = static_cast<char>(v & 0xFF);
}

}  // namespace

std::string quote_ident(const std::string& name) { return "\"" + name + "\""; }

// Copied from src/postgres/sql.cpp (statements()); main.cpp compares them with the library's at start.
FloorSql floor_sql(const std::string& T) {
    FloorSql s;
    s.claim = fmt::format("INSERT INTO {} (scope, key, state, fingerprint, fingerprint_alg, fence, "
                          "lease_until, expires_at) VALUES ($1, $2, 'in_progress', $3, $4, $5, "
                          "now() + $6 * interval '1 millisecond', now() + $7 * interval '1 second') "
                          "ON CONFLICT (scope, key) DO NOTHING RETURNING fence",
                          T);
    s.select = fmt::format("SELECT state, fingerprint, fingerprint_alg, fence, attempt, result, created_at, "
                           "lease_until, expires_at, phase, phase_data, "
                           "(state = 'in_progress' AND lease_until < now()), "
                           "(state = 'completed' AND expires_at < now()), now() FROM {} WHERE scope = $1 AND key = $2",
                           T);
    s.save = fmt::format("UPDATE {} SET state = 'completed', result = $4, completed_at = now() "
                         "WHERE scope = $1 AND key = $2 AND fence = $3 AND state = 'in_progress' "
                         "RETURNING waiters",
                         T);
    // Statement names as PostgresStore makes them: unique per table (FNV-1a of the quoted name).
    std::uint32_t h = 2166136261u;
    for (const unsigned char c : T) h = (h ^ c) * 16777619u;
    const std::string suffix = fmt::format("_{:08x}", h);
    s.claim_name = "idem_claim" + suffix;
    s.select_name = "idem_select" + suffix;
    s.save_name = "idem_save" + suffix;
    s.claim_types = {kText, kText, kBytea, kInt2, kInt8, kInt8, kInt8};
    s.select_types = {kText, kText};
    s.save_types = {kText, kText, kInt8, kBytea};
    return s;
}

// PostgresStore's defaults: statement_timeout 5 s, lock_timeout 1 s, idle-in-transaction 2 × 5 s.
std::string idem_session_options() {
    return "-c enable_seqscan=off -c statement_timeout=5000 -c lock_timeout=1000 -c idle_in_transaction_session_timeout=10000";
}

PGconn* connect_or_throw(const std::string& conninfo, const char* application_name, const std::string& options) {
    const char* keys[] = {"dbname", "connect_timeout", "application_name", "options", nullptr};
    const char* values[] = {conninfo.c_str(), "5", application_name, options.empty() ? nullptr : options.c_str(),
                            nullptr};
    PGconn* conn = PQconnectdbParams(keys, values, 1);
    if (conn == nullptr) throw std::runtime_error("out of memory connecting to PostgreSQL");
    if (PQstatus(conn) != CONNECTION_OK) {
        std::string msg = trim(PQerrorMessage(conn));
        PQfinish(conn);
        throw std::runtime_error("cannot connect to PostgreSQL: " + msg);
    }
    PQsetNoticeProcessor(conn, [](void*, const char*) {}, nullptr);
    return conn;
}

FloorClient::FloorClient(const std::string& conninfo, const std::string& table)
    : conn_(connect_or_throw(conninfo, "idem-bench-floor", idem_session_options())),
      sql_(floor_sql(quote_ident(table))) {
    const FloorSql& sql = sql_;
    const auto prepare = [&](const std::string& name, const std::string& text, const std::vector<Oid>& types) {
        PGresult* r = PQprepare(conn_, name.c_str(), text.c_str(), static_cast<int>(types.size()), types.data());
        const bool ok = r != nullptr && PQresultStatus(r) == PGRES_COMMAND_OK;
        PQclear(r);
        if (!ok) fail("prepare " + name);
    };
    try {
        prepare(sql.claim_name, sql.claim, sql.claim_types);
        prepare(sql.select_name, sql.select, sql.select_types);
        prepare(sql.save_name, sql.save, sql.save_types);
        if (PQenterPipelineMode(conn_) != 1) fail("enter pipeline mode");
    } catch (...) {
        PQfinish(conn_);
        throw;
    }
}

FloorClient::~FloorClient() { PQfinish(conn_); }

void FloorClient::fail(const std::string& what) {
    throw std::runtime_error("floor: " + what + ": " + trim(PQerrorMessage(conn_)));
}

PGresult* FloorClient::next() {
    PGresult* r = PQgetResult(conn_);
    if (r == nullptr) fail("missing result");
    return r;
}

void FloorClient::expect_end() {
    if (PGresult* extra = PQgetResult(conn_)) {
        PQclear(extra);
        fail("unexpected extra result");
    }
}

void FloorClient::expect_end_and_sync() {
    expect_end();
    PGresult* sync = next();
    const bool ok = PQresultStatus(sync) == PGRES_PIPELINE_SYNC;
    PQclear(sync);
    if (!ok) fail("pipeline out of sync");
}

FloorClient::Answer FloorClient::claim(std::string_view scope, std::string_view key, std::string_view fingerprint,
                                       std::int16_t alg, std::int64_t fence, std::int64_t lease_ms,
                                       std::int64_t retention_s) {
    std::array<char, 2> alg_buf{};
    std::array<char, 8> fence_buf{}, lease_buf{}, retention_buf{};
    put_be(alg_buf, static_cast<std::uint16_t>(alg));
    put_be(fence_buf, static_cast<std::uint64_t>(fence));
    put_be(lease_buf, static_cast<std::uint64_t>(lease_ms));
    put_be(retention_buf, static_cast<std::uint64_t>(retention_s));
    const char* ins_values[] = {scope.data(),    key.data(),       fingerprint.data(),   alg_buf.data(),
                                fence_buf.data(), lease_buf.data(), retention_buf.data()};
    const int ins_lengths[] = {static_cast<int>(scope.size()), static_cast<int>(key.size()),
                               static_cast<int>(fingerprint.size()), 2, 8, 8, 8};
    const int formats[] = {1, 1, 1, 1, 1, 1, 1};
    const char* sel_values[] = {scope.data(), key.data()};
    const int sel_lengths[] = {static_cast<int>(scope.size()), static_cast<int>(key.size())};

    // The library's claim shape: [INSERT, SELECT | Sync], one transaction, one round trip.
    if (PQsendQueryPrepared(conn_, sql_.claim_name.c_str(), 7, ins_values, ins_lengths, formats, 1) != 1) fail("send claim");
    if (PQsendQueryPrepared(conn_, sql_.select_name.c_str(), 2, sel_values, sel_lengths, formats, 1) != 1) fail("send select");
    if (PQpipelineSync(conn_) != 1) fail("sync");  // flushes: the whole claim leaves in one go
    ++round_trips_;

    PGresult* ins = next();
    if (PQresultStatus(ins) != PGRES_TUPLES_OK) {
        const std::string msg = PQresultErrorMessage(ins);
        PQclear(ins);
        throw std::runtime_error("floor: claim failed: " + trim(msg));
    }
    const bool inserted = PQntuples(ins) == 1;
    PQclear(ins);
    expect_end();  // the SELECT follows in the same segment

    PGresult* sel = next();
    Answer answer = Answer::other;
    if (PQresultStatus(sel) == PGRES_TUPLES_OK && PQntuples(sel) == 1) {
        const std::string_view state(PQgetvalue(sel, 0, 0), static_cast<std::size_t>(PQgetlength(sel, 0, 0)));
        if (inserted) {
            answer = Answer::claimed;
        } else if (state == "completed") {
            answer = Answer::completed;
        } else if (state == "in_progress") {
            answer = Answer::in_progress;
        }
    }
    PQclear(sel);
    expect_end_and_sync();
    return answer;
}

bool FloorClient::save(std::string_view scope, std::string_view key, std::int64_t fence, std::string_view result) {
    std::array<char, 8> fence_buf{};
    put_be(fence_buf, static_cast<std::uint64_t>(fence));
    const char* values[] = {scope.data(), key.data(), fence_buf.data(), result.data()};
    const int lengths[] = {static_cast<int>(scope.size()), static_cast<int>(key.size()), 8,
                           static_cast<int>(result.size())};
    const int formats[] = {1, 1, 1, 1};
    if (PQsendQueryPrepared(conn_, sql_.save_name.c_str(), 4, values, lengths, formats, 1) != 1) fail("send save");
    if (PQpipelineSync(conn_) != 1) fail("sync");
    ++round_trips_;
    PGresult* r = next();
    if (PQresultStatus(r) != PGRES_TUPLES_OK) {
        const std::string msg = PQresultErrorMessage(r);
        PQclear(r);
        throw std::runtime_error("floor: save failed: " + trim(msg));
    }
    const bool saved = PQntuples(r) == 1;
    PQclear(r);
    expect_end_and_sync();
    return saved;
}

}  // namespace bench
