// The sides' calls (see sides.hpp).
#include "sides.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <thread>

namespace bench {
namespace {

// The key of one call of the ideal floors: a new random one, or one of the `preloaded` keys of the
// case (an index is drawn for every case, so that the random streams stay the same).
std::string case_key(Case kind, std::int64_t preloaded, Rng& rng) {
    const auto pick = rng.below(static_cast<std::uint64_t>(preloaded));
    return kind == Case::fresh      ? random_hex_key(rng)
           : kind == Case::conflict ? preloaded_key(kConflictBase, pick)
                                    : preloaded_key(kReplayBase, pick);
}

}  // namespace

void prewarm(idem::PostgresStore& store, int threads) {
    const idem::Key key(kScope, "warm-up");
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
        workers.emplace_back([&] {
            while (store.stats().connections_opened < static_cast<std::uint64_t>(threads) && Clock::now() < deadline) {
                (void)store.read(key);
            }
        });
    }
    for (auto& w : workers) w.join();
}

bool LibraryOp::operator()(int thread, Rng& rng) const {
    idem::IdempotencyStore& store = *stores[static_cast<std::size_t>(thread) % stores.size()];
    const auto effect = [] { return kResult; };  // the no-op effect
    switch (kind) {
        case Case::fresh: {
            const idem::Key key(kScope, random_hex_key(rng));
            return idem::execute_once(store, key, fp, effect).outcome() == idem::Outcome::executed;
        }
        case Case::replay:
        case Case::replay_cached: {
            const idem::Key key(kScope, preloaded_key(kReplayBase, rng.below(static_cast<std::uint64_t>(preloaded))));
            const auto r = idem::execute_once(store, key, fp, effect);
            return r.outcome() == idem::Outcome::replayed && r.response() == kResult;
        }
        case Case::conflict: {
            const idem::Key key(kScope, preloaded_key(kConflictBase, rng.below(static_cast<std::uint64_t>(preloaded))));
            return idem::execute_once(store, key, fp, effect).outcome() == idem::Outcome::in_progress;
        }
    }
    return false;
}

bool FloorOp::operator()(int thread, Rng& rng) const {
    FloorClient& c = *clients[static_cast<std::size_t>(thread)];
    const std::int64_t fence = random_fence(rng);
    switch (kind) {
        case Case::fresh: {
            const std::string key = random_hex_key(rng);
            if (c.claim(kScope, key, fp, 1, fence, kLeaseMs, kRetentionS) != FloorClient::Answer::claimed) {
                return false;
            }
            return c.save(kScope, key, fence, kResult);
        }
        case Case::replay:
        case Case::replay_cached: {
            const std::string key = preloaded_key(kReplayBase, rng.below(static_cast<std::uint64_t>(preloaded)));
            return c.claim(kScope, key, fp, 1, fence, kLeaseMs, kRetentionS) == FloorClient::Answer::completed;
        }
        case Case::conflict: {
            const std::string key = preloaded_key(kConflictBase, rng.below(static_cast<std::uint64_t>(preloaded)));
            return c.claim(kScope, key, fp, 1, fence, kLeaseMs, kRetentionS) == FloorClient::Answer::in_progress;
        }
    }
    return false;
}

bool IdealOp::operator()(int, Rng& rng) const {
    keys.clear();
    fences.clear();
    for (std::size_t i = 0; i < group; ++i) {
        keys.push_back(case_key(kind, preloaded, rng));
        fences.push_back(random_fence(rng));
    }
    std::sort(keys.begin(), keys.end());  // as PostgresStore sorts a batch
    const auto c = client->claim(kScope, keys, fp, 1, fences, kLeaseMs, kRetentionS);
    switch (kind) {
        case Case::fresh: return c.inserted == group && client->save(kScope, keys, fences, kResult) == group;
        case Case::replay:
        case Case::replay_cached: return c.inserted == 0 && c.completed == group;
        case Case::conflict: return c.inserted == 0 && c.in_progress == group;
    }
    return false;
}

bool IdealGather::arrive(int phase, Case kind, std::string key, std::int64_t fence, std::string_view fp) {
    std::unique_lock lock(mutex_);
    // Callers move in lockstep: a caller a round ahead (a save after the others' claims) cannot
    // exist, since everyone waits for everyone.
    round_.emplace_back(std::move(key), fence);
    phase_ = phase;
    kind_ = kind;
    fp_ = fp;
    const std::uint64_t mine = generation_;
    if (round_.size() == callers_) {
        send(lock);
    } else {
        cv_.wait(lock, [&] { return generation_ != mine; });
    }
    if (!error_.empty()) throw std::runtime_error(error_);
    return good_;
}

void IdealGather::leave() noexcept {
    std::unique_lock lock(mutex_);
    --callers_;
    if (!round_.empty() && round_.size() == callers_) send(lock);
}

void IdealGather::send(std::unique_lock<std::mutex>&) noexcept {
    const std::size_t n = round_.size();
    try {
        std::sort(round_.begin(), round_.end());  // as PostgresStore sorts a batch
        keys_.clear();
        fences_.clear();
        for (auto& [k, f] : round_) {
            keys_.push_back(k);
            fences_.push_back(f);
        }
        if (phase_ == 0) {
            const auto c = client_->claim(kScope, keys_, fp_, 1, fences_, kLeaseMs, kRetentionS);
            good_ = kind_ == Case::fresh      ? c.inserted == n
                    : kind_ == Case::conflict ? c.inserted == 0 && c.in_progress == n
                                              : c.inserted == 0 && c.completed == n;
        } else {
            good_ = client_->save(kScope, keys_, fences_, kResult) == n;
        }
    } catch (const std::exception& e) {
        error_ = e.what();
    }
    round_.clear();
    ++generation_;
    cv_.notify_all();
}

bool IdealThreadsOp::operator()(int, Rng& rng) const {
    std::string key = case_key(kind, preloaded, rng);
    const std::int64_t fence = random_fence(rng);
    const bool claimed = gather.arrive(0, kind, key, fence, fp);
    if (kind != Case::fresh) return claimed;
    return gather.arrive(1, kind, std::move(key), fence, fp) && claimed;  // the no-op effect, then the save
}

}  // namespace bench
