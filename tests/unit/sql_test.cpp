// Every statement idem sends, checked against what Citus refuses on a distributed table
// (docs/scale-out.md): a non-IMMUTABLE function in RETURNING or an ON CONFLICT clause (0A000), FOR
// UPDATE/SHARE on a statement not routed to one shard (0A000), and multi-statement strings (42601
// once DDL must be propagated). Also: docs/schema.sql is what ensure_schema() runs.
//
// The checks read the SQL text: idem writes its keywords in upper case and its RETURNING lists as
// plain column names, which is what lets a few string rules decide. The rules are tested on known
// bad statements first, so that a rule that accepts everything fails here.
#include "postgres/sansio/sql.hpp"

#include "idem/postgres_store.hpp"

#include <catch2/catch.hpp>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

// The text without -- comments and without the contents of '…' literals and $fn$…$fn$ bodies
// (so that a ';' or a keyword inside any of them is not taken for SQL).
std::string code_only(const std::string& sql) {
    std::string out;
    bool quoted = false;
    for (std::size_t i = 0; i < sql.size(); ++i) {
        const char c = sql[i];
        if (sql.compare(i, 4, "$fn$") == 0) {
            const auto end = sql.find("$fn$", i + 4);
            out += "$fn$$fn$";
            i = end == std::string::npos ? sql.size() : end + 3;
            continue;
        }
        if (quoted) {
            if (c == '\'') quoted = false;
            continue;
        }
        if (c == '\'') {
            quoted = true;
            out += "''";
            continue;
        }
        if (c == '-' && i + 1 < sql.size() && sql[i + 1] == '-') {
            while (i < sql.size() && sql[i] != '\n') ++i;
            out += ' ';
            continue;
        }
        out += c;
    }
    return out;
}

// Each problem Citus would have with `sql` on a distributed table; empty: none.
std::vector<std::string> citus_problems(const std::string& sql) {
    std::vector<std::string> problems;
    const std::string code = code_only(sql);
    if (code.find(';') != std::string::npos) problems.push_back("more than one statement in one string");
    static const std::regex locking(R"(\bFOR\s+(NO\s+KEY\s+)?(UPDATE|SHARE|KEY\s+SHARE)\b)", std::regex::icase);
    if (std::regex_search(code, locking)) problems.push_back("FOR UPDATE/SHARE");
    static const std::regex returning(R"(\bRETURNING\s)", std::regex::icase);
    if (std::smatch m; std::regex_search(code, m, returning)) {
        // Only column references and constants: anything else may be (or call) a function. SQL's
        // value functions look like names, so they are named here.
        static const std::regex item(R"(\s*(([A-Za-z_][A-Za-z0-9_]*\.)?[A-Za-z_][A-Za-z0-9_]*|true|false)\s*)");
        static const std::regex value_function(
            R"(\s*(current_timestamp|current_time|current_date|localtimestamp|localtime|current_user|session_user|)"
            R"(current_role|user|current_catalog|current_schema)\s*)",
            std::regex::icase);
        std::stringstream list(m.suffix().str());
        for (std::string part; std::getline(list, part, ',');) {
            if (!std::regex_match(part, item) || std::regex_match(part, value_function)) {
                problems.push_back("RETURNING item '" + part + "'");
            }
        }
    }
    if (const auto at = code.find("ON CONFLICT"); at != std::string::npos) {
        // DO NOTHING (on the primary key): no WHERE, no SET, hence no function in the clause.
        if (code.compare(at, 37, "ON CONFLICT (scope, key) DO NOTHING R") != 0 &&
            code.compare(at, 24, "ON CONFLICT DO NOTHING R") != 0 &&
            code.substr(at) != "ON CONFLICT (scope, key) DO NOTHING") {
            problems.push_back("ON CONFLICT other than (scope, key) DO NOTHING");
        }
    }
    return problems;
}

}  // namespace

TEST_CASE("the Citus rules refuse what Citus refuses", "[unit][sql]") {
    CHECK(citus_problems("UPDATE t SET a = 1 WHERE k = $1 RETURNING a, (b < now()), now()").size() == 2);
    CHECK(citus_problems("UPDATE t SET a = 1 RETURNING clock_timestamp()").size() == 1);
    CHECK(citus_problems("UPDATE t SET a = 1 RETURNING a,\n  CURRENT_TIMESTAMP").size() == 1);
    CHECK(citus_problems("DELETE FROM t returning\tlocaltimestamp").size() == 1);
    CHECK(citus_problems("WITH v AS (SELECT k FROM t LIMIT 1 FOR UPDATE SKIP LOCKED) DELETE FROM t USING v").size() ==
          1);
    CHECK(citus_problems("SELECT 1 FROM t FOR SHARE").size() == 1);
    CHECK(citus_problems("CREATE TABLE a (x int); CREATE INDEX ON a (x)").size() == 1);
    CHECK(citus_problems("INSERT INTO t VALUES ($1) ON CONFLICT (scope, key) DO UPDATE SET at = now()").size() == 1);
    // and accepts what it runs
    CHECK(citus_problems("INSERT INTO t VALUES (now()) ON CONFLICT (scope, key) DO NOTHING RETURNING fence").empty());
    CHECK(citus_problems("UPDATE t SET x = 'a;b' WHERE k < now() RETURNING t.fence, waiters, false").empty());
    CHECK(citus_problems("CREATE TABLE a (\n x int -- a comment; with a semicolon\n)").empty());
}

TEST_CASE("every statement idem sends is one Citus accepts on a distributed table", "[unit][sql]") {
    for (const std::string name : {"idem_keys", "billing.idem_keys"})
        for (const idem::pg::Generation generation :
             {idem::pg::Generation{}, idem::pg::Generation{std::chrono::hours(1)}}) {
            const auto table = idem::pg::TableName::parse(name);
            const auto defs = idem::pg::statements(table, generation);
            REQUIRE(defs.size() == idem::pg::kStmtCount);
            for (std::size_t i = 0; i < defs.size(); ++i) {
                INFO(name << ": statement " << i << " (" << defs[i].name << "): " << defs[i].sql);
                REQUIRE_FALSE(defs[i].sql.empty());
                auto problems = citus_problems(defs[i].sql);
                if (i == idem::pg::kPurge) {
                    // Sent only until a table refuses it (0A000); then kPurgeDistributed, checked too.
                    REQUIRE(problems == std::vector<std::string>{"FOR UPDATE/SHARE"});
                    continue;
                }
                CHECK(problems.empty());
                for (const auto& p : problems) UNSCOPED_INFO(p);
            }
            for (const std::string& ddl : idem::pg::schema_statements(table, generation)) {
                INFO(name << ": " << ddl);
                // The version table stays on the coordinator (never distributed): its upsert may use now().
                if (ddl.find(table.version_table + " (table_name, version)") != std::string::npos) {
                    CHECK(code_only(ddl).find(';') == std::string::npos);
                    continue;
                }
                CHECK(citus_problems(ddl).empty());
            }
        }
}

TEST_CASE("docs/schema.sql is what ensure_schema() runs", "[unit][sql]") {
    std::ifstream in(IDEM_SOURCE_DIR "/docs/schema.sql", std::ios::binary);
    REQUIRE(in);
    std::stringstream text;
    text << in.rdbuf();
    CHECK(text.str() == idem::PostgresStore::schema_sql("idem_keys"));
}
