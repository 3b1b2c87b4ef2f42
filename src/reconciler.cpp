#include "idem/reconciler.hpp"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "idem/errors.hpp"

namespace idem {
namespace {

struct Described {
    std::string type;
    std::string sqlstate;
    std::string message;
};

// Most derived class first: a response_too_large is also a response_not_saved and an outcome_unknown.
Described describe(const std::exception_ptr& thrown) {
    try {
        std::rethrow_exception(thrown);
    } catch (const response_too_large& e) {
        return {"response_too_large", e.sqlstate(), e.what()};
    } catch (const response_not_saved& e) {
        return {"response_not_saved", e.sqlstate(), e.what()};
    } catch (const outcome_unknown& e) {
        return {"outcome_unknown", e.sqlstate(), e.what()};
    } catch (const lease_lost& e) {
        return {"lease_lost", e.sqlstate(), e.what()};
    } catch (const corrupt_record& e) {
        return {"corrupt_record", e.sqlstate(), e.what()};
    } catch (const database_error& e) {
        return {"database_error", e.sqlstate(), e.what()};
    } catch (const pool_timeout& e) {
        return {"pool_timeout", e.sqlstate(), e.what()};
    } catch (const store_unavailable& e) {
        return {"store_unavailable", e.sqlstate(), e.what()};
    } catch (const config_error& e) {
        return {"config_error", e.sqlstate(), e.what()};
    } catch (const invalid_key& e) {
        return {"invalid_key", e.sqlstate(), e.what()};
    } catch (const error& e) {
        return {"error", e.sqlstate(), e.what()};
    } catch (const std::exception& e) {
        return {"std::exception", {}, e.what()};
    } catch (...) {
        return {"unknown", {}, "an exception not derived from std::exception"};
    }
}

// Whether the store will refuse the same decision again: the bytes are over the limit, the
// database rejects the data itself (22 data exception, 23 integrity constraint, 42 syntax or access
// rule, 54 program limit — e.g. a row too large), or it refuses idem for good (config_error: 42501
// a missing privilege, 42P01 no table, ... — thrown as config_error, not database_error, so the
// class test below never sees them). Outages, serialization failures and lock timeouts (08, 40,
// 55, 57, ...) pass; lease_lost means the key is someone else's now.
bool will_repeat(Reconciler::Stage stage, const Described& d) {
    if (stage != Reconciler::Stage::save && stage != Reconciler::Stage::release) return false;
    if (d.type == "response_too_large" || d.type == "config_error") return true;
    if (d.type != "database_error" || d.sqlstate.size() != 5) return false;
    const std::string_view sqlclass = std::string_view(d.sqlstate).substr(0, 2);
    return sqlclass == "22" || sqlclass == "23" || sqlclass == "42" || sqlclass == "54";
}

// The observer's detail feeds logs and metrics: the message's first line only, bounded. The lines
// after it are PostgreSQL's DETAIL/CONTEXT, and "Failing row contains (...)" shows the row's values
// (the start of the saved response, the phase data); Failure::message keeps the whole text.
constexpr std::size_t kMaxDetailMessageBytes = 512;

std::string_view first_line_bounded(std::string_view message) {
    message = message.substr(0, message.find('\n'));
    if (message.size() <= kMaxDetailMessageBytes) return message;
    std::size_t end = kMaxDetailMessageBytes;
    // Not inside a UTF-8 sequence: back up over continuation bytes.
    while (end > 0 && (static_cast<unsigned char>(message[end]) & 0xC0) == 0x80) --end;
    return message.substr(0, end);
}

std::string detail_of(std::string_view stage, const Described& d) {
    std::string detail;
    detail.append(stage).append(": ").append(d.type);
    if (!d.sqlstate.empty()) detail.append(" ").append(d.sqlstate);
    detail.append(": ").append(first_line_bounded(d.message));
    return detail;
}

// " (key 'v' in scope 's')", as idem::http::Route's log lines name a key.
std::string naming(const Key& key) { return " (key '" + key.value() + "' in scope '" + key.scope() + "')"; }

std::string ms(std::chrono::milliseconds d) { return std::to_string(d.count()) + " ms"; }

}  // namespace

template <class Line>
void Reconciler::tell(const Line& line) const noexcept {
    if (!options_.log) return;
    try {
        options_.log("idem::Reconciler: " + line());
    } catch (...) {
        // A log that fails (or no memory for the line) must not stop the sweep.
    }
}

Reconciler::Reconciler(IdempotencyStore& store, Resolver resolver, ReconcilerOptions options)
    : store_(store), resolver_(std::move(resolver)), options_(std::move(options)) {
    if (!resolver_) throw config_error("idem: Reconciler needs a resolver");
    if (options_.batch == 0) throw config_error("idem: Reconciler batch must be at least 1");
    if (options_.failure_backoff.count() < 0 || options_.failure_backoff > max_failure_backoff) {
        // Longer does not fit a store's clock arithmetic (MemoryStore adds it to a nanosecond
        // time_point; PostgreSQL refuses the interval): it would not back off at all.
        throw config_error("idem: Reconciler failure_backoff must be between 0 and 100 years");
    }
}

void Reconciler::record_failure(Sweep& sweep, const Key& key, Stage stage, std::exception_ptr thrown,
                                std::optional<Fence> held) {
    Described d = describe(thrown);
    bool backed_off = false;
    if (held && options_.failure_backoff.count() > 0 && will_repeat(stage, d)) {
        try {
            store_.extend_lease(key, *held, options_.failure_backoff);
            backed_off = true;
        } catch (...) {
            // Not held longer: stale again when this reconciler's lease passes, and reported again.
        }
    }
    std::string detail = detail_of(to_string(stage), d);
    if (backed_off) {
        detail.append(" (left alone for ").append(std::to_string(options_.failure_backoff.count())).append(" ms)");
    }
    store_.emit(Event::reconcile_failed, &key, {}, 1, detail);
    tell([&] {
        std::string line = "could not resolve: " + detail_of(to_string(stage), d) + "; ";
        if (!held) {
            line += "not taken, listed again next sweep";
        } else if (backed_off) {
            line += "left alone for " + ms(options_.failure_backoff);
        } else if (d.type == "lease_lost") {
            line += "another owner has the key";
        } else {
            line += "listed again in " + ms(options_.lease);
        }
        return line + naming(key);
    });
    sweep.failures.push_back(
        Failure{key, stage, std::move(d.type), std::move(d.sqlstate), std::move(d.message), backed_off});
    ++sweep.failed;
}

std::optional<std::size_t> Reconciler::stale_keys() const noexcept {
    const std::uint64_t n = stale_.value.load(std::memory_order_relaxed);
    if (n == Count::kUncounted) return std::nullopt;
    return static_cast<std::size_t>(n);
}

Reconciler::Sweep Reconciler::run_once() {
    Sweep sweep;
    // The backlog before this sweep takes any: the gauge. (A scan like the listing's, which is
    // skipped when there is nothing to list.)
    sweep.stale = store_.count_stale(options_.scopes);
    stale_.value.store(std::min<std::uint64_t>(sweep.stale, Count::kUncounted - 1), std::memory_order_relaxed);
    if (sweep.stale == 0) return sweep;
    // Listing takes nothing (it works across Citus shards); take_over() on each key is the
    // router-level write that decides which reconciler handles it.
    for (const StaleKey& stale : store_.list_stale(options_.batch, options_.scopes)) {
        ++sweep.listed;
        const auto started = std::chrono::steady_clock::now();
        std::optional<Fence> fence;
        try {
            fence = store_.take_over(stale.key, stale.record.fence, options_.lease, false);
        } catch (...) {
            record_failure(sweep, stale.key, Stage::take_over, std::current_exception(), std::nullopt);
            continue;
        }
        if (!fence) continue;  // another reconciler, a resumed retry, or the late owner got there first
        ++sweep.taken;
        // Each failure below leaves the key in progress, held by this reconciler until its lease
        // passes (or longer: see record_failure).
        Reconciliation r(stale.key, stale.record, *fence);
        try {
            resolver_(r);
        } catch (...) {
            record_failure(sweep, stale.key, Stage::resolver, std::current_exception(), fence);
            continue;
        }
        const Reconciliation::Decision decision = r.decision();
        if (decision == Reconciliation::Decision::leave) {
            ++sweep.left;
            tell([&] {
                return "left in progress" + (r.reason().empty() ? std::string() : ": " + r.reason()) +
                       "; listed again in " + ms(options_.lease) + naming(stale.key);
            });
            continue;
        }
        const Stage stage = decision == Reconciliation::Decision::save ? Stage::save : Stage::release;
        try {
            if (stage == Stage::save) {
                store_.save(stale.key, *fence, r.encoded_result());
            } else {
                store_.release(stale.key, *fence);
            }
        } catch (...) {
            record_failure(sweep, stale.key, stage, std::current_exception(), fence);
            continue;
        }
        if (stage == Stage::save) {
            ++sweep.saved;
        } else {
            ++sweep.released;
        }
        store_.emit(Event::reconciled, &stale.key, std::chrono::steady_clock::now() - started);
        tell([&] {
            return std::string(stage == Stage::save ? "saved" : "released") +
                   (r.reason().empty() ? std::string() : ": " + r.reason()) + naming(stale.key);
        });
    }
    return sweep;
}

void Reconciler::run(std::stop_token stop, std::chrono::milliseconds interval) {
    std::mutex mutex;
    std::condition_variable_any wake;
    while (!stop.stop_requested()) {
        try {
            while (!stop.stop_requested()) {
                const Sweep sweep = run_once();
                // A full batch means more may be waiting: sweep again at once. Not after a failed
                // take_over: that key is listed again at once, and sweeping again would spin on it.
                // Not after a sweep that resolved nothing either: with a lease shorter than a sweep
                // the keys it left or failed on are stale again at once; each sweep that goes on at
                // once removes a key, so the loop ends.
                const bool take_over_failed = std::any_of(sweep.failures.begin(), sweep.failures.end(),
                                                          [](const Failure& f) { return f.stage == Stage::take_over; });
                const bool resolved_any = sweep.saved + sweep.released > 0;
                if (sweep.listed < options_.batch || take_over_failed || !resolved_any) break;
            }
        } catch (...) {
            // Anything (the store unreachable while listing, std::bad_alloc, a std::system_error):
            // reported, and the loop goes on next interval.
            try {
                const Described d = describe(std::current_exception());
                store_.emit(Event::reconcile_failed, nullptr, {}, 1, detail_of("sweep", d));
                tell([&] { return detail_of("sweep failed", d) + "; sweeping again in " + ms(interval); });
            } catch (...) {
                store_.emit(Event::reconcile_failed, nullptr, {}, 1, "sweep: failed (no memory to say why)");
            }
        }
        std::unique_lock lock(mutex);
        wake.wait_for(lock, stop, interval, [] { return false; });
    }
}

}  // namespace idem
