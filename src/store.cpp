#include "idem/store.hpp"

#include <cstring>
#include <limits>
#include <string>

#include "idem/errors.hpp"

namespace idem {

response_too_large detail::result_too_large(std::string result, std::size_t max_bytes, std::string_view note) {
    std::string what = "idem: result of " + std::to_string(result.size()) + " bytes exceeds max_result_bytes " +
                       std::to_string(max_bytes);
    if (!note.empty()) what.append(" ").append(note);
    return response_too_large(what, std::move(result));
}

namespace {

// Whether a found record's fingerprint names the request of `fp`. The row's algorithm decides
// what it is compared with: a plain row (written without a FingerprintSecret, or before one was
// set) with the request's plain SHA-256, a keyed row with the request's keyed digest. So a store
// given a secret replays and refuses rows of both kinds correctly.
bool same_request(const Fingerprint& stored, const Fingerprint& fp) {
    if (stored.algorithm() == FingerprintAlgorithm::sha256) {
        const Fingerprint::Digest* plain = fp.plain_digest();
        return plain != nullptr && std::memcmp(plain->data(), stored.digest().data(), Fingerprint::size) == 0;
    }
    if (stored.algorithm() == FingerprintAlgorithm::hmac_sha256 && fp.algorithm() == FingerprintAlgorithm::sha256) {
        // Not a mismatch: the request may well be the same one. Running it again would be worse.
        throw config_error(
            "idem: the stored record's fingerprint is keyed (hmac-sha256) but this store has no "
            "fingerprint_secret: rows were keyed; configure fingerprint_secret");
    }
    return stored == fp;
}

}  // namespace

ClaimStatus claim_status(const Record& existing, const Fingerprint& fp) {
    // The fingerprint is checked first: a reused key with another request is the client's error
    // whatever state the first request is in.
    if (!same_request(existing.fingerprint, fp)) return ClaimStatus::mismatch;
    return existing.state == RecordState::completed ? ClaimStatus::completed : ClaimStatus::in_progress;
}

}  // namespace idem

namespace idem {

std::vector<Claim> IdempotencyStore::claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                                 const ClaimOptions& options) {
    if (keys.size() != fps.size()) throw config_error("idem: claim_batch needs one fingerprint per key");
    std::vector<Claim> claims;
    claims.reserve(keys.size());
    try {
        for (std::size_t i = 0; i < keys.size(); ++i) claims.push_back(claim(keys[i], fps[i], options));
    } catch (...) {
        // Never strand a won claim whose effect will not run.
        for (std::size_t i = 0; i < claims.size(); ++i) {
            if (claims[i].status != ClaimStatus::claimed) continue;
            try {
                release(keys[i], claims[i].fence);
            } catch (const error&) {
            }
        }
        throw;
    }
    return claims;
}

std::size_t IdempotencyStore::count_stale(const ScopeFilter& scopes) {
    return list_stale(std::numeric_limits<std::size_t>::max(), scopes).size();
}

std::vector<SaveStatus> IdempotencyStore::save_batch(std::span<const SaveRequest> saves) {
    std::vector<SaveStatus> statuses;
    statuses.reserve(saves.size());
    for (const SaveRequest& s : saves) {
        try {
            save(s.key, s.fence, s.result);
            statuses.push_back(SaveStatus::saved);
        } catch (const lease_lost&) {
            statuses.push_back(SaveStatus::lease_lost);
        } catch (const response_too_large&) {
            statuses.push_back(SaveStatus::too_large);
        }
    }
    return statuses;
}

}  // namespace idem
