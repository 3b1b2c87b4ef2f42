// payments-e2e: the gateway's commits and stalls (a commit that fails or is cut off, one that outlasts
// the release time, a charge run past its deadline) and a client that stops reading.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "e2e_support.hpp"
#include "gateway.hpp"

namespace e2e {

using namespace std::chrono_literals;

void gateway_fault_sections(Run& the_run) {
    const std::string &A = the_run.A, &acct = the_run.acct, &db = the_run.db, &server_exe = the_run.server_exe;
    std::vector<Server>& servers = the_run.servers;
    const auto fresh_key = [&the_run](const std::string& tag) { return the_run.fresh_key(tag); };

    section("a charge whose commit fails is not a charge");
    {
        // The gateway's INSERT returns its row before its implicit commit, which may still fail: a
        // deferred trigger that refuses (an error after the row: rolled back, nothing charged) or
        // one that waits while the test terminates its backend (the connection lost before the
        // server said the commit was done: the outcome is unknown). Neither may be taken as a
        // charge: the ledger, the witness, has no row.
        constexpr long kRefused = 770001, kCutOff = 770002;
        Sql sql(db);
        sql.query(R"SQL(CREATE OR REPLACE FUNCTION payments_e2e_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.order_id = 770001 THEN RAISE EXCEPTION 'payments-e2e: refused at commit'; END IF;
    PERFORM pg_sleep(30);
    RETURN NULL;
END $$)SQL");
        sql.query(
            "CREATE CONSTRAINT TRIGGER payments_e2e_at_commit AFTER INSERT ON gateway_charges "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.order_id IN (770001, 770002)) "
            "EXECUTE FUNCTION payments_e2e_at_commit()");
        const std::string refused_key = fresh_key("commit-refused");
        const Reply refused = pay(A, acct, refused_key, payment_body(kRefused, 100, "tok_ok"));
        check(refused.status == 503 && refused.body.find("gateway_unavailable") != std::string::npos,
              "commit refused -> 503 gateway_unavailable (not charged, key released), got " + describe(refused));
        check(gateway_count(A, refused_key) == 0, "commit refused: no charge in the ledger");

        // G: a 30 s lease, so that no reconciler takes the key over while its commit waits.
        const auto waiting_instance =
            start_server(server_exe, {"--listen", "127.0.0.1:0", "--db", db, "--reconcile-every-ms", "3600000"});
        check(waiting_instance.has_value(), "instance G starts");
        if (waiting_instance) {
            servers.push_back(*waiting_instance);
            const std::string G = waiting_instance->url;
            const std::string cut_key = fresh_key("commit-cut-off");
            Reply cut;
            std::thread paying([&] { cut = pay(G, acct, cut_key, payment_body(kCutOff, 100, "tok_ok")); });
            bool terminated = false;
            for (const auto until = Clock::now() + 20s; !terminated && Clock::now() < until;) {
                terminated = !sql.query(
                                     "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                                     "application_name = 'payments-gateway' AND wait_event = 'PgSleep'")
                                  .empty();
                if (!terminated) std::this_thread::sleep_for(20ms);
            }
            paying.join();
            check(terminated, "the gateway's backend was terminated during its commit");
            check(cut.status == 503 && cut.body == R"({"error":"outcome_unknown"})",
                  "connection lost during the commit -> 503 outcome_unknown, got " + describe(cut));
            check(gateway_count(G, cut_key) == 0, "connection lost during the commit: no charge in the ledger");
            const Reply busy = pay(G, acct, cut_key, payment_body(kCutOff, 100, "tok_ok"));
            check(busy.status == 409, "its key stays in progress for the reconciler -> 409, got " + describe(busy));
        }
        sql.query("DROP TRIGGER payments_e2e_at_commit ON gateway_charges");
        sql.query("DROP FUNCTION payments_e2e_at_commit()");
        const Reply paid = pay(A, acct, refused_key, payment_body(kRefused, 100, "tok_ok"));
        check(paid.status == 201 && !paid.replayed(), "the released key pays on its retry, got " + describe(paid));
        check(gateway_count(A, refused_key) == 1, "one charge for it");
    }

    section("a charge still committing when its key is due for release: one charge");
    {
        // The gateway's commit waits (a deferred trigger waits for a lock this test holds) until
        // the key's claim is 10 s old, past the 8 s after which a key with no charge is released.
        // The reconciler must not take "no row yet" for "no charge": the key stays in progress
        // until the commit has ended, then replays the charge. A release would show as a retry
        // answered otherwise than 409 before the commit was let go.
        constexpr long kSlowCommit = 770003;
        Sql sql(db);
        Sql holder(db);
        holder.query("SELECT pg_advisory_lock(770004)");
        sql.query(R"SQL(CREATE OR REPLACE FUNCTION payments_e2e_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF pg_try_advisory_lock(770003) THEN
        PERFORM pg_advisory_lock(770004);
        PERFORM pg_advisory_unlock(770004);
        PERFORM pg_advisory_unlock(770003);
    END IF;
    RETURN NULL;
END $$)SQL");
        sql.query(
            "CREATE CONSTRAINT TRIGGER payments_e2e_slow_commit AFTER INSERT ON gateway_charges "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.order_id = 770003) "
            "EXECUTE FUNCTION payments_e2e_slow_commit()");
        const std::string key = fresh_key("slow-commit");
        const std::string body = payment_body(kSlowCommit, 100, "tok_ok");
        Reply first;
        std::thread paying([&] { first = pay(A, acct, key, body); });
        bool committing = false;
        for (const auto until = Clock::now() + 10s; !committing && Clock::now() < until;) {
            committing = !sql.query(
                                 "SELECT 1 FROM pg_stat_activity WHERE application_name = 'payments-gateway' "
                                 "AND wait_event_type = 'Lock' AND wait_event = 'advisory'")
                              .empty();
            if (!committing) std::this_thread::sleep_for(20ms);
        }
        check(committing, "the charge's commit is under way");
        // Retries until the key is settled: 409 while in progress, then the charge replayed. The
        // commit is let go once the claim is 10 s old by the database's clock.
        Reply settled;
        int in_progress = 0;
        bool let_go = false;
        for (const auto until = Clock::now() + 60s; Clock::now() < until;) {
            settled = pay(A, acct, key, body);
            if (settled.status != 409) break;
            ++in_progress;
            if (!let_go) {
                const auto age = sql.query(
                    "SELECT extract(epoch FROM clock_timestamp() - created_at) > 10 FROM idem_keys WHERE key = $1",
                    {key});
                if (!age.empty() && age[0][0] == "t") {
                    holder.query("SELECT pg_advisory_unlock(770004)");
                    let_go = true;
                }
            }
            std::this_thread::sleep_for(250ms);
        }
        if (!let_go) holder.query("SELECT pg_advisory_unlock(770004)");
        paying.join();
        check(let_go, "the key stays in progress 10 s after its claim while its charge commits, got " +
                          describe(settled) + " after " + std::to_string(in_progress) + " answers 409");
        check(settled.status == 201 && settled.replayed(),
              "then its retry replays the one charge (not a new one), got " + describe(settled) +
                  "; the first request got " + describe(first));
        check(gateway_count(A, key) == 1, "one charge for it");
        sql.query("DROP TRIGGER payments_e2e_slow_commit ON gateway_charges");
        sql.query("DROP FUNCTION payments_e2e_slow_commit()");
    }

    section("the gateway's rules: a charge past its deadline is refused, the ledger read only when settled");
    {
        // gateway_charge compares the request's deadline with the database's clock, after taking
        // the key's lock: a charge sent in time but run late (its backend stalled) is not made.
        const std::string key = fresh_key("late-charge");
        Sql sql(db);
        const auto late = sql.query(
            "SELECT count(*) FROM gateway_charge($1, $2, 770004, 100, 'BRL', 'tok_ok', 'captured', "
            "clock_timestamp() - interval '1 second')",
            {acct, key});
        check(late.size() == 1 && late[0][0] == "0", "a charge past its deadline: no row returned");
        const auto in_time = sql.query(
            "SELECT count(*) FROM gateway_charge($1, $2, 770004, 100, 'BRL', 'tok_ok', 'captured', "
            "clock_timestamp() + interval '1 minute')",
            {acct, key});
        check(in_time.size() == 1 && in_time[0][0] == "1", "the same charge in time: made");
        check(gateway_count(A, key) == 1, "the ledger holds the one charge made in time");

        // The deadline a charge carries: the request's, on the database's clock (here: this
        // machine's wall clock, then one 7 s behind it).
        const payments::PaymentRequest payment{770004, 100, "BRL", "tok_ok"};
        for (const auto offset : {std::chrono::microseconds(0), std::chrono::microseconds(-7'000'000)}) {
            const auto now_us = [](std::chrono::system_clock::duration from_now) {
                return std::chrono::duration_cast<std::chrono::microseconds>(
                           (std::chrono::system_clock::now() + from_now).time_since_epoch())
                    .count();
            };
            payments::DatabaseClock clock;
            const auto sampled = Clock::now();
            (void)clock.update(now_us(offset), sampled, sampled);
            const payments::ChargeRequest request{
                .account = acct, .idempotency_key = key, .payment = &payment, .deadline = Clock::now() + 3s};
            const auto params = payments::ledger::charge_statement(request, clock).params;
            const long long carried = params.size() == 8 ? std::stoll(params[7]) : 0;
            const long long wanted = now_us(3s + offset);
            check(std::llabs(carried - wanted) < 500'000,
                  "a charge 3 s before its deadline, the clocks " + std::to_string(offset.count()) +
                      " us apart: it carries the deadline on the database's clock (off by " +
                      std::to_string(carried - wanted) + " us)");
        }

        // The clock is read after the key's lock is taken: a charge that waited for the lock past
        // its deadline is refused, however early it was sent.
        {
            const std::string waited_key = fresh_key("late-after-lock");
            Sql holder(db);
            holder.query("SELECT pg_advisory_lock(hashtext($1), hashtext($2))", {acct, waited_key});
            std::vector<std::vector<std::string>> waited;
            std::thread charging([&] {
                Sql charger(db);
                waited = charger.query(
                    "SELECT count(*) FROM gateway_charge($1, $2, 770004, 100, 'BRL', 'tok_ok', 'captured', "
                    "clock_timestamp() + interval '1 second')",
                    {acct, waited_key});
            });
            // Its deadline was fixed when the call began: let it go 1.5 s after it is seen waiting.
            bool waiting = false;
            for (const auto until = Clock::now() + 20s; !waiting && Clock::now() < until;) {
                waiting = !holder
                               .query(
                                   "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND "
                                   "wait_event = 'advisory' AND query LIKE '%gateway_charge(%'")
                               .empty();
                if (!waiting) std::this_thread::sleep_for(20ms);
            }
            check(waiting, "the charge waits for the key's lock");
            std::this_thread::sleep_for(1500ms);
            holder.query("SELECT pg_advisory_unlock(hashtext($1), hashtext($2))", {acct, waited_key});
            charging.join();
            check(waited.size() == 1 && waited[0][0] == "0",
                  "a charge sent 1 s before its deadline that got the key's lock 2 s later: refused");
            check(gateway_count(A, waited_key) == 0, "no charge for it in the ledger");
        }

        // gateway_settled reads the ledger only while no charge for the key holds its lock, and
        // only under READ COMMITTED (a snapshot older than its lock could miss a charge).
        Sql holder(db);
        holder.query("SELECT pg_advisory_lock(hashtext($1), hashtext($2))", {acct, key});
        std::string in_flight;
        try {
            (void)sql.query("SELECT * FROM gateway_settled($1, $2)", {key, acct});
        } catch (const std::exception& e) {
            in_flight = e.what();
        }
        check(in_flight.find("in flight") != std::string::npos,
              "a charge in flight: gateway_settled refuses to read (55P03), got '" + in_flight + "'");
        holder.query("SELECT pg_advisory_unlock(hashtext($1), hashtext($2))", {acct, key});
        check(sql.query("SELECT * FROM gateway_settled($1, $2)", {key, acct}).size() == 1,
              "none in flight: gateway_settled reads the one charge");
        std::string isolation;
        try {
            sql.query("SET default_transaction_isolation = 'repeatable read'");
            (void)sql.query("SELECT * FROM gateway_settled($1, $2)", {key, acct});
        } catch (const std::exception& e) {
            isolation = e.what();
        }
        sql.query("RESET default_transaction_isolation");
        check(isolation.find("READ COMMITTED") != std::string::npos,
              "under REPEATABLE READ gateway_settled refuses to read, got '" + isolation + "'");
    }

    section("a client that stops reading is disconnected (--threads 1)");
    {
        // H serves one connection at a time. A client pipelines requests and never reads their
        // answers: once the socket buffers are full the server cannot finish writing. It must
        // give up on that client, or the one slot (and SIGTERM) waits for it forever.
        auto stuck_instance = start_server(
            server_exe, {"--listen", "127.0.0.1:0", "--db", db, "--reconcile-every-ms", "3600000", "--threads", "1"});
        check(stuck_instance.has_value(), "instance H starts with --threads 1");
        if (stuck_instance) {
            const std::string H = stuck_instance->url;
            const int port = std::stoi(H.substr(H.rfind(':') + 1));
            // A connection that sends `requests` pipelined GET /metrics and reads nothing.
            const auto stuck_client = [port](int requests) {
                const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                const int small = 4096;
                setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
                sockaddr_in to{};
                to.sin_family = AF_INET;
                to.sin_port = htons(static_cast<std::uint16_t>(port));
                to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
                if (connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) != 0) return fd;
                std::string pipeline;
                for (int i = 0; i < requests; ++i) pipeline += "GET /metrics HTTP/1.1\r\nHost: h\r\n\r\n";
                std::size_t sent = 0;
                for (const auto until = Clock::now() + 2s; sent < pipeline.size() && Clock::now() < until;) {
                    const ssize_t n = ::send(fd, pipeline.data() + sent, pipeline.size() - sent, MSG_DONTWAIT);
                    if (n > 0) sent += static_cast<std::size_t>(n);
                    else std::this_thread::sleep_for(10ms);
                }
                return fd;
            };
            const std::size_t metrics_bytes = send(H, "GET", "/metrics", {}).body.size();
            // Far more answer bytes than the largest socket buffers hold (4 MiB each way).
            const int requests = static_cast<int>((32u << 20) / std::max<std::size_t>(metrics_bytes, 1024));
            const int first = stuck_client(requests);
            std::this_thread::sleep_for(1s);
            const auto asked = Clock::now();
            const Reply health = send(H, "GET", "/healthz", {});
            check(health.status == 200 && Clock::now() - asked < 20s,
                  "the next connection is served once the stuck client is dropped, got " + describe(health));
            close(first);
            const int second = stuck_client(requests);
            std::this_thread::sleep_for(1s);
            const int status = stop_server(*stuck_instance);
            check(status == 0,
                  "SIGTERM with a client that reads nothing: exit status 0 within 15 s, got " + std::to_string(status));
            close(second);
        }
    }
}

}  // namespace e2e
