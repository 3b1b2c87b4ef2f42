// payments-e2e --faults (e2e_faults.hpp).
#include "e2e_faults.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <latch>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "e2e_support.hpp"

namespace e2e {

using namespace std::chrono_literals;

namespace {

/// One payment intent: one key, retried by its own thread until it gets its 201.
struct Intent {
    std::string key;
    std::string body;
    Clock::time_point first_request;
    std::optional<Clock::time_point> settled_at;  // the first 201
    std::string body_201;
    std::optional<Reply> refused;  // a final answer other than 201 (never expected)
    std::map<int, int> statuses;   // status -> how many (0: no response)
};

double seconds_between(Clock::time_point from, Clock::time_point to) {
    return std::chrono::duration<double>(to - from).count();
}

std::string histogram(const std::map<int, int>& statuses) {
    std::string out;
    for (const auto& [status, n] : statuses)
        out += (out.empty() ? "" : " ") + std::to_string(status) + "x" + std::to_string(n);
    return out;
}

}  // namespace

int run_faults(const std::string& server_exe, const std::string& db, const FaultOptions& fo) {
    std::mt19937_64 rng(std::random_device{}());
    const std::string run = std::to_string(rng() % 1'000'000'000);
    const std::string acct = "acct_faults_" + run;
    char dir_template[] = "/tmp/payments-faults.XXXXXX";
    const char* dir = mkdtemp(dir_template);
    if (dir == nullptr) {
        std::cout << "FAILED: mkdtemp" << std::endl;
        return 1;
    }
    const std::string log_dir = dir;

    section("starting instances A and B (--lease-ms " + std::to_string(kFaultsLease.count()) +
            " --reconcile-every-ms " + std::to_string(kFaultsReconcileEvery.count()) + ")");
    std::vector<Server> servers;
    std::vector<std::string> logs;
    for (const char* name : {"A", "B"}) {
        logs.push_back(log_dir + "/" + name + ".log");
        auto s =
            start_server(server_exe,
                         {"--listen", "127.0.0.1:0", "--db", db, "--lease-ms", std::to_string(kFaultsLease.count()),
                          "--reconcile-every-ms", std::to_string(kFaultsReconcileEvery.count()),
                          // (a request's claim and its save further apart: more faults
                          // land in between)
                          "--gateway-latency-ms", "20", "--threads", "64"},
                         logs.back());
        if (!s) {
            std::cout << "FAILED: could not start instance " << name << std::endl;
            return 1;
        }
        servers.push_back(*s);
    }
    const std::string A = servers[0].url, B = servers[1].url;

    Sql killer(db);
    Sql witness(db);

    // Terminates up to `victims` of the instances' backends (idem's and the gateway's
    // connections), chosen at random; returns their pids as a PostgreSQL array literal.
    int kills = 0, rounds = 0;
    const auto terminate = [&](int victims) {
        ++rounds;
        const auto killed = killer.query(
            "SELECT coalesce(array_agg(pid), '{}') FROM (SELECT pid FROM pg_stat_activity WHERE "
            "application_name IN ('payments-server', 'payments-gateway') AND pid <> "
            "pg_backend_pid() ORDER BY random() LIMIT $1) v WHERE pg_terminate_backend(pid)",
            {std::to_string(victims)});
        const std::string pids = killed.at(0).at(0);
        kills += pids == "{}" ? 0 : static_cast<int>(std::count(pids.begin(), pids.end(), ',') + 1);
        return pids;
    };
    // Terminates every backend of the instances and waits until they have all exited.
    const auto terminate_all = [&] {
        const std::string pids = terminate(1'000'000);
        for (const auto until = Clock::now() + 30s; Clock::now() < until;) {
            if (killer.query("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])", {pids}).at(0).at(0) ==
                "0")
                return;
            std::this_thread::sleep_for(10ms);
        }
        check(false, "the terminated backends exited within 30 s");
    };
    // Payments sent all at once, alternately to A and B; the replies in order.
    const auto pay_at_once = [&](const std::string& tag, int count, long first_order) {
        std::vector<std::string> keys;
        std::vector<Reply> replies(static_cast<std::size_t>(count));
        for (int i = 0; i < count; ++i) keys.push_back("faults-" + run + "-" + tag + "-" + std::to_string(i));
        std::latch go(count);
        std::vector<std::thread> threads;
        for (int i = 0; i < count; ++i) {
            threads.emplace_back([&, i] {
                const auto at = static_cast<std::size_t>(i);
                go.arrive_and_wait();
                const auto sent = Clock::now();
                replies[at] = pay(i % 2 == 0 ? A : B, acct, keys[at], payment_body(first_order + i, 100 + i, "tok_ok"));
                replies[at].took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - sent);
            });
        }
        for (auto& t : threads) t.join();
        return std::pair(keys, replies);
    };
    // The gateway's ledger ids per key of this run's account, straight from the database.
    const auto ledger = [&] {
        std::map<std::string, std::vector<std::string>> charges;
        for (const auto& row : witness.query("SELECT idempotency_key, id FROM gateway_charges "
                                             "WHERE account = $1 ORDER BY id",
                                             {acct})) {
            charges[row[0]].push_back(row[1]);
        }
        return charges;
    };
    // What the database and the servers' logs say about a key (on failure): its row (state, age
    // by the database's clock, lease left), its charges, and every line of A's and B's about it —
    // the reconciler's say, for each sweep that took it, what it decided or why it left it (the
    // key's age, the release age, a charge in flight, an error) and when it is stale again, so a
    // key still in progress is seen waiting for its next look or stranded.
    const auto explain = [&](const std::string& key) {
        const auto rows = witness.query(
            "SELECT state, fence, attempt, created_at, lease_until, now(), "
            "floor(extract(epoch FROM now() - created_at) * 1000)::bigint, "
            "floor(extract(epoch FROM lease_until - now()) * 1000)::bigint FROM idem_keys "
            "WHERE scope = $1 AND key = $2",
            {"payments:acct:" + acct, key});
        if (rows.empty()) std::cout << "     idem row: none" << std::endl;
        for (const auto& row : rows) {
            std::cout << "     idem row: state " << row[0] << ", fence " << row[1] << ", attempt " << row[2]
                      << ", created " << row[3] << " (" << row[6] << " ms ago), lease until " << row[4] << " ("
                      << row[7] << " ms from now " << row[5] << ")" << std::endl;
        }
        const auto charged = witness.query(
            "SELECT count(*) FROM gateway_charges WHERE account = $1 AND idempotency_key = $2", {acct, key});
        std::cout << "     gateway charges: " << charged.at(0).at(0) << std::endl;
        for (std::size_t s = 0; s < logs.size(); ++s) {
            std::ifstream in(logs[s]);
            for (std::string line; std::getline(in, line);) {
                if (line.find("'" + key + "'") != std::string::npos)
                    std::cout << "     log "
                              << "AB"[s] << ": " << line << std::endl;
            }
        }
    };
    // The servers' reconciler lines about no key (failed sweeps, clock samples), on failure: a
    // thread that could not sweep leaves every key waiting.
    const auto explain_sweeps = [&] {
        for (std::size_t s = 0; s < logs.size(); ++s) {
            std::ifstream in(logs[s]);
            for (std::string line; std::getline(in, line);) {
                if (line.find("reconciler: sweep failed") != std::string::npos ||
                    line.find("reconciler: reading the database's clock") != std::string::npos)
                    std::cout << "     log "
                              << "AB"[s] << ": " << line << std::endl;
            }
        }
    };
    // Per instance, from its reconciler's sweeps that found stale keys ("reconciler: sweep: ...;
    // started P ms after the previous one, took D ms"): the longest D and the longest P.
    const auto longest_sweeps = [&] {
        std::string out;
        for (std::size_t s = 0; s < logs.size(); ++s) {
            long took = 0, gap = 0;
            int sweeps = 0;
            std::ifstream in(logs[s]);
            for (std::string line; std::getline(in, line);) {
                if (line.find("reconciler: sweep: ") == std::string::npos) continue;
                const auto started = line.find("; started ");
                const auto took_at = line.rfind(", took ");
                if (started == std::string::npos || took_at == std::string::npos) continue;
                ++sweeps;
                gap = std::max(gap, std::atol(line.c_str() + started + 10));
                took = std::max(took, std::atol(line.c_str() + took_at + 7));
            }
            out += std::string(out.empty() ? "" : "; ") + "AB"[s] + ": " + std::to_string(sweeps) +
                   " sweeps, the longest took " + std::to_string(took) + " ms, the latest started " +
                   std::to_string(gap) + " ms after the previous";
        }
        return out;
    };

    // New payments must be paid on their first request, each charged once.
    const auto check_paid_at_once = [&](const std::vector<std::string>& keys, const std::vector<Reply>& replies,
                                        const std::string& when) {
        auto charges = ledger();
        std::chrono::milliseconds slowest{0};
        for (const Reply& r : replies) slowest = std::max(slowest, r.took);
        std::cout << "   the slowest answered in " << slowest.count() << " ms" << std::endl;
        for (std::size_t i = 0; i < keys.size(); ++i) {
            const bool paid = replies[i].status == 201 && !replies[i].replayed();
            check(paid, "new payment " + keys[i] + " " + when + " -> 201 at once, got " + describe(replies[i]) +
                            " after " + std::to_string(replies[i].took.count()) + " ms");
            if (!paid) explain(keys[i]);
            check(charges[keys[i]].size() == 1, "new payment " + keys[i] + ": the gateway holds " +
                                                    std::to_string(charges[keys[i]].size()) + " charges");
        }
    };
    section("terminating the instances' backends for " + std::to_string(fo.faults.count()) + " ms while " +
            std::to_string(fo.keys) + " payments start, each retried");
    std::vector<Intent> intents(static_cast<std::size_t>(fo.keys));
    const auto start = Clock::now() + 200ms;
    // Every client retries until its 201, or until well past the bound (to tell "late" from
    // "never" in the report).
    std::atomic<Clock::rep> give_up{Clock::time_point::max().time_since_epoch().count()};
    std::vector<std::thread> clients;
    for (int i = 0; i < fo.keys; ++i) {
        Intent& intent = intents[static_cast<std::size_t>(i)];
        intent.key = "faults-" + run + "-" + std::to_string(i);
        intent.body = payment_body(1000 + i, 100 + i, "tok_ok");
        // Spread over the fault window, so that claims, charges and saves all meet a fault.
        intent.first_request = start + (fo.faults - 400ms) * i / fo.keys;
        clients.emplace_back([&intent, &give_up, &A, &B, &acct, i] {
            std::minstd_rand jitter(static_cast<unsigned>(i) + 1);
            std::this_thread::sleep_until(intent.first_request);
            for (int n = 0; Clock::now().time_since_epoch().count() < give_up.load(); ++n) {
                const Reply r = pay((i + n) % 2 == 0 ? A : B, acct, intent.key, intent.body);
                ++intent.statuses[r.status];
                if (r.status == 201) {
                    intent.settled_at = Clock::now();
                    intent.body_201 = r.body;
                    return;
                }
                if (r.status != 0 && r.status != 409 && r.status != 429 && r.status < 500) {
                    intent.refused = r;
                    return;
                }
                std::this_thread::sleep_for(kRetryMin +
                                            std::chrono::milliseconds(jitter() % (kRetryMax - kRetryMin).count()));
            }
        });
    }
    // Every 20..100 ms 1..3 backends, every eighth round and last all of them. The faults end
    // when the backends of the last round have exited.
    std::minstd_rand fault_rng(static_cast<unsigned>(rng()));
    std::this_thread::sleep_until(start);
    while (Clock::now() < start + fo.faults) {
        terminate(rounds % 8 == 7 ? 1'000'000 : static_cast<int>(1 + fault_rng() % 3));
        std::this_thread::sleep_for(std::chrono::milliseconds(20 + fault_rng() % 80));
    }
    terminate_all();
    const auto last_fault = Clock::now();
    const auto deadline = last_fault + fo.bound;
    std::cout << "   " << kills << " backends terminated in " << rounds << " rounds" << std::endl;

    section("new payments right after the faults: paid at once");
    const auto [after_keys, after_replies] = pay_at_once("after", 8, 2000);
    give_up = (deadline + 5s).time_since_epoch().count();
    for (auto& t : clients) t.join();
    check_paid_at_once(after_keys, after_replies, "right after the faults");

    section("every key settled within " + std::to_string(fo.bound.count()) +
            " ms of the last fault: one 201, replayed byte for byte, one charge");
    std::map<int, int> all_statuses;
    double latest = 0;
    for (const Intent& intent : intents) {
        for (const auto& [status, n] : intent.statuses) all_statuses[status] += n;
        if (intent.settled_at) latest = std::max(latest, seconds_between(last_fault, *intent.settled_at));
    }
    std::cout << "   answers to the clients (0: no response): " << histogram(all_statuses) << std::endl;
    std::cout << "   the last key settled " << latest
              << " s after the last fault (README's bound: " << std::chrono::duration<double>(kSettleBound).count()
              << " s + two sweeps; with the retry's " << kRetryMax.count() << " ms and " << kSchedulingSlack.count()
              << " ms for the sweeps and scheduling: " << fo.bound.count() << " ms)" << std::endl;
    std::cout << "   reconciler sweeps with stale keys: " << longest_sweeps() << std::endl;
    check(kills > 0, "the faults terminated backends");
    auto charges = ledger();
    int unsettled = 0;
    for (const Intent& intent : intents) {
        const auto& ids = charges[intent.key];
        const bool in_time = intent.settled_at && *intent.settled_at <= deadline;
        const std::string who = "key " + intent.key + " (first sent " +
                                std::to_string(seconds_between(start, intent.first_request)) +
                                " s into the faults; answers " + histogram(intent.statuses) + ")";
        if (intent.refused) check(false, who + ": refused with " + describe(*intent.refused));
        check(in_time,
              who + ": " +
                  (intent.settled_at ? "201 only " + std::to_string(seconds_between(last_fault, *intent.settled_at)) +
                                           " s after the last fault"
                                     : "no 201 " + std::to_string(seconds_between(last_fault, Clock::now())) +
                                           " s after the last fault"));
        check(ids.size() == 1, who + ": the gateway holds " + std::to_string(ids.size()) + " charges");
        if (intent.settled_at) {
            const auto json = nlohmann::json::parse(intent.body_201, nullptr, false);
            check(!json.is_discarded() && ids.size() == 1 && json.value("payment_id", "") == "pay_" + ids[0],
                  who + ": the 201 is the gateway's one charge: " + intent.body_201);
            // A 201 whose save failed was answered from memory; the reconciler stores the same
            // bytes later. Either way, stored by the deadline.
            Reply again = pay(B, acct, intent.key, intent.body);
            while (again.status != 201 && Clock::now() < deadline) {
                std::this_thread::sleep_for(100ms);
                again = pay(B, acct, intent.key, intent.body);
            }
            check(again.status == 201 && again.replayed() && again.body == intent.body_201,
                  who + ": a retry replays the 201 byte for byte, got " + describe(again));
        }
        if (!in_time || ids.size() != 1) {
            ++unsettled;
            explain(intent.key);
        }
    }
    for (const auto& key : after_keys) {
        if (charges[key].size() != 1) explain(key);
    }
    if (unsettled > 0) explain_sweeps();

    section(
        "one more fault in a quiet moment (every backend terminated), then new payments: "
        "paid at once");
    terminate_all();
    const auto [quiet_keys, quiet_replies] = pay_at_once("quiet", 8, 4000);
    check_paid_at_once(quiet_keys, quiet_replies, "after a fault in a quiet moment");
    for (std::size_t i = 0; i < quiet_keys.size(); ++i) {
        if (quiet_replies[i].status != 201) explain(quiet_keys[i]);
    }

    const auto left = witness.query("SELECT count(*) FROM idem_keys WHERE scope = $1 AND state = 'in_progress'",
                                    {"payments:acct:" + acct});
    check(left.at(0).at(0) == "0", "no key left in progress: " + left.at(0).at(0));

    section("SIGTERM: both instances exit cleanly");
    for (auto& s : servers) {
        const std::string url = s.url;
        const int status = stop_server(s);
        check(status == 0, "instance " + url + " exited with " + std::to_string(status));
    }
    if (g_failures == 0 && !fo.keep_logs) {
        for (const auto& log : logs) std::remove(log.c_str());
        rmdir(log_dir.c_str());
    } else {
        std::cout << "   server logs kept in " << log_dir << std::endl;
    }
    std::cout << (g_failures == 0 ? "PASSED" : "FAILED") << ": " << g_checks - g_failures << "/" << g_checks
              << " checks passed (" << unsettled << " of " << fo.keys << " keys of the faults unsettled in time)"
              << std::endl;
    return g_failures == 0 ? 0 : 1;
}

}  // namespace e2e
