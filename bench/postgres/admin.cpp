#include "admin.hpp"

#include <fmt/format.h>
#include <idem/postgres_store.hpp>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string_view>

#include "../common/util.hpp"
#include "floor.hpp"

namespace bench {

Admin::Admin(std::string conninfo)
    : conninfo_(std::move(conninfo)), conn_(connect_or_throw(conninfo_, "idem-bench-admin", {})) {}

Admin::~Admin() { PQfinish(conn_); }

std::string Admin::exec(const std::string& sql, const std::vector<std::string>& params) {
    std::vector<const char*> values;
    values.reserve(params.size());
    for (const auto& p : params) values.push_back(p.c_str());
    PGresult* r =
        PQexecParams(conn_, sql.c_str(), static_cast<int>(values.size()), nullptr, values.data(), nullptr, nullptr, 0);
    const auto status = r ? PQresultStatus(r) : PGRES_FATAL_ERROR;
    if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
        std::string msg = PQerrorMessage(conn_);
        PQclear(r);
        while (!msg.empty() && msg.back() == '\n') msg.pop_back();
        throw std::runtime_error("admin: " + sql.substr(0, 60) + "…: " + msg);
    }
    std::string first;
    if (status == PGRES_TUPLES_OK && PQntuples(r) > 0 && PQnfields(r) > 0) first = PQgetvalue(r, 0, 0);
    PQclear(r);
    return first;
}

void Admin::create_table(const std::string& name, std::chrono::milliseconds generation_length) {
    drop_table(name);
    idem::PostgresOptions options;
    options.table = name;
    options.pool_size = 1;
    if (generation_length.count() > 0) options.generations = idem::PostgresOptions::Generations{generation_length, 2};
    idem::PostgresStore(conninfo_, options).ensure_schema();
}

void Admin::drop_table(const std::string& name) {
    exec("DROP TABLE IF EXISTS " + quote_ident(name));  // a generational table's partitions with it
    exec("DROP FUNCTION IF EXISTS " + quote_ident(name + "_claimable") + "(text, text)");
    exec("DROP FUNCTION IF EXISTS " + quote_ident(name + "_closed") + "()");
    exec(
        "DO $$ BEGIN IF to_regclass('idem_schema_version') IS NOT NULL THEN "
        "DELETE FROM idem_schema_version WHERE table_name = '" +
        name + "'; END IF; END $$");
}

void Admin::preload(const std::string& table, Preload state, std::int64_t base, std::int64_t count, std::string_view fp,
                    bool md5_keys, std::int64_t first, std::optional<std::int64_t> generation) {
    const bool completed = state == Preload::completed;
    // $1 fingerprint, $2..$3 the chunk's i, then $4 the decimal keys' base, then the generation.
    const std::string gen_param = md5_keys ? "$4" : "$5";
    const std::string created = generation ? "to_timestamp(" + gen_param + "::bigint / 1000.0)" : "now()";
    const std::string sql = fmt::format(
        "INSERT INTO {table} (scope, key, state, fingerprint, fingerprint_alg, fence, attempt, result, created_at, "
        "lease_until, completed_at, expires_at{gen_column}) "
        "SELECT 'bench', {key}, '{state}', $1, 1, i + 1, 1, {result}, {created}, {created} + interval '{lease}', "
        "{completed_at}, {created} + interval '1 day'{gen_value} FROM generate_series($2::bigint, $3::bigint) AS i",
        fmt::arg("table", quote_ident(table)), fmt::arg("gen_column", generation ? ", generation" : ""),
        fmt::arg("key", md5_keys ? "md5(i::text)" : "($4::bigint + i)::text"),
        fmt::arg("state", completed ? "completed" : "in_progress"),
        fmt::arg("result", completed ? "'\\x6f6b'::bytea" : "NULL"), fmt::arg("created", created),
        fmt::arg("lease", completed ? "30 seconds" : "1 day"), fmt::arg("completed_at", completed ? created : "NULL"),
        fmt::arg("gen_value", generation ? ", " + gen_param + "::bigint" : ""));
    constexpr std::int64_t chunk = 1'000'000;
    const auto started = Clock::now();
    for (std::int64_t from = 0; from < count; from += chunk) {
        const std::int64_t to = std::min(count, from + chunk) - 1;
        const std::string from_s = std::to_string(first + from), to_s = std::to_string(first + to),
                          base_s = std::to_string(base), gen_s = generation ? std::to_string(*generation) : "";
        std::vector<const char*> values{fp.data(), from_s.c_str(), to_s.c_str()};
        std::vector<int> lengths{static_cast<int>(fp.size()), 0, 0};
        if (!md5_keys) values.push_back(base_s.c_str());
        if (generation) values.push_back(gen_s.c_str());
        lengths.resize(values.size(), 0);
        const std::vector<int> formats = [&] {
            std::vector<int> f(values.size(), 0);
            f[0] = 1;
            return f;
        }();
        PGresult* r = PQexecParams(conn_, sql.c_str(), static_cast<int>(values.size()), nullptr, values.data(),
                                   lengths.data(), formats.data(), 0);
        const bool ok = r != nullptr && PQresultStatus(r) == PGRES_COMMAND_OK;
        PQclear(r);
        if (!ok) throw std::runtime_error("admin: preload failed: " + std::string(PQerrorMessage(conn_)));
        if (count > chunk) {
            std::fprintf(stderr, "  preload %s: %lld / %lld rows (%.0f s)\n", table.c_str(),
                         static_cast<long long>(to + 1), static_cast<long long>(count),
                         seconds_between(started, Clock::now()));
        }
    }
}

void Admin::checkpoint() {
    if (!checkpoint_ok_) return;
    try {
        exec("CHECKPOINT");
    } catch (const std::exception& e) {
        checkpoint_ok_ = false;
        std::fprintf(stderr, "warning: CHECKPOINT refused (%s); phases run without it\n", e.what());
    }
}

namespace {

std::string lsn_text(std::uint64_t lsn) { return fmt::format("{:X}/{:X}", lsn >> 32, lsn & 0xFFFFFFFFu); }

}  // namespace

std::uint64_t Admin::wal_lsn() {
    // The insert position: the end of the last record written, so always where a record begins
    // (pg_current_wal_lsn, the write position, may fall inside one). pg_lsn as "hi/lo" in hex.
    const std::string text = exec("SELECT pg_current_wal_insert_lsn()::text");
    const auto slash = text.find('/');
    if (slash == std::string::npos) throw std::runtime_error("admin: unexpected LSN '" + text + "'");
    return (std::stoull(text.substr(0, slash), nullptr, 16) << 32) | std::stoull(text.substr(slash + 1), nullptr, 16);
}

bool Admin::enable_walinspect() {
    try {
        exec("CREATE EXTENSION IF NOT EXISTS pg_walinspect");
        return true;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "note: no commit counts (pg_walinspect: %s)\n", e.what());
        return false;
    }
}

std::uint64_t Admin::commit_records(std::uint64_t from, std::uint64_t to) {
    if (to <= from) return 0;
    // The end is capped at the flushed position: pg_walinspect refuses a "future" LSN, and every
    // commit a client saw acknowledged is flushed (synchronous_commit = on), with every record
    // before it. So when not even the first record after `from` is flushed, there was no commit.
    try {
        const std::string n = exec(
            "SELECT CASE WHEN pg_current_wal_flush_lsn() <= $1::pg_lsn THEN 0 ELSE (SELECT coalesce(sum(count), 0) "
            "FROM pg_get_wal_stats($1::pg_lsn, least($2::pg_lsn, pg_current_wal_flush_lsn()), true) "
            "WHERE \"resource_manager/record_type\" = 'Transaction/COMMIT') END",
            {lsn_text(from), lsn_text(to)});
        return std::stoull(n);
    } catch (const std::runtime_error& e) {
        if (std::string_view(e.what()).find("could not find a valid record") != std::string_view::npos) return 0;
        throw;
    }
}

std::string Admin::setting(const std::string& name) { return exec("SELECT current_setting($1)", {name}); }

std::string Admin::server_summary() {
    std::string out = "server_version=" + setting("server_version");
    for (const char* name : {"synchronous_commit", "fsync", "wal_sync_method", "full_page_writes", "shared_buffers",
                             "max_wal_size", "checkpoint_timeout"}) {
        out += std::string(", ") + name + "=" + setting(name);
    }
    return out;
}

Tables::~Tables() {
    if (keep) return;
    for (const auto& n : names) {
        try {
            admin.drop_table(n);
        } catch (const std::exception& e) {
            std::fprintf(stderr, "warning: could not drop %s: %s\n", n.c_str(), e.what());
        }
    }
}

std::string Tables::add(const std::string& name, std::chrono::milliseconds generation_length) {
    admin.create_table(name, generation_length);
    names.push_back(name);
    return name;
}

}  // namespace bench
