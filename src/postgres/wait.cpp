// PostgresStore's wait for another attempt's save (ClaimOptions::wait; docs/design.md, "Waiting
// instead of 409"): LISTEN/NOTIFY where a session is its own, polling everywhere. The decisions
// (when to read again, when the wait is over) are the ClaimMachine's; this is their I/O.
#include "store_impl.hpp"

namespace idem {

// ClaimOptions::wait (docs/design.md, "Waiting instead of 409"). Until the machine's deadline:
// read the key again now and then (a poll, kWaitPoll: one primary-key SELECT) and, where LISTEN
// works, wake at once on the saver's NOTIFY. Polling is what makes waiting work everywhere: a
// pooler in transaction mode (PgBouncer) runs LISTEN on a server connection it then hands to
// other clients, and the NOTIFY never reaches the waiter. With LISTEN too, polls are the
// backstop: a notification that does not come (a failed best-effort NOTIFY, a save through
// another Citus node) costs one interval at most, instead of the rest of the wait. Returns
// what the machine decided next.
pg::ClaimMachine::Next PostgresStore::Impl::wait_for_save(const Key& key, pg::ClaimMachine& machine) {
    using Strategy = PostgresOptions::WaitStrategy;
    const Fence waited_for = machine.stale_fence();
    const bool pooled = session.load(std::memory_order_relaxed) == kSessionPooled;
    if (options.wait_strategy != Strategy::poll && !pooled) {
        // Listeners hold a connection while they wait: never more than pool_size - 1 of them,
        // so the owner's save always finds one. Past that, wait by polling (notify: in_progress).
        if (waiting.fetch_add(1) + 1 < options.pool_size) {
            struct Done {
                std::atomic<std::size_t>& n;
                ~Done() { n.fetch_sub(1); }
            } leave{waiting};
            if (auto next = listen_for_save(key, machine, waited_for)) return *next;
        } else {
            waiting.fetch_sub(1);
            if (options.wait_strategy == Strategy::notify) return machine.on_waited(false);
        }
    }
    // Polling: the connection goes back to the pool between polls.
    std::this_thread::sleep_until(machine.next_poll());
    try {
        return with_connection(
            "wait", [&](pg::Connection& conn, int) { return machine.on_polled(poll_waited(conn, key, waited_for)); });
    } catch (const pool_timeout&) {
        return machine.on_waited(false);  // no connection to look with: the key was in progress
    }
}

pg::StepResults PostgresStore::Impl::poll_waited(pg::Connection& conn, const Key& key, Fence waited_for) {
    Params p;
    p.text(key.scope()).text(key.value()).int8(waited_for);
    return run_one(conn, pg::kWaitPoll, p);
}

// Whether LISTEN on `conn` would be heard (wait_strategy automatic): not through a pooler. The
// server's backend pid differs from the one libpq got at connect when a pooler (PgBouncer, any
// pool mode) made that up; a direct session, a TCP proxy or a Citus coordinator keeps it. Asked
// once per store (one round trip on its first wait): every connection goes the same way.
bool PostgresStore::Impl::own_session(pg::Connection& conn) {
    if (options.wait_strategy == PostgresOptions::WaitStrategy::notify) return true;
    int known = session.load(std::memory_order_relaxed);
    if (known == kSessionUnknown) {
        Params pid;
        pid.int4(PQbackendPID(conn.native()));
        auto res = run_one(conn, pg::kOwnSession, pid);
        if (!res[0].ok()) throw_statement_error(res[0], "wait");
        known = pg::get_bool(res[0].result.get(), 0, 0) ? kSessionOwn : kSessionPooled;
        session.store(known, std::memory_order_relaxed);
    }
    return known == kSessionOwn;
}

// The listening wait, on one pooled connection held throughout: LISTEN, flag the row as waited
// for, then wake on the saver's NOTIFY, on a poll that is due (automatic; notify polls at the
// deadline only), or at the deadline. nullopt: LISTEN is not usable here (a pooler): poll.
std::optional<pg::ClaimMachine::Next> PostgresStore::Impl::listen_for_save(const Key& key, pg::ClaimMachine& machine,
                                                                           Fence waited_for) {
    using Next = pg::ClaimMachine::Next;
    return with_connection("wait", [&](pg::Connection& conn, int) -> std::optional<Next> {
        if (!own_session(conn)) return std::nullopt;
        const std::string payload = pg::notify_payload(table, key);
        Params none, mark;
        mark.text(key.scope()).text(key.value());
        // LISTEN first: a save committed after the mark is then certain to be heard.
        const Step steps[] = {{&defs[pg::kListen], &none}, {&defs[pg::kMarkWaiter], &mark}};
        const bool polls = options.wait_strategy != PostgresOptions::WaitStrategy::notify;
        std::optional<Next> next;
        try {
            auto res = run(conn, steps);
            if (!res[0].ok()) throw_statement_error(res[0], "listen");
            if (!res[1].ok()) throw_statement_error(res[1], "wait");
            if (res[1].rows() == 0) next = machine.on_waited(true);  // no longer in progress: read it
            while (!next) {
                const Clock::time_point until = polls ? machine.next_poll() : machine.wait_until();
                if (conn.wait_notification(pg::kChannel, payload, until)) {
                    next = machine.on_waited(true);
                    break;
                }
                const Next polled = machine.on_polled(poll_waited(conn, key, waited_for));
                if (polled != Next::wait) next = polled;
            }
        } catch (...) {
            conn.mark_broken();  // may still be listening: never pool it again
            throw;
        }
        // The answer stands whatever happens now: a connection that cannot stop listening is
        // discarded, not retried with (that would wait again).
        try {
            auto done = run_one(conn, pg::kUnlisten, none);
            if (!done[0].ok()) conn.mark_broken();
            // Drop notifications that arrived meanwhile, so the pooled connection is clean.
            conn.wait_notification(pg::kChannel, "", Clock::now());
        } catch (...) {
            conn.mark_broken();
        }
        return next;
    });
}

}  // namespace idem
