// payments-e2e: GET /metrics — instance E's Prometheus counters against a known sequence of calls,
// and an instance with the replay cache and group commit on.
#include <algorithm>
#include <chrono>
#include <latch>
#include <map>
#include <string>
#include <thread>
#include <vector>
#include "e2e_support.hpp"

namespace e2e {

using namespace std::chrono_literals;

void metrics_section(Run& the_run) {
    const std::string &E = the_run.E, &acct = the_run.acct, &db = the_run.db, &server_exe = the_run.server_exe;
    std::vector<Server>& servers = the_run.servers;
    const auto fresh_key = [&the_run](const std::string& tag) { return the_run.fresh_key(tag); };

    section("GET /metrics: instance E's Prometheus counters are exactly the calls made");
    {
        // The value of one sample line ("name{labels} value"), or "" if the series is missing.
        const auto value = [](const std::string& text, const std::string& series) {
            const auto at = text.find("\n" + series + " ");
            if (at == std::string::npos) return std::string();
            const auto from = at + series.size() + 2;
            return text.substr(from, text.find('\n', from) - from);
        };
        const auto calls = [&](const std::string& text, const std::string& outcome) {
            return value(text, "idem_calls_total{outcome=\"" + outcome + "\"}");
        };
        const std::vector<std::string> outcomes{"executed", "replayed", "in_progress",
                                                "mismatch", "released", "unknown"};
        const Reply before = send(E, "GET", "/metrics", {});
        check(before.status == 200 && before.header("Content-Type").starts_with("text/plain; version=0.0.4"),
              "/metrics answers 200 text/plain; version=0.0.4: " + describe(before) + " " +
                  before.header("Content-Type"));
        for (const auto& outcome : outcomes)
            check(calls(before.body, outcome) == "0",
                  "before any payment, calls " + outcome + " = 0, got '" + calls(before.body, outcome) + "'");

        const std::string acct_m = acct + "_metrics";
        constexpr int kNew = 4, kReplays = 3;
        std::vector<std::string> keys;
        for (int i = 0; i < kNew; ++i) {
            keys.push_back(fresh_key("metrics"));
            const Reply r = pay(E, acct_m, keys.back(), payment_body(60 + i, 700, "tok_ok"));
            check(r.status == 201 && !r.replayed(), "metrics: new payment -> 201, got " + describe(r));
        }
        for (int i = 0; i < kReplays; ++i) {
            const Reply r = pay(E, acct_m, keys[static_cast<std::size_t>(i)], payment_body(60 + i, 700, "tok_ok"));
            check(r.status == 201 && r.replayed(), "metrics: replay -> 201 replayed, got " + describe(r));
        }
        const Reply reused = pay(E, acct_m, keys[0], payment_body(60, 701, "tok_ok"));
        check(reused.status == 422, "metrics: reused key -> 422, got " + describe(reused));
        const Reply invalid = pay(E, acct_m, fresh_key("metrics"), "{");
        check(invalid.status == 400, "metrics: invalid body -> 400 (no claim), got " + describe(invalid));
        const std::string timeout_key = fresh_key("metrics-timeout");
        const Reply lost = pay(E, acct_m, timeout_key, payment_body(70, 700, "tok_timeout"));
        check(lost.status == 503, "metrics: tok_timeout -> 503 (unknown), got " + describe(lost));
        const Reply busy = pay(E, acct_m, timeout_key, payment_body(70, 700, "tok_timeout"));
        check(busy.status == 409, "metrics: its retry -> 409 (in progress), got " + describe(busy));

        const Reply after = send(E, "GET", "/metrics", {});
        check(after.status == 200, "/metrics answers 200 again: " + describe(after));
        const std::map<std::string, std::string> expected{{"executed", std::to_string(kNew)},
                                                          {"replayed", std::to_string(kReplays)},
                                                          {"in_progress", "1"},
                                                          {"mismatch", "1"},
                                                          {"released", "0"},
                                                          {"unknown", "1"}};
        for (const auto& [outcome, n] : expected) {
            check(calls(after.body, outcome) == n,
                  "calls " + outcome + " = " + n + ", got '" + calls(after.body, outcome) + "'");
            const std::string histogram = "idem_call_duration_seconds";
            const std::string label = "{outcome=\"" + outcome + "\"";
            check(value(after.body, histogram + "_count" + label + "}") == n &&
                      value(after.body, histogram + "_bucket" + label + ",le=\"+Inf\"}") == n,
                  "duration histogram of " + outcome + " counts " + n);
        }
        check(value(after.body, "idem_pool_connections_max") == "4", "pool max 4");
        const std::string open = value(after.body, "idem_pool_connections_open");
        check(open >= "1" && open <= "4" && open.size() == 1, "1..4 connections open: " + open);
        check(value(after.body, "idem_pool_waiters") == "0", "no caller waits for a connection");
        check(value(after.body, "idem_pool_acquire_timeouts_total") == "0", "no pool timeout");
        check(value(after.body, "idem_reconcile_failures_total{kind=\"sweep\"}") == "0", "no failed reconciler sweep");
        check(value(after.body, "idem_store_claims_total") == std::to_string(kNew + kReplays + 1 + 2),
              "the store saw one claim per call that reached it: " + value(after.body, "idem_store_claims_total"));
        check(value(after.body, "payments_store_saves_total") == std::to_string(kNew),
              "one save per new payment: " + value(after.body, "payments_store_saves_total"));
        check(value(after.body, "payments_group_commit_grouped_claims_total") == "0" &&
                  value(after.body, "payments_group_commit_grouped_saves_total") == "0",
              "--group-commit off: no claim or save went in a shared transaction");

        // F: the defaults, the replay cache and group commit on. The first replay reads the
        // completed record from PostgreSQL and keeps it; the next ones never reach the store, and
        // are byte-identical.
        const auto cached_instance = start_server(
            server_exe, {"--listen", "127.0.0.1:0", "--db", db, "--reconcile-every-ms", "3600000", "--db-pool", "2"});
        check(cached_instance.has_value(), "instance F starts with the default replay cache and group commit");
        if (cached_instance) {
            servers.push_back(*cached_instance);
            const std::string F = cached_instance->url;
            const std::string key = fresh_key("cached");
            const Reply first = pay(F, acct_m, key, payment_body(90, 900, "tok_ok"));
            check(first.status == 201 && !first.replayed(), "cache: new payment -> 201, got " + describe(first));
            for (int i = 0; i < 3; ++i) {
                const Reply r = pay(F, acct_m, key, payment_body(90, 900, "tok_ok"));
                check(r.status == 201 && r.replayed() && r.body == first.body,
                      "cache: replay " + std::to_string(i + 1) + " -> 201 replayed, same bytes, got " + describe(r));
            }
            const Reply changed = pay(F, acct_m, key, payment_body(90, 901, "tok_ok"));
            check(changed.status == 422,
                  "cache: same key, other amount -> 422 from a cached entry, got " + describe(changed));
            const Reply m = send(F, "GET", "/metrics", {});
            check(calls(m.body, "executed") == "1" && calls(m.body, "replayed") == "3" &&
                      calls(m.body, "mismatch") == "1",
                  "cache: F counted 1 executed, 3 replayed, 1 mismatch");
            check(value(m.body, "idem_store_claims_total") == "2",
                  "cache: the store saw the new payment and the first replay only: " +
                      value(m.body, "idem_store_claims_total"));
            check(send(F, "GET", "/gateway/charges?idempotency_key=" + key, {}).body.find("\"count\":1") !=
                      std::string::npos,
                  "cache: one charge");

            // More simultaneous payments than F has connections: the claims and saves that find
            // none free share transactions. Each payment is still charged once and replays its own
            // bytes.
            constexpr int kBurst = 24;
            std::vector<std::string> burst_keys;
            for (int i = 0; i < kBurst; ++i) burst_keys.push_back(fresh_key("grouped"));
            std::vector<Reply> firsts(kBurst);
            std::latch go(kBurst);
            std::vector<std::thread> threads;
            for (int i = 0; i < kBurst; ++i) {
                threads.emplace_back([&, i] {
                    go.arrive_and_wait();
                    const auto at = static_cast<std::size_t>(i);
                    firsts[at] = pay(F, acct_m, burst_keys[at], payment_body(100 + i, 1000 + i, "tok_ok"));
                });
            }
            for (auto& t : threads) t.join();
            int paid = 0, charged_once = 0, replayed = 0;
            for (int i = 0; i < kBurst; ++i) {
                const auto at = static_cast<std::size_t>(i);
                if (firsts[at].status == 201 && !firsts[at].replayed()) ++paid;
                if (gateway_count(F, burst_keys[at]) == 1) ++charged_once;
                const Reply again = pay(F, acct_m, burst_keys[at], payment_body(100 + i, 1000 + i, "tok_ok"));
                if (again.status == 201 && again.replayed() && again.body == firsts[at].body) ++replayed;
            }
            check(paid == kBurst, "group commit: every simultaneous payment -> 201: " + std::to_string(paid));
            check(charged_once == kBurst, "group commit: one charge each: " + std::to_string(charged_once));
            check(replayed == kBurst, "group commit: each replays its own bytes: " + std::to_string(replayed));
            const Reply g = send(F, "GET", "/metrics", {});
            const std::string grouped_claims = value(g.body, "payments_group_commit_grouped_claims_total");
            const std::string grouped_saves = value(g.body, "payments_group_commit_grouped_saves_total");
            std::cout << "   grouped: " << grouped_claims << " claims in "
                      << value(g.body, "payments_group_commit_claim_groups_total") << " transactions, " << grouped_saves
                      << " saves in " << value(g.body, "payments_group_commit_save_groups_total") << std::endl;
            check(!grouped_claims.empty() && grouped_claims != "0",
                  "group commit: claims that found no connection free went in shared transactions");
        }
    }
}

}  // namespace e2e
