// The two sides' calls of --store redis and --store tiered: the floor (raw hiredis sending the
// library's own scripts by hand) and the library's (a store's pool opened, execute_once checked).
#pragma once

#include <idem/idem.hpp>

#include <cstdint>
#include <string>
#include <string_view>

#include "options.hpp"
#include "raw.hpp"

namespace bench::redis {

/// The floor: one connection, the library's claim and save scripts sent by hand.
class Floor {
public:
    Floor(const Options& o, Names names, std::string_view fp_alg, std::string_view fp);
    /// The claim script's tag ("claimed" / "found" ...) and, for a found record, its state and result.
    struct Answer {
        std::string_view tag, state, result;
        Reply reply{nullptr, &freeReplyObject};
    };
    Answer claim(const std::string& key, std::int64_t fence);
    bool save(const std::string& key, std::int64_t fence);
    [[nodiscard]] std::uint64_t round_trips() const noexcept { return round_trips_; }

private:
    Raw raw_;
    Names names_;
    std::string fp_alg_, fp_, claim_sha_, save_sha_;
    std::uint64_t round_trips_ = 0;
};

// Opens `connections` pooled connections of a store before anything is timed (the pools open
// them lazily): reads from as many threads until the store has opened that many, 5 s at most.
void prewarm(idem::IdempotencyStore& store, int connections);

/// execute_once with the no-op effect: true when the outcome is `want` (and a replay's result is
/// the preloaded one).
bool execute(idem::IdempotencyStore& store, const idem::Key& key, const idem::Fingerprint& fp, idem::Outcome want);

}  // namespace bench::redis
