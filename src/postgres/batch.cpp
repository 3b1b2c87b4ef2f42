// PostgresStore's batches: claim_batch and save_batch, one round trip for many keys (the
// statements of rows.hpp).
#include "idem/postgres_store.hpp"

#include "store_impl.hpp"

namespace idem {

std::vector<Claim> PostgresStore::claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                              const ClaimOptions& options) {
    Impl& m = *impl_;
    if (keys.size() != fps.size()) throw config_error("idem: claim_batch needs one fingerprint per key");
    // Keyed once (PostgresOptions::fingerprint_secret): the rows sent, the classification of the
    // rows found and the keys settled alone (claim_with_fence) all use these.
    std::vector<Fingerprint> keyed;
    fps = detail::keyed(m.options.fingerprint_secret, fps, keyed);
    const auto lease = options.lease.value_or(m.options.default_lease);
    const auto retention = options.retention.value_or(m.options.default_retention);
    std::vector<std::optional<Claim>> out(keys.size());
    // Claims won so far: released again if a later part of the batch fails, so an exception never
    // strands a claim whose effect will not run. Not a key taken over (resume_stale, `existing`
    // set): an earlier attempt's outcome is unknown there, and deleting its record (recovery point
    // included) would let the next claim run the effect again. It stays in progress, stale again
    // when our lease passes.
    const auto release_won = [&] {
        for (std::size_t i = 0; i < out.size(); ++i) {
            if (out[i] && out[i]->status == ClaimStatus::claimed && !out[i]->existing) {
                try {
                    release(keys[i], out[i]->fence);
                } catch (const error&) {
                    // stays in progress: safe (the effect did not run), the reconciler releases it
                }
            }
        }
    };
    try {
        // Chunks keep one transaction's lock count and one statement's size bounded.
        constexpr std::size_t kChunk = 1024;
        for (std::size_t begin = 0; begin < keys.size(); begin += kChunk) {
            const std::size_t n = std::min(kChunk, keys.size() - begin);
            // Claims in key order: concurrent batches that share keys lock them in the same order.
            std::vector<std::size_t> order(n);
            for (std::size_t j = 0; j < n; ++j) order[j] = begin + j;
            std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return keys[a] < keys[b]; });
            for (std::size_t j = 1; j < n; ++j) {
                if (keys[order[j]] == keys[order[j - 1]]) throw config_error("idem: claim_batch keys must be distinct");
            }
            std::vector<Impl::ClaimRow> rows(n);
            for (std::size_t j = 0; j < n; ++j) {
                const std::size_t i = order[j];
                rows[j] = {keys[i].scope(),     keys[i].value(),
                           fps[i].bytes(),      static_cast<std::int16_t>(fps[i].algorithm()),
                           detail::new_fence(), lease.count(),
                           retention.count()};
            }
            m.counters().claims.fetch_add(n, std::memory_order_relaxed);

            for (int failures = 0;; ++failures) {
                // [claims | Sync | read | Sync], one round trip: on one node every claim of the chunk
                // commits together (two array statements); on Citus each shard's segment on its own
                // (Impl::claim_rows).
                Impl::ClaimAnswers a = m.with_connection(
                    "claim_batch", [&](pg::Connection& conn, int) { return m.claim_rows(conn, rows); });
                if (a.write_failure >= 0 && std::all_of(a.row_failed.begin(), a.row_failed.end(),
                                                        [](bool f) { return f; })) {  // nothing committed
                    const StepResult& failed = a.res[static_cast<std::size_t>(a.write_failure)];
                    if (!claim_retryable(failed.sqlstate())) throw_statement_error(failed, "claim_batch");
                    m.counters().retries.fetch_add(1, std::memory_order_relaxed);
                    if (failures + 1 < m.options.claim_attempts) {
                        std::this_thread::sleep_for(std::chrono::milliseconds(detail::jitter(20)));
                        continue;
                    }
                    // Contended: settle each key on its own (each with its own bounded retries).
                    m.counters().claims.fetch_sub(n, std::memory_order_relaxed);  // claim() counts again
                    for (std::size_t j = 0; j < n; ++j) {
                        out[order[j]] = claim_with_fence(keys[order[j]], fps[order[j]], options, rows[j].fence);
                    }
                    break;
                }
                // The claims committed under their own Sync: won whatever happens to the read.
                // Recorded first, so that release_won() frees them if the batch throws later.
                std::vector<bool> inserted(n, false);
                for (std::size_t j = 0; j < n; ++j) {
                    if (!a.won.contains(rows[j].fence)) continue;
                    inserted[j] = true;
                    m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);
                    out[order[j]] = Claim{ClaimStatus::claimed, rows[j].fence, std::nullopt, {}};
                }
                if (a.write_failure >= 0) {
                    // Some claim segments committed, others not (a distributed table: one segment
                    // per shard). A refusal that no retry heals fails the batch (release_won()
                    // frees what it won); anything else, the keys of the failed segments settle below.
                    const StepResult& failed = a.res[static_cast<std::size_t>(a.write_failure)];
                    if (!claim_retryable(failed.sqlstate())) throw_statement_error(failed, "claim_batch");
                    m.counters().retries.fetch_add(1, std::memory_order_relaxed);
                }
                for (std::size_t j = 0; j < n; ++j) {
                    const std::size_t i = order[j];
                    if (inserted[j]) continue;  // recorded above
                    if (a.row_failed[j] || a.read_failure >= 0) {
                        // Its claim did not commit, or the read failed (a transaction of its own):
                        // the single-key path, which retries or reports the failure; if it throws,
                        // release_won() frees the claims won above.
                        m.counters().claims.fetch_sub(1, std::memory_order_relaxed);  // claim() counts again
                        out[i] = claim_with_fence(keys[i], fps[i], options, rows[j].fence);
                        continue;
                    }
                    // The record read decides, as for a single claim (pg::ClaimMachine): replayed,
                    // refused, in progress, or ours from an attempt whose answer was lost.
                    auto it = a.found.find(Impl::KeyRef(rows[j].scope, rows[j].key));
                    Claim c;
                    pg::ClaimMachine machine(c, rows[j].fence, fps[i], options, m.options.claim_attempts,
                                             m.options.max_retry_after);
                    if (it != a.found.end()) parse_record(it->second.first, it->second.second, c.existing.emplace());
                    if (it == a.found.end() || machine.on_found() != pg::ClaimMachine::Next::done) {
                        // The rare cases (a vanished row, an expired record, a take-over or a wait)
                        // take the single-key path, which runs them all.
                        m.counters().claims.fetch_sub(1, std::memory_order_relaxed);
                        out[i] = claim_with_fence(keys[i], fps[i], options, rows[j].fence);
                        continue;
                    }
                    if (machine.won()) {
                        m.counters().claims_won.fetch_add(1, std::memory_order_relaxed);
                    } else {
                        detail::open_claim(m.options.sealing, m.options.table, keys[i], c);
                    }
                    out[i] = std::move(c);
                }
                break;
            }
        }
    } catch (...) {
        release_won();
        throw;
    }
    std::vector<Claim> claims;
    claims.reserve(out.size());
    for (auto& c : out) claims.push_back(std::move(*c));
    return claims;
}

std::vector<SaveStatus> PostgresStore::save_batch(std::span<const SaveRequest> saves) {
    Impl& m = *impl_;
    std::vector<SaveStatus> statuses(saves.size(), SaveStatus::lease_lost);
    std::vector<std::size_t> order;                // positions in saves, by key
    std::unordered_map<Fence, std::size_t> index;  // fence → position in saves
    for (std::size_t i = 0; i < saves.size(); ++i) {
        if (saves[i].result.size() > m.options.max_result_bytes) {
            statuses[i] = SaveStatus::too_large;  // decided before any I/O
            continue;
        }
        order.push_back(i);
        index.emplace(saves[i].fence, i);
    }
    if (order.empty()) return statuses;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return saves[a].key < saves[b].key; });
    // Sealed once (when sealing is on): every attempt, and a row sent again alone, stores these bytes.
    std::vector<std::string> sealed(saves.size());
    std::vector<std::string_view> stored(saves.size());
    for (std::size_t i : order)
        stored[i] = detail::seal_result(m.options.sealing, m.options.table, saves[i].key, saves[i].fence,
                                        saves[i].result, sealed[i]);
    std::vector<Impl::SaveRow> rows;
    rows.reserve(order.size());
    for (std::size_t i : order) rows.push_back({saves[i].key.scope(), saves[i].key.value(), stored[i], saves[i].fence});
    m.counters().saves.fetch_add(rows.size(), std::memory_order_relaxed);
    std::vector<std::size_t> notify, alone;
    m.with_connection(
        "save_batch",
        [&](pg::Connection& conn, int attempt) {
            notify.clear(), alone.clear();
            // One UPDATE … FROM unnest for every result (Impl::save_rows). On Citus one statement per
            // scope or key, each committed on its own: when only some failed, the others are saved and
            // the failed rows go through save() one by one (below), which retries and re-reads.
            Impl::SaveAnswers a = m.save_rows(conn, rows);
            if (a.failure >= 0) {
                if (std::all_of(a.row_failed.begin(), a.row_failed.end(), [](bool f) { return f; })) {
                    throw_statement_error(a.res[static_cast<std::size_t>(a.failure)], "save_batch");
                }
                for (std::size_t j = 0; j < rows.size(); ++j) {
                    if (a.row_failed[j]) alone.push_back(index.at(rows[j].fence));
                }
            }
            for (auto [fence, waiters] : a.saved) {
                auto it = index.find(fence);
                if (it == index.end()) continue;
                statuses[it->second] = SaveStatus::saved;
                if (waiters) notify.push_back(it->second);
            }
            if (attempt > 1) {  // an earlier attempt of this batch may have committed before its connection broke
                for (auto [fence, i] : index) {
                    if (statuses[i] != SaveStatus::lease_lost) continue;
                    if (detail::save_landed(m.select(conn, saves[i].key), fence, stored[i])) {
                        statuses[i] = SaveStatus::saved;
                    }
                }
            }
        },
        m.options.save_retry_window);
    for (std::size_t i : notify) m.wake_waiters(saves[i].key);
    for (std::size_t i : alone) {
        if (statuses[i] == SaveStatus::saved) continue;              // an earlier attempt's, recognised above
        m.counters().saves.fetch_sub(1, std::memory_order_relaxed);  // save() counts again
        try {
            save_stored(saves[i].key, saves[i].fence, stored[i]);
            statuses[i] = SaveStatus::saved;
        } catch (const lease_lost&) {
            statuses[i] = SaveStatus::lease_lost;
        }
    }
    return statuses;
}

}  // namespace idem
