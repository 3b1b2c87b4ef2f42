// How every store applies SealingOptions (idem/sealing.hpp) at its boundary: results are sealed
// once, when a save enters the store (so every retry of that save, and the recognition of an
// earlier attempt's write, see the same stored bytes), and opened when a record leaves it. Each is
// bound to its key, the fence of the claim that saved it and the store's deployment: `own` is the
// store's table or key prefix, which SealingOptions::context replaces when set.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "idem/errors.hpp"
#include "idem/sealing.hpp"
#include "idem/store.hpp"

namespace idem::detail {

/// Throws config_error for a keyring that is set but empty (a store's constructor).
inline void check_sealing(const SealingOptions& sealing) {
    if (sealing.keyring && sealing.keyring->empty()) {
        throw config_error(
            "idem: SealingOptions::keyring holds no key; add one, or leave it null to store results as "
            "given");
    }
}

/// What a store's sealed results are bound to beside key and claim.
[[nodiscard]] inline SealBinding binding(const SealingOptions& sealing, std::string_view own, Fence fence) noexcept {
    return SealBinding{fence, sealing.context.empty() ? own : std::string_view(sealing.context)};
}

/// The bytes to store for `result`, saved by the claim of `fence`: sealed into `buffer` when
/// sealing is on, else `result` itself.
[[nodiscard]] inline std::string_view seal_result(const SealingOptions& sealing, std::string_view own, const Key& key,
                                                  Fence fence, std::string_view result, std::string& buffer) {
    if (!sealing.keyring) return result;
    buffer = seal(*sealing.keyring, key, result, binding(sealing, own, fence));
    return buffer;
}

/// Opens in place a stored result of the claim of `fence`; throws corrupt_record when it does not
/// open.
inline void open_result(const SealingOptions& sealing, std::string_view own, const Key& key, Fence fence,
                        std::optional<std::string>& result) {
    if (!sealing.keyring || !result) return;
    if (sealing.open_unsealed && !looks_sealed(*result)) return;  // written before sealing was on
    result = open_sealed(*sealing.keyring, key, *result, binding(sealing, own, fence), sealing.open_format_1);
}

/// Opens a record read back for `key` (its result belongs to the record's fence).
inline void open_record(const SealingOptions& sealing, std::string_view own, const Key& key,
                        std::optional<Record>& record) {
    if (record) open_result(sealing, own, key, record->fence, record->result);
}

/// With sealing on, a mismatch never replays: its record's result is dropped (unopened, when it
/// comes from the database), so a reused key answers mismatch whether or not that result opens.
/// Returns whether it dropped it.
inline bool drop_mismatch_result(const SealingOptions& sealing, Claim& claim) {
    if (!sealing.keyring || claim.status != ClaimStatus::mismatch || !claim.existing) return false;
    claim.existing->result.reset();
    return true;
}

/// Opens the record a claim found (a mismatch's result is dropped: drop_mismatch_result).
inline void open_claim(const SealingOptions& sealing, std::string_view own, const Key& key, Claim& claim) {
    if (drop_mismatch_result(sealing, claim)) return;
    open_record(sealing, own, key, claim.existing);
}

}  // namespace idem::detail
