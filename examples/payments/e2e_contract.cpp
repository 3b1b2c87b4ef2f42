// payments-e2e: the HTTP contract (401, 400, 422, 402, 409, 429, retries, concurrency, isolation)
// through HTTP alone, the fake gateway's ledger the witness of how often a card was charged.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <latch>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>
#include "e2e_support.hpp"

namespace e2e {

using namespace std::chrono_literals;

void contract_sections(Run& the_run) {
    const std::string &A = the_run.A, &B = the_run.B, &C = the_run.C, &D = the_run.D;
    const std::string &acct = the_run.acct, &db = the_run.db, &run = the_run.id;
    const std::string &server_exe = the_run.server_exe, &client_exe = the_run.client_exe;
    std::vector<Server>& servers = the_run.servers;
    const auto fresh_key = [&the_run](const std::string& tag) { return the_run.fresh_key(tag); };

    section("401: no or malformed Authorization");
    {
        const std::string key = fresh_key("auth");
        const Reply none = pay(A, "", key, payment_body(1, 100, "tok_ok"));
        check(none.status == 401, "no Authorization -> 401, got " + describe(none));
        httplib::Headers basic{{"Authorization", "Basic YWxpY2U6c2VjcmV0"}, {"Idempotency-Key", key}};
        const Reply b = send(A, "POST", "/payments", basic, payment_body(1, 100, "tok_ok"));
        check(b.status == 401, "Basic auth -> 401, got " + describe(b));
        check(gateway_count(A, key) == 0, "no charge after 401");
    }

    section("400: missing or invalid Idempotency-Key");
    {
        const Reply missing = pay(A, acct, std::nullopt, payment_body(2, 100, "tok_ok"));
        check(missing.status == 400, "missing key -> 400, got " + describe(missing));
        for (const std::string& bad : {std::string(), std::string(256, 'k'),
                                       std::string("ab\x01"
                                                   "cd"),
                                       std::string("ab\tcd"), std::string("\xff\xfe")}) {
            const Reply r = pay(A, acct, bad, payment_body(2, 100, "tok_ok"));
            check(r.status == 400, "invalid key (" + std::to_string(bad.size()) + " bytes) -> 400, got " + describe(r));
        }
        const Reply max = pay(A, acct, run + std::string(255 - run.size(), 'k'), payment_body(2, 100, "tok_ok"));
        check(max.status == 201, "a 255-byte key is accepted, got " + describe(max));
    }

    section("GET /gateway/charges: 400 for a parameter the ledger could never hold, never 503");
    {
        const auto status_of = [&](const std::string& query) {
            return send(A, "GET", "/gateway/charges?" + query, {}).status;
        };
        check(status_of("account=x") == 400, "no idempotency_key -> 400");
        for (const char* bad : {"%FF", "a%00b", "%C3%28", "%ED%A0%80", "%F4%90%80%80", "%C0%AF"}) {
            check(status_of(std::string("idempotency_key=") + bad) == 400,
                  std::string("idempotency_key=") + bad + " -> 400");
        }
        check(status_of("idempotency_key=k&account=%FE") == 400, "account=%FE -> 400");
        const Reply fine = send(A, "GET", "/gateway/charges?idempotency_key=caf%C3%A9%F0%9F%92%B3", {});
        check(fine.status == 200 && fine.body.find("\"count\":0") != std::string::npos,
              "a UTF-8 key no one used -> 200, count 0: " + describe(fine));
    }

    section("400: invalid bodies do not consume the key; the corrected request then succeeds");
    const std::string k1 = fresh_key("body");
    std::string k1_body;
    {
        const std::vector<std::pair<std::string, std::string>> bad_bodies = {
            {"not JSON", "{order_id: 1"},
            {"empty body", ""},
            {"array", "[1,2]"},
            {"missing card", R"({"order_id":7,"amount_cents":2500,"currency":"BRL"})"},
            {"amount as string", R"({"order_id":7,"amount_cents":"2500","currency":"BRL","card":"tok_ok"})"},
            {"amount as float", R"({"order_id":7,"amount_cents":2500.0,"currency":"BRL","card":"tok_ok"})"},
            {"amount fractional", R"({"order_id":7,"amount_cents":25.5,"currency":"BRL","card":"tok_ok"})"},
            {"amount zero", R"({"order_id":7,"amount_cents":0,"currency":"BRL","card":"tok_ok"})"},
            {"amount negative", R"({"order_id":7,"amount_cents":-100,"currency":"BRL","card":"tok_ok"})"},
            {"order_id as string", R"({"order_id":"7","amount_cents":2500,"currency":"BRL","card":"tok_ok"})"},
            {"lowercase currency", R"({"order_id":7,"amount_cents":2500,"currency":"brl","card":"tok_ok"})"},
            {"4-letter currency", R"({"order_id":7,"amount_cents":2500,"currency":"BRLX","card":"tok_ok"})"},
            {"card as number", R"({"order_id":7,"amount_cents":2500,"currency":"BRL","card":42})"},
            {"unknown field", R"({"order_id":7,"amount_cents":2500,"currency":"BRL","card":"tok_ok","x":1})"},
            {"duplicate field",
             R"({"order_id":7,"amount_cents":1,"amount_cents":2500,"currency":"BRL","card":"tok_ok"})"},
            {"trailing garbage", R"({"order_id":7,"amount_cents":2500,"currency":"BRL","card":"tok_ok"} x)"},
        };
        for (const auto& [what, body] : bad_bodies) {
            const Reply r = pay(what.size() % 2 == 0 ? A : B, acct, k1, body);
            check(r.status == 400, what + " -> 400, got " + describe(r));
        }
        check(gateway_count(A, k1) == 0, "no gateway call for invalid bodies");
        k1_body = payment_body(7, 2500, "tok_ok");
        const Reply ok = pay(A, acct, k1, k1_body);
        check(ok.status == 201, "same key, corrected body -> 201, got " + describe(ok));
        check(!ok.replayed(), "first success is not marked as replayed");
        const auto json = nlohmann::json::parse(ok.body, nullptr, false);
        check(!json.is_discarded() && json.value("status", "") == "captured" && json.value("order_id", 0) == 7 &&
                  json.value("amount_cents", 0) == 2500 && json.value("currency", "") == "BRL" &&
                  json.value("payment_id", "").starts_with("pay_"),
              "201 body has payment_id, status, order_id, amount_cents, currency: " + ok.body);
        check(ok.header("Content-Type").starts_with("application/json"), "201 is application/json");

        section(
            "replay: same status, byte-identical body, Idempotent-Replayed; field "
            "order/whitespace do not matter");
        const Reply again = pay(B, acct, k1, k1_body);
        check(again.status == 201 && again.body == ok.body,
              "replay on the other instance is identical: " + describe(again));
        check(again.replayed(), "replay carries Idempotent-Replayed: true");
        const std::string reordered =
            "{ \"card\" : \"tok_ok\",\n  \"currency\":\"BRL\", "
            "\"amount_cents\": 2500 ,\"order_id\":7 }";
        const Reply re = pay(A, acct, k1, reordered);
        check(re.status == 201 && re.body == ok.body && re.replayed(),
              "reordered fields and whitespace -> same replay, got " + describe(re));
        check(gateway_count(A, k1) == 1, "gateway count for the key is 1");

        section("422: same key, different request");
        const Reply other = pay(B, acct, k1, payment_body(7, 2600, "tok_ok"));
        check(other.status == 422, "different amount -> 422, got " + describe(other));
        const Reply other_card = pay(A, acct, k1, payment_body(7, 2500, "tok_declined"));
        check(other_card.status == 422, "different card -> 422, got " + describe(other_card));
        check(gateway_count(A, k1) == 1, "gateway count still 1 after 422s");
    }

    section("402: a decline is saved and replayed without calling the gateway again");
    {
        const std::string key = fresh_key("declined");
        const Reply first = pay(A, acct, key, payment_body(8, 990, "tok_declined"));
        check(first.status == 402, "tok_declined -> 402, got " + describe(first));
        const auto json = nlohmann::json::parse(first.body, nullptr, false);
        check(!json.is_discarded() && json.value("error", "") == "card_declined", "402 body has error card_declined");
        check(gateway_count(A, key) == 1, "the declined attempt is one gateway call");
        const Reply second = pay(B, acct, key, payment_body(8, 990, "tok_declined"));
        check(second.status == 402 && second.body == first.body && second.replayed(),
              "402 replayed identically, got " + describe(second));
        check(gateway_count(B, key) == 1, "gateway count stays 1 after the replay");
    }

    section("tok_timeout: 503 outcome_unknown -> 409 while in progress -> reconciled 201, one charge");
    {
        const std::string key = fresh_key("timeout");
        const std::string body = payment_body(9, 4200, "tok_timeout");
        const Reply first = pay(A, acct, key, body);
        check(first.status == 503, "tok_timeout -> 503, got " + describe(first));
        check(first.body == R"({"error":"outcome_unknown"})",
              "503 body is {\"error\":\"outcome_unknown\"}: " + first.body);
        const Reply retry = pay(B, acct, key, body);
        check(retry.status == 409, "immediate retry -> 409, got " + describe(retry));
        check(!retry.header("Retry-After").empty(), "409 has Retry-After");
        check(gateway_count(A, key) == 1, "the gateway did record one charge");
        Reply settled;
        const auto until = Clock::now() + 15s;
        while (Clock::now() < until) {
            settled = pay(settled.status % 2 == 0 ? A : B, acct, key, body);
            if (settled.status != 409) break;
            std::this_thread::sleep_for(100ms);
        }
        check(settled.status == 201, "after the reconciler, the retry gets 201, got " + describe(settled));
        const auto json = nlohmann::json::parse(settled.body, nullptr, false);
        const std::string charges = send(A, "GET", "/gateway/charges?idempotency_key=" + key, {}).body;
        const auto ledger = nlohmann::json::parse(charges, nullptr, false);
        check(!json.is_discarded() && !ledger.is_discarded() && ledger["count"] == 1 &&
                  json.value("payment_id", "") == ledger["charges"][0].value("payment_id", "?") &&
                  json.value("status", "") == "captured",
              "the 201 is the one charge the gateway made: " + settled.body + " vs " + charges);
        const Reply again = pay(A, acct, key, body);
        check(again.status == 201 && again.body == settled.body && again.replayed(), "and it replays identically");
        check(gateway_count(A, key) == 1, "gateway count is 1");
    }

    section("a payment slower than its lease keeps its key: 201 at once, one charge");
    {
        // An instance whose gateway answers 4 s after the claim, twice the lease, with the
        // reconciler looking every 100 ms: the request must keep its key until its own save.
        // (A charge starts within 5 s of the request or not at all: 4 s is the slowest gateway
        // that still charges.)
        const auto slow_instance =
            start_server(server_exe, {"--listen", "127.0.0.1:0", "--db", db, "--lease-ms", "2000",
                                      "--reconcile-every-ms", "100", "--gateway-latency-ms", "4000"});
        check(slow_instance.has_value(), "the slow instance (lease 2 s, gateway 4 s) starts");
        if (slow_instance) {
            servers.push_back(*slow_instance);
            const std::string key = fresh_key("slow");
            const std::string body = payment_body(11, 4300, "tok_ok");
            const Reply first = pay(slow_instance->url, acct, key, body);
            check(first.status == 201 && !first.replayed(),
                  "a payment 4 s long with a 2 s lease -> 201 at once, got " + describe(first));
            check(gateway_count(A, key) == 1, "the gateway holds one charge");
            const Reply again = pay(A, acct, key, body);
            check(again.status == 201 && again.replayed() && again.body == first.body,
                  "a retry replays it byte for byte, got " + describe(again));
        }
    }

    section("50 simultaneous identical requests over two instances -> one charge");
    {
        const std::string key = fresh_key("burst");
        const std::string body = payment_body(10, 15000, "tok_ok");
        constexpr int kRequests = 50;
        std::vector<Reply> replies(kRequests);
        std::latch go(kRequests);
        std::vector<std::thread> threads;
        for (int i = 0; i < kRequests; ++i) {
            threads.emplace_back([&, i] {
                go.arrive_and_wait();
                replies[static_cast<std::size_t>(i)] = pay(i % 2 == 0 ? A : B, acct, key, body);
            });
        }
        for (auto& t : threads) t.join();
        std::map<int, int> by_status;
        std::set<std::string> bodies_201;
        bool retry_after_ok = true;
        for (const auto& r : replies) {
            ++by_status[r.status];
            if (r.status == 0) std::cout << "   network error: " << r.error << std::endl;
            if (r.status == 201) bodies_201.insert(r.body);
            if (r.status == 409 && r.header("Retry-After").empty()) retry_after_ok = false;
        }
        std::string summary;
        for (const auto& [status, n] : by_status) summary += std::to_string(status) + "x" + std::to_string(n) + " ";
        std::cout << "   statuses: " << summary << std::endl;
        check(by_status.size() <= 2 && by_status[201] >= 1 && by_status[201] + by_status[409] == kRequests,
              "every response is 201 or 409: " + summary);
        check(bodies_201.size() == 1,
              "every 201 body is byte-identical (" + std::to_string(bodies_201.size()) + " distinct)");
        check(retry_after_ok, "every 409 has Retry-After");
        check(gateway_count(A, key) == 1, "gateway count is 1");
        const Reply after = pay(B, acct, key, body);
        check(after.status == 201 && bodies_201.count(after.body) == 1 && after.replayed(),
              "a later retry replays the same 201");
    }

    section("account isolation: the same key in two accounts is two payments");
    {
        const std::string key = fresh_key("shared");
        const std::string acct_b = acct + "_b";
        const Reply a = pay(A, acct, key, payment_body(11, 1000, "tok_ok"));
        const Reply b = pay(B, acct_b, key, payment_body(12, 2000, "tok_ok"));
        check(a.status == 201 && b.status == 201,
              "both accounts get 201 (no 422 across accounts): " + describe(a) + " / " + describe(b));
        check(a.body != b.body, "different payments");
        check(gateway_count(A, key, acct) == 1 && gateway_count(A, key, acct_b) == 1, "one charge per account");
        const Reply a2 = pay(B, acct, key, payment_body(11, 1000, "tok_ok"));
        check(a2.status == 201 && a2.body == a.body && a2.replayed(), "account A's replay is A's payment");
        const Reply b_with_a_body = pay(A, acct_b, key, payment_body(11, 1000, "tok_ok"));
        check(b_with_a_body.status == 422, "account B cannot reach A's request under the same key");
    }

    section("429: per-account rate limit across instances, key not consumed");
    {
        const std::string limited = acct + "_rl";
        // All at once (a latch), so that they fall in one or two of the limiter's 1 s windows
        // however long each takes on a busy machine.
        std::vector<std::pair<std::string, Reply>> sent(10);
        {
            std::latch go(10);
            std::vector<std::thread> threads;
            for (int i = 0; i < 10; ++i) {
                sent[static_cast<std::size_t>(i)].first = fresh_key("rl");
                threads.emplace_back([&, i] {
                    auto& [key, reply] = sent[static_cast<std::size_t>(i)];
                    go.arrive_and_wait();
                    reply = pay(i % 2 == 0 ? C : D, limited, key, payment_body(20 + i, 100, "tok_ok"));
                });
            }
            for (auto& t : threads) t.join();
        }
        int ok = 0, limited_count = 0;
        std::string rejected_key;
        int rejected_order = 0;
        bool retry_after = true;
        for (std::size_t i = 0; i < sent.size(); ++i) {
            const auto& [key, r] = sent[i];
            if (r.status == 201) ++ok;
            if (r.status == 429) {
                ++limited_count;
                if (r.header("Retry-After").empty()) retry_after = false;
                if (rejected_key.empty()) {
                    rejected_key = key;
                    rejected_order = 20 + static_cast<int>(i);
                }
            }
        }
        check(limited_count >= 1 && ok + limited_count == 10, "10 quick requests at 3/s: some 429s, the rest 201 (" +
                                                                  std::to_string(ok) + " ok, " +
                                                                  std::to_string(limited_count) + " limited)");
        check(ok <= 6, "no more than 3 per second were accepted across both instances");
        check(retry_after, "every 429 has Retry-After");
        const Reply other = pay(C, acct + "_other", fresh_key("rl-other"), payment_body(30, 100, "tok_ok"));
        check(other.status == 201, "another account is not limited, got " + describe(other));
        if (!rejected_key.empty()) {
            check(gateway_count(C, rejected_key) == 0, "no gateway call for a 429");
            std::this_thread::sleep_for(1100ms);
            const Reply later = pay(D, limited, rejected_key, payment_body(rejected_order, 100, "tok_ok"));
            check(later.status == 201 && !later.replayed(),
                  "after Retry-After the same key succeeds: " + describe(later));
            check(gateway_count(C, rejected_key) == 1, "one charge for it");
        }
    }

    section("payments-client: one key per intent, reused on retries");
    {
        const std::string key = fresh_key("client");
        auto [rc1, out1] = run_client(client_exe, {"--url", A, "--account", acct, "--order", "40", "--amount", "5000",
                                                   "--currency", "BRL", "--card", "tok_ok", "--key", key});
        check(rc1 == 0 && out1.find("HTTP 201") != std::string::npos,
              "client pays: exit " + std::to_string(rc1) + "\n" + out1);
        auto [rc2, out2] = run_client(client_exe, {"--url", B, "--account", acct, "--order", "40", "--amount", "5000",
                                                   "--currency", "BRL", "--card", "tok_ok", "--key", key});
        check(rc2 == 0 && out2.find("HTTP 201 (replayed)") != std::string::npos, "client replays: " + out2);
        check(gateway_count(A, key) == 1, "one charge");

        auto [rc3, out3] = run_client(client_exe, {"--url", B, "--account", acct, "--order", "41", "--amount", "5000",
                                                   "--currency", "BRL", "--card", "tok_timeout"});
        check(rc3 == 0 && out3.find("HTTP 201") != std::string::npos && out3.find("HTTP 503") != std::string::npos,
              "client retries through 503/409 to the reconciled 201: " + out3);
        const auto key_at = out3.find("Idempotency-Key ");
        if (key_at != std::string::npos) {
            const std::string generated = out3.substr(key_at + 16, 36);
            check(gateway_count(A, generated) == 1, "the generated key was charged once: " + generated);
        }
        auto [rc4, out4] = run_client(client_exe, {"--url", A, "--account", acct, "--order", "42", "--amount", "5000",
                                                   "--currency", "brl", "--card", "tok_ok"});
        check(rc4 == 1 && out4.find("HTTP 400") != std::string::npos && out4.find("retrying") == std::string::npos,
              "client does not retry a 400: " + out4);
    }
}

}  // namespace e2e
