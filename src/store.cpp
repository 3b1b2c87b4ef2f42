#include "idem/store.hpp"

namespace idem {

ClaimStatus classify(const Record& existing, const Fingerprint& fp) noexcept {
    // The fingerprint is checked first: a reused key with another request is the client's error
    // whatever state the first request is in.
    if (!(existing.fingerprint == fp)) return ClaimStatus::mismatch;
    return existing.state == RecordState::completed ? ClaimStatus::completed : ClaimStatus::in_progress;
}

}  // namespace idem
