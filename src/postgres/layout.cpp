// PostgresStore's knowledge of how its table is laid out (docs/scale-out.md): one node, or a
// Citus table distributed by scope or by key. The layout shapes the statements of batches and
// commit groups (pg::ClaimRowsPlan, pg::SaveRowsPlan).
#include "store_impl.hpp"

namespace idem {

// The table's layout (see `distribution`); asked once per store, on a pooled connection, and
// like a connection's set-up not counted in stats().round_trips. A failed question is not
// remembered: the batch goes with arrays, which work everywhere, and asks next time.
pg::Layout PostgresStore::Impl::layout(pg::Connection& conn) {
    switch (options.statement_shape) {
        case PostgresOptions::StatementShape::arrays: return pg::Layout::plain;
        case PostgresOptions::StatementShape::per_scope: return pg::Layout::by_scope;
        case PostgresOptions::StatementShape::per_key: return pg::Layout::by_key;
        case PostgresOptions::StatementShape::automatic: break;
    }
    // The flag first: its acquire makes the layout stored before it (known_layout) visible.
    const bool learnt = layout_known.load(std::memory_order_acquire);
    const pg::Layout known = distribution.load(std::memory_order_relaxed);
    // Not distributed, but Citus is there: asked again now and then (the table may be
    // distributed later, by distribute() in another process or by hand).
    if (learnt && (known != pg::Layout::plain || !citus.load(std::memory_order_relaxed) ||
                   Clock::now().time_since_epoch().count() < recheck_layout_at.load(std::memory_order_relaxed))) {
        return known;
    }
    const auto ask = [&](pg::Stmt stmt, Params& p) {
        const Step step{&defs[stmt], &p};
        return conn.run(std::span(&step, 1), deadline());
    };
    Params none;
    auto installed = ask(pg::kCitusInstalled, none);
    if (!installed[0].ok() || installed[0].rows() != 1) return pg::Layout::plain;
    pg::Layout found = pg::Layout::plain;
    const bool with_citus = pg::get_bool(installed[0].result.get(), 0, 0);
    if (with_citus) {
        Params p;
        p.text(table.qualified);
        auto column = ask(pg::kDistributionColumn, p);
        if (!column[0].ok()) return pg::Layout::plain;
        if (column[0].rows() == 1) {
            const std::string_view c = pg::get_bytes(column[0].result.get(), 0, 0);
            found = c == "scope" ? pg::Layout::by_scope : c == "key" ? pg::Layout::by_key : pg::Layout::plain;
        }
    }
    citus.store(with_citus, std::memory_order_relaxed);
    recheck_layout_at.store((Clock::now() + std::chrono::seconds(60)).time_since_epoch().count(),
                            std::memory_order_relaxed);
    known_layout(found);
    return found;
}

}  // namespace idem
