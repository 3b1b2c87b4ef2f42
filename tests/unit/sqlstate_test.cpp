// Which idem error a PostgreSQL failure is (src/postgres/sansio/sqlstate.hpp), and that idemctl's exit code
// says the same for the same SQLSTATE (tools/idemctl/failure.hpp): one decision, asserted over the
// classes an operator meets — connection (08), authorization (28), catalog (3D), transaction
// rollback (40), syntax and access (42), resources (53), object state (55), operator
// intervention (57) — and idem's own two cases.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "idemctl/failure.hpp"
#include "postgres/sansio/sqlstate.hpp"

namespace {

using idem::pg::FailureKind;

// The exception the library throws for `sqlstate`, as the kind it stands for.
FailureKind thrown_kind(const std::string& sqlstate, const std::string& message) {
    try {
        idem::pg::throw_database_error("idem: test failed: " + message, sqlstate);
    } catch (const idem::config_error&) {
        return FailureKind::configuration;
    } catch (const idem::store_unavailable&) {
        return FailureKind::unavailable;
    } catch (const idem::database_error&) {
        return FailureKind::refused;
    }
    FAIL("throw_database_error threw nothing");
    return FailureKind::refused;
}

idemctl::Exit exit_of(FailureKind kind) {
    switch (kind) {
        case FailureKind::configuration: return idemctl::Exit::config;
        case FailureKind::unavailable: return idemctl::Exit::unavailable;
        case FailureKind::refused: break;
    }
    return idemctl::Exit::failure;
}

}  // namespace

TEST_CASE("SQLSTATE kinds: the library and idemctl decide alike", "[unit][sqlstate]") {
    struct Case {
        std::string sqlstate;
        FailureKind kind;
        std::string message = "ERROR: something";
    };
    const std::vector<Case> cases{
        {"08000", FailureKind::unavailable},
        {"08006", FailureKind::unavailable},
        {"08P01", FailureKind::unavailable},
        {"28000", FailureKind::configuration},
        {"28P01", FailureKind::configuration},
        {"3D000", FailureKind::configuration},
        {"3F000", FailureKind::configuration},
        {"40001", FailureKind::refused},
        {"40P01", FailureKind::refused},
        {"42501", FailureKind::configuration},
        {"42P01", FailureKind::configuration},
        {"42703", FailureKind::configuration},
        {"42704", FailureKind::configuration},
        {"42P10", FailureKind::configuration},
        {"42883", FailureKind::configuration},
        {"42601", FailureKind::refused},  // a syntax error is a bug
        {"42P07", FailureKind::refused},
        {"53000", FailureKind::unavailable},
        {"53100", FailureKind::unavailable},
        {"53200", FailureKind::unavailable},
        {"53300", FailureKind::unavailable},
        {"55P03", FailureKind::unavailable},
        {"55006", FailureKind::refused},
        {"57014", FailureKind::unavailable},
        {"57P01", FailureKind::unavailable},
        {"57P03", FailureKind::unavailable},
        {"23505", FailureKind::refused},
        {"23514", FailureKind::refused},
        {"23514", FailureKind::unavailable, "ERROR: no partition of relation \"t\" found for row"},
        {"0A000", FailureKind::refused},
        {"0A000", FailureKind::configuration, "ERROR: idem: generations need READ COMMITTED claims, not serializable"},
    };
    for (const Case& c : cases) {
        CAPTURE(c.sqlstate, c.message);
        CHECK(idem::pg::failure_kind(c.sqlstate, c.message) == c.kind);
        CHECK(thrown_kind(c.sqlstate, c.message) == c.kind);
        // idemctl drifted once: every 42xxx a configuration error, no 53xxx an outage.
        CHECK(idemctl::exit_for(c.sqlstate, c.message) == exit_of(c.kind));
    }
}
