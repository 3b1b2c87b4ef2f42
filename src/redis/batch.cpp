// RedisStore's batches (include/idem/redis/store.hpp): claim_batch and save_batch, each one
// round trip of scripts on one connection.
#include "store_impl.hpp"

namespace idem {

std::vector<Claim> RedisStore::claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                           const ClaimOptions& options) {
    if (keys.size() != fps.size()) throw config_error("idem: claim_batch: keys and fingerprints differ in number");
    if (keys.empty()) return {};
    Impl& m = *impl_;
    // Keyed once (RedisOptions::fingerprint_secret): what the scripts store and compare, and what
    // the records found are classified with.
    std::vector<Fingerprint> keyed;
    fps = detail::keyed(m.options.fingerprint_secret, fps, keyed);
    m.counters.claims.fetch_add(keys.size(), std::memory_order_relaxed);
    std::vector<Fence> fences(keys.size());
    for (auto& f : fences) f = detail::new_fence();
    ClaimOptions once = options;
    once.wait = std::chrono::milliseconds(0);
    // Every answer is read before any is acted on, so no reply is left unread on a connection that
    // goes back to the pool. A retry sends the same fences: keys already won answer `own`.
    struct Answers {
        std::vector<Reply> replies;
        std::exception_ptr first_error;
    };
    Answers answers = m.with_connection("claim_batch", [&](Connection& conn, int) {
        for (std::size_t i = 0; i < keys.size(); ++i) m.send_claim(conn, keys[i], fps[i], fences[i], once);
        m.append_wait(conn);
        Answers a;
        a.replies.reserve(keys.size());
        for (std::size_t i = 0; i < keys.size(); ++i) {
            try {
                a.replies.push_back(m.script_reply(conn, "claim_batch"));
            } catch (const Impl::noscript&) {
                throw;
            } catch (...) {
                if (conn.broken()) throw;
                if (!a.first_error) a.first_error = std::current_exception();
                a.replies.emplace_back();
            }
        }
        m.read_wait(conn, "claim_batch");
        return a;
    });
    std::vector<Claim> claims(keys.size());
    for (std::size_t i = 0; i < keys.size(); ++i) {
        if (!answers.replies[i]) continue;
        try {
            claims[i] = m.claim_answer(*answers.replies[i], keys[i], fps[i], fences[i], once, *this);
            detail::open_claim(m.options.sealing, m.options.key_prefix, keys[i], claims[i]);
        } catch (...) {
            if (!answers.first_error) answers.first_error = std::current_exception();
            answers.replies[i].reset();
        }
    }
    if (answers.first_error) {
        // A failure of the batch, thrown as claim() would throw it: first release what it won.
        for (std::size_t i = 0; i < keys.size(); ++i) {
            if (!answers.replies[i] || claims[i].status != ClaimStatus::claimed || claims[i].existing) continue;
            try {
                release(keys[i], fences[i]);
            } catch (const error&) {
                // Left in progress with a fence nobody holds: the reconciler resolves it.
            }
        }
        std::rethrow_exception(answers.first_error);
    }
    return claims;
}

std::vector<SaveStatus> RedisStore::save_batch(std::span<const SaveRequest> saves) {
    Impl& m = *impl_;
    std::vector<SaveStatus> statuses(saves.size(), SaveStatus::too_large);
    std::vector<std::size_t> sent;
    for (std::size_t i = 0; i < saves.size(); ++i) {
        if (saves[i].result.size() <= m.options.max_result_bytes) sent.push_back(i);
    }
    if (sent.empty()) return statuses;
    // Sealed once: a resent batch carries the same bytes, which each script recognises as its own.
    std::vector<std::string> sealed(saves.size());
    std::vector<std::string_view> stored(saves.size());
    for (std::size_t i : sent)
        stored[i] = detail::seal_result(m.options.sealing, m.options.key_prefix, saves[i].key, saves[i].fence,
                                        saves[i].result, sealed[i]);
    m.counters.saves.fetch_add(sent.size(), std::memory_order_relaxed);
    const auto send = [&](Connection& conn, int) {
        std::vector<std::string> fences;
        fences.reserve(sent.size());
        for (std::size_t i : sent) {
            fences.push_back(std::to_string(saves[i].fence));
            Impl::append_script(conn, redis::kSave, {m.record_key(saves[i].key), m.index_key},
                                {fences.back(), stored[i], member_of(saves[i].key)});
        }
        m.append_wait(conn);
        std::exception_ptr first_error;
        for (std::size_t j = 0; j < sent.size(); ++j) {
            try {
                Reply reply = m.script_reply(conn, "save_batch");
                if (redis::integer_of(*reply) < 0) {
                    throw corrupt_record("idem: save_batch: a Redis key holds a hash idem did not write");
                }
                statuses[sent[j]] = redis::integer_of(*reply) == 1 ? SaveStatus::saved : SaveStatus::lease_lost;
            } catch (const Impl::noscript&) {
                throw;
            } catch (...) {
                if (conn.broken()) throw;
                if (!first_error) first_error = std::current_exception();
            }
        }
        m.read_wait(conn, "save_batch");
        if (first_error) std::rethrow_exception(first_error);
        return 0;
    };
    // As save(): within save_retry_window the batch rides out an outage; each script recognises
    // its own earlier write, so a resent batch answers saved for the saves that landed before.
    m.with_connection("save_batch", send, m.options.save_retry_window);
    return statuses;
}

}  // namespace idem
