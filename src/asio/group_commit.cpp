// idem::asio's group commit (docs/design.md, "The asynchronous path"): the queue of first
// attempts, and the groups that run the plans of src/postgres/sansio/group_plan.hpp on the strand.
#include "store_impl.hpp"

namespace idem::asio {

template <class Member>
net::awaitable<void> AsyncPostgresStore::Impl::wait_in(std::deque<Member*>& queue, Member& me) {
    co_await net::async_initiate<decltype(net::use_awaitable), void()>(
        [this, &queue, &me](auto handler) {
            me.wake.emplace(std::move(handler));
            queue.push_back(&me);
            publish_queued();
        },
        net::use_awaitable);
}

// One handler for the whole group: each member's coroutine runs on in turn (to its next
// suspension), as if each had its own posted handler, without a post per member.
template <class Member>
void AsyncPostgresStore::Impl::wake_all(std::vector<Member*>& group) {
    std::vector<net::any_completion_handler<void()>> wakes;
    wakes.reserve(group.size());
    for (Member* m : group) wakes.emplace_back(std::move(*m->wake));
    net::post(strand, [wakes = std::move(wakes)]() mutable {
        for (auto& h : wakes) std::move(h)();
    });
}

// The size of the next group: up to kLargestGroup members, and for saves up to
// kLargestSaveGroupBytes of results (one statement of tens of megabytes would run into its own
// deadline); at least one.
template <class Member>
std::size_t AsyncPostgresStore::Impl::group_size(const std::deque<Member*>& queue) noexcept {
    std::size_t n = std::min(queue.size(), kLargestGroup);
    if constexpr (std::is_same_v<Member, SaveMember>) {
        std::size_t bytes = 0;
        for (std::size_t i = 0; i < n; ++i) {
            bytes += queue[i]->result.size();
            if (i > 0 && bytes > kLargestSaveGroupBytes) return i;
        }
    }
    return n;
}

template <class Member>
std::vector<Member*> AsyncPostgresStore::Impl::next_group(std::deque<Member*>& queue) {
    const auto n = static_cast<std::ptrdiff_t>(group_size(queue));
    std::vector<Member*> group(queue.begin(), queue.begin() + n);
    queue.erase(queue.begin(), queue.begin() + n);
    return group;
}

// Group commit on: a queue's group goes out while no transaction is in flight (`in_flight`: claims
// and saves), or when it is full (the queue holds more than one transaction takes). Off: whenever a
// slot is free.
template <class Member>
bool AsyncPostgresStore::Impl::may_launch(const std::deque<Member*>& queue, std::size_t in_flight) const noexcept {
    if (queue.empty()) return false;
    if (!options.group_commit || in_flight == 0) return true;
    const std::size_t n = group_size(queue);
    return n == kLargestGroup || n < queue.size();
}

void AsyncPostgresStore::Impl::schedule_launch() {
    if (launch_pending) return;
    launch_pending = true;
    net::post(strand, [self = shared_from_this()] {
        self->launch_pending = false;
        self->launch_groups();
    });
}

// Group commit off: the queue's first member goes now, alone, in the transaction slot the caller
// counted for it.
template <class Member>
void AsyncPostgresStore::Impl::give_turn(std::deque<Member*>& queue) {
    Member* m = queue.front();
    queue.pop_front();
    m->turn = true;
    net::post(strand, [h = std::move(*m->wake)]() mutable { std::move(h)(); });
}

// While nothing is in flight every queue goes, one group each (more only for full groups), so
// that their commits reach the server together and share a flush; while a transaction is in
// flight, only a full group. Order, for when slots run short: saves first — a save ends its call,
// a claim starts one more — except right after a save group, so that effects ending one after
// another cannot hold claims back for longer than one transaction. Group commit off: one member
// at a time, each alone, saves first.
void AsyncPostgresStore::Impl::launch_groups() {
    const std::size_t in_flight = claims_in_flight + saves_in_flight;  // before this launch
    bool saves_sent = false, claims_sent = false;
    while (transaction_slot_free()) {
        // What a partial group of each queue waits for (may_launch: nothing, or it goes only full).
        const bool save = may_launch(save_queue, saves_sent ? 1 : in_flight);
        const bool claim = may_launch(claim_queue, claims_sent ? 1 : in_flight);
        if (save && !(claim && claims_next)) {
            ++saves_in_flight;
            saves_sent = true;
            if (options.group_commit) {
                net::co_spawn(strand, run_save_group(next_group(save_queue)), net::detached);
            } else {
                give_turn(save_queue);
            }
        } else if (claim) {
            ++claims_in_flight;
            claims_sent = true;
            if (options.group_commit) {
                net::co_spawn(strand, run_claim_group(next_group(claim_queue)), net::detached);
            } else {
                give_turn(claim_queue);
            }
        } else {
            break;
        }
        claims_next = false;
    }
    publish_queued();
}

// A claim's first round trip: alone at once while no transaction is in flight and nobody queues
// (group commit off: while a connection has no transaction), else in the next group (group commit
// off: alone, when its turn comes).
net::awaitable<void> AsyncPostgresStore::Impl::claim_first(ClaimMember& me) {
    if (citus_seen || may_go_alone(true)) {
        ++claims_in_flight;
    } else {
        schedule_launch();
        co_await wait_in(claim_queue, me);
        if (!me.turn) co_return;  // its group answered (or sent it alone)
    }
    try {
        me.plain = co_await with_connection<pg::StepResults>("claim", [&](AsyncConnection& conn, int) {
            return claim_round_trip(conn, *me.key, *me.fp, me.fence, me.lease, me.retention);
        });
        me.got = ClaimMember::Got::plain;
    } catch (...) {
        me.got = ClaimMember::Got::error, me.error = std::current_exception();
    }
    --claims_in_flight;
    launch_groups();
}

static void all_alone(const std::optional<pg::ClaimGroupPlan>& plan, std::span<pg::ClaimSlot* const> slots) {
    if (plan) {
        plan->all_alone();
    } else {
        pg::answer_all(slots, pg::ClaimSlot::Got::alone);
    }
}

template <class Slot, class Member>
std::vector<Slot*> slots_of(const std::vector<Member*>& group) {
    return std::vector<Slot*>(group.begin(), group.end());
}

// Never throws: every member leaves with an answer, an error, or "alone" (its own call then
// sends its own statements, with its fence, and recognises whatever the group committed).
net::awaitable<void> AsyncPostgresStore::Impl::run_claim_group(std::vector<ClaimMember*> group) {
    for (ClaimMember* c : group) c->got = ClaimMember::Got::alone;
    std::shared_ptr<AsyncConnection> conn;
    std::exception_ptr unreachable;
    try {
        conn = co_await acquire();
    } catch (...) {
        unreachable = std::current_exception();  // nothing sent: each gets what its own call would
    }
    const std::vector<pg::ClaimSlot*> slots = slots_of<pg::ClaimSlot>(group);
    if (unreachable) {
        pg::answer_all(slots, ClaimMember::Got::error, unreachable);
    } else if (conn->citus()) {
        citus_seen = true;  // each goes alone: the single-key statements know Citus
    } else {
        std::optional<pg::ClaimGroupPlan> plan;
        try {
            plan.emplace(defs, pg::Layout::plain, slots);
            pg::note_group(counters.claim_groups, counters.grouped_claims, largest.claims, group.size());
            count(counters.round_trips);
            plan->read(co_await conn->run(plan->steps(), deadline()));
        } catch (const pg::connection_broken&) {
            // The group may have committed before its answer was lost: each goes alone with its
            // fence and recognises its row.
            suspect_idle();
            all_alone(plan, slots);
        } catch (...) {
            all_alone(plan, slots);
        }
        // (a member going alone after the group's statement makes a second attempt: a retry)
        for (const ClaimMember* c : group) {
            if (c->got == ClaimMember::Got::alone) count(counters.retries);
        }
    }
    --claims_in_flight;
    wake_all(group);
    schedule_launch();  // after the members' next requests (wake_all posted them first)
}

// A save's first attempt: alone at once while no transaction is in flight and nobody queues
// (group commit off: while a connection has no transaction and no save queues; the caller saves
// by itself), else in the next group (group commit off: alone, when its turn comes, in the slot
// counted for it: `turn`). Returns false for "alone".
net::awaitable<bool> AsyncPostgresStore::Impl::save_first(SaveMember& me) {
    if (citus_seen || may_go_alone(false)) co_return false;
    schedule_launch();
    co_await wait_in(save_queue, me);
    co_return me.got != SaveMember::Got::alone;
}

net::awaitable<void> AsyncPostgresStore::Impl::run_save_group(std::vector<SaveMember*> group) {
    for (SaveMember* m : group) m->got = SaveMember::Got::alone;
    std::shared_ptr<AsyncConnection> conn;
    bool reached = true;
    try {
        conn = co_await acquire();
    } catch (...) {
        reached = false;  // nothing sent: each goes alone (and keeps trying for its save_retry_window)
    }
    if (reached && conn->citus()) {
        citus_seen = true;
    } else if (reached) {
        std::optional<pg::SaveGroupPlan> plan;
        try {
            plan.emplace(defs, pg::Layout::plain, slots_of<pg::SaveSlot>(group));
            pg::note_group(counters.save_groups, counters.grouped_saves, largest.saves, plan->sent().size());
            count(counters.round_trips);
            plan->read(co_await conn->run(plan->steps(), deadline()));
        } catch (const pg::connection_broken&) {
            suspect_idle();
            if (plan) plan->all_alone();
        } catch (...) {
            if (plan) plan->all_alone();
        }
        if (plan) {
            for (const pg::SaveSlot* m : plan->sent()) {
                if (m->got == SaveMember::Got::alone) count(counters.retries);
            }
        }
    }
    --saves_in_flight;
    claims_next = true;
    wake_all(group);
    schedule_launch();  // after the members' next requests (wake_all posted them first)
}

}  // namespace idem::asio
