#include "generations.hpp"

#include "sansio/admin_sql.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

namespace idem::pg {
namespace {

std::string literal(const TableName& t) { return t.schema.empty() ? t.table : t.schema + "." + t.table; }

struct Partition {
    std::string name;
    std::int64_t start = 0;
    bool detach_pending = false;
};

// The table's generations, oldest first; partitions not named by idem are left out.
std::vector<Partition> partitions(AdminSession& db, const TableName& t) {
    auto r = db.exec(kPartitionsSql, {t.qualified});
    std::vector<Partition> out;
    const std::string prefix = generation_prefix(t);
    for (int row = 0; row < PQntuples(r.get()); ++row) {
        const std::string name = PQgetvalue(r.get(), row, 0);
        if (!name.starts_with(prefix) || name.size() == prefix.size()) continue;
        const std::string digits = name.substr(prefix.size());
        if (digits.find_first_not_of("0123456789") != std::string::npos) continue;
        out.push_back({name, std::stoll(digits), std::string_view(PQgetvalue(r.get(), row, 1)) == "t"});
    }
    std::sort(out.begin(), out.end(), [](const Partition& a, const Partition& b) { return a.start < b.start; });
    return out;
}

void expect_partitioned(AdminSession& db, const TableName& t) {
    const auto kind = db.value(kRelkindSql, {t.qualified});
    if (!kind) {
        throw config_error("idem: table " + literal(t) + " does not exist (call PostgresStore::ensure_schema())",
                           "42P01");
    }
    if (*kind != "p") {
        throw config_error("idem: table " + literal(t) +
                           " is a plain table but PostgresOptions::generations is set: migrate it to generations "
                           "(docs/design.md, \"Generations\") or leave generations unset");
    }
}

std::optional<std::int64_t> recorded_length(AdminSession& db, const TableName& t) {
    const auto note = db.value(kGenerationNoteSql, {t.qualified});
    if (!note || !note->starts_with(kGenerationLengthNote)) return std::nullopt;
    return std::strtoll(note->c_str() + kGenerationLengthNote.size(), nullptr, 10);
}

bool lock_timed_out(const error& e) { return e.sqlstate() == "55P03"; }

// The name of the advisory lock a table's maintenance holds (hashtextextended of it).
std::string maintenance_lock(const TableName& t) { return "idem.generations:" + t.qualified; }

// Creates the current generation and `ahead` more that do not exist yet — as tables with the
// table's indexes, outside the lock below; for maintenance only once fewer than half of them are
// left — then attaches them in one transaction under the table's
// SHARE lock: the lock every claim's ROW EXCLUSIVE conflicts with, so that no claim is in flight
// while the set of generations grows (docs/design.md, "Generations", has the argument). The attach
// only links tables and indexes that exist, so writes wait for it briefly. Unless `db` is already
// in a transaction (ensure_schema), the wait for the lock is at most `attach_wait`: then nothing is
// attached (`timed_out`) and the next maintenance tries again. A claim queued behind the wait
// waits less than its own lock_timeout when `attach_wait` is at most half of it.
std::size_t create_ahead(AdminSession& db, const TableName& t, std::chrono::milliseconds length, std::size_t ahead,
                         bool in_transaction, std::chrono::milliseconds attach_wait, bool& timed_out) {
    auto r = db.exec(upcoming_generations_sql(length, ahead));
    std::set<std::int64_t> existing;
    for (const Partition& p : partitions(db, t)) existing.insert(p.start);
    std::vector<std::int64_t> missing;
    for (int row = 0; row < PQntuples(r.get()); ++row) {
        const std::int64_t start = std::stoll(PQgetvalue(r.get(), row, 0));
        if (existing.count(start) == 0) missing.push_back(start);
    }
    if (missing.empty()) return 0;
    // Maintenance attaches in batches: only once fewer than half of `ahead` are ready past the
    // current generation (which must exist), so that writes wait for an attach that rarely.
    const std::size_t wanted = static_cast<std::size_t>(PQntuples(r.get()));
    const bool current_missing = missing.front() == std::stoll(PQgetvalue(r.get(), 0, 0));
    if (!in_transaction && !current_missing && wanted - 1 - missing.size() >= (ahead + 1) / 2) return 0;
    for (const std::int64_t start : missing) {
        // CREATE, then ATTACH: CREATE TABLE … PARTITION OF would take ACCESS EXCLUSIVE, which
        // readers wait for too. A generation left behind by a maintenance cut off in between is
        // recognised as idem's by its comment and dropped once its time has passed.
        db.exec(create_generation_sql(t, start));
        db.exec(mark_made_ahead_sql(t, start));
    }
    if (!in_transaction) db.exec(kBeginSql);
    try {
        if (!in_transaction) db.exec(local_lock_timeout_sql(attach_wait));
        // SHARE: claims, saves and every other write wait until the transaction ends; reads do not.
        db.exec(lock_out_writes_sql(t));
        for (const std::int64_t start : missing) db.exec(attach_generation_sql(t, start));
        if (!in_transaction) db.exec(kCommitSql);
    } catch (const error& e) {
        if (in_transaction) throw;
        db.exec(kRollbackSql);
        if (!lock_timed_out(e)) throw;
        timed_out = true;
        return 0;
    }
    return missing.size();
}

// Steps 2 and 3 of retiring `p` (see generations.hpp): the keys it holds when it may go, or
// nullopt to keep it for now (`timed_out`: closing it waited past lock_timeout).
std::optional<std::size_t> close_and_check(AdminSession& db, const TableName& t, const Partition& p, bool& timed_out) {
    // Step 1, cheap first: the newest expiry by the expiry index.
    if (db.value(generation_unexpired_sql(t, p.name)) == "t") return std::nullopt;
    const bool closed = db.value(kGenerationClosedSql, {generation_table(t, p.name)}) == "t";
    if (!closed) {
        db.exec(kBeginSql);
        try {
            // Citus creates a trigger on a distributed table's shards only when told to; this one
            // only refuses rows, which is safe on any shard.
            db.exec(kAllowCitusTriggersSql);
            db.exec(close_generation_sql(t, p.name));
            // A re-claim whose transaction began before the generation ended computes this
            // generation as its DEFAULT and would revive an expired row in place, after the check
            // below: refused too (40001, and the claim reads again in a new transaction).
            db.exec(close_generation_updates_sql(t, p.name));
            db.exec(kCommitSql);
        } catch (const error& e) {
            db.exec(kRollbackSql);
            if (!lock_timed_out(e)) throw;
            timed_out = true;  // a writer holds it: next time
            return std::nullopt;
        }
    }
    // A full read of the generation, once: no index serves `state` (saves stay HOT updates).
    auto r = db.exec(generation_keys_sql(t, p.name));
    const bool live =
        std::string_view(PQgetvalue(r.get(), 0, 1)) != "0" || std::string_view(PQgetvalue(r.get(), 0, 2)) == "t";
    if (live) return std::nullopt;
    return static_cast<std::size_t>(std::stoull(PQgetvalue(r.get(), 0, 0)));
}

// Tables a maintenance left behind, cut off in between: generations it detached but did not drop
// (named like a generation, no partition, carrying the closing trigger, which only a checked
// generation's detach leaves behind), and generations it made ahead but did not attach whose time
// has passed (carrying kMadeAheadNote's comment; a current or future one is attached by create_ahead).
void drop_detached(AdminSession& db, const TableName& t, std::chrono::milliseconds length) {
    auto r = db.exec(kLeftoverGenerationsSql,
                     {t.schema, generation_prefix(t), std::string(kMadeAheadNote), std::to_string(length.count())});
    for (int row = 0; row < PQntuples(r.get()); ++row) db.exec(drop_generation_sql(t, PQgetvalue(r.get(), row, 0)));
}

void detach_and_drop(AdminSession& db, const TableName& t, const Partition& p) {
    // CONCURRENTLY: the table's readers and writers never wait on it. It waits for the
    // transactions that may still see the partition; a detach cut short stays pending, and is
    // finished (FINALIZE) at the next maintenance.
    try {
        db.exec(detach_generation_sql(t, p.name, p.detach_pending ? Detach::finalize : Detach::concurrently));
    } catch (const database_error& e) {
        if (e.sqlstate() != "0A000" && e.sqlstate() != "XX000") throw;
        // Citus refuses CONCURRENTLY on a distributed table: a plain detach takes the table's
        // ACCESS EXCLUSIVE lock, which every statement behind it then waits for; a short wait,
        // or the next maintenance tries again.
        if (db.value(kCitusCatalogSql) != "t") throw;
        db.exec(kBeginSql);
        try {
            db.exec(local_lock_timeout_sql(std::chrono::milliseconds(100)));
            db.exec(detach_generation_sql(t, p.name, Detach::plain));
            db.exec(kCommitSql);
        } catch (...) {
            db.exec(kRollbackSql);
            throw;
        }
    }
    db.exec(drop_generation_sql(t, p.name));
}

}  // namespace

bool try_lock_out_maintenance(AdminSession& db, const TableName& t) {
    return db.value(kTryXactLockSql, {maintenance_lock(t)}) == "t";
}

void prepare_generations(AdminSession& db, const TableName& t, std::chrono::milliseconds length, std::size_t ahead) {
    expect_partitioned(db, t);
    if (recorded_length(db, t) != length.count()) {
        db.exec(generation_default_sql(t, length));
        db.exec(record_generation_length_sql(t, length));
    }
    bool timed_out = false;
    create_ahead(db, t, length, ahead, true, std::chrono::milliseconds(0), timed_out);
}

GenerationReport maintain_generations(AdminSession& db, const TableName& t, std::chrono::milliseconds length,
                                      std::size_t ahead, std::chrono::milliseconds lock_wait) {
    GenerationReport report;
    expect_partitioned(db, t);
    // One maintainer per table; the others have nothing to add. (ensure_schema() holds the same
    // lock while it may change the length: the length is read under it.)
    const std::string lock_name = maintenance_lock(t);
    if (db.value(kTrySessionLockSql, {lock_name}) != "t") return report;
    try {
        const auto recorded = recorded_length(db, t);
        if (recorded != length.count()) {
            throw config_error("idem: table " + literal(t) + " has generations of " +
                               (recorded ? std::to_string(*recorded) + " ms" : std::string("no recorded length")) +
                               ", this store's PostgresOptions::generations says " + std::to_string(length.count()) +
                               " ms (ensure_schema() changes the table's)");
        }
        db.exec(lock_timeout_sql(lock_wait));
        // Each step that waits for a lock waits at most lock_wait; after one waited in vain the
        // others are left for the next maintenance, so that one call waits about lock_wait at most.
        bool gave_up = false;
        // Writes queue behind the attach's lock request: it waits half their lock_timeout at most.
        const auto attach_wait = lock_wait / 2;
        drop_detached(db, t, length);
        report.created = create_ahead(db, t, length, ahead, false, attach_wait, gave_up);
        const std::int64_t now_ms = std::stoll(*db.value(kNowMillisSql));
        // A table has at most one detach pending: finish it before any other begins.
        auto all = partitions(db, t);
        std::stable_partition(all.begin(), all.end(), [](const Partition& p) { return p.detach_pending; });
        for (const Partition& p : all) {
            const bool ended = p.start + length.count() <= now_ms;
            if (!p.detach_pending && !ended) continue;  // current or ahead
            if (gave_up) {
                ++report.kept;
                continue;
            }
            std::optional<std::size_t> rows = 0;  // a pending detach was checked before it began
            if (!p.detach_pending) rows = close_and_check(db, t, p, gave_up);
            if (!rows) {
                ++report.kept;
                continue;
            }
            try {
                detach_and_drop(db, t, p);
            } catch (const error& e) {
                if (!lock_timed_out(e)) throw;
                // Still pending (finished next time), and no other detach can begin meanwhile.
                ++report.kept;
                gave_up = true;
                continue;
            }
            ++report.retired;
            report.rows_removed += *rows;
            // A detach waits for older transactions: keep the generations ahead in step meanwhile.
            report.created += create_ahead(db, t, length, ahead, false, attach_wait, gave_up);
        }
    } catch (...) {
        try {
            db.exec(kSessionUnlockSql, {lock_name});
        } catch (...) {
        }
        throw;
    }
    db.exec(kSessionUnlockSql, {lock_name});
    return report;
}

}  // namespace idem::pg
