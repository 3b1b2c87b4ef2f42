// Group commit: leader/follower combining of concurrent calls into shared transactions (internal).
//
// A caller join()s. While fewer than `limit` groups are in flight it leads at once: no timer. Its
// group is itself and whoever queued while it waited for a connection (absorb()). Otherwise it
// queues. A leader sends its group, writes every
// member's answer, and then relays: take_next() makes the whole queue the next group, which the
// finishing leader usually sends itself on the connection it holds (the server starts on it at
// once, instead of after the next leader's thread has been woken and scheduled: on two cores that
// wake-up was most of a group's time), then hand_over() gives it to the group's first member, who
// reads its answers and leads it; finally answered() wakes the finishing leader's own members. A
// queued caller waits at most until its `deadline` (its wait for a connection: pool_wait from when it
// found none free), then leaves and goes alone.
// Members live on their callers' stacks.
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
        std::vector<Member*> group;                      // set when this member is promoted to lead a queued group
        std::chrono::steady_clock::time_point deadline;  // when its wait for a connection ends
    };

    explicit Combiner(std::size_t limit) : limit_(limit) {}

    enum class Role { lead, answered, alone };

    /// Blocks until `me` leads a group (`group` gets it, `me` first), another leader answered it, or
    /// its deadline passed in the queue (groups in flight stuck, e.g. on a lock, or holding every
    /// pooled connection): then it left the queue and the caller goes on alone, as it would without
    /// group commit (its wait for a connection ends at the same deadline).
    Role join(Member& me, std::vector<Member*>& group) {
        std::unique_lock lock(mutex_);
        if (in_flight_ < limit_) {
            ++in_flight_;
            group.assign(1, &me);
            return Role::lead;
        }
        queue_.push_back(&me);
        if (!me.cv.wait_until(lock, me.deadline, [&] { return me.state != Member::State::queued; })) {
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

    /// Callers in the queue now.
    std::size_t queued() noexcept {
        std::lock_guard lock(mutex_);
        return queue_.size();
    }

    /// A leader that has just got its connection takes every caller queued meanwhile into its own
    /// group (appended to `group`, in arrival order): they would otherwise wait for this group's
    /// round trip before their own. They now wait for an answer however long it takes.
    void absorb(std::vector<Member*>& group) noexcept {
        std::lock_guard lock(mutex_);
        for (Member* m : queue_) m->state = Member::State::grouped;
        group.insert(group.end(), queue_.begin(), queue_.end());
        queue_.clear();
    }

    /// A leader is done with its group's round trip. Returns false when nobody is queued (one group
    /// fewer in flight). Otherwise `next` gets the whole queue, in arrival order, as the next group
    /// (still in flight: the caller must hand_over() it); its members now wait for an answer however
    /// long it takes.
    bool take_next(std::vector<Member*>& next) noexcept {
        std::lock_guard lock(mutex_);
        if (queue_.empty()) {
            --in_flight_;
            return false;
        }
        for (Member* m : queue_) m->state = Member::State::grouped;
        next.swap(queue_);
        queue_.clear();
        return true;
    }

    /// Makes next[0] the leader of `next` (from take_next()) and wakes it.
    void hand_over(std::vector<Member*>&& next) noexcept {
        std::lock_guard lock(mutex_);
        Member* lead = next.front();
        lead->group = std::move(next);
        lead->state = Member::State::lead;
        lead->cv.notify_one();
    }

    /// The leader of `group` (group[0]) has written every member's answer: wakes them.
    void answered(const std::vector<Member*>& group) noexcept {
        std::lock_guard lock(mutex_);
        for (std::size_t i = 1; i < group.size(); ++i) {
            group[i]->state = Member::State::answered;
            group[i]->cv.notify_one();
        }
    }

private:
    const std::size_t limit_;
    std::mutex mutex_;
    std::vector<Member*> queue_;
    std::size_t in_flight_ = 0;
};

}  // namespace idem::pg
