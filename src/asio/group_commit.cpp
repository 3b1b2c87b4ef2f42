// idem::asio's group commit (docs/design.md, "The asynchronous path"): the queue of first
// attempts, and the groups that run the plans of src/postgres/group_plan.hpp on the strand.
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

template <class Member>
void AsyncPostgresStore::Impl::wake_all(std::vector<Member*>& group) {
    for (Member* m : group) {
        net::post(strand, [h = std::move(*m->wake)]() mutable { std::move(h)(); });
    }
}

// The next group: up to kLargestGroup members, and for saves up to kLargestSaveGroupBytes of
// results (one statement of tens of megabytes would run into its own deadline); at least one.
template <class Member>
std::vector<Member*> AsyncPostgresStore::Impl::next_group(std::deque<Member*>& queue) {
    std::size_t n = std::min(queue.size(), kLargestGroup);
    if constexpr (std::is_same_v<Member, SaveMember>) {
        std::size_t bytes = 0;
        for (std::size_t i = 0; i < n; ++i) {
            bytes += queue[i]->result.size();
            if (i > 0 && bytes > kLargestSaveGroupBytes) {
                n = i;
                break;
            }
        }
    }
    std::vector<Member*> group(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(n));
    queue.erase(queue.begin(), queue.begin() + static_cast<std::ptrdiff_t>(n));
    return group;
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

// Saves first: a save ends its call (and frees its slot in the caller's own flight), a claim
// starts one more. Group commit off: one member at a time, each alone.
void AsyncPostgresStore::Impl::launch_groups() {
    while (transaction_slot_free()) {
        if (!save_queue.empty()) {
            ++saves_in_flight;
            if (options.group_commit) {
                net::co_spawn(strand, run_save_group(next_group(save_queue)), net::detached);
            } else {
                give_turn(save_queue);
            }
        } else if (!claim_queue.empty()) {
            ++claims_in_flight;
            if (options.group_commit) {
                net::co_spawn(strand, run_claim_group(next_group(claim_queue)), net::detached);
            } else {
                give_turn(claim_queue);
            }
        } else {
            break;
        }
    }
    publish_queued();
}

// A claim's first round trip: alone at once while a connection has no transaction and nobody
// queues, else in the next group (group commit off: alone, when its turn comes).
net::awaitable<void> AsyncPostgresStore::Impl::claim_first(ClaimMember& me) {
    if (citus_seen || (transaction_slot_free() && claim_queue.empty() && save_queue.empty())) {
        ++claims_in_flight;
    } else {
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
    launch_groups();
}

// A save's first attempt: alone at once while a connection has no transaction and no save queues
// (the caller saves by itself), else in the next group (group commit off: alone, when its turn
// comes, in the slot counted for it: `turn`). Returns false for "alone".
net::awaitable<bool> AsyncPostgresStore::Impl::save_first(SaveMember& me) {
    if (citus_seen || (transaction_slot_free() && save_queue.empty())) co_return false;
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
    wake_all(group);
    launch_groups();
}

}  // namespace idem::asio
