// idem-bench --store redis | tiered: see bench/redis.hpp and docs/benchmarks.md ("Redis").
//
// redis: for each thread count T and case, alternating rounds (ABBA) of two sides:
//   floor: T hiredis connections, each sending by hand what RedisStore sends: EVALSHA of the
//          library's claim script (and, for new keys, of its save script) with the same keys and
//          arguments, the scripts loaded with SCRIPT LOAD from src/redis/scripts.hpp;
//   idem:  execute_once through one RedisStore (pool_size = T), no-op effect.
// Each side writes under its own key prefix; both are preloaded with the same completed and
// in-progress records (the hashes the scripts write).
// tiered: replays of preloaded completed keys through PostgresStore alone, CachedStore{RedisReplayCache}
// (the tier filled, untimed, before the first case) and CachedStore{ReplayCache, RedisReplayCache}
// with the memory tier empty at the start of every phase and each key asked once (a hit in Redis,
// copied into memory: the first replay in this process of a key some instance cached).
#include "redis.hpp"

#include <fmt/format.h>
#include <hiredis/hiredis.h>
#include <unistd.h>
#include <idem/idem.hpp>
#include <idem/postgres_store.hpp>
#include <idem/redis/replay_cache.hpp>
#include <idem/redis/store.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "admin.hpp"
#include "redis/scripts.hpp"  // internal: the floor sends the library's own scripts
#include "util.hpp"

namespace bench {
namespace {

const std::string kScope = "bench";
const std::string kResult = "ok";
// What RedisStore sends with its default options (default_lease 30 s, default_retention 24 h).
constexpr std::int64_t kLeaseMs = 30'000;
constexpr std::int64_t kRetentionMs = 86'400'000;
constexpr std::int64_t kDayMs = 86'400'000;
constexpr int kWarmupCalls = 3;

enum class Case { fresh, replay, conflict };
const char* case_name(Case c) { return c == Case::fresh ? "new" : c == Case::replay ? "replay" : "conflict"; }

struct Options {
    std::string store;  // redis | tiered
    std::vector<int> threads{1, 4, 16};
    std::vector<Case> cases{Case::fresh, Case::replay, Case::conflict};
    double seconds = 6;
    int rounds = 3;
    std::int64_t preload = 100'000;
    std::string json;
    bool expect_round_trips = false;
    std::string only;  ///< run this side only (to profile it; no ratio)
    std::string socket, host = "127.0.0.1", db;
    int port = 6379;
};

[[noreturn]] void usage(int code) {
    std::fprintf(code == 0 ? stdout : stderr, "%s", R"(usage: idem-bench --store redis|tiered [options]

  --store redis           execute_once over a RedisStore (new, replay, conflict) vs a raw-hiredis
                          floor sending the same EVALSHA commands, one connection per thread
  --store tiered          replays: PostgresStore vs CachedStore{RedisReplayCache} and
                          CachedStore{ReplayCache, RedisReplayCache} in front of it (needs PostgreSQL:
                          --db CONNINFO or $IDEM_TEST_DATABASE_URL, e.g. under scripts/with-postgres.sh)
  --redis-socket PATH     the server's unix socket (default $IDEM_TEST_REDIS_SOCKET, e.g. under
                          scripts/with-redis.sh)
  --redis-host H, --redis-port P   TCP instead (127.0.0.1, 6379)
  --threads LIST          thread counts (default 1,4,16)
  --cases LIST            redis: new,replay,conflict (default all)
  --seconds N             measured seconds per case and side (default 6)
  --rounds N              alternating rounds per case (default 3)
  --preload N             completed (and, redis, in-progress) keys per side (default 100000)
  --json FILE             the figures as JSON
  --only SIDE             run one side only, to profile it (redis: floor, idem; tiered: postgres,
                          redis, memory+redis); no ratio
  --expect-round-trips    exit 3 unless every call had the expected outcome and round trips per call
                          are new 2 / replay 1 / conflict 1 (redis), 1 for PostgresStore's replays and
                          0 to the primary for the tiers (tiered)
)");
    std::exit(code);
}

long long to_int(const std::string& s) {
    char* end = nullptr;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    if (end == s.c_str() || *end != '\0') usage(2);
    return v;
}

Options parse(int argc, char** argv) {
    Options o;
    for (Args args(argc, argv, usage); args.next();) {
        const std::string& arg = args.name();
        const auto value = [&args] { return args.value(); };
        if (arg == "--store") {
            o.store = value();
        } else if (arg == "--redis-socket") {
            o.socket = value();
        } else if (arg == "--redis-host") {
            o.host = value();
        } else if (arg == "--redis-port") {
            o.port = static_cast<int>(to_int(value()));
        } else if (arg == "--db") {
            o.db = value();
        } else if (arg == "--threads") {
            o.threads.clear();
            for (const auto& t : split(value())) o.threads.push_back(static_cast<int>(to_int(t)));
            if (o.threads.empty() || std::any_of(o.threads.begin(), o.threads.end(), [](int t) { return t < 1; }))
                usage(2);
        } else if (arg == "--cases") {
            o.cases.clear();
            for (const auto& c : split(value())) {
                if (c == "new") {
                    o.cases.push_back(Case::fresh);
                } else if (c == "replay") {
                    o.cases.push_back(Case::replay);
                } else if (c == "conflict") {
                    o.cases.push_back(Case::conflict);
                } else {
                    usage(2);
                }
            }
        } else if (arg == "--seconds") {
            o.seconds = std::strtod(value().c_str(), nullptr);
            if (!(o.seconds > 0)) usage(2);
        } else if (arg == "--rounds") {
            o.rounds = static_cast<int>(to_int(value()));
            if (o.rounds < 1) usage(2);
        } else if (arg == "--preload") {
            o.preload = to_int(value());
            if (o.preload < 1) usage(2);
        } else if (arg == "--json") {
            o.json = value();
        } else if (arg == "--expect-round-trips") {
            o.expect_round_trips = true;
        } else if (arg == "--only") {
            o.only = value();
        } else if (arg == "-h" || arg == "--help") {
            usage(0);
        } else {
            std::fprintf(stderr, "idem-bench --store %s: unknown argument '%s'\n", o.store.c_str(), arg.c_str());
            usage(2);
        }
    }
    if (o.store != "redis" && o.store != "tiered") usage(2);
    return o;
}

// ---- raw hiredis --------------------------------------------------------------------------------

using Reply = std::unique_ptr<redisReply, decltype(&freeReplyObject)>;

/// One blocking hiredis connection: what the floor and the housekeeping use.
class Raw {
public:
    explicit Raw(const Options& o) {
        c_ = o.socket.empty() ? redisConnect(o.host.c_str(), o.port) : redisConnectUnix(o.socket.c_str());
        if (c_ == nullptr || c_->err != 0) {
            const std::string why = c_ ? c_->errstr : "out of memory";
            if (c_) redisFree(c_);
            throw std::runtime_error("cannot connect to Redis: " + why);
        }
    }
    ~Raw() { redisFree(c_); }
    Raw(const Raw&) = delete;
    Raw& operator=(const Raw&) = delete;

    void append(std::initializer_list<std::string_view> args) { append(args.begin(), args.size()); }
    void append(const std::string_view* args, std::size_t n) {
        constexpr std::size_t kMax = 32;
        if (n > kMax) throw std::logic_error("Raw::append: too many arguments");
        const char* argv[kMax];
        std::size_t lens[kMax];
        for (std::size_t i = 0; i < n; ++i) {
            argv[i] = args[i].data();
            lens[i] = args[i].size();
        }
        if (redisAppendCommandArgv(c_, static_cast<int>(n), argv, lens) != REDIS_OK) fail();
    }
    Reply get() {
        void* raw = nullptr;
        if (redisGetReply(c_, &raw) != REDIS_OK || raw == nullptr) fail();
        Reply r(static_cast<redisReply*>(raw), &freeReplyObject);
        if (r->type == REDIS_REPLY_ERROR) throw std::runtime_error(std::string("Redis: ") + r->str);
        return r;
    }
    Reply command(std::initializer_list<std::string_view> args) {
        append(args);
        return get();
    }

private:
    [[noreturn]] void fail() { throw std::runtime_error(std::string("Redis connection: ") + c_->errstr); }
    redisContext* c_ = nullptr;
};

std::string_view text(const redisReply& r) { return r.str ? std::string_view(r.str, r.len) : std::string_view(); }

/// A key's names as RedisStore writes them under `prefix` (idem/redis/store.hpp, key_prefix).
struct Names {
    std::string prefix;
    std::string record(const std::string& member) const { return prefix + "r:" + member; }
    std::string index() const { return prefix + "in_progress"; }
};
std::string member_of(std::string_view key) { return std::to_string(kScope.size()) + ":" + kScope + std::string(key); }

/// The floor: one connection, the library's claim and save scripts sent by hand.
class Floor {
public:
    Floor(const Options& o, Names names, std::string_view fp_alg, std::string_view fp)
        : raw_(o), names_(std::move(names)), fp_alg_(fp_alg), fp_(fp) {
        claim_sha_ = text(*raw_.command({"SCRIPT", "LOAD", idem::redis::kScripts[idem::redis::kClaim]}));
        save_sha_ = text(*raw_.command({"SCRIPT", "LOAD", idem::redis::kScripts[idem::redis::kSave]}));
    }
    /// The claim script's tag ("claimed" / "found" ...) and, for a found record, its state and result.
    struct Answer {
        std::string_view tag, state, result;
        Reply reply{nullptr, &freeReplyObject};
    };
    Answer claim(const std::string& key, std::int64_t fence) {
        const std::string member = member_of(key);
        const std::string record = names_.record(member);
        const std::string index = names_.index();
        const std::string f = std::to_string(fence), lease = std::to_string(kLeaseMs),
                          retention = std::to_string(kRetentionMs);
        raw_.append({"EVALSHA", claim_sha_, "2", record, index, f, fp_alg_, fp_, lease, retention, "0", member});
        ++round_trips_;
        Answer a;
        a.reply = raw_.get();
        const redisReply& r = *a.reply;
        if (r.type != REDIS_REPLY_ARRAY || r.elements < 2) throw std::runtime_error("floor: bad claim answer");
        a.tag = text(*r.element[0]);
        if (r.elements == 13) {
            a.state = text(*r.element[2]);
            a.result = text(*r.element[7]);
        }
        return a;
    }
    bool save(const std::string& key, std::int64_t fence) {
        const std::string member = member_of(key);
        const std::string record = names_.record(member);
        const std::string index = names_.index();
        const std::string f = std::to_string(fence);
        raw_.append({"EVALSHA", save_sha_, "2", record, index, f, kResult, member});
        ++round_trips_;
        const Reply r = raw_.get();
        return r->type == REDIS_REPLY_INTEGER && r->integer == 1;
    }
    [[nodiscard]] std::uint64_t round_trips() const noexcept { return round_trips_; }

private:
    Raw raw_;
    Names names_;
    std::string fp_alg_, fp_, claim_sha_, save_sha_;
    std::uint64_t round_trips_ = 0;
};

std::int64_t redis_now_ms(Raw& raw) {
    const Reply t = raw.command({"TIME"});
    return std::stoll(std::string(text(*t->element[0]))) * 1000 + std::stoll(std::string(text(*t->element[1]))) / 1000;
}

/// Writes `count` records as RedisStore's scripts write them: completed (expiring in a day) or
/// in progress (lease of a day, in the index), keys base + i.
void preload(Raw& raw, const Names& names, bool completed, std::int64_t base, std::int64_t count,
             std::string_view fp_alg, std::string_view fp) {
    const std::int64_t now = redis_now_ms(raw);
    const std::string c = std::to_string(now), l = std::to_string(completed ? now : now + kDayMs),
                      e = std::to_string(now + kDayMs + (completed ? 0 : kRetentionMs));
    const std::string index = names.index();
    Rng rng(static_cast<std::uint64_t>(base) ^ 0x5EEDull);
    constexpr std::int64_t kChunk = 1000;
    for (std::int64_t from = 0; from < count; from += kChunk) {
        const std::int64_t to = std::min(count, from + kChunk);
        for (std::int64_t i = from; i < to; ++i) {
            const std::string member = member_of(preloaded_key(base, static_cast<std::uint64_t>(i)));
            const std::string record = names.record(member);
            const std::string fence = std::to_string(random_fence(rng));
            if (completed) {
                raw.append({"HSET", record, "s", "c",     "fa", fp_alg, "fp", fp, "f", fence,
                            "a",    "1",    "r", kResult, "c",  c,      "l",  l,  "e", e});
                raw.append({"PEXPIREAT", record, e});
            } else {
                raw.append(
                    {"HSET", record, "s", "p", "fa", fp_alg, "fp", fp, "f", fence, "a", "1", "c", c, "l", l, "e", e});
                raw.append({"ZADD", index, l, member});
            }
        }
        for (std::int64_t i = from; i < to; ++i) {
            (void)raw.get();
            (void)raw.get();
        }
    }
}

/// Deletes every key under `prefix` (SCAN + UNLINK).
void drop_prefix(Raw& raw, const std::string& prefix) {
    std::string cursor = "0";
    const std::string pattern = prefix + "*";
    do {
        const Reply r = raw.command({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"});
        cursor = std::string(text(*r->element[0]));
        const redisReply& keys = *r->element[1];
        for (std::size_t i = 0; i < keys.elements; ++i) raw.append({"UNLINK", text(*keys.element[i])});
        for (std::size_t i = 0; i < keys.elements; ++i) (void)raw.get();
    } while (cursor != "0");
}

// ---- phases -------------------------------------------------------------------------------------

/// The counters a side reports: [0] round trips (the store's, the floor's, or the primary's),
/// [1] Redis tier hits, [2] memory tier hits, [3] tier errors + calls skipped after one.
using Counts = std::array<std::uint64_t, 4>;

double cpu_seconds() {
    timespec ts{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) / 1e9;
}

struct Side {
    explicit Side(std::string n) : name(std::move(n)) {}
    std::string name;
    std::uint64_t calls = 0, unexpected = 0;
    double seconds = 0, cpu = 0;
    Counts counts{};
    Histogram hist;
    std::vector<double> round_ops;  ///< ops/s of each phase, in round order

    [[nodiscard]] double ops() const { return seconds > 0 ? static_cast<double>(calls) / seconds : 0; }
    [[nodiscard]] double per_call(std::uint64_t n) const {
        return calls ? static_cast<double>(n) / static_cast<double>(calls) : 0;
    }
    [[nodiscard]] double cpu_us() const { return calls ? cpu * 1e6 / static_cast<double>(calls) : 0; }
};

/// Thrown by an op that has run out of keys: the phase ends there (the call is not counted).
struct Exhausted {};

/// `op(thread, rng)` on `threads` threads for `seconds` after kWarmupCalls each, added to `side`;
/// `counts()` is read once all are warm and again after the last one stopped.
void run_phase(Side& side, int threads, double seconds, std::uint64_t seed, const std::function<bool(int, Rng&)>& op,
               const std::function<Counts()>& counts) {
    const auto n = static_cast<std::size_t>(threads);
    auto hists = std::make_unique<Histogram[]>(n);
    std::vector<std::uint64_t> done(n, 0), bad(n, 0);
    std::atomic<bool> stop{false};
    std::mutex m;
    std::string error;
    Counts before{};
    Clock::time_point start;
    double cpu0 = 0;
    std::barrier ready(threads + 1, [&]() noexcept {
        before = counts();
        cpu0 = cpu_seconds();
        start = Clock::now();
    });
    std::vector<std::thread> workers;
    for (std::size_t t = 0; t < n; ++t) {
        workers.emplace_back([&, t] {
            Rng rng = Rng::stream(seed, t);
            const int id = static_cast<int>(t);
            const auto failed = [&](const std::exception& e) {
                std::lock_guard lock(m);
                if (error.empty()) error = e.what();
                stop.store(true);
            };
            bool warm = true;
            try {
                for (int i = 0; i < kWarmupCalls; ++i) (void)op(id, rng);
            } catch (const std::exception& e) {
                failed(e);
                warm = false;
            }
            ready.arrive_and_wait();
            if (!warm) return;
            try {
                while (!stop.load(std::memory_order_relaxed)) {
                    const auto t0 = Clock::now();
                    const bool good = op(id, rng);
                    hists[t].record(static_cast<std::uint64_t>(std::chrono::nanoseconds(Clock::now() - t0).count()));
                    ++done[t];
                    if (!good) ++bad[t];
                }
            } catch (const Exhausted&) {
                stop.store(true);
            } catch (const std::exception& e) {
                failed(e);
            }
        });
    }
    ready.arrive_and_wait();
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    while (!stop.load() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    stop.store(true);
    for (auto& w : workers) w.join();
    const auto end = Clock::now();
    side.cpu += cpu_seconds() - cpu0;
    if (!error.empty()) throw std::runtime_error(error);
    const Counts after = counts();
    const double took = seconds_between(start, end);
    side.seconds += took;
    for (std::size_t i = 0; i < 4; ++i) side.counts[i] += after[i] - before[i];
    std::uint64_t calls = 0;
    for (std::size_t t = 0; t < n; ++t) {
        calls += done[t];
        side.unexpected += bad[t];
        side.hist.merge(hists[t]);
    }
    side.calls += calls;
    side.round_ops.push_back(took > 0 ? static_cast<double>(calls) / took : 0);
}

/// Alternating rounds (A B, then B A, ...) of every side, `seconds / rounds` each.
void run_rounds(const Options& o, std::vector<Side>& sides, std::uint64_t& seed,
                const std::function<void(std::size_t side, Side&)>& one_phase) {
    for (int round = 0; round < o.rounds; ++round) {
        for (std::size_t step = 0; step < sides.size(); ++step) {
            const std::size_t i = round % 2 == 0 ? step : sides.size() - 1 - step;
            seed += 0x632BE59BD9B4E019ull;
            if (o.only.empty() || o.only == sides[i].name) one_phase(i, sides[i]);
        }
    }
}

struct Run {
    int threads = 0;
    std::string kind;
    std::vector<Side> sides;  // sides[0] is what the ratios compare with

    /// The median over rounds of side i's ops/s / sides[0]'s in the same round: on a busy machine
    /// a stall of another program lands in a few phases, and this ratio does not follow them.
    [[nodiscard]] double median_round_ratio(std::size_t i) const {
        std::vector<double> r;
        const auto& a = sides[i].round_ops;
        const auto& b = sides[0].round_ops;
        for (std::size_t k = 0; k < std::min(a.size(), b.size()); ++k) {
            if (b[k] > 0) r.push_back(a[k] / b[k]);
        }
        if (r.empty()) return NAN;
        std::sort(r.begin(), r.end());
        const std::size_t m = r.size() / 2;
        return r.size() % 2 ? r[m] : (r[m - 1] + r[m]) / 2;
    }
};

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.6g}", v) : "null"; }

void print_header(const char* base) {
    std::printf("%-7s %-8s %-13s %11s %8s %8s %8s %8s %8s %7s %s\n", "threads", "case", "side", "ops/s", base, "median",
                "p50 us", "p99 us", "RT/call", "cpu us", "(RT: store's round trips; tiered: the primary's)");
}

void print_run(const Run& r) {
    const double base = r.sides[0].ops();
    for (std::size_t i = 0; i < r.sides.size(); ++i) {
        const Side& s = r.sides[i];
        std::printf("%-7d %-8s %-13s %11.0f %8.3f %8.3f %8.0f %8.0f %8.3f %7.1f", r.threads, r.kind.c_str(),
                    s.name.c_str(), s.ops(), base > 0 ? s.ops() / base : NAN, r.median_round_ratio(i),
                    s.hist.percentile_us(0.5), s.hist.percentile_us(0.99), s.per_call(s.counts[0]), s.cpu_us());
        if (s.counts[1] || s.counts[2] || s.counts[3]) {
            std::printf("  redis hits %.3f, memory hits %.3f, tier errors %llu", s.per_call(s.counts[1]),
                        s.per_call(s.counts[2]), static_cast<unsigned long long>(s.counts[3]));
        }
        if (s.unexpected) std::printf("  UNEXPECTED OUTCOMES %llu", static_cast<unsigned long long>(s.unexpected));
        std::printf("\n");
    }
    std::fflush(stdout);
}

void write_json(const std::string& path, const Options& o, const std::vector<Run>& runs) {
    std::string s = fmt::format("{{\n  \"store\": \"{}\", \"seconds_per_case\": {}, \"rounds\": {},\n  \"runs\": [",
                                o.store, json_number(o.seconds), o.rounds);
    for (std::size_t i = 0; i < runs.size(); ++i) {
        const Run& r = runs[i];
        const double base = r.sides[0].ops();
        // The flat fields as the postgres runs have them: sides[1] (idem; the Redis tier) vs sides[0].
        const Side& lib = r.sides[1];
        s += fmt::format(
            "{}{{\"threads\": {}, \"case\": \"{}\", \"ops_per_s\": {}, \"floor_ops_per_s\": {}, "
            "\"ratio\": {}, \"round_trips_per_call\": {}, \"floor_round_trips_per_call\": {}, \"sides\": {{",
            i ? ",\n    " : "\n    ", r.threads, r.kind, json_number(lib.ops()), json_number(base),
            json_number(base > 0 ? lib.ops() / base : NAN), json_number(lib.per_call(lib.counts[0])),
            json_number(r.sides[0].per_call(r.sides[0].counts[0])));
        for (std::size_t j = 0; j < r.sides.size(); ++j) {
            const Side& d = r.sides[j];
            s += fmt::format(
                "{}\"{}\": {{\"ops_per_s\": {}, \"ratio\": {}, \"median_round_ratio\": {}, \"p50_us\": {}, \"p99_us\": "
                "{}, \"calls\": {}, "
                "\"unexpected_outcomes\": {}, \"round_trips_per_call\": {}, \"client_cpu_us_per_call\": {}, "
                "\"redis_tier_hits_per_call\": {}, \"memory_tier_hits_per_call\": {}, \"tier_errors\": {}}}",
                j ? ", " : "", d.name, json_number(d.ops()), json_number(base > 0 ? d.ops() / base : NAN),
                json_number(r.median_round_ratio(j)), json_number(d.hist.percentile_us(0.5)),
                json_number(d.hist.percentile_us(0.99)), d.calls, d.unexpected, json_number(d.per_call(d.counts[0])),
                json_number(d.cpu_us()), json_number(d.per_call(d.counts[1])), json_number(d.per_call(d.counts[2])),
                d.counts[3]);
        }
        s += "}}";
    }
    s += "\n  ]\n}\n";
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr || std::fwrite(s.data(), 1, s.size(), f) != s.size() || std::fclose(f) != 0) {
        throw std::runtime_error("cannot write " + path);
    }
}

idem::RedisOptions redis_options(const Options& o) {
    idem::RedisOptions r;
    r.unix_socket = o.socket;
    r.host = o.host;
    r.port = o.port;
    return r;
}

// Opens `connections` pooled connections of a store before anything is timed (the pools open
// them lazily): reads from as many threads until the store has opened that many, 5 s at most.
void prewarm(idem::IdempotencyStore& store, int connections) {
    const idem::Key key(kScope, "warm-up");
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    const auto want = static_cast<std::uint64_t>(connections);
    std::vector<std::thread> workers;
    for (int t = 0; t < connections; ++t) {
        workers.emplace_back([&] {
            while (store.stats().connections_opened < want && Clock::now() < deadline) (void)store.read(key);
        });
    }
    for (auto& w : workers) w.join();
}

bool execute(idem::IdempotencyStore& store, const idem::Key& key, const idem::Fingerprint& fp, idem::Outcome want) {
    const auto r = idem::execute_once(store, key, fp, [] { return kResult; });
    return r.outcome() == want && (want != idem::Outcome::replayed || r.response() == kResult);
}

// ---- --store redis ------------------------------------------------------------------------------

std::vector<Run> run_redis(const Options& o, const idem::Fingerprint& fp, std::uint64_t seed) {
    const std::string prefix = fmt::format("idem-bench-{}:", ::getpid());
    const Names lib_names{prefix + "lib:"}, floor_names{prefix + "floor:"};
    const std::string fp_alg = std::to_string(static_cast<int>(fp.algorithm()));
    const std::string fp_bytes(fp.bytes());
    Raw admin(o);
    struct Cleanup {
        Raw& raw;
        std::string prefix;
        ~Cleanup() {
            try {
                drop_prefix(raw, prefix);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "warning: could not delete %s*: %s\n", prefix.c_str(), e.what());
            }
        }
    } cleanup{admin, prefix};
    std::fprintf(stderr, "preloading %lld completed + %lld in-progress keys per side...\n",
                 static_cast<long long>(o.preload), static_cast<long long>(o.preload));
    for (const Names* names : {&lib_names, &floor_names}) {
        preload(admin, *names, true, kReplayBase, o.preload, fp_alg, fp_bytes);
        preload(admin, *names, false, kConflictBase, o.preload, fp_alg, fp_bytes);
    }
    std::vector<Run> runs;
    print_header("/floor");
    for (const int threads : o.threads) {
        idem::RedisOptions options = redis_options(o);
        options.key_prefix = lib_names.prefix;
        options.pool_size = static_cast<std::size_t>(threads);
        idem::RedisStore store(options);
        prewarm(store, threads);
        std::vector<std::unique_ptr<Floor>> floors;
        for (int t = 0; t < threads; ++t) floors.push_back(std::make_unique<Floor>(o, floor_names, fp_alg, fp_bytes));
        const auto floor_counts = [&floors] {
            Counts c{};
            for (const auto& f : floors) c[0] += f->round_trips();
            return c;
        };
        const auto store_counts = [&store] { return Counts{store.stats().round_trips, 0, 0, 0}; };
        for (const Case kind : o.cases) {
            const auto pick = [&](Rng& rng) {
                if (kind == Case::fresh) return random_hex_key(rng);
                return preloaded_key(kind == Case::replay ? kReplayBase : kConflictBase,
                                     rng.below(static_cast<std::uint64_t>(o.preload)));
            };
            const std::function<bool(int, Rng&)> floor_op = [&](int t, Rng& rng) {
                Floor& f = *floors[static_cast<std::size_t>(t)];
                const std::string key = pick(rng);
                const std::int64_t fence = random_fence(rng);
                const Floor::Answer a = f.claim(key, fence);
                switch (kind) {
                    case Case::fresh: return a.tag == "claimed" && f.save(key, fence);
                    case Case::replay: return a.tag == "found" && a.state == "c" && a.result == kResult;
                    case Case::conflict: return a.tag == "found" && a.state == "p";
                }
                return false;
            };
            const idem::Outcome want = kind == Case::fresh    ? idem::Outcome::executed
                                       : kind == Case::replay ? idem::Outcome::replayed
                                                              : idem::Outcome::in_progress;
            const std::function<bool(int, Rng&)> lib_op = [&](int, Rng& rng) {
                return execute(store, idem::Key(kScope, pick(rng)), fp, want);
            };
            Run run{threads, case_name(kind), {Side{"floor"}, Side{"idem"}}};
            run_rounds(o, run.sides, seed, [&](std::size_t i, Side& side) {
                if (i == 0) {
                    run_phase(side, threads, o.seconds / o.rounds, seed, floor_op, floor_counts);
                } else {
                    run_phase(side, threads, o.seconds / o.rounds, seed, lib_op, store_counts);
                }
            });
            print_run(run);
            runs.push_back(std::move(run));
        }
    }
    return runs;
}

bool check_redis(const std::vector<Run>& runs) {
    bool ok = true;
    for (const Run& r : runs) {
        const std::uint64_t want = r.kind == "new" ? 2 : 1;
        for (const Side& s : r.sides) {
            if (s.calls == 0 || s.unexpected != 0 || s.counts[0] != want * s.calls) {
                std::fprintf(stderr,
                             "FAIL: %s at %d threads, %s: %llu round trips for %llu calls (want %llu per call), "
                             "%llu unexpected outcomes\n",
                             r.kind.c_str(), r.threads, s.name.c_str(), static_cast<unsigned long long>(s.counts[0]),
                             static_cast<unsigned long long>(s.calls), static_cast<unsigned long long>(want),
                             static_cast<unsigned long long>(s.unexpected));
                ok = false;
            }
        }
    }
    return ok;
}

// ---- --store tiered -----------------------------------------------------------------------------

std::vector<Run> run_tiered(const Options& o, const idem::Fingerprint& fp, std::uint64_t seed) {
    const std::string table = fmt::format("bench_{}_tiered", ::getpid());
    const std::string prefix = fmt::format("idem-bench-{}:", ::getpid());
    Admin admin(o.db);
    Raw raw(o);
    struct Cleanup {
        Admin& admin;
        Raw& raw;
        std::string table, prefix;
        ~Cleanup() {
            try {
                admin.drop_table(table);
                drop_prefix(raw, prefix);
            } catch (const std::exception& e) {
                std::fprintf(stderr, "warning: clean-up: %s\n", e.what());
            }
        }
    } cleanup{admin, raw, table, prefix};
    admin.create_table(table);
    std::fprintf(stderr, "preloading %lld completed keys into %s...\n", static_cast<long long>(o.preload),
                 table.c_str());
    admin.exec("ALTER TABLE \"" + table + "\" SET (autovacuum_enabled = false)");
    admin.preload(table, Admin::Preload::completed, kReplayBase, o.preload, fp.bytes(), false);
    admin.exec("VACUUM (ANALYZE) \"" + table + "\"");

    idem::RedisReplayCacheOptions tier_options;
    tier_options.connection = idem::RedisReplayCacheOptions::cache_connection_defaults();
    const idem::RedisOptions where = redis_options(o);
    tier_options.connection.unix_socket = where.unix_socket;
    tier_options.connection.host = where.host;
    tier_options.connection.port = where.port;
    tier_options.connection.key_prefix = prefix;
    const auto keys = static_cast<std::uint64_t>(o.preload);
    const auto key_of = [](std::uint64_t i) { return idem::Key(kScope, preloaded_key(kReplayBase, i)); };

    std::vector<Run> runs;
    print_header("/pg");
    bool filled = false;
    for (const int threads : o.threads) {
        idem::PostgresOptions pg_options;
        pg_options.table = table;
        pg_options.pool_size = static_cast<std::size_t>(threads);
        idem::PostgresStore primary(o.db, pg_options);
        prewarm(primary, threads);
        tier_options.connection.pool_size = static_cast<std::size_t>(std::max(threads, 4));
        auto tier = std::make_shared<idem::RedisReplayCache>(tier_options);
        idem::CachedStore redis_only(primary, std::vector<std::shared_ptr<idem::ReplayTier>>{tier});
        if (!filled) {
            // The Redis tier holds every key before the first case (untimed): each one's first replay,
            // through a tier on the same entries with patient timeouts (a busy machine misses 50 ms).
            std::fprintf(stderr, "filling the Redis tier with %llu keys...\n", static_cast<unsigned long long>(keys));
            idem::RedisReplayCacheOptions patient = tier_options;
            patient.connection.command_timeout = patient.connection.pool_wait = std::chrono::seconds(5);
            patient.pause_after_error = std::chrono::milliseconds(0);
            auto filler_tier = std::make_shared<idem::RedisReplayCache>(patient);
            idem::CachedStore filler(primary, std::vector<std::shared_ptr<idem::ReplayTier>>{filler_tier});
            std::atomic<std::uint64_t> next{0};
            std::vector<std::thread> fillers;
            for (int t = 0; t < 4; ++t) {
                fillers.emplace_back([&] {
                    for (std::uint64_t i; (i = next.fetch_add(1)) < keys;) (void)filler.claim(key_of(i), fp);
                });
            }
            for (auto& f : fillers) f.join();
            if (filler_tier->stats().inserts < keys) {
                throw std::runtime_error(fmt::format("the Redis tier kept {} of {} keys ({} errors)",
                                                     filler_tier->stats().inserts, keys, filler_tier->stats().errors));
            }
            filled = true;
        }
        // memory+redis: a fresh CachedStore (empty memory tier) per phase; every call takes the next
        // key, and the phase ends early when every key has been asked once.
        std::unique_ptr<idem::CachedStore> two_tier;
        std::atomic<std::uint64_t> next_key{0};
        std::uint64_t first_key = 0;
        const auto tier_counts = [&]() {
            const auto s = tier->stats();
            const std::uint64_t memory_hits = two_tier ? two_tier->cache().stats().hits : 0;
            return Counts{primary.stats().round_trips, s.hits, memory_hits, s.errors + s.skipped};
        };
        const auto random_key = [&](Rng& rng) { return key_of(rng.below(keys)); };
        const std::function<bool(int, Rng&)> pg_op = [&](int, Rng& rng) {
            return execute(primary, random_key(rng), fp, idem::Outcome::replayed);
        };
        const std::function<bool(int, Rng&)> redis_op = [&](int, Rng& rng) {
            return execute(redis_only, random_key(rng), fp, idem::Outcome::replayed);
        };
        const std::function<bool(int, Rng&)> two_op = [&](int, Rng&) {
            const std::uint64_t n = next_key.fetch_add(1, std::memory_order_relaxed);
            if (n - first_key >= keys) throw Exhausted{};
            return execute(*two_tier, key_of(n % keys), fp, idem::Outcome::replayed);
        };
        Run run{threads, "replay", {Side{"postgres"}, Side{"redis"}, Side{"memory+redis"}}};
        run_rounds(o, run.sides, seed, [&](std::size_t i, Side& side) {
            const double s = o.seconds / o.rounds;
            if (i == 0) {
                run_phase(side, threads, s, seed, pg_op, tier_counts);
            } else if (i == 1) {
                run_phase(side, threads, s, seed, redis_op, tier_counts);
            } else {
                two_tier = std::make_unique<idem::CachedStore>(
                    primary,
                    std::vector<std::shared_ptr<idem::ReplayTier>>{std::make_shared<idem::ReplayCache>(), tier});
                first_key = seed % keys;
                next_key.store(first_key);
                run_phase(side, threads, s, seed, two_op, tier_counts);
                two_tier.reset();
            }
        });
        print_run(run);
        runs.push_back(std::move(run));
    }
    return runs;
}

bool check_tiered(const std::vector<Run>& runs) {
    bool ok = true;
    for (const Run& r : runs) {
        for (const Side& s : r.sides) {
            const bool pg = s.name == "postgres";
            // A tier's timeout is a miss answered by the primary: allowed (and reported), not failed.
            const bool good =
                s.calls > 0 && s.unexpected == 0 && (pg ? s.counts[0] == s.calls : s.counts[0] == 0 || s.counts[3] > 0);
            if (!good) {
                std::fprintf(stderr,
                             "FAIL: replay at %d threads, %s: %llu primary round trips for %llu calls (want %s), "
                             "%llu unexpected outcomes\n",
                             r.threads, s.name.c_str(), static_cast<unsigned long long>(s.counts[0]),
                             static_cast<unsigned long long>(s.calls), pg ? "1 per call" : "0",
                             static_cast<unsigned long long>(s.unexpected));
                ok = false;
            }
        }
    }
    return ok;
}

}  // namespace

int redis_main(int argc, char** argv) {
    Options o = parse(argc, argv);
    if (o.socket.empty() && o.host == "127.0.0.1" && o.port == 6379) {
        if (const char* env = std::getenv("IDEM_TEST_REDIS_SOCKET"); env != nullptr && env[0] != '\0') o.socket = env;
    }
    if (o.store == "tiered" && o.db.empty()) {
        const char* env = std::getenv("IDEM_TEST_DATABASE_URL");
        if (env == nullptr || env[0] == '\0') {
            std::fprintf(stderr,
                         "idem-bench --store tiered needs PostgreSQL: --db CONNINFO or $IDEM_TEST_DATABASE_URL "
                         "(scripts/with-postgres.sh scripts/with-redis.sh idem-bench --store tiered)\n");
            return 2;
        }
        o.db = env;
    }
    try {
        Raw probe(o);
        const Reply info = probe.command({"INFO", "server"});
        const std::string_view server = text(*info);
        const auto version_at = server.find("redis_version:");
        const std::string version(
            version_at == std::string_view::npos
                ? std::string_view("?")
                : server.substr(version_at + 14, server.find('\r', version_at) - version_at - 14));
        const Reply aof = probe.command({"CONFIG", "GET", "appendfsync"});
        const std::string fsync(aof->elements == 2 ? text(*aof->element[1]) : "?");
        std::printf(
            "idem-bench --store %s — Redis %s at %s, appendfsync %s; %u CPUs; %.1f s per case and side in %d "
            "alternating rounds; pool size = threads\n",
            o.store.c_str(), version.c_str(),
            o.socket.empty() ? fmt::format("{}:{}", o.host, o.port).c_str() : o.socket.c_str(), fsync.c_str(),
            std::thread::hardware_concurrency(), o.seconds, o.rounds);
        if (fsync != "always") std::printf("WARNING: appendfsync is not always: not the durable figures\n");
        std::fflush(stdout);
        const idem::Fingerprint fp = idem::fingerprint("idem-bench", 1);
        const std::uint64_t seed = static_cast<std::uint64_t>(Clock::now().time_since_epoch().count()) ^
                                   (static_cast<std::uint64_t>(::getpid()) << 32);
        const std::vector<Run> runs = o.store == "redis" ? run_redis(o, fp, seed) : run_tiered(o, fp, seed);
        if (!o.json.empty()) write_json(o.json, o, runs);
        if (o.expect_round_trips) {
            if (!(o.store == "redis" ? check_redis(runs) : check_tiered(runs))) return 3;
            std::printf("round trips per call as expected\n");
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "idem-bench: %s\n", e.what());
        return 1;
    }
    return 0;
}

}  // namespace bench
