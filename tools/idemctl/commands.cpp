// tools/idemctl/commands.cpp — show, list, stats, purge, release, reconcile-report.
#include "commands.hpp"

#include "conninfo.hpp"
#include "database.hpp"
#include "idem/errors.hpp"
#include "idem/http.hpp"
#include "idem/key.hpp"
#include "idem/postgres_store.hpp"
#include "idem/response.hpp"
#include "idem/sealing.hpp"
#include "json.hpp"
#include "postgres/sansio/admin_sql.hpp"
#include "table.hpp"
#include "text.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace idemctl {
namespace {

using std::chrono::milliseconds;

std::string table_of(const Options& o) { return o.table.empty() ? idem::PostgresOptions{}.table : o.table; }

/// The --table name, checked by the library's rules (PostgresStore::schema_sql throws config_error
/// for a name it would refuse): a bad one is a usage error, before any connection.
std::string checked_table_name(const Options& o) {
    const std::string table = table_of(o);
    try {
        (void)idem::PostgresStore::schema_sql(table);
    } catch (const idem::config_error& e) {
        throw ToolError(Exit::usage, "--table: " + std::string(idem::detail::without_prefix(e.what())));
    }
    return table;
}

/// A store on one connection (nothing connects until its first call).
std::unique_ptr<idem::PostgresStore> open_store(const Options& o) {
    require_parsable(o.conninfo);
    idem::PostgresOptions options;
    options.table = checked_table_name(o);
    options.pool_size = 1;
    options.application_name = "idemctl";
    return std::make_unique<idem::PostgresStore>(o.conninfo, options);
}

/// The table name checked, for idemctl's own SQL (the library's statements, admin_sql.hpp).
idem::pg::TableName checked_table(const Options& o) { return idem::pg::TableName::parse(checked_table_name(o)); }

idem::Key key_of(const Options& o) { return idem::Key{o.arguments[0], o.arguments[1]}; }

std::string key_label(const std::string& scope, const std::string& key) {
    return fmt::format("scope '{}' key '{}'", printable(scope), printable(key));
}

ToolError not_found(const Options& o, const idem::Key& key) {
    return ToolError(Exit::not_found,
                     fmt::format("no record for {} in table {}", key_label(key.scope(), key.value()), table_of(o)));
}

/// An in-progress key's lease as of `now`: "in 4m10s", or "passed 1m05s ago". (A completed key
/// holds none: its row keeps the time of its last claim, which means nothing any more.)
std::string lease_left(TimePoint lease_until, TimePoint now) {
    const std::string when = relative(lease_until, now);
    return lease_until < now ? "passed " + when : when;
}

// --- show -------------------------------------------------------------------------------------

/// The stored result as an HTTP response (idem::codec<Response>, as idem/http.hpp stores it), if it
/// is one.
std::optional<idem::Response> as_response(const std::string& result) {
    if (!result.starts_with("IDR1")) return std::nullopt;
    try {
        return idem::codec<idem::Response>::decode(result);
    } catch (const idem::corrupt_record&) {
        return std::nullopt;
    }
}

/// What show found about a result's sealing.
struct Sealing {
    std::optional<std::uint32_t> key_id{};  ///< sealed, with this key id
    bool opened = false;                    ///< opened (and so authenticated) with --keyring
    bool keyring_given = false;             ///< --keyring was given
};

Json record_json(const idem::Key& key, const idem::Record& r, const Sealing& seal) {
    Json j = Json::object();
    j["scope"] = key.scope();
    j["key"] = key.value();
    j["state"] = idem::to_string(r.state);
    j["attempt"] = r.attempt;
    j["fence"] = r.fence;
    j["fingerprint"] = std::string(idem::to_string(r.fingerprint.algorithm())) + ":" + r.fingerprint.hex();
    j["created_at"] = format_time(r.created_at);
    j["lease_until"] = format_time(r.lease_until);
    j["lease_passed"] = r.lease_until < r.read_at;
    j["stale"] = r.lease_expired;
    j["expires_at"] = format_time(r.expires_at);
    j["expired"] = r.expired;
    j["read_at"] = format_time(r.read_at);
    set_optional_bytes(j, "phase", r.phase);
    set_optional_bytes(j, "phase_data", r.phase_data);
    if (!r.result) {
        j["result_bytes"] = nullptr;
        j["response"] = nullptr;
        return j;
    }
    j["result_bytes"] = static_cast<std::uint64_t>(r.result->size());
    j["sealed_key_id"] = seal.key_id ? Json(*seal.key_id) : Json();
    j["opened"] = seal.opened;
    if (seal.key_id && !seal.opened) {  // no --keyring
        j["response"] = nullptr;
        return j;
    }
    if (const auto response = as_response(*r.result)) {
        Json headers = Json::array();
        for (const auto& [name, value] : response->headers) {
            Json h = Json::object();
            set_bytes(h, "name", name);
            set_bytes(h, "value", value);
            headers.push_back(std::move(h));
        }
        Json rj = Json::object();
        rj["status"] = response->status;
        rj["headers"] = std::move(headers);
        rj["body_bytes"] = static_cast<std::uint64_t>(response->body.size());
        set_bytes(rj, "body", response->body);
        j["response"] = std::move(rj);
    } else {
        j["response"] = nullptr;
        set_bytes(j, "result", *r.result);
    }
    return j;
}

void print_record(std::ostream& out, const idem::Key& key, const idem::Record& r, const Sealing& seal) {
    const auto row = [&](std::string_view name, const std::string& value) {
        out << fmt::format("{:<12} {}\n", name, value);
    };
    row("scope", printable(key.scope()));
    row("key", printable(key.value()));
    row("state", std::string(idem::to_string(r.state)));
    row("attempt", std::to_string(r.attempt));
    row("fence", std::to_string(r.fence));
    row("fingerprint", std::string(idem::to_string(r.fingerprint.algorithm())) + ":" + r.fingerprint.hex());
    row("created_at", fmt::format("{} ({})", format_time(r.created_at), relative(r.created_at, r.read_at)));
    if (r.state == idem::RecordState::in_progress) {
        std::string lease = lease_left(r.lease_until, r.read_at);
        if (r.lease_expired) lease += "; stale: a reconciler may take it over";
        row("lease_until", fmt::format("{} ({})", format_time(r.lease_until), lease));
    } else {
        row("lease_until", "- (none: the key is completed)");
    }
    std::string expiry = relative(r.expires_at, r.read_at);
    if (r.expires_at < r.read_at) {
        expiry = "passed " + expiry +
                 (r.expired ? "; expired: a new claim starts afresh, purge deletes it"
                            : "; an in-progress key never expires");
    }
    row("expires_at", fmt::format("{} ({})", format_time(r.expires_at), expiry));
    row("phase", r.phase ? printable(*r.phase) : "-");
    row("phase_data",
        r.phase_data ? fmt::format("{} ({} bytes)", printable(*r.phase_data), r.phase_data->size()) : "-");
    if (!r.result) {
        row("result", "- (none yet: in progress)");
        return;
    }
    if (seal.key_id && !seal.opened) {
        row("result", fmt::format("{} bytes, sealed with key id {} (give --keyring FILE to open it)", r.result->size(),
                                  *seal.key_id));
        return;
    }
    if (seal.opened) {
        row("sealing", fmt::format("sealed with key id {}, opened and authenticated with --keyring", *seal.key_id));
    } else if (seal.keyring_given) {
        row("sealing", "stored unsealed: not authenticated (written without sealing, or planted)");
    }
    const auto response = as_response(*r.result);
    if (!response) {
        row("result", fmt::format("{} bytes (not an HTTP response): {}", r.result->size(), printable(*r.result)));
        return;
    }
    row("result", fmt::format("{} bytes: an HTTP response", r.result->size()));
    row("status", std::to_string(response->status));
    for (const auto& [name, value] : response->headers) row("header", printable(name) + ": " + printable(value));
    row("body", fmt::format("{} bytes: {}", response->body.size(), printable(response->body)));
}

/// Opens `record`'s result in place when it is sealed and a keyring was given (corrupt_record when
/// it does not open), and says what it found.
Sealing open_result(const Options& o, const idem::Key& key, idem::Record& record) {
    Sealing seal;
    seal.keyring_given = !o.keyring.empty();
    if (!record.result) return seal;
    if (idem::looks_sealed(*record.result)) {
        seal.key_id = idem::sealed_key_id(*record.result);
        if (!seal.key_id) throw idem::corrupt_record("idem: the sealed result of this key is truncated");
    }
    if (!seal.key_id || !seal.keyring_given) return seal;
    const idem::Keyring keyring = idem::Keyring::from_file(o.keyring);
    const std::string context = o.seal_context.empty() ? table_of(o) : o.seal_context;
    record.result = idem::open_sealed(keyring, key, *record.result, idem::SealBinding{record.fence, context});
    seal.opened = true;
    return seal;
}

/// The key cpp-httplib would have handed an HTTP adapter for `key` (percent-decoded), when that is
/// another key idem accepts.
std::optional<idem::Key> percent_decoded(const idem::Key& key) {
    std::string decoded = idem::http::percent_decode_header_value(key.value());
    if (decoded == key.value()) return std::nullopt;
    try {
        return idem::Key{key.scope(), std::move(decoded)};
    } catch (const idem::invalid_key&) {
        return std::nullopt;  // (a NUL or malformed UTF-8: no adapter stores that)
    }
}

// The key as given first; without a record, and unless --exact, its percent-decoded form: what an
// adapter over cpp-httplib stored for it.
Exit show(const Options& o, std::ostream& out) {
    const idem::Key key = key_of(o);
    const auto store = open_store(o);
    auto record = store->read(key);
    const std::optional<idem::Key> decoded = record || o.exact ? std::nullopt : percent_decoded(key);
    if (decoded) record = store->read(*decoded);
    if (!record) {
        ToolError missing = not_found(o, key);
        if (!decoded) throw missing;
        throw ToolError(Exit::not_found, fmt::format("{}, nor for its percent-decoded form '{}'", missing.what(),
                                                     printable(decoded->value())));
    }
    const idem::Key& shown = decoded ? *decoded : key;
    const Sealing seal = open_result(o, shown, *record);
    if (o.json) {
        Json j = record_json(shown, *record, seal);
        j["requested_key"] = key.value();
        j["lookup"] = decoded ? "percent_decoded" : "exact";
        out << dump(j) << '\n';
        return Exit::ok;
    }
    if (decoded) {
        out << fmt::format(
            "note: no record for key '{}'; showing key '{}', its percent-decoded form (cpp-httplib "
            "decodes %XX in header values before idem sees them; --exact looks up only the key as "
            "given)\n",
            printable(key.value()), printable(decoded->value()));
    }
    print_record(out, shown, *record, seal);
    return Exit::ok;
}

// --- list -------------------------------------------------------------------------------------

/// Microseconds since the epoch of a timestamptz column, as idemctl's statements select them.
TimePoint from_micros(std::int64_t us) { return TimePoint(std::chrono::microseconds(us)); }

Exit list(const Options& o, std::ostream& out) {
    if (o.scope) (void)idem::ScopeFilter::exact(*o.scope);  // invalid_key: exit 2
    if (o.scope_prefix) (void)idem::ScopeFilter::prefix(*o.scope_prefix);
    const idem::pg::TableName table = checked_table(o);
    const std::size_t limit = o.limit == 0 ? 50 : o.limit;
    Database db(o.conninfo);
    // Filters are parameters (NULL: not filtering), so the statement text never varies.
    const Rows rows = db.query(
        idem::pg::list_keys_sql(table),
        {o.scope, o.scope_prefix, o.state, o.stale ? "true" : "false",
         o.older_than ? std::optional(std::to_string(o.older_than->count())) : std::nullopt, std::to_string(limit + 1)},
        table_of(o));
    const std::size_t shown = std::min<std::size_t>(static_cast<std::size_t>(rows.count()), limit);
    const bool more = static_cast<std::size_t>(rows.count()) > limit;
    Json records = Json::array();
    std::vector<std::vector<std::string>> table_rows;
    Cells cell(o.wide);
    for (int i = 0; i < static_cast<int>(shown); ++i) {
        const TimePoint created = from_micros(rows.integer(i, 6)), lease = from_micros(rows.integer(i, 7)),
                        expires = from_micros(rows.integer(i, 8)), now = from_micros(rows.integer(i, 12));
        const bool stale = rows.boolean(i, 10), expired = rows.boolean(i, 11);
        const std::string state = expired ? "expired" : rows.text(i, 2);
        if (o.json) {
            Json r = Json::object();
            // (text columns, but in a database whose encoding is not UTF8 they may hold any bytes)
            set_bytes(r, "scope", rows.text(i, 0));
            set_bytes(r, "key", rows.text(i, 1));
            r["state"] = rows.text(i, 2);
            r["attempt"] = rows.integer(i, 3);
            r["fence"] = rows.integer(i, 4);
            set_optional_bytes(r, "phase", rows.optional_text(i, 5));
            r["created_at"] = format_time(created);
            r["age_ms"] = millis_between(created, now);
            r["lease_until"] = format_time(lease);
            r["stale"] = stale;
            r["expires_at"] = format_time(expires);
            r["expired"] = expired;
            r["result_bytes"] = rows.is_null(i, 9) ? Json() : Json(rows.integer(i, 9));
            records.push_back(std::move(r));
        } else {
            table_rows.push_back({cell(rows.text(i, 0)), cell(rows.text(i, 1)), state + (stale ? " (stale)" : ""),
                                  rows.text(i, 3), format_duration(milliseconds(millis_between(created, now))),
                                  rows.text(i, 2) == "in_progress" ? lease_left(lease, now) : "-",
                                  rows.is_null(i, 5) ? "-" : cell(rows.text(i, 5)),
                                  rows.is_null(i, 9) ? "-" : rows.text(i, 9)});
        }
    }
    if (o.json) {
        Json j = Json::object();
        j["table"] = table_of(o);
        j["count"] = static_cast<std::uint64_t>(shown);
        j["more"] = more;
        j["records"] = std::move(records);
        out << dump(j) << '\n';
        return Exit::ok;
    }
    if (shown == 0) {
        out << "no records match\n";
        return Exit::ok;
    }
    print_table(out, {"SCOPE", "KEY", "STATE", "ATTEMPT", "AGE", "LEASE", "PHASE", "RESULT_BYTES"}, table_rows);
    cell.note(out);
    if (more) out << fmt::format("(more than {} records match: raise --limit or narrow the filters)\n", limit);
    return Exit::ok;
}

// --- stats ------------------------------------------------------------------------------------

Exit stats(const Options& o, std::ostream& out) {
    const idem::pg::TableName table = checked_table(o);
    Database db(o.conninfo);
    const Rows counts = db.query(idem::pg::key_counts_sql(table), {}, table_of(o));
    const Rows oldest = db.query(idem::pg::oldest_in_progress_sql(table), {}, table_of(o));
    const Rows size = db.query(idem::pg::kTableSizesSql, {table.qualified}, table_of(o));
    const std::int64_t in_progress = counts.integer(0, 0), stale = counts.integer(0, 1),
                       completed = counts.integer(0, 2), expired = counts.integer(0, 3);
    const TimePoint now = from_micros(counts.integer(0, 4));
    if (o.json) {
        Json j = Json::object();
        j["table"] = table_of(o);
        j["in_progress"] = in_progress;
        j["stale"] = stale;
        j["completed"] = completed;
        j["expired"] = expired;
        j["total"] = in_progress + completed;
        if (oldest.count() == 1) {
            const TimePoint created = from_micros(oldest.integer(0, 2));
            Json k = Json::object();
            set_bytes(k, "scope", oldest.text(0, 0));
            set_bytes(k, "key", oldest.text(0, 1));
            k["created_at"] = format_time(created);
            k["age_ms"] = millis_between(created, now);
            j["oldest_in_progress"] = std::move(k);
        } else {
            j["oldest_in_progress"] = nullptr;
        }
        j["table_bytes"] = size.integer(0, 0);
        j["index_bytes"] = size.integer(0, 1);
        j["total_bytes"] = size.integer(0, 2);
        out << dump(j) << '\n';
        return Exit::ok;
    }
    out << fmt::format("table        {}\n", table_of(o));
    out << fmt::format("in_progress  {} ({} past their lease: stale, for the reconciler)\n", in_progress, stale);
    out << fmt::format("completed    {} ({} past retention: expired, for purge)\n", completed, expired);
    out << fmt::format("total        {}\n", in_progress + completed);
    if (oldest.count() == 1) {
        const TimePoint created = from_micros(oldest.integer(0, 2));
        out << fmt::format("oldest in_progress  {} (created {}, {} ago)\n",
                           key_label(oldest.text(0, 0), oldest.text(0, 1)), format_time(created),
                           format_duration(milliseconds(millis_between(created, now))));
    } else {
        out << "oldest in_progress  -\n";
    }
    out << fmt::format("size         table {} bytes, indexes {} bytes, total {} bytes\n", size.integer(0, 0),
                       size.integer(0, 1), size.integer(0, 2));
    return Exit::ok;
}

// --- purge ------------------------------------------------------------------------------------

Exit purge(const Options& o, std::ostream& out) {
    const auto store = open_store(o);
    const bool progress = ::isatty(STDERR_FILENO) == 1;
    std::size_t purged = 0, batches = 0;
    // One batch per call, so progress shows between them; a short batch means nothing is left
    // that no other session holds.
    for (;;) {
        const std::size_t n = store->purge_expired(o.batch, 1);
        purged += n;
        ++batches;
        if (progress)
            std::cerr << fmt::format("\rpurged {} expired records ({} batches)", purged, batches) << std::flush;
        if (n < o.batch) break;
    }
    if (progress) std::cerr << '\n';
    if (o.json) {
        Json j = Json::object();
        j["table"] = table_of(o);
        j["purged"] = static_cast<std::uint64_t>(purged);
        j["batches"] = static_cast<std::uint64_t>(batches);
        out << dump(j) << '\n';
    } else {
        out << fmt::format("purged {} expired records from {} in {} batches of up to {}\n", purged, table_of(o),
                           batches, o.batch);
    }
    return Exit::ok;
}

// --- release ----------------------------------------------------------------------------------

/// Asks on the terminal; true only for "yes".
bool confirmed(const idem::Key& key, const idem::Record& r, idem::Fence fence) {
    std::cerr << fmt::format(
        "Release {} (state {}, attempt {}, phase {}, fence {})?\n"
        "{}Only if its effect CERTAINLY did not happen: the next retry runs it again.\n"
        "Type yes to release: ",
        key_label(key.scope(), key.value()), idem::to_string(r.state), r.attempt, r.phase ? printable(*r.phase) : "-",
        fence, r.lease_expired ? "" : "Its lease has not passed: an attempt may be running right now.\n");
    std::string answer;
    if (!std::getline(std::cin, answer)) return false;
    return answer == "yes";
}

Exit release(const Options& o, std::ostream& out) {
    const idem::Key key = key_of(o);
    const bool terminal = ::isatty(STDIN_FILENO) == 1 && ::isatty(STDERR_FILENO) == 1;
    if (!o.yes && !terminal) {
        throw ToolError(Exit::usage,
                        "release not confirmed: stdin is not a terminal; pass --yes to release "
                        "without a prompt (nothing was changed)");
    }
    const auto store = open_store(o);
    const auto record = store->read(key);
    if (!record) throw not_found(o, key);
    const auto mismatch = [&](const idem::Record& r) {
        return ToolError(Exit::fence,
                         fmt::format("fence {} does not own {}: it is {} with fence {} (nothing was changed)", *o.fence,
                                     key_label(key.scope(), key.value()), idem::to_string(r.state), r.fence));
    };
    if (record->state != idem::RecordState::in_progress || record->fence != *o.fence) throw mismatch(*record);
    if (!record->lease_expired && !o.force) {
        // The fence does not tell a stuck key from one whose effect is running right now: releasing
        // that one lets the next request run the effect a second time.
        throw ToolError(Exit::usage,
                        fmt::format("{} is still within its lease (until {}): an attempt may be running its effect "
                                    "right now, and releasing it would let the next request run it again. Wait "
                                    "until the lease passes, or pass --force (nothing was changed)",
                                    key_label(key.scope(), key.value()), format_time(record->lease_until)));
    }
    if (!o.yes && !confirmed(key, *record, *o.fence)) {
        throw ToolError(Exit::usage, "release not confirmed (nothing was changed)");
    }
    try {
        store->release(key, *o.fence);
    } catch (const idem::lease_lost&) {
        // Taken over, saved or released since the read: say what it is now.
        if (const auto now = store->read(key)) throw mismatch(*now);
        throw ToolError(Exit::not_found, fmt::format("{} was released or purged meanwhile (nothing was changed)",
                                                     key_label(key.scope(), key.value())));
    }
    if (o.json) {
        Json j = Json::object();
        j["released"] = true;
        j["scope"] = key.scope();
        j["key"] = key.value();
        j["fence"] = *o.fence;
        out << dump(j) << '\n';
    } else {
        out << fmt::format("released {} (fence {}): the next request with this key runs its effect\n",
                           key_label(key.scope(), key.value()), *o.fence);
    }
    return Exit::ok;
}

// --- reconcile-report -------------------------------------------------------------------------

/// Counts the rows list_stale() could not decode (it reports each as Event::reconcile_failed).
class UndecodableRows final : public idem::Observer {
public:
    void on_event(const idem::EventInfo& event) noexcept override {
        if (event.event == idem::Event::reconcile_failed) count.fetch_add(1, std::memory_order_relaxed);
    }
    std::atomic<std::uint64_t> count{0};
};

Exit reconcile_report(const Options& o, std::ostream& out) {
    const idem::ScopeFilter filter = o.scope          ? idem::ScopeFilter::exact(*o.scope)
                                     : o.scope_prefix ? idem::ScopeFilter::prefix(*o.scope_prefix)
                                                      : idem::ScopeFilter::all();
    const std::size_t limit = o.limit == 0 ? 100 : o.limit;
    const auto store = open_store(o);
    const auto undecodable = std::make_shared<UndecodableRows>();
    store->set_observer(undecodable);
    const auto stale = store->list_stale(limit, filter);
    Json keys = Json::array();
    std::vector<std::vector<std::string>> rows;
    Cells cell(o.wide);
    for (const auto& [key, r] : stale) {
        const auto lease_age = milliseconds(millis_between(r.lease_until, r.read_at));
        const auto age = milliseconds(millis_between(r.created_at, r.read_at));
        if (o.json) {
            Json k = Json::object();
            k["scope"] = key.scope();
            k["key"] = key.value();
            k["attempt"] = r.attempt;
            k["fence"] = r.fence;
            set_optional_bytes(k, "phase", r.phase);
            set_optional_bytes(k, "phase_data", r.phase_data);
            k["created_at"] = format_time(r.created_at);
            k["lease_until"] = format_time(r.lease_until);
            k["lease_passed_ms"] = lease_age.count();
            k["age_ms"] = age.count();
            keys.push_back(std::move(k));
        } else {
            rows.push_back({cell(key.scope()), cell(key.value()), std::to_string(r.attempt), std::to_string(r.fence),
                            format_duration(lease_age) + " ago", format_duration(age), r.phase ? cell(*r.phase) : "-",
                            r.phase_data ? printable(*r.phase_data) : "-"});
        }
    }
    const std::uint64_t bad = undecodable->count.load();
    if (o.json) {
        Json j = Json::object();
        j["table"] = table_of(o);
        j["count"] = static_cast<std::uint64_t>(stale.size());
        j["undecodable"] = bad;
        j["stale"] = std::move(keys);
        out << dump(j) << '\n';
        return Exit::ok;
    }
    if (stale.empty() && bad == 0) {
        out << "no stale keys: every in-progress key is within its lease\n";
        return Exit::ok;
    }
    if (!stale.empty()) {
        out << fmt::format("{} stale keys (in progress, lease passed), oldest lease first:\n", stale.size());
        print_table(out, {"SCOPE", "KEY", "ATTEMPT", "FENCE", "LEASE_PASSED", "AGE", "PHASE", "PHASE_DATA"}, rows);
        cell.note(out);
    }
    if (bad > 0) {
        out << fmt::format("{} stale rows could not be decoded (corrupt records; idemctl list shows their keys)\n",
                           bad);
    }
    out << "A Reconciler resolves these from the provider's answer. By hand: idemctl show SCOPE "
           "KEY; only when the\n"
           "effect certainly did not happen, idemctl release SCOPE KEY --fence F.\n";
    return Exit::ok;
}

}  // namespace

Exit run(const Options& o, std::ostream& out) {
    if (o.command == "show") return show(o, out);
    if (o.command == "list") return list(o, out);
    if (o.command == "stats") return stats(o, out);
    if (o.command == "purge") return purge(o, out);
    if (o.command == "release") return release(o, out);
    return reconcile_report(o, out);
}

}  // namespace idemctl
