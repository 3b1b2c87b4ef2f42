// Group commit: leader/follower combining of concurrent calls into shared transactions (internal).
//
// A caller join()s. While fewer than `limit` groups are in flight it leads at once, alone: no timer,
// no added latency at low load. Otherwise it queues; when a leader finish()es, the whole queue
// becomes the next group and its first member leads it (the finishing leader does not run it: its
// own caller would wait one more round trip). A queued caller waits at most `patience`
// (PostgresOptions::pool_wait), then leaves and goes alone. The leader sends the group, writes every member's
// answer, then finish()es, which wakes the members. Members live on their callers' stacks.
//
// Invariant: the queue is non-empty only while `limit` groups are in flight, so a group in flight
// always has a successor ready when the queue is not empty. Thread-safe.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <vector>

namespace idem::pg {

class Combiner {
public:
    struct Member {
        std::condition_variable cv;
        enum class State { queued, grouped, lead, answered } state = State::queued;
        std::vector<Member*> group;  // set when this member is promoted to lead a queued group
    };

    explicit Combiner(std::size_t limit) : limit_(limit) {}

    enum class Role { lead, answered, alone };

    /// Blocks until `me` leads a group (`group` gets it, `me` first), another leader answered it, or
    /// it waited `patience` in the queue (groups in flight stuck, e.g. on a lock, or holding every
    /// pooled connection): then it left the queue and the caller goes on alone, as it would without
    /// group commit.
    Role join(Member& me, std::chrono::milliseconds patience, std::vector<Member*>& group) {
        std::unique_lock lock(mutex_);
        if (in_flight_ < limit_) {
            ++in_flight_;
            group.assign(1, &me);
            return Role::lead;
        }
        queue_.push_back(&me);
        if (!me.cv.wait_for(lock, patience, [&] { return me.state != Member::State::queued; })) {
            queue_.erase(std::find(queue_.begin(), queue_.end(), &me));  // still queued: in no group
            return Role::alone;
        }
        // In a group now: its leader writes into `me`, so wait for the answer however long it takes
        // (the group's round trip is bounded by the statement deadline).
        me.cv.wait(lock, [&] { return me.state != Member::State::grouped; });
        if (me.state == Member::State::answered) return Role::answered;
        group = std::move(me.group);
        return Role::lead;
    }

    /// The leader of `group` (group[0]) has answered every member: wakes them, hands the queue on.
    void finish(const std::vector<Member*>& group) noexcept {
        std::lock_guard lock(mutex_);
        for (std::size_t i = 1; i < group.size(); ++i) {
            group[i]->state = Member::State::answered;
            group[i]->cv.notify_one();
        }
        if (queue_.empty()) {
            --in_flight_;
            return;
        }
        Member* next = queue_.front();
        for (Member* m : queue_) m->state = Member::State::grouped;
        next->group = std::move(queue_);
        queue_.clear();
        next->state = Member::State::lead;
        next->cv.notify_one();
    }

private:
    const std::size_t limit_;
    std::mutex mutex_;
    std::vector<Member*> queue_;
    std::size_t in_flight_ = 0;
};

}  // namespace idem::pg
