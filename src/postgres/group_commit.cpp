// PostgresStore's group commit (docs/design.md, "Group commit"): the blocking driver of the group
// plans of group_plan.hpp. Callers are gathered by pg::Combiner (one thread each); a group's leader
// sends the plan on a pooled connection, writes every member's answer, and relays the next group on
// the same connection before it wakes its own members.
#include "store_impl.hpp"

namespace idem {

struct PostgresStore::Impl::GroupCommit {
    Impl& s;

    // A group's statements on their way: sent on a connection, answers not read yet. Sent by the
    // group's own leader, or relayed: by the previous group's leader, on the connection it just read
    // its own answers from, so that the server starts on this group while its leader's thread wakes
    // up. Views into the members (who wait for their answers) and into itself: never moved once sent.
    struct Flight {
        Clock::time_point deadline;
        std::optional<pg::Lease> conn;  // while its answers are unread

        Flight() = default;
        Flight(const Flight&) = delete;
        Flight& operator=(const Flight&) = delete;
        ~Flight() {
            if (conn) (*conn)->abandon_exchange();  // unread answers: the connection is never reused
        }
        // Throws connection_broken (then nothing is in flight: `lease` is discarded, broken).
        void send(std::span<const Step> steps, pg::Lease lease) {
            lease->send_pipeline(steps, deadline);
            conn.emplace(std::move(lease));
        }
        // The answers; `lease` gets the connection back (for the next group: it is marked broken
        // when receiving failed). Throws what receive_pipeline throws.
        pg::StepResults receive(std::span<const Step> steps, std::optional<pg::Lease>& lease) {
            lease.emplace(std::move(*conn));
            conn.reset();
            return (*lease)->receive_pipeline(steps, deadline);
        }
    };
    struct ClaimFlight : Flight {
        std::optional<pg::ClaimGroupPlan> plan;
    };
    struct SaveFlight : Flight {
        std::optional<pg::SaveGroupPlan> plan;
    };

    // One caller in a group. The leader writes its slot's answer before Combiner::answered; the
    // member reads it after join() returns. As the leader of a relayed group: the previous leader
    // sent it (`flight`: its answers are to be read), or tried to (`relayed` without a flight:
    // every member's answer is written already).
    template <class Slot, class F>
    struct Member : pg::Combiner::Member {
        Slot* slot = nullptr;
        bool relayed = false;
        std::unique_ptr<F> flight;
    };
    using ClaimMember = Member<pg::ClaimSlot, ClaimFlight>;
    using SaveMember = Member<pg::SaveSlot, SaveFlight>;

    template <class M>
    static auto slots_of(const std::vector<pg::Combiner::Member*>& group) {
        std::vector<decltype(M::slot)> slots;
        slots.reserve(group.size());
        for (pg::Combiner::Member* m : group) slots.push_back(static_cast<M*>(m)->slot);
        return slots;
    }

    void note_claims(std::size_t n) noexcept {
        pg::note_group(s.counters().claim_groups, s.counters().grouped_claims, s.largest.claims, n);
    }
    void note_saves(std::size_t n) noexcept {
        pg::note_group(s.counters().save_groups, s.counters().grouped_saves, s.largest.saves, n);
    }

    // Sends the claims of `group` on `conn` (one plain node). On failure every member's answer is
    // written (alone: the statements may have reached the server; each member's retry with its own
    // fence recognises whatever committed) and null is returned. Never throws.
    std::unique_ptr<ClaimFlight> send_claims(const std::vector<pg::Combiner::Member*>& group, pg::Lease conn) noexcept {
        try {
            const auto slots = slots_of<ClaimMember>(group);
            try {
                note_claims(group.size());
                auto f = std::make_unique<ClaimFlight>();
                f->plan.emplace(s.defs, pg::Layout::plain, slots);
                f->deadline = s.deadline();
                s.counters().round_trips.fetch_add(1, std::memory_order_relaxed);
                for (pg::ClaimSlot* c : slots) c->sent = true;
                f->send(f->plan->steps(), std::move(conn));
                return f;
            } catch (const pg::connection_broken&) {
                s.pool->suspect_idle();
            } catch (...) {
            }
            pg::answer_all(slots, pg::ClaimSlot::Got::alone);
        } catch (...) {
        }
        return nullptr;
    }

    // Reads the answers of a claim or save flight and writes every member's. Returns the
    // connection, for the next group, unless it broke. Never throws.
    template <class AFlight>
    std::optional<pg::Lease> land(AFlight& f) noexcept {
        std::optional<pg::Lease> conn;
        try {
            f.plan->read(f.receive(f.plan->steps(), conn));
            return conn;
        } catch (const pg::connection_broken&) {
            // The group may have committed before its answer was lost: each member goes again alone
            // with its own fence and recognises its row (the single-key path's reconnect-safe retry).
            s.pool->suspect_idle();
        } catch (...) {
        }
        f.plan->all_alone();
        return std::nullopt;
    }

    // A group's own leader takes a connection (waiting for one: its callers found none free), takes
    // in the callers that queued meanwhile, then sends and reads its statements. Returns the
    // connection when the next group may be relayed on it. Never throws: should anything throw all
    // the same (out of memory), every member goes alone with its fence, a retry of its own that
    // recognises whatever the group committed for it.
    std::optional<pg::Lease> answer_claims(pg::Combiner& groups, std::vector<pg::Combiner::Member*>& group) noexcept {
        std::vector<pg::ClaimSlot*> slots;
        try {
            std::optional<pg::Lease> conn;
            try {
                conn.emplace(s.acquire(group.front()->deadline));
            } catch (const pool_timeout&) {
                // Nothing was sent. The leader (the first to queue) has waited its pool_wait: its
                // call gets pool_timeout. The others' waits end later: each waits on alone, to its
                // own deadline (Got::alone, not sent).
                slots = slots_of<ClaimMember>(group);
                note_claims(slots.size());
                pg::answer_all(std::span(slots).first(1), pg::ClaimSlot::Got::error, std::current_exception());
                pg::answer_all(std::span(slots).subspan(1), pg::ClaimSlot::Got::alone);
                return std::nullopt;
            } catch (...) {
                // Nothing was sent: each member gets what its own call would have (store_unavailable,
                // config_error), without trying to connect once more.
                slots = slots_of<ClaimMember>(group);
                note_claims(slots.size());
                pg::answer_all(slots, pg::ClaimSlot::Got::error, std::current_exception());
                return std::nullopt;
            }
            groups.absorb(group);
            slots = slots_of<ClaimMember>(group);
            if (slots.size() == 1) {  // alone: exactly the single-key round trip, with its retries
                note_claims(1);
                pg::ClaimSlot& c = *slots[0];
                std::optional<pg::Lease> kept;
                try {
                    c.plain = s.claim_round_trip(*c.key, *c.fp, c.fence, c.lease, c.retention, &kept,
                                                 Impl::FirstTry{std::move(conn), nullptr, std::nullopt});
                    c.got = pg::ClaimSlot::Got::plain;
                } catch (...) {
                    c.got = pg::ClaimSlot::Got::error, c.error = pg::own_copy(std::current_exception());
                }
                return kept;
            }
            bool plain = false;
            try {
                plain = s.relay_possible(**conn);
            } catch (const pg::connection_broken&) {
                // the layout's question met a dead connection: nothing of the group was sent
                s.pool->suspect_idle();
                note_claims(slots.size());
                pg::answer_all(slots, pg::ClaimSlot::Got::alone);
                return std::nullopt;
            }
            if (plain) {
                auto f = send_claims(group, std::move(*conn));
                return f ? land(*f) : std::nullopt;
            }
            // A distributed table: one-shard segments (pg::ClaimRowsPlan), in blocks where needed.
            note_claims(slots.size());
            const pg::ClaimGroupPlan plan(s.defs, s.layout(**conn), slots);
            for (pg::ClaimSlot* c : slots) c->sent = true;
            try {
                plan.read(plan.blocks() ? s.run_block(**conn, plan.steps(), plan.segments())
                                        : s.run(**conn, plan.steps(), plan.segments()));
            } catch (const pg::connection_broken&) {
                s.pool->suspect_idle();
                plan.all_alone();
            }
            return std::nullopt;
        } catch (...) {
            pg::answer_all(slots, pg::ClaimSlot::Got::alone);
            for (pg::ClaimSlot* c : slots) c->sent = true;  // not known: go alone as after a send
            return std::nullopt;
        }
    }

    // Sends the saves of `group` on `conn` (any layout: a save is one statement per segment, never a
    // block). Members not sent (a key or fence twice, or a failure) are answered alone, and null is
    // returned when nothing is in flight. Never throws.
    std::unique_ptr<SaveFlight> send_saves(const std::vector<pg::Combiner::Member*>& group, pg::Lease conn) noexcept {
        try {
            const auto slots = slots_of<SaveMember>(group);
            try {
                note_saves(group.size());
                auto f = std::make_unique<SaveFlight>();
                const pg::Layout layout = s.layout(*conn);
                const pg::SaveGroupPlan& plan = f->plan.emplace(s.defs, layout, slots);
                const auto segments = plan.segments();
                f->deadline =
                    s.deadline() + s.options.lock_timeout * static_cast<long long>(segments > 1 ? segments - 1 : 0);
                s.counters().round_trips.fetch_add(1, std::memory_order_relaxed);
                f->send(plan.steps(), std::move(conn));
                return f;
            } catch (const pg::connection_broken&) {
                s.pool->suspect_idle();
            } catch (...) {
            }
            // `sent` says whether each may have been saved
            for (pg::SaveSlot* v : slots) v->got = pg::SaveSlot::Got::alone;
        } catch (...) {
        }
        return nullptr;
    }

    // A save group's own leader takes a connection (waiting for one), takes in the callers that
    // queued meanwhile, then sends and reads its statement. Returns the connection for the next
    // group. Never throws.
    std::optional<pg::Lease> answer_saves(pg::Combiner& groups, std::vector<pg::Combiner::Member*>& group) noexcept {
        std::unique_ptr<SaveFlight> f;
        try {
            pg::Lease conn = s.acquire(group.front()->deadline);
            groups.absorb(group);
            f = send_saves(group, std::move(conn));
        } catch (...) {
            // Nothing sent: each goes alone, its first attempt waiting for a connection to its own
            // deadline, as its call would without group commit (the leader's has passed).
            note_saves(group.size());
        }
        return f ? land(*f) : std::nullopt;
    }

    // Whether the next group may be relayed on `conn`. Saves: always (single statements, never a
    // block: any layout). Claims: on one plain node only.
    template <class M>
    bool may_relay(pg::Connection& conn) noexcept {
        if constexpr (std::is_same_v<M, SaveMember>) {
            return true;
        } else {
            try {
                return s.relay_possible(conn);
            } catch (...) {
                return false;  // the layout's question failed: the group's own leader sends it
            }
        }
    }

    // A group's leader, start to end (claims and saves alike): its answers (reading a relayed
    // flight, or sending and reading its own statements), then the relay of the next group, then
    // its members woken. Never throws.
    template <class M>
    void lead(pg::Combiner& groups, M& me, std::vector<pg::Combiner::Member*>& group) noexcept {
        constexpr bool claims = std::is_same_v<M, ClaimMember>;
        std::optional<pg::Lease> conn = me.flight    ? land(*me.flight)
                                        : me.relayed ? std::nullopt  // answered by the relay's failure
                                        : claims     ? answer_claims(groups, group)
                                                     : answer_saves(groups, group);
        me.flight.reset();
        std::vector<pg::Combiner::Member*> next;
        if (groups.take_next(next)) {
            auto& lead = static_cast<M&>(*next.front());
            // Not while another caller waits for a pooled connection: the chain would keep this one
            // for as long as callers queue.
            if (conn && !(*conn)->broken() && !s.pool->has_waiters() && may_relay<M>(**conn)) {
                lead.relayed = true;
                if constexpr (claims) {
                    lead.flight = send_claims(next, std::move(*conn));
                } else {
                    lead.flight = send_saves(next, std::move(*conn));
                }
            }
            conn.reset();
            groups.hand_over(std::move(next));
        }
        conn.reset();
        groups.answered(group);
    }

    template <class M>
    bool join(pg::Combiner& groups, typename std::remove_pointer_t<decltype(M::slot)>& slot,
              Clock::time_point deadline) {
        M me;
        me.slot = &slot;
        me.deadline = deadline;
        std::vector<pg::Combiner::Member*> group;
        const auto role = groups.join(me, group);
        if (role == pg::Combiner::Role::lead) lead(groups, me, group);
        return role != pg::Combiner::Role::alone;
    }
};

bool PostgresStore::Impl::claim_in_group(pg::ClaimSlot& slot, Clock::time_point deadline) {
    return GroupCommit{*this}.join<GroupCommit::ClaimMember>(*claim_groups, slot, deadline);
}

bool PostgresStore::Impl::save_in_group(pg::SaveSlot& slot, Clock::time_point deadline) {
    return GroupCommit{*this}.join<GroupCommit::SaveMember>(*save_groups, slot, deadline);
}

}  // namespace idem
