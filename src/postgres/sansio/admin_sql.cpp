#include "admin_sql.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace idem::pg {
namespace {

long long at_least_1ms(std::chrono::milliseconds wait) { return std::max<long long>(1, wait.count()); }

// A timestamptz expression as whole microseconds since the epoch.
std::string micros(std::string_view expression) {
    return fmt::format("(extract(epoch FROM {}) * 1000000)::int8", expression);
}

}  // namespace

std::string lock_timeout_sql(std::chrono::milliseconds wait) {
    return fmt::format("SET lock_timeout = '{}ms'", at_least_1ms(wait));
}

std::string local_lock_timeout_sql(std::chrono::milliseconds wait) {
    return fmt::format("SET LOCAL lock_timeout = '{}ms'", at_least_1ms(wait));
}

std::string create_schema_sql(const TableName& t) { return "CREATE SCHEMA IF NOT EXISTS \"" + t.schema + "\""; }

std::string schema_version_sql(const TableName& t) {
    return "SELECT version FROM " + t.version_table + " WHERE table_name = $1";
}

std::string setting_sql(std::string_view name) {
    return fmt::format("SELECT setting FROM pg_catalog.pg_settings WHERE name = '{}'", name);
}

std::string role_setting_sql(std::string_view role, std::string_view name, std::string_view value) {
    return fmt::format("ALTER ROLE \"{}\" SET {} = '{}'", role, name, value);
}

std::string generation_prefix(const TableName& t) { return t.table + "_g"; }

std::string generation_name(const TableName& t, std::int64_t start) {
    return generation_prefix(t) + std::to_string(start);
}

std::string generation_table(const TableName& t, std::string_view name) {
    return fmt::format("{}\"{}\"", t.schema.empty() ? "" : "\"" + t.schema + "\".", name);
}

std::string generation_default_sql(const TableName& t, std::chrono::milliseconds length) {
    return fmt::format("ALTER TABLE {} ALTER COLUMN generation SET DEFAULT {}", t.qualified,
                       generation_expression(length));
}

std::string record_generation_length_sql(const TableName& t, std::chrono::milliseconds length) {
    return fmt::format("COMMENT ON COLUMN {}.generation IS '{}{}'", t.qualified, kGenerationLengthNote, length.count());
}

std::string upcoming_generations_sql(std::chrono::milliseconds length, std::size_t ahead) {
    const auto at = fmt::format("now() + n * interval '{} milliseconds'", length.count());
    return fmt::format("SELECT DISTINCT {} FROM generate_series(0, {}) AS n ORDER BY 1",
                       generation_expression(length, at), ahead);
}

std::string create_generation_sql(const TableName& t, std::int64_t start) {
    return fmt::format(
        "CREATE TABLE IF NOT EXISTS {} (LIKE {} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES) "
        "WITH (fillfactor = 90)",
        generation_table(t, generation_name(t, start)), t.qualified);
}

std::string mark_made_ahead_sql(const TableName& t, std::int64_t start) {
    return fmt::format("COMMENT ON TABLE {} IS '{}'", generation_table(t, generation_name(t, start)), kMadeAheadNote);
}

std::string lock_out_writes_sql(const TableName& t) {
    return fmt::format("LOCK TABLE ONLY {} IN SHARE MODE", t.qualified);
}

std::string attach_generation_sql(const TableName& t, std::int64_t start) {
    return fmt::format("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES IN ({})", t.qualified,
                       generation_table(t, generation_name(t, start)), start);
}

std::string generation_unexpired_sql(const TableName& t, std::string_view name) {
    return fmt::format("SELECT max(expires_at) >= now() FROM {}", generation_table(t, name));
}

std::string close_generation_sql(const TableName& t, std::string_view name) {
    return fmt::format("CREATE TRIGGER idem_closed BEFORE INSERT ON {} FOR EACH ROW EXECUTE FUNCTION {}()",
                       generation_table(t, name), closed_function(t));
}

std::string close_generation_updates_sql(const TableName& t, std::string_view name) {
    return fmt::format(
        "CREATE TRIGGER idem_closed_update BEFORE UPDATE ON {} FOR EACH ROW "
        "WHEN (OLD.state = 'completed' AND NEW.generation = OLD.generation) "
        "EXECUTE FUNCTION {}()",
        generation_table(t, name), closed_function(t));
}

std::string generation_keys_sql(const TableName& t, std::string_view name) {
    return fmt::format(
        "SELECT count(*), count(*) FILTER (WHERE state = 'in_progress'), coalesce(bool_or(expires_at >= now()), false) "
        "FROM {}",
        generation_table(t, name));
}

std::string detach_generation_sql(const TableName& t, std::string_view name, Detach how) {
    const std::string part = generation_table(t, name);
    if (how == Detach::plain) return fmt::format("ALTER TABLE {} DETACH PARTITION {}", t.qualified, part);
    return fmt::format("ALTER TABLE {} DETACH PARTITION {} {}", t.qualified, part,
                       how == Detach::finalize ? "FINALIZE" : "CONCURRENTLY");
}

std::string drop_generation_sql(const TableName& t, std::string_view name) {
    return fmt::format("DROP TABLE IF EXISTS {}", generation_table(t, name));
}

std::string list_keys_sql(const TableName& t) {
    // Filters are parameters (NULL: not filtering), so the statement text never varies.
    return fmt::format(
        "SELECT scope, key, state, attempt, fence, phase, {}, {}, {}, octet_length(result), "
        "(state = 'in_progress' AND lease_until < now()), (state = 'completed' AND expires_at < "
        "now()), {} "
        "FROM {} WHERE ($1::text IS NULL OR scope = $1) AND ($2::text IS NULL OR "
        "starts_with(scope, $2)) "
        "AND ($3::text IS NULL OR state = $3 OR ($3 = 'expired' AND state = 'completed' AND "
        "expires_at < now())) "
        "AND (NOT $4::bool OR (state = 'in_progress' AND lease_until < now())) "
        "AND ($5::int8 IS NULL OR created_at < now() - $5 * interval '1 second') "
        "ORDER BY created_at, scope, key LIMIT $6",
        micros("created_at"), micros("lease_until"), micros("expires_at"), micros("now()"), t.qualified);
}

std::string key_counts_sql(const TableName& t) {
    return fmt::format(
        "SELECT count(*) FILTER (WHERE state = 'in_progress'), "
        "count(*) FILTER (WHERE state = 'in_progress' AND lease_until < now()), "
        "count(*) FILTER (WHERE state = 'completed'), "
        "count(*) FILTER (WHERE state = 'completed' AND expires_at < now()), {} FROM {}",
        micros("now()"), t.qualified);
}

std::string oldest_in_progress_sql(const TableName& t) {
    return fmt::format(
        "SELECT scope, key, {} FROM {} WHERE state = 'in_progress' "
        "ORDER BY created_at, scope, key LIMIT 1",
        micros("created_at"), t.qualified);
}

}  // namespace idem::pg
