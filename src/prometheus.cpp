#include "idem/prometheus.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>

#include "idem/errors.hpp"
#include "process.hpp"

namespace idem {

namespace {

using Cell = std::atomic<std::uint64_t>;

// The outcomes of a call (idem_calls_total and idem_call_duration_seconds), in Event order.
constexpr std::array kCallOutcomes{Event::executed, Event::replayed, Event::in_progress,
                                   Event::mismatch, Event::released, Event::unknown};
constexpr std::size_t kShards = 16;  // threads share a shard modulo this: few share a cache line

// Where an event is counted in a shard: one cell per event, then the two kinds of
// reconcile_failed (a key's, a sweep's) instead of its own cell; then the histograms, one per call
// outcome and one for reconciled, each (buckets + 1) counts and a sum in nanoseconds.
constexpr std::size_t kFailedKey = event_count;
constexpr std::size_t kFailedSweep = event_count + 1;
constexpr std::size_t kHistograms0 = event_count + 2;
constexpr std::size_t kHistogramCount = kCallOutcomes.size() + 1;
constexpr std::size_t kReconciledHistogram = kCallOutcomes.size();

// The histogram an event's duration goes to, if any.
constexpr std::optional<std::size_t> histogram_of(Event e) noexcept {
    for (std::size_t i = 0; i < kCallOutcomes.size(); ++i) {
        if (kCallOutcomes[i] == e) return i;
    }
    if (e == Event::reconciled) return kReconciledHistogram;
    return std::nullopt;
}

bool valid_label_name(std::string_view name) noexcept {
    if (name.empty() || name.starts_with("__")) return false;
    const auto alpha = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
    if (!alpha(name.front())) return false;
    return std::all_of(name.begin(), name.end(), [&](char c) { return alpha(c) || (c >= '0' && c <= '9'); });
}

// A label value in the text format: backslash, double quote and line feed escaped.
void append_escaped(std::string& out, std::string_view value, bool quotes) {
    for (const char c : value) {
        switch (c) {
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '"':
                if (quotes) {
                    out += "\\\"";
                    break;
                }
                [[fallthrough]];
            default: out += c;
        }
    }
}

void append_number(std::string& out, std::uint64_t value) {
    char buf[24];
    const auto r = std::to_chars(buf, buf + sizeof buf, value);
    out.append(buf, r.ptr);
}

// The shortest digits that read back as `value`, in plain notation ("0.0005", "2.5", "10", "0"), as
// Prometheus' own clients write le="…" bounds; exponent notation only where that would not fit.
void append_number(std::string& out, double value) {
    char buf[64];
    auto r = std::to_chars(buf, buf + sizeof buf, value, std::chars_format::fixed);
    if (r.ec != std::errc()) r = std::to_chars(buf, buf + sizeof buf, value);
    out.append(buf, r.ptr);
}

double seconds(std::uint64_t nanos) noexcept { return static_cast<double>(nanos) / 1e9; }

// Writes families: HELP / TYPE once per family, then samples with the constant labels first.
class Writer {
public:
    Writer(std::string& out, const std::string& constant) : out_(out), constant_(constant) {}

    void family(std::string_view name, std::string_view type, std::string_view help) {
        out_ += "# HELP ";
        out_ += name;
        out_ += ' ';
        append_escaped(out_, help, false);
        out_ += "\n# TYPE ";
        out_ += name;
        out_ += ' ';
        out_ += type;
        out_ += '\n';
    }

    // `label`: "name=\"value\"" of the series' own label (already escaped), or empty.
    template <class Number>
    void sample(std::string_view name, std::string_view suffix, std::string_view label, Number value,
                std::string_view le = {}) {
        out_ += name;
        out_ += suffix;
        std::string_view sep = "{";
        const auto add = [&](std::string_view part) {
            if (part.empty()) return;
            out_ += sep;
            out_ += part;
            sep = ",";
        };
        add(constant_);
        add(label);
        if (!le.empty()) {
            out_ += sep;
            out_ += "le=\"";
            out_ += le;
            out_ += '"';
            sep = ",";
        }
        if (sep == ",") out_ += '}';
        out_ += ' ';
        append_number(out_, value);
        out_ += '\n';
    }

    void counter(std::string_view name, std::string_view help, std::uint64_t value) {
        family(name, "counter", help);
        sample(name, "", "", value);
    }

    void gauge(std::string_view name, std::string_view help, std::uint64_t value) {
        family(name, "gauge", help);
        sample(name, "", "", value);
    }

    // One histogram series: cumulative[i] observations <= les[i], then +Inf (count), sum, count.
    void histogram(std::string_view name, std::string_view label, std::span<const std::string> les,
                   std::span<const std::uint64_t> cumulative, std::uint64_t count, double sum) {
        for (std::size_t i = 0; i < les.size(); ++i) sample(name, "_bucket", label, cumulative[i], les[i]);
        sample(name, "_bucket", label, count, "+Inf");
        sample(name, "_sum", label, sum);
        sample(name, "_count", label, count);
    }

private:
    std::string& out_;
    const std::string& constant_;
};

}  // namespace

struct PrometheusObserver::State {
    std::vector<std::int64_t> bounds;  // options.buckets in nanoseconds
    std::vector<std::string> les;      // and as written in le="…"
    std::string constant;              // the constant labels, escaped: a="x",b="y"
    std::size_t cells_per_shard = 0;
    std::array<std::unique_ptr<Cell[]>, kShards> shards;

    mutable std::mutex sources_mutex;
    std::function<PoolStats()> pool_source;
    std::function<StoreStats()> store_source;
    std::function<std::size_t()> stale_source;

    [[nodiscard]] std::size_t histogram_cell(std::size_t histogram) const noexcept {
        return kHistograms0 + histogram * (bounds.size() + 2);
    }
    [[nodiscard]] std::uint64_t total(std::size_t cell) const noexcept {
        std::uint64_t sum = 0;
        for (const auto& shard : shards) sum += shard[cell].load(std::memory_order_relaxed);
        return sum;
    }
};

PrometheusObserver::PrometheusObserver(PrometheusOptions options) : state_(std::make_unique<State>()) {
    State& s = *state_;
    if (options.buckets.empty() || options.buckets.size() > 64) {
        throw config_error("idem: PrometheusOptions::buckets must hold 1 to 64 bounds");
    }
    for (const double bound : options.buckets) {
        if (!std::isfinite(bound) || bound <= 0 || bound > 1e9) {
            throw config_error(
                "idem: PrometheusOptions::buckets: every bound must be a positive number of seconds "
                "up to 1e9");
        }
        const auto nanos = static_cast<std::int64_t>(std::llround(bound * 1e9));
        if (nanos <= 0 || (!s.bounds.empty() && nanos <= s.bounds.back())) {
            throw config_error("idem: PrometheusOptions::buckets must be strictly increasing (in whole nanoseconds)");
        }
        s.bounds.push_back(nanos);
        std::string le;
        append_number(le, bound);
        s.les.push_back(std::move(le));
    }
    std::vector<std::string_view> names;
    for (const auto& [name, value] : options.labels) {
        if (!valid_label_name(name) || name == "le" || name == "outcome" || name == "kind" ||
            std::find(names.begin(), names.end(), name) != names.end()) {
            throw config_error("idem: PrometheusOptions::labels: invalid or repeated label name '" + name + "'");
        }
        names.push_back(name);
        if (!s.constant.empty()) s.constant += ',';
        s.constant += name;
        s.constant += "=\"";
        append_escaped(s.constant, value, true);
        s.constant += '"';
    }
    s.cells_per_shard = kHistograms0 + kHistogramCount * (s.bounds.size() + 2);
    for (auto& shard : s.shards) shard = std::make_unique<Cell[]>(s.cells_per_shard);
}

PrometheusObserver::~PrometheusObserver() = default;

void PrometheusObserver::on_event(const EventInfo& event) noexcept {
    const auto index = static_cast<std::size_t>(event.event);
    if (index >= event_count) return;
    State& s = *state_;
    Cell* const cells = s.shards[detail::thread_index() % kShards].get();
    std::size_t counter = index;
    if (event.event == Event::reconcile_failed) counter = event.key != nullptr ? kFailedKey : kFailedSweep;
    cells[counter].fetch_add(event.count, std::memory_order_relaxed);
    const auto histogram = histogram_of(event.event);
    if (!histogram || event.duration.count() <= 0) return;  // not timed
    const std::int64_t nanos = event.duration.count();
    const std::size_t first = s.histogram_cell(*histogram);
    const auto bucket = static_cast<std::size_t>(std::lower_bound(s.bounds.begin(), s.bounds.end(), nanos) -
                                                 s.bounds.begin());  // the first bound >= nanos, or +Inf
    cells[first + bucket].fetch_add(1, std::memory_order_relaxed);
    cells[first + s.bounds.size() + 1].fetch_add(static_cast<std::uint64_t>(nanos), std::memory_order_relaxed);
}

void PrometheusObserver::set_pool_source(std::function<PoolStats()> source) {
    std::lock_guard lock(state_->sources_mutex);
    state_->pool_source = std::move(source);
}

void PrometheusObserver::set_store_source(std::function<StoreStats()> source) {
    std::lock_guard lock(state_->sources_mutex);
    state_->store_source = std::move(source);
}

void PrometheusObserver::set_stale_source(std::function<std::size_t()> source) {
    std::lock_guard lock(state_->sources_mutex);
    state_->stale_source = std::move(source);
}

std::string PrometheusObserver::render() const {
    const State& s = *state_;
    std::function<PoolStats()> pool_source;
    std::function<StoreStats()> store_source;
    std::function<std::size_t()> stale_source;
    {
        std::lock_guard lock(s.sources_mutex);
        pool_source = s.pool_source;
        store_source = s.store_source;
        stale_source = s.stale_source;
    }
    // Asked first: a source that throws leaves nothing half written.
    std::optional<PoolStats> pool;
    if (pool_source) pool = pool_source();
    std::optional<StoreStats> store;
    if (store_source) store = store_source();
    std::optional<std::size_t> stale;
    if (stale_source) stale = stale_source();

    std::string out;
    out.reserve(8192);
    Writer w(out, s.constant);
    const std::size_t nb = s.bounds.size();
    std::vector<std::uint64_t> cumulative(nb);
    // One histogram of the shards' cells: cumulative buckets; returns (count, sum in seconds).
    const auto gather = [&](std::size_t histogram) {
        const std::size_t first = s.histogram_cell(histogram);
        std::uint64_t running = 0;
        for (std::size_t b = 0; b < nb; ++b) {
            running += s.total(first + b);
            cumulative[b] = running;
        }
        running += s.total(first + nb);
        return std::pair(running, seconds(s.total(first + nb + 1)));
    };
    const auto outcome_label = [](Event e) { return "outcome=\"" + std::string(to_string(e)) + "\""; };

    w.family("idem_calls_total", "counter",
             "Calls of execute_once, execute_batch and idem::http by outcome (released: not_performed; unknown: "
             "the effect's outcome is not known, the key waits for a reconciler).");
    for (const Event e : kCallOutcomes) {
        w.sample("idem_calls_total", "", outcome_label(e), s.total(static_cast<std::size_t>(e)));
    }
    w.family("idem_call_duration_seconds", "histogram",
             "Duration of the timed calls by outcome, from the claim to the answer.");
    for (std::size_t h = 0; h < kCallOutcomes.size(); ++h) {
        const auto [count, sum] = gather(h);
        w.histogram("idem_call_duration_seconds", outcome_label(kCallOutcomes[h]), s.les, cumulative, count, sum);
    }
    w.counter("idem_takeovers_total", "Stale in-progress keys taken over (resume mode or a reconciler).",
              s.total(static_cast<std::size_t>(Event::taken_over)));
    w.counter("idem_reconciled_total", "Keys a reconciler resolved (saved or released).",
              s.total(static_cast<std::size_t>(Event::reconciled)));
    w.family("idem_reconcile_duration_seconds", "histogram",
             "Time from a reconciler's take-over of a key to its resolution.");
    {
        const auto [count, sum] = gather(kReconciledHistogram);
        w.histogram("idem_reconcile_duration_seconds", "", s.les, cumulative, count, sum);
    }
    w.family("idem_reconcile_failures_total", "counter",
             "Reconciler failures: kind=\"key\", a key that could not be resolved (it stays in progress); "
             "kind=\"sweep\", a whole sweep that failed.");
    w.sample("idem_reconcile_failures_total", "", "kind=\"key\"", s.total(kFailedKey));
    w.sample("idem_reconcile_failures_total", "", "kind=\"sweep\"", s.total(kFailedSweep));
    w.counter("idem_purged_rows_total", "Expired records deleted by purge_expired.",
              s.total(static_cast<std::size_t>(Event::purged)));
    if (stale) {
        w.gauge("idem_stale_keys",
                "In-progress keys whose lease has passed (none holds them), counted by the reconciler at its last "
                "sweep.",
                *stale);
    }

    if (store) {
        w.counter("idem_store_round_trips_total", "Waits for the database's answer (a pipeline counts once).",
                  store->round_trips);
        w.counter("idem_store_claims_total", "claim() calls.", store->claims);
        w.counter("idem_store_retries_total", "Statements sent again (broken connection, 40001, 40P01, 55P03).",
                  store->retries);
        w.counter("idem_store_connections_opened_total", "Database connections opened.", store->connections_opened);
        w.counter("idem_store_connections_discarded_total",
                  "Database connections closed after an error or a failed health check.", store->connections_discarded);
    }
    if (pool) {
        w.gauge("idem_pool_connections_max", "The most connections the pool may open (pool_size).", pool->size);
        w.gauge("idem_pool_connections_open", "Connections open now: idle, leased or being opened.", pool->open);
        w.gauge("idem_pool_connections_idle", "Open connections no caller holds now.", pool->idle);
        w.gauge("idem_pool_waiters", "Callers waiting now for a connection to come back.", pool->waiters);
        w.counter("idem_pool_acquires_total", "Requests for a pooled connection.", pool->acquires);
        w.counter("idem_pool_acquire_waits_total", "Requests that found the pool exhausted and waited.", pool->waited);
        w.counter("idem_pool_acquire_timeouts_total", "Requests that waited pool_wait in vain (pool_timeout).",
                  pool->timeouts);
        // Only the requests that waited are observed, each once when its wait ended: every series
        // then only grows. (Counting the requests that found a connection free as 0 s would make the
        // low buckets shrink whenever a request still waiting at one scrape ends by the next.)
        w.family("idem_pool_acquire_wait_seconds", "histogram",
                 "Time spent waiting for a pooled connection by the requests that found none free.");
        static const auto les = [] {
            std::vector<std::string> v;
            for (const double bound : PoolStats::wait_bounds) append_number(v.emplace_back(), bound);
            return v;
        }();
        w.histogram("idem_pool_acquire_wait_seconds", "", les, pool->waits_within, pool->waited,
                    seconds(static_cast<std::uint64_t>(std::max<std::int64_t>(0, pool->wait_time.count()))));
    }
    return out;
}

}  // namespace idem
