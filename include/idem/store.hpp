// idem/store.hpp — IdempotencyStore: the interface every backend implements.
//
// A key moves through these states (docs/design.md has the full machine and who may take each step):
//
//   (none) --claim--> in_progress{fence, lease} --save(fence)--> completed{result, expires_at}
//                       |  |  |                                          |
//                       |  |  +--release(fence): effect certainly not done--> (none)
//                       |  +--lease passes: still in_progress to clients;     | expires_at passes
//                       |       take_over(old fence) -> in_progress{new fence} v
//                       |       (a reconciler, or a retry in resume mode)  expired --claim--> in_progress
//                       +--extend_lease / record_phase (fence holder only)     purge_expired --> (none)
//
// * claim() is the only way to create a record, and the database arbitrates it: exactly one of any
//   number of concurrent claims on a key wins. The winning claim is durable (committed) before
//   claim() returns. Losers get the existing record, classified as in_progress, completed or mismatch.
//   A completed record past its retention counts as absent: the claim takes it over atomically.
//   An in-progress key never expires: its outcome is unknown until someone resolves it.
// * Every write after the claim names the fence token it holds. A write whose fence no longer owns
//   the key throws lease_lost and changes nothing.
// * Stores are reconnect-safe: a claim/save/release interrupted by a broken connection is retried on
//   a fresh one with the same fence, and recognises its own earlier write.
//
// Thread-safety: every member function may be called from any number of threads at once, except
// set_observer(), which must happen before the store is shared.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "idem/fingerprint.hpp"
#include "idem/key.hpp"
#include "idem/observer.hpp"

namespace idem {

/// Proof of ownership of a claimed key: random, 63 bits, never reused in practice.
using Fence = std::int64_t;

/// Per-call settings; what is left empty takes the store's default.
struct ClaimOptions {
    /// How long the claimer owns the key before it counts as stale (default 30 s).
    std::optional<std::chrono::milliseconds> lease{};
    /// How long the completed record (and so the replay) is kept, from the claim (default 24 h).
    std::optional<std::chrono::seconds> retention{};
    /// Resume mode (opt-in): a key in progress whose lease has passed, claimed again with the same
    /// fingerprint, is taken over (new fence, attempt + 1) and the effect runs again. Only for
    /// effects whose downstream deduplicates by the same key.
    bool resume_stale = false;
    /// Wait instead of in_progress (opt-in): wait up to this long for the running attempt to save
    /// its result, and replay it; the key is read once more at the wait's end, then in_progress.
    /// Zero answers in_progress at once. How a store hears of the save (a notification, polling
    /// the key) is its own: its header says.
    std::chrono::milliseconds wait{0};
};

/// A stored record's state: claimed and running (or of unknown outcome), or completed with its
/// result.
enum class RecordState { in_progress, completed };

/// "in_progress" or "completed".
[[nodiscard]] constexpr std::string_view to_string(RecordState state) noexcept {
    return state == RecordState::in_progress ? "in_progress" : "completed";
}

/// A stored key, as read back.
struct Record {
    RecordState state = RecordState::in_progress;  ///< in progress, or completed with a result
    /// The fingerprint of the request that claimed the key, as stored (sha256, or hmac_sha256 from
    /// a store with a FingerprintSecret).
    Fingerprint fingerprint{FingerprintAlgorithm::sha256, {}};
    Fence fence = 0;  ///< the fence token of the current owner
    /// 1 for the first attempt; resume-mode takeovers add one.
    std::int32_t attempt = 1;
    /// The stored result bytes; set when state == completed.
    std::optional<std::string> result{};
    /// The last recovery point the effect recorded (record_phase), and its data.
    std::optional<std::string> phase{};
    std::optional<std::string> phase_data{};             ///< the data recorded with `phase`
    std::chrono::system_clock::time_point created_at{};  ///< when the key was claimed
    /// When the owner's lease passes (in progress).
    std::chrono::system_clock::time_point lease_until{};
    std::chrono::system_clock::time_point expires_at{};  ///< when the retention passes (completed)
    /// When the record was read, by the store's clock (a database's: its now() when it read the
    /// record). expires_at - read_at is the retention left as
    /// the store stated it, whatever the local clock says (the replay cache relies on it). Left
    /// at the epoch by a store that does not know it.
    std::chrono::system_clock::time_point read_at{};
    /// As of the read, by the database's clock: the lease has passed (in progress only) / the
    /// retention has passed (completed only).
    bool lease_expired = false;
    bool expired = false;  ///< the retention has passed (completed only)
};

/// What a claim decided: this call owns the key, another call does, the key is completed (replay),
/// or the key was used with another fingerprint.
enum class ClaimStatus { claimed, in_progress, completed, mismatch };

/// What claim() decided.
struct Claim {
    ClaimStatus status = ClaimStatus::in_progress;  ///< what the claim decided
    /// claimed: the token every later write for this key must carry.
    Fence fence = 0;
    /// in_progress, completed, mismatch: the record found. claimed after a resume-mode takeover:
    /// the record as the takeover left it — this attempt's fence, attempt number and lease, the
    /// earlier attempt's phase and phase data.
    std::optional<Record> existing{};
    /// in_progress: when the client should try again.
    std::chrono::milliseconds retry_after{0};
    /// claimed after a resume-mode takeover: the fence of the attempt taken over (which can no
    /// longer write the key); 0 otherwise, and when a takeover whose first answer was lost is
    /// recognised from the record alone (RedisStore).
    Fence taken_over_fence = 0;
};

/// An in-progress key whose lease has passed: its owner crashed, hangs, or met an unknown outcome.
struct StaleKey {
    Key key;          ///< the key
    Record record{};  ///< its record, as listed
};

/// One save of a batch (see IdempotencyStore::save_batch).
struct SaveRequest {
    const Key& key;             ///< the key to complete
    Fence fence = 0;            ///< the fence token of its claim
    std::string_view result{};  ///< the encoded result to store
};

/// What save_batch did with one save: stored; refused because the fence lost the key; refused
/// because the result exceeds max_result_bytes().
enum class SaveStatus { saved, lease_lost, too_large };

/// Counters since the store was made. A "round trip" is one wait for the database's answer: a
/// pipeline of statements flushed together counts once. Connection set-up is not counted.
struct StoreStats {
    std::uint64_t round_trips = 0;  ///< waits for the database's answer
    std::uint64_t claims = 0;       ///< claim() calls
    std::uint64_t claims_won = 0;   ///< claims that created (or took over) the record
    std::uint64_t saves = 0;        ///< save() calls (and saves of a batch)
    std::uint64_t releases = 0;     ///< release() calls
    std::uint64_t reads = 0;        ///< read() calls
    /// Statements retried (broken connection, 40001, 55P03...).
    std::uint64_t retries = 0;
    std::uint64_t connections_opened = 0;     ///< database connections opened
    std::uint64_t connections_discarded = 0;  ///< closed after an error or a failed health check
    // A store that groups concurrent calls into shared transactions reports it apart
    // (group_commit_stats(), idem/group_commit_stats.hpp).
};

/// The interface every backend implements (see the top of this header for the states of a key).
/// Implemented by PostgresStore, idem::asio::AsyncPostgresStore, RedisStore (idem/redis/store.hpp),
/// MemoryStore and CachedStore.
class IdempotencyStore {
public:
    virtual ~IdempotencyStore() = default;

    /// Claims `key` for a request with fingerprint `fp`. Durable before it returns.
    /// Throws store_unavailable (nothing claimed by this call) or database_error.
    [[nodiscard]] virtual Claim claim(const Key& key, const Fingerprint& fp, const ClaimOptions& options = {}) = 0;

    /// Completes the key with `result`. Throws lease_lost if `fence` no longer owns it,
    /// response_too_large if result.size() > max_result_bytes() (before any I/O),
    /// store_unavailable / database_error otherwise.
    virtual void save(const Key& key, Fence fence, std::string_view result) = 0;

    /// Deletes an in-progress claim whose effect certainly did not happen, so the key may run again.
    /// Throws lease_lost if `fence` no longer owns it.
    virtual void release(const Key& key, Fence fence) = 0;

    /// Claims many keys at once: claims[i] answers keys[i] with fps[i], exactly as claim() would.
    /// Keys must be distinct. A store may claim them together (its header says how); the default
    /// runs claim() for each. Throws like claim() for failures of the whole batch, releasing what
    /// it had won.
    [[nodiscard]] virtual std::vector<Claim> claim_batch(std::span<const Key> keys, std::span<const Fingerprint> fps,
                                                         const ClaimOptions& options = {});

    /// Saves many results at once; statuses[i] answers saves[i] (a store may save them together:
    /// its header says how). A fence that lost its key gets lease_lost and changes nothing; a
    /// result over max_result_bytes() gets too_large; the others are saved. Throws for
    /// whole-batch failures.
    [[nodiscard]] virtual std::vector<SaveStatus> save_batch(std::span<const SaveRequest> saves);

    /// Heartbeat: the fence holder extends its lease to now + `lease`. Throws lease_lost.
    virtual void extend_lease(const Key& key, Fence fence, std::chrono::milliseconds lease) = 0;

    /// Recovery point: the fence holder records the phase it reached and small data (e.g. the
    /// provider's id), so a resumed attempt or the reconciler continues from there. Throws lease_lost.
    virtual void record_phase(const Key& key, Fence fence, std::string_view phase, std::string_view data) = 0;

    /// Takes over an in-progress key whose lease has passed and whose fence is still `stale_fence`:
    /// gives it a new fence and a lease of `lease`. `new_attempt` adds one to the attempt number
    /// (resume mode: the effect runs again); a reconciler passes false. Exactly one of several
    /// concurrent takers succeeds; the others get nullopt. The old fence holder gets lease_lost
    /// from any later write.
    [[nodiscard]] virtual std::optional<Fence> take_over(const Key& key, Fence stale_fence,
                                                         std::chrono::milliseconds lease, bool new_attempt) = 0;

    /// The stored record, if any (expired records included until purged).
    [[nodiscard]] virtual std::optional<Record> read(const Key& key) = 0;

    /// Up to `limit` in-progress keys whose lease has passed, oldest lease first, in the scopes
    /// `scopes` selects (see ScopeFilter: all, one exact scope, or a literal prefix). Listing takes
    /// nothing: take_over() does. A row that cannot be decoded is left out and
    /// reported to the observer (Event::reconcile_failed with its key); it still counts towards
    /// `limit`, so a listing may return fewer keys than it was allowed.
    [[nodiscard]] virtual std::vector<StaleKey> list_stale(std::size_t limit,
                                                           const ScopeFilter& scopes = ScopeFilter::all()) = 0;

    /// How many in-progress keys whose lease has passed are in `scopes` now: the keys list_stale
    /// would return with no limit (rows that cannot be decoded included). The backlog of unknown
    /// outcomes no one holds; a key a reconciler took and left counts again once its lease passes.
    /// The default lists them all (list_stale) and counts them: a store of your own should
    /// override it.
    [[nodiscard]] virtual std::size_t count_stale(const ScopeFilter& scopes = ScopeFilter::all());

    /// Deletes completed records past their retention, `batch_size` rows per transaction, skipping
    /// rows another session has locked, until none is left or `max_batches` ran. Returns how many
    /// were deleted. Never waits on a claim, and claims of live keys never wait on it.
    virtual std::size_t purge_expired(std::size_t batch_size = 1000, std::size_t max_batches = SIZE_MAX) = 0;

    /// Counters since the store was made.
    [[nodiscard]] virtual StoreStats stats() const = 0;

    /// Largest result save() accepts, in bytes.
    [[nodiscard]] virtual std::size_t max_result_bytes() const noexcept = 0;

    /// The fingerprint this store writes for a new claim of a request whose fingerprint is `fp`,
    /// and compares found records with (claim_status()): `fp` itself by default; keyed with the
    /// store's FingerprintSecret when it has one (idem/fingerprint_secret.hpp). claim() and
    /// claim_batch() key by themselves: callers pass the plain fingerprint. A store wrapping
    /// another (CachedStore) answers for the store it wraps.
    [[nodiscard]] virtual Fingerprint key_fingerprint(const Fingerprint& fp) const { return fp; }

    /// Observer of this store's events (execute_once, reconciler, purge report here too).
    /// Set it before sharing the store between threads.
    void set_observer(std::shared_ptr<Observer> observer) noexcept { observer_ = std::move(observer); }
    /// The observer set with set_observer(), or null.
    [[nodiscard]] Observer* observer() const noexcept { return observer_.get(); }
    /// Reports an event to the observer, if any.
    void emit(Event event, const Key* key, std::chrono::nanoseconds duration = {}, std::uint64_t count = 1,
              std::string_view detail = {}) const noexcept {
        if (observer_) observer_->on_event(EventInfo{event, key, duration, count, detail});
    }

protected:
    /// For implementations.
    IdempotencyStore() = default;
    /// For implementations (copies the observer).
    IdempotencyStore(const IdempotencyStore&) = default;
    /// For implementations (copies the observer).
    IdempotencyStore& operator=(const IdempotencyStore&) = default;

private:
    std::shared_ptr<Observer> observer_;
};

/// How a found record answers a claim for fingerprint `fp` (shared by every backend): mismatch
/// when the record was claimed by another request, else its state. `fp` is the claim's fingerprint
/// as the store keys it (IdempotencyStore::key_fingerprint()). The record's algorithm decides the
/// comparison: a sha256 record is compared with fp's plain digest, an hmac_sha256 one with fp's
/// keyed digest (a store moving to a FingerprintSecret still replays the rows written before).
/// Throws config_error for a keyed record and an unkeyed `fp` (a store without the secret its
/// rows were written with): neither a mismatch nor a reason to run the effect again.
[[nodiscard]] ClaimStatus claim_status(const Record& existing, const Fingerprint& fp);

}  // namespace idem
