// consumer — deduplicate an at-least-once stream of JSON events with idem::execute_batch.
//
//   consumer [--db CONNINFO] [--scope NAME] [--batch N] [--table NAME] [--quiet] [FILE|-]
//
// Reads newline-delimited JSON events from FILE (or stdin: no FILE or "-"), e.g.
//   {"id": "evt-001", "type": "deposit", "account": "alice", "amount_cents": 10000}
// The event id is the idempotency key (within --scope, default "ledger-consumer"). Events are grouped
// into batches of --batch (default 64); each batch is claimed in one round trip, the effect runs for
// the winners, and their results are saved in one round trip (idem/batch.hpp).
//
// The effect applies the event to a balance in the table consumer_balances (same database, the
// consumer's own libpq connection): deposit adds amount_cents, withdrawal subtracts it. Run the
// consumer twice over the same file: the balances do not move the second time.
//
// Fingerprint: SHA-256 over the compact re-serialisation of the parsed event (nlohmann::json::dump():
// object keys sorted, no whitespace). A redelivered event is byte-identical, and even a copy with
// other whitespace or key order is recognised as the same event; the same id with different content
// is reported as a conflict (mismatch), never applied.
//
// Output: one line per event (unless --quiet), then
//   applied N, skipped M (duplicates D, already applied R), failed F, invalid I
//   balances: alice 7800, bob ...
// duplicates = copies of an id earlier in the same batch; already applied = completed by an earlier
// batch or run (the stored result is shown); failed = conflict (same id, other content), effect
// refused (bad event: released, so a fixed redelivery may run), outcome unknown (the key stays in
// progress), or still in progress in another consumer; invalid = not JSON, not an object, or no
// usable "id". Exit status: 0 when the stream was processed, 1 on a fatal error, 2 on bad usage.
//
// Database: --db, else $IDEM_TEST_DATABASE_URL, else $DATABASE_URL (a libpq conninfo).
#include <libpq-fe.h>
#include <idem/idem.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using json = nlohmann::json;

struct Options {
    std::string db;
    std::string scope = "ledger-consumer";
    std::size_t batch = 64;
    std::string table = "idem_keys";
    std::string input = "-";
    bool quiet = false;
};

[[noreturn]] void usage(const std::string& problem) {
    if (!problem.empty()) std::cerr << "consumer: " << problem << "\n";
    std::cerr << "usage: consumer [--db CONNINFO] [--scope NAME] [--batch N] [--table NAME] [--quiet] [FILE|-]\n";
    std::exit(2);
}

Options parse_args(int argc, char** argv) {
    Options o;
    bool have_input = false;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        const auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage(arg + " needs a value");
            return argv[++i];
        };
        if (arg == "--db") {
            o.db = value();
        } else if (arg == "--scope") {
            o.scope = value();
        } else if (arg == "--table") {
            o.table = value();
        } else if (arg == "--batch") {
            const std::string v = value();
            try {
                const long n = std::stol(v);
                if (n < 1 || n > 10000) throw std::out_of_range(v);
                o.batch = static_cast<std::size_t>(n);
            } catch (const std::exception&) {
                usage("--batch must be 1..10000");
            }
        } else if (arg == "--quiet" || arg == "-q") {
            o.quiet = true;
        } else if (arg == "--help" || arg == "-h") {
            usage("");
        } else if (arg != "-" && arg.starts_with("-")) {
            usage("unknown option " + arg);
        } else if (have_input) {
            usage("one input only");
        } else {
            o.input = arg;
            have_input = true;
        }
    }
    if (o.db.empty()) {
        for (const char* name : {"IDEM_TEST_DATABASE_URL", "DATABASE_URL"}) {
            if (const char* v = std::getenv(name); v && *v) {
                o.db = v;
                break;
            }
        }
    }
    if (o.db.empty()) usage("no database: pass --db CONNINFO or set DATABASE_URL");
    try {
        idem::validate_key_part(o.scope, "scope");
    } catch (const idem::invalid_key& e) {
        usage(e.what());
    }
    return o;
}

// --- the effect: a balance table, over the consumer's own connection -----------------------------

class Ledger {
public:
    explicit Ledger(const std::string& conninfo) : conn_(PQconnectdb(conninfo.c_str()), &PQfinish) {
        if (!conn_ || PQstatus(conn_.get()) != CONNECTION_OK) {
            throw std::runtime_error("cannot connect: " + std::string(conn_ ? PQerrorMessage(conn_.get()) : "?"));
        }
        PQsetNoticeProcessor(
            conn_.get(), [](void*, const char*) {}, nullptr);  // "already exists, skipping"
        exec(
            "CREATE TABLE IF NOT EXISTS consumer_balances ("
            " scope text NOT NULL, account text NOT NULL, balance_cents bigint NOT NULL,"
            " PRIMARY KEY (scope, account))",
            {});
    }

    /// Adds `delta` to the account's balance (autocommit); returns the new balance.
    std::int64_t add(const std::string& scope, const std::string& account, std::int64_t delta) {
        if (PQstatus(conn_.get()) != CONNECTION_OK) {
            // Nothing was sent: certainly not applied, so the claim may be released.
            throw idem::not_performed("ledger connection is down");
        }
        auto rows = exec(
            "INSERT INTO consumer_balances (scope, account, balance_cents) VALUES ($1, $2, $3) "
            "ON CONFLICT (scope, account) DO UPDATE "
            "SET balance_cents = consumer_balances.balance_cents + EXCLUDED.balance_cents "
            "RETURNING balance_cents",
            {scope, account, std::to_string(delta)});
        return std::stoll(rows.at(0).at(0));
    }

    std::vector<std::pair<std::string, std::int64_t>> balances(const std::string& scope) {
        std::vector<std::pair<std::string, std::int64_t>> out;
        for (auto& row :
             exec("SELECT account, balance_cents FROM consumer_balances WHERE scope = $1 ORDER BY account", {scope})) {
            out.emplace_back(row.at(0), std::stoll(row.at(1)));
        }
        return out;
    }

private:
    // The rows, as text values.
    std::vector<std::vector<std::string>> exec(const std::string& sql, const std::vector<std::string>& params) {
        std::vector<const char*> values;
        for (const auto& p : params) values.push_back(p.c_str());
        std::unique_ptr<PGresult, decltype(&PQclear)> r(
            PQexecParams(conn_.get(), sql.c_str(), static_cast<int>(values.size()), nullptr, values.data(), nullptr,
                         nullptr, 0),
            &PQclear);
        const auto status = r ? PQresultStatus(r.get()) : PGRES_FATAL_ERROR;
        if (status != PGRES_COMMAND_OK && status != PGRES_TUPLES_OK) {
            // Sent, and failed: whether it committed is unknown (a plain error, not not_performed).
            throw std::runtime_error("ledger: " + std::string(PQerrorMessage(conn_.get())));
        }
        std::vector<std::vector<std::string>> rows;
        for (int i = 0; i < PQntuples(r.get()); ++i) {
            std::vector<std::string> row;
            for (int c = 0; c < PQnfields(r.get()); ++c) row.emplace_back(PQgetvalue(r.get(), i, c));
            rows.push_back(std::move(row));
        }
        return rows;
    }

    std::unique_ptr<PGconn, decltype(&PQfinish)> conn_;
};

// --- events ----------------------------------------------------------------------------------------

struct Event {
    std::size_t line = 0;
    std::string id;
    json body;
};

struct Counts {
    std::size_t applied = 0, duplicates = 0, already = 0, failed = 0, invalid = 0;
};

/// Applies one event; the returned text is what idem stores and replays for its id.
/// A malformed event is refused with not_performed: nothing happened, the claim is released.
std::string apply(Ledger& ledger, const std::string& scope, const Event& e) {
    const json& b = e.body;
    const std::string type = b.value("type", std::string());
    if (type != "deposit" && type != "withdrawal") throw idem::not_performed("unknown type '" + type + "'");
    if (!b.contains("account") || !b["account"].is_string() || b["account"].get<std::string>().empty()) {
        throw idem::not_performed("no account");
    }
    if (!b.contains("amount_cents") || !b["amount_cents"].is_number_integer() ||
        b["amount_cents"].get<std::int64_t>() <= 0 || b["amount_cents"].get<std::int64_t>() > 1'000'000'000'000) {
        throw idem::not_performed("amount_cents must be a positive integer");
    }
    const std::string account = b["account"].get<std::string>();
    const std::int64_t amount = b["amount_cents"].get<std::int64_t>();
    const std::int64_t delta = type == "deposit" ? amount : -amount;
    const std::int64_t balance = ledger.add(scope, account, delta);
    return type + " " + account + " " + (delta > 0 ? "+" : "") + std::to_string(delta) + " (balance " +
           std::to_string(balance) + ")";
}

std::string reason(const std::exception_ptr& error) {
    try {
        if (error) std::rethrow_exception(error);
    } catch (const std::exception& e) {
        return e.what();
    } catch (...) {
    }
    return "unknown error";
}

class Consumer {
public:
    Consumer(const Options& o, idem::IdempotencyStore& store, Ledger& ledger) : o_(o), store_(store), ledger_(ledger) {}

    void add(Event e, idem::Fingerprint fp) {
        // Workaround: execute_batch calls every later copy of an id in a batch a "duplicate", even
        // with other content. A copy with another fingerprint goes to the next batch instead, where
        // the store answers mismatch.
        if (auto it = pending_fp_.find(e.id); it != pending_fp_.end() && !(it->second == fp)) flush();
        pending_fp_.emplace(e.id, fp);
        messages_.push_back(idem::Message{idem::Key{o_.scope, e.id}, fp});
        events_.push_back(std::move(e));
        if (messages_.size() >= o_.batch) flush();
    }

    void flush() {
        // Messages another consumer holds right now are redelivered a few times, as a broker would.
        for (int round = 0; !messages_.empty(); ++round) {
            auto results = idem::execute_batch(store_, messages_,
                                               [&](std::size_t i) { return apply(ledger_, o_.scope, events_[i]); });
            std::vector<idem::Message> retry;
            std::vector<Event> retry_events;
            std::chrono::milliseconds wait{0};
            for (std::size_t i = 0; i < results.size(); ++i) {
                const auto& r = results[i];
                const Event& e = events_[i];
                switch (r.outcome) {
                    case idem::BatchOutcome::executed:
                        ++counts.applied;
                        say("applied  " + e.id + ": " + *r.response);
                        break;
                    case idem::BatchOutcome::replayed:
                        ++counts.already;
                        say("skipped  " + e.id + ": already applied (" + *r.response + ")");
                        break;
                    case idem::BatchOutcome::duplicate:
                        ++counts.duplicates;
                        say("skipped  " + e.id + ": duplicate of line " + std::to_string(first_line(e.id)) +
                            " in this batch");
                        break;
                    case idem::BatchOutcome::mismatch:
                        ++counts.failed;
                        say("failed   " + e.id + " (line " + std::to_string(e.line) +
                            "): conflict: this id was seen with different content; not applied");
                        break;
                    case idem::BatchOutcome::released:
                        ++counts.failed;
                        say("failed   " + e.id + " (line " + std::to_string(e.line) +
                            "): refused, not applied: " + reason(r.error));
                        break;
                    case idem::BatchOutcome::failed:
                        ++counts.failed;
                        say("failed   " + e.id + " (line " + std::to_string(e.line) +
                            "): outcome unknown, left in progress for reconciliation: " + reason(r.error));
                        break;
                    case idem::BatchOutcome::in_progress:
                        if (round < 5) {
                            retry.push_back(messages_[i]);
                            retry_events.push_back(e);
                            wait = std::max(wait, r.retry_after);
                        } else {
                            ++counts.failed;
                            say("failed   " + e.id + ": still in progress in another consumer; redeliver later");
                        }
                        break;
                }
            }
            messages_ = std::move(retry);
            events_ = std::move(retry_events);
            if (!messages_.empty()) std::this_thread::sleep_for(std::max(wait, std::chrono::milliseconds(50)));
        }
        pending_fp_.clear();
    }

    void say(const std::string& line) const {
        if (!o_.quiet) std::cout << line << "\n";
    }

    Counts counts;

private:
    std::size_t first_line(const std::string& id) const {
        for (const auto& e : events_) {
            if (e.id == id) return e.line;
        }
        return 0;
    }

    const Options& o_;
    idem::IdempotencyStore& store_;
    Ledger& ledger_;
    std::vector<idem::Message> messages_;
    std::vector<Event> events_;
    std::map<std::string, idem::Fingerprint> pending_fp_;
};

}  // namespace

int main(int argc, char** argv) {
    const Options o = parse_args(argc, argv);

    std::ifstream file;
    std::istream* in = &std::cin;
    if (o.input != "-") {
        file.open(o.input);
        if (!file) {
            std::cerr << "consumer: cannot open " << o.input << "\n";
            return 1;
        }
        in = &file;
    }

    try {
        idem::PostgresOptions options;
        options.table = o.table;
        options.pool_size = 2;
        idem::PostgresStore store(o.db, options);
        store.ensure_schema();
        Ledger ledger(o.db);
        Consumer consumer(o, store, ledger);

        std::string line;
        for (std::size_t number = 1; std::getline(*in, line); ++number) {
            if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank
            json body = json::parse(line, nullptr, /*allow_exceptions=*/false);
            std::string why;
            std::string id;
            if (body.is_discarded()) {
                why = "not valid JSON";
            } else if (!body.is_object()) {
                why = "not a JSON object";
            } else if (!body.contains("id")) {
                why = "no \"id\"";
            } else if (body["id"].is_string()) {
                id = body["id"].get<std::string>();
            } else if (body["id"].is_number_integer()) {
                id = body["id"].dump();
            } else {
                why = "\"id\" is neither a string nor an integer";
            }
            if (why.empty()) {
                try {
                    idem::validate_key_part(id, "id");
                } catch (const idem::invalid_key& e) {
                    why = e.what();
                }
            }
            if (!why.empty()) {
                ++consumer.counts.invalid;
                consumer.say("invalid  line " + std::to_string(number) + ": " + why);
                continue;
            }
            // Canonical content: dump() of the parsed object (keys sorted, compact).
            const idem::Fingerprint fp = idem::fingerprint("consumer-event/v1", body.dump());
            consumer.add(Event{number, std::move(id), std::move(body)}, fp);
        }
        consumer.flush();

        const Counts& c = consumer.counts;
        std::cout << "applied " << c.applied << ", skipped " << c.duplicates + c.already << " (duplicates "
                  << c.duplicates << ", already applied " << c.already << "), failed " << c.failed << ", invalid "
                  << c.invalid << "\n";
        std::cout << "balances:";
        const auto balances = ledger.balances(o.scope);
        for (std::size_t i = 0; i < balances.size(); ++i) {
            std::cout << (i ? ", " : " ") << balances[i].first << " " << balances[i].second;
        }
        std::cout << (balances.empty() ? " (none)\n" : "\n");
        return 0;
    } catch (const std::exception& e) {
        std::cerr << "consumer: " << e.what() << "\n";
        return 1;
    }
}
