// The rules of a replay cache in front of a store (internal), one copy for CachedStore
// (src/cached_store.cpp) and AsyncPostgresStore's in-process cache (src/asio/store.cpp):
// what a cached record answers, and which answers of the store are kept.
//
// The cache holds records as the store hands them out (opened, when the store seals its results),
// so a hit answers what the store's own claim would. An answer is inserted with the cache's clock
// read *before* the store was asked (ReplayTier::insert's `asked_at`): the entry's expiry then
// never lies past what the database stated (its read_at is later than that moment).
#pragma once

#include "idem/store.hpp"

namespace idem::detail {

/// What a claim answers from a cached completed record: the same as the store would, with no
/// round trip (a completed record answers completed or mismatch, whatever the claim's options).
/// `keyed_fp` is the claim's fingerprint keyed as the store keys it (key_fingerprint()), so
/// claim_status() compares the cached record by its own algorithm, as the store compares its row.
/// Throws config_error as claim_status() does (a keyed record, an unkeyed fingerprint).
[[nodiscard]] inline Claim from_cache(const Record& record, const Fingerprint& keyed_fp) {
    return Claim{claim_status(record, keyed_fp), 0, record, {}};
}

/// Whether the store's answer to a claim may be kept: completed, or a mismatch on a completed
/// record whose result came with it (a sealing store drops a mismatch's result). In-progress
/// records never are (in_progress, waiting and resume mode always ask the store); the cache
/// itself also refuses a record without read_at.
[[nodiscard]] inline bool cacheable(const Claim& c) {
    return (c.status == ClaimStatus::completed || c.status == ClaimStatus::mismatch) && c.existing &&
           c.existing->state == RecordState::completed && c.existing->result;
}

}  // namespace idem::detail
