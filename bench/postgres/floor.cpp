#include "floor.hpp"

#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>

namespace bench {
namespace {

constexpr Oid kInt2 = 21, kInt8 = 20, kText = 25, kBytea = 17;
constexpr Oid kInt2Array = 1005, kInt8Array = 1016, kTextArray = 1009, kByteaArray = 1001;

std::string trim(std::string s) {
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    return s;
}

template <std::size_t N>
void put_be(std::array<char, N>& buf, std::uint64_t v) {
    for (std::size_t i = N; i-- > 0; v >>= 8) buf[i] = static_cast<char>(v & 0xFF);
}

// A one-dimensional array without NULLs in PostgreSQL's binary format: ndim, has-null flag, element
// type, then (size, lower bound) and each element as length + bytes.
class BinaryArray {
public:
    BinaryArray(Oid element, std::size_t n) {
        put32(1);
        put32(0);
        put32(element);
        put32(static_cast<std::uint32_t>(n));
        put32(1);
    }
    void add(std::string_view v) {
        put32(static_cast<std::uint32_t>(v.size()));
        data_.append(v);
    }
    void add_int(std::uint64_t v, int width) {
        put32(static_cast<std::uint32_t>(width));
        for (int i = width; i-- > 0;) data_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    }
    [[nodiscard]] const std::string& bytes() const { return data_; }

private:
    void put32(std::uint32_t v) {
        for (int i = 4; i-- > 0;) data_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    }
    std::string data_;
};

}  // namespace

std::string quote_ident(const std::string& name) { return "\"" + name + "\""; }

// Copied from src/postgres/sql.cpp (statements()); main.cpp compares them with the library's at start.
FloorSql floor_sql(const std::string& T) {
    FloorSql s;
    s.claim = fmt::format(
        "INSERT INTO {} (scope, key, state, fingerprint, fingerprint_alg, fence, "
        "lease_until, expires_at) VALUES ($1, $2, 'in_progress', $3, $4, $5, "
        "clock_timestamp() + $6 * interval '1 millisecond', now() + $7 * interval '1 second') "
        "ON CONFLICT (scope, key) DO NOTHING RETURNING fence",
        T);
    s.select = fmt::format(
        "SELECT state, fingerprint, fingerprint_alg, fence, attempt, result, created_at, "
        "lease_until, expires_at, phase, phase_data, "
        "(state = 'in_progress' AND lease_until < now()), "
        "(state = 'completed' AND expires_at < now()), now() FROM {} WHERE scope = $1 AND key = $2",
        T);
    s.save = fmt::format(
        "UPDATE {} SET state = 'completed', result = $4, completed_at = now() "
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
    s.claim_batch = fmt::format(
        "INSERT INTO {} (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, "
        "expires_at) SELECT u.s, u.k, 'in_progress', u.f, u.a, u.fe, "
        "clock_timestamp() + $6 * interval '1 millisecond', now() + $7 * interval '1 second' "
        "FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int2[], $5::int8[]) AS u(s, k, f, a, fe) "
        "ON CONFLICT (scope, key) DO NOTHING RETURNING fence",
        T);
    s.select_batch = fmt::format(
        "SELECT state, fingerprint, fingerprint_alg, fence, attempt, result, created_at, "
        "lease_until, expires_at, phase, phase_data, "
        "(state = 'in_progress' AND lease_until < now()), "
        "(state = 'completed' AND expires_at < now()), now(), t.scope, t.key "
        "FROM unnest($1::text[], $2::text[]) AS u(s, k) "
        "JOIN {} AS t ON t.scope = u.s AND t.key = u.k",
        T);
    s.save_batch = fmt::format(
        "UPDATE {} AS t SET state = 'completed', result = u.r, completed_at = now() "
        "FROM unnest($1::text[], $2::text[], $3::int8[], $4::bytea[]) AS u(s, k, f, r) "
        "WHERE t.scope = u.s AND t.key = u.k AND t.fence = u.f AND t.state = 'in_progress' "
        "RETURNING t.fence, t.waiters",
        T);
    s.claim_batch_name = "idem_claim_batch" + suffix;
    s.select_batch_name = "idem_select_batch" + suffix;
    s.save_batch_name = "idem_save_batch" + suffix;
    s.claim_batch_types = {kTextArray, kTextArray, kByteaArray, kInt2Array, kInt8Array, kInt8, kInt8};
    s.select_batch_types = {kTextArray, kTextArray};
    s.save_batch_types = {kTextArray, kTextArray, kInt8Array, kByteaArray};
    return s;
}

// PostgresStore's defaults: statement_timeout 5 s, lock_timeout 1 s, idle-in-transaction 2 × 5 s.
std::string idem_session_options() {
    return "-c enable_seqscan=off -c statement_timeout=5000 -c lock_timeout=1000 -c "
           "idle_in_transaction_session_timeout=10000";
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
    PQsetNoticeProcessor(
        conn, [](void*, const char*) {}, nullptr);
    return conn;
}

namespace {

struct Statement {
    const std::string& name;
    const std::string& sql;
    const std::vector<Oid>& types;
};

// A connection with `statements` prepared, in pipeline mode; throws (and closes it) on failure.
PGconn* connect_prepared(const std::string& conninfo, const char* application_name,
                         std::initializer_list<Statement> statements) {
    PGconn* conn = connect_or_throw(conninfo, application_name, idem_session_options());
    std::string error;
    for (const Statement& st : statements) {
        PGresult* r =
            PQprepare(conn, st.name.c_str(), st.sql.c_str(), static_cast<int>(st.types.size()), st.types.data());
        const bool ok = r != nullptr && PQresultStatus(r) == PGRES_COMMAND_OK;
        PQclear(r);
        if (!ok) {
            error = "prepare " + st.name;
            break;
        }
    }
    if (error.empty() && PQenterPipelineMode(conn) != 1) error = "enter pipeline mode";
    if (!error.empty()) {
        const std::string msg = std::string(application_name) + ": " + error + ": " + trim(PQerrorMessage(conn));
        PQfinish(conn);
        throw std::runtime_error(msg);
    }
    return conn;
}

// PQgetResult, where a result must come.
PGresult* next_result(PGconn* conn, const char* who) {
    PGresult* r = PQgetResult(conn);
    if (r == nullptr) throw std::runtime_error(std::string(who) + ": missing result: " + trim(PQerrorMessage(conn)));
    return r;
}

}  // namespace

FloorClient::FloorClient(const std::string& conninfo, const std::string& table) : sql_(floor_sql(quote_ident(table))) {
    conn_ = connect_prepared(conninfo, "idem-bench-floor",
                             {{sql_.claim_name, sql_.claim, sql_.claim_types},
                              {sql_.select_name, sql_.select, sql_.select_types},
                              {sql_.save_name, sql_.save, sql_.save_types}});
}

FloorClient::~FloorClient() { PQfinish(conn_); }

void FloorClient::fail(const std::string& what) {
    throw std::runtime_error("floor: " + what + ": " + trim(PQerrorMessage(conn_)));
}

PGresult* FloorClient::next() { return next_result(conn_, "floor"); }

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
    const char* ins_values[] = {scope.data(),     key.data(),       fingerprint.data(),  alg_buf.data(),
                                fence_buf.data(), lease_buf.data(), retention_buf.data()};
    const int ins_lengths[] = {
        static_cast<int>(scope.size()), static_cast<int>(key.size()), static_cast<int>(fingerprint.size()), 2, 8, 8, 8};
    const int formats[] = {1, 1, 1, 1, 1, 1, 1};
    const char* sel_values[] = {scope.data(), key.data()};
    const int sel_lengths[] = {static_cast<int>(scope.size()), static_cast<int>(key.size())};

    // The library's claim shape: [INSERT, SELECT | Sync], one transaction, one round trip.
    if (PQsendQueryPrepared(conn_, sql_.claim_name.c_str(), 7, ins_values, ins_lengths, formats, 1) != 1)
        fail("send claim");
    if (PQsendQueryPrepared(conn_, sql_.select_name.c_str(), 2, sel_values, sel_lengths, formats, 1) != 1)
        fail("send select");
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

namespace bench {

IdealClient::IdealClient(const std::string& conninfo, const std::string& table) : sql_(floor_sql(quote_ident(table))) {
    conn_ = connect_prepared(conninfo, "idem-bench-ideal",
                             {{sql_.claim_batch_name, sql_.claim_batch, sql_.claim_batch_types},
                              {sql_.select_batch_name, sql_.select_batch, sql_.select_batch_types},
                              {sql_.save_batch_name, sql_.save_batch, sql_.save_batch_types}});
}

IdealClient::~IdealClient() { PQfinish(conn_); }

void IdealClient::fail(const std::string& what) {
    throw std::runtime_error("ideal: " + what + ": " + trim(PQerrorMessage(conn_)));
}

PGresult* IdealClient::next() { return next_result(conn_, "ideal"); }

IdealClient::Claimed IdealClient::claim(std::string_view scope, const std::vector<std::string>& keys,
                                        std::string_view fingerprint, std::int16_t alg,
                                        const std::vector<std::int64_t>& fences, std::int64_t lease_ms,
                                        std::int64_t retention_s) {
    const std::size_t n = keys.size();
    BinaryArray scopes(kText, n), values(kText, n), fps(kBytea, n), algs(kInt2, n), fence_arr(kInt8, n);
    for (std::size_t i = 0; i < n; ++i) {
        scopes.add(scope);
        values.add(keys[i]);
        fps.add(fingerprint);
        algs.add_int(static_cast<std::uint16_t>(alg), 2);
        fence_arr.add_int(static_cast<std::uint64_t>(fences[i]), 8);
    }
    std::array<char, 8> lease_buf{}, retention_buf{};
    put_be(lease_buf, static_cast<std::uint64_t>(lease_ms));
    put_be(retention_buf, static_cast<std::uint64_t>(retention_s));
    const std::string* arrays[] = {&scopes.bytes(), &values.bytes(), &fps.bytes(), &algs.bytes(), &fence_arr.bytes()};
    const char* ins_values[7];
    int ins_lengths[7];
    for (int i = 0; i < 5; ++i) {
        ins_values[i] = arrays[i]->data();
        ins_lengths[i] = static_cast<int>(arrays[i]->size());
    }
    ins_values[5] = lease_buf.data();
    ins_values[6] = retention_buf.data();
    ins_lengths[5] = ins_lengths[6] = 8;
    const int formats[] = {1, 1, 1, 1, 1, 1, 1};
    const char* sel_values[] = {scopes.bytes().data(), values.bytes().data()};
    const int sel_lengths[] = {static_cast<int>(scopes.bytes().size()), static_cast<int>(values.bytes().size())};

    // The library's batch claim: [INSERT | Sync | SELECT | Sync], flushed together: one round trip.
    if (PQsendQueryPrepared(conn_, sql_.claim_batch_name.c_str(), 7, ins_values, ins_lengths, formats, 1) != 1) {
        fail("send claim batch");
    }
    if (PQpipelineSync(conn_) != 1) fail("sync");
    if (PQsendQueryPrepared(conn_, sql_.select_batch_name.c_str(), 2, sel_values, sel_lengths, formats, 1) != 1) {
        fail("send select batch");
    }
    if (PQpipelineSync(conn_) != 1) fail("sync");
    ++round_trips_;

    Claimed out;
    bool ok = true;
    PGresult* ins = next();
    ok = ok && PQresultStatus(ins) == PGRES_TUPLES_OK;
    out.inserted = static_cast<std::size_t>(PQntuples(ins));
    PQclear(ins);
    PGresult* end = PQgetResult(conn_);  // NULL: end of the INSERT's results
    PQclear(end);
    PGresult* sync = next();
    ok = ok && end == nullptr && PQresultStatus(sync) == PGRES_PIPELINE_SYNC;
    PQclear(sync);
    PGresult* sel = next();
    ok = ok && PQresultStatus(sel) == PGRES_TUPLES_OK;
    for (int row = 0; ok && row < PQntuples(sel); ++row) {
        const std::string_view state(PQgetvalue(sel, row, 0), static_cast<std::size_t>(PQgetlength(sel, row, 0)));
        if (state == "completed") ++out.completed;
        if (state == "in_progress") ++out.in_progress;
    }
    PQclear(sel);
    end = PQgetResult(conn_);
    PQclear(end);
    sync = next();
    ok = ok && end == nullptr && PQresultStatus(sync) == PGRES_PIPELINE_SYNC;
    PQclear(sync);
    if (!ok) fail("claim batch failed");
    return out;
}

std::size_t IdealClient::save(std::string_view scope, const std::vector<std::string>& keys,
                              const std::vector<std::int64_t>& fences, std::string_view result) {
    const std::size_t n = keys.size();
    BinaryArray scopes(kText, n), values(kText, n), fence_arr(kInt8, n), results(kBytea, n);
    for (std::size_t i = 0; i < n; ++i) {
        scopes.add(scope);
        values.add(keys[i]);
        fence_arr.add_int(static_cast<std::uint64_t>(fences[i]), 8);
        results.add(result);
    }
    const char* vals[] = {scopes.bytes().data(), values.bytes().data(), fence_arr.bytes().data(),
                          results.bytes().data()};
    const int lengths[] = {static_cast<int>(scopes.bytes().size()), static_cast<int>(values.bytes().size()),
                           static_cast<int>(fence_arr.bytes().size()), static_cast<int>(results.bytes().size())};
    const int formats[] = {1, 1, 1, 1};
    if (PQsendQueryPrepared(conn_, sql_.save_batch_name.c_str(), 4, vals, lengths, formats, 1) != 1) {
        fail("send save batch");
    }
    if (PQpipelineSync(conn_) != 1) fail("sync");
    ++round_trips_;
    PGresult* r = next();
    bool ok = PQresultStatus(r) == PGRES_TUPLES_OK;
    const auto saved = static_cast<std::size_t>(PQntuples(r));
    PQclear(r);
    PGresult* end = PQgetResult(conn_);
    PQclear(end);
    PGresult* sync = next();
    ok = ok && end == nullptr && PQresultStatus(sync) == PGRES_PIPELINE_SYNC;
    PQclear(sync);
    if (!ok) fail("save batch failed");
    return saved;
}

}  // namespace bench
