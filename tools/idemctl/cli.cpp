// tools/idemctl/cli.cpp — parsing idemctl's command line (see cli.hpp).
#include "cli.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <array>
#include <charconv>
#include <limits>

namespace idemctl {
namespace {

constexpr std::string_view kHelp =
    R"(idemctl — inspect and operate idem's idempotency keys in PostgreSQL.

Usage: idemctl [OPTIONS] COMMAND [ARGS]   (after --, every argument is an argument: a key may
                                           start with '-')

Commands:
  show SCOPE KEY          one key: state, attempt, fence, phase and its data, lease and expiry
                          (passed or not, by the database's clock), result size, and the stored
                          HTTP response decoded when the result is one
  list                    keys, oldest first: --scope, --scope-prefix, --state, --stale,
                          --older-than, --limit (default 50)
  stats                   counts by state, keys past their lease, expired records awaiting purge,
                          the oldest in-progress key, table and index size
  purge                   deletes completed records past their retention, --batch rows (default
                          1000) per transaction, until none is left; progress on stderr when it is
                          a terminal
  release SCOPE KEY --fence F
                          deletes an in-progress key whose effect CERTAINLY did not happen, so a
                          retry runs it again; only while F is still the key's fence. Asks for
                          confirmation on a terminal; without one it needs --yes. Refused while
                          the key's lease has not passed (its effect may be running) unless --force
  reconcile-report        in-progress keys past their lease, oldest lease first, with attempt,
                          phase, phase data and lease age: what a reconciler faces (--scope,
                          --scope-prefix, --limit, default 100)

Options:
  --db CONNINFO           libpq conninfo or URI; default: libpq's environment (PGHOST, PGPORT,
                          PGDATABASE, PGUSER, PGPASSWORD, PGSERVICE, ...)
  --table NAME            idem's table, [schema.]table (default idem_keys)
  --json                  one JSON document on stdout (errors too: {"error": {...}})
  --scope SCOPE           only this scope (exact)
  --scope-prefix PREFIX   only scopes starting with PREFIX (literally: no wildcards)
  --state STATE           list: in_progress, completed or expired (completed, past retention)
  --stale                 list: only in-progress keys past their lease
  --older-than DURATION   list: only keys created longer ago than DURATION (90s, 10m, 2h, 3d)
  --limit N               list / reconcile-report: at most N keys
  --batch N               purge: rows per transaction
  --fence F               release: the fence the key must still have (idemctl show prints it)
  --yes                   release: do not ask for confirmation
  --force                 release: also while the key's lease has not passed
  -h, --help              this text

Exit codes:
  0  ok
  1  not found: no record for the key
  2  usage: bad command line or input (invalid scope or key, duration, fence), or a release not
     confirmed
  3  database unavailable (cannot connect, timed out): try again
  4  fence mismatch: the fence does not own the key (lease_lost); nothing was changed
  5  configuration error: no such table (run ensure_schema()), database or role, failed
     authentication, missing privilege
  6  other failure: the database refused a statement, or a record cannot be decoded

Passwords are never printed: conninfo in messages is shown without its password.
)";

struct OptionSpec {
    std::string_view name;
    bool takes_value;
    /// Commands that accept it; empty: every command.
    std::array<std::string_view, 3> commands;
};

constexpr std::array<OptionSpec, 15> kOptions{{
    {"--db", true, {}},
    {"--table", true, {}},
    {"--json", false, {}},
    {"--help", false, {}},
    {"-h", false, {}},
    {"--yes", false, {"release"}},
    {"--force", false, {"release"}},
    {"--fence", true, {"release"}},
    {"--scope", true, {"list", "reconcile-report"}},
    {"--scope-prefix", true, {"list", "reconcile-report"}},
    {"--state", true, {"list"}},
    {"--stale", false, {"list"}},
    {"--older-than", true, {"list"}},
    {"--limit", true, {"list", "reconcile-report"}},
    {"--batch", true, {"purge"}},
}};

struct CommandSpec {
    std::string_view name;
    std::size_t arguments;  ///< positional arguments it needs
};

constexpr std::array<CommandSpec, 6> kCommands{{
    {"show", 2},
    {"list", 0},
    {"stats", 0},
    {"purge", 0},
    {"release", 2},
    {"reconcile-report", 0},
}};

[[noreturn]] void usage(const std::string& message) {
    throw ToolError(Exit::usage, message + " (idemctl --help lists commands and options)");
}

template <class Int>
Int parse_integer(std::string_view text, std::string_view what, Int min, Int max = std::numeric_limits<Int>::max()) {
    Int value{};
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc{} || end != text.data() + text.size() || value < min || value > max) {
        usage(fmt::format(
            "{} must be an integer{}{}, not '{}'", what, min > 0 ? fmt::format(" of at least {}", min) : std::string(),
            max < std::numeric_limits<Int>::max() ? fmt::format(" and at most {}", max) : std::string(), text));
    }
    return value;
}

// --limit and --batch: far below what the SQL's bigint (and limit + 1) can hold.
constexpr std::size_t kMostRows = 1'000'000'000;

void apply(Options& o, std::string_view name, const std::string& value) {
    if (name == "--db") o.conninfo = value;
    else if (name == "--table") o.table = value;
    else if (name == "--json") o.json = true;
    else if (name == "--help" || name == "-h") o.help = true;
    else if (name == "--yes") o.yes = true;
    else if (name == "--force") o.force = true;
    else if (name == "--fence")
        o.fence = parse_integer<std::int64_t>(value, "--fence", std::numeric_limits<std::int64_t>::min());
    else if (name == "--scope") o.scope = value;
    else if (name == "--scope-prefix") o.scope_prefix = value;
    else if (name == "--state") {
        if (value != "in_progress" && value != "completed" && value != "expired") {
            usage(fmt::format("--state must be in_progress, completed or expired, not '{}'", value));
        }
        o.state = value;
    } else if (name == "--stale") o.stale = true;
    else if (name == "--older-than") o.older_than = parse_duration(value);
    else if (name == "--limit") o.limit = parse_integer<std::size_t>(value, "--limit", 1, kMostRows);
    else if (name == "--batch") o.batch = parse_integer<std::size_t>(value, "--batch", 1, kMostRows);
}

}  // namespace

std::string_view help_text() noexcept { return kHelp; }

std::chrono::seconds parse_duration(std::string_view text) {
    const auto bad = [&] {
        usage(fmt::format("'{}' is not a duration: a positive whole number and a unit, s, m, h or d (e.g. 10m)", text));
    };
    if (text.size() < 2) bad();
    std::int64_t per_unit = 0;
    switch (text.back()) {
        case 's': per_unit = 1; break;
        case 'm': per_unit = 60; break;
        case 'h': per_unit = 3600; break;
        case 'd': per_unit = 86400; break;
        default: bad();
    }
    const std::string_view digits = text.substr(0, text.size() - 1);
    std::int64_t n = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
    // At most 100 years: what the database's timestamp arithmetic always holds.
    if (ec != std::errc{} || end != digits.data() + digits.size() || n <= 0 ||
        n > std::int64_t{36500} * 86400 / per_unit)
        bad();
    return std::chrono::seconds(n * per_unit);
}

Options parse(int argc, const char* const* argv) {
    Options o;
    std::vector<std::pair<const OptionSpec*, std::string>> given;
    std::vector<std::string> positional;
    bool options_ended = false;  // after "--" everything is positional (a key may start with '-')
    for (int i = 1; i < argc; ++i) {
        std::string_view arg = argv[i];
        if (!options_ended && arg == "--") {
            options_ended = true;
            continue;
        }
        if (options_ended || arg.size() < 2 || arg[0] != '-') {
            positional.emplace_back(arg);
            continue;
        }
        std::string_view name = arg;
        std::optional<std::string> inline_value;
        if (const auto eq = arg.find('='); eq != std::string_view::npos && arg.starts_with("--")) {
            name = arg.substr(0, eq);
            inline_value = std::string(arg.substr(eq + 1));
        }
        const auto spec =
            std::find_if(kOptions.begin(), kOptions.end(), [&](const OptionSpec& s) { return s.name == name; });
        if (spec == kOptions.end()) usage(fmt::format("unknown option '{}'", name));
        std::string value;
        if (spec->takes_value) {
            if (inline_value) {
                value = *inline_value;
            } else if (i + 1 < argc) {
                value = argv[++i];
            } else {
                usage(fmt::format("{} needs a value", name));
            }
        } else if (inline_value) {
            usage(fmt::format("{} takes no value", name));
        }
        given.emplace_back(&*spec, std::move(value));
    }
    for (const auto& [spec, value] : given) {
        if (spec->name == "--help" || spec->name == "-h") o.help = true;
    }
    if (o.help) return o;
    if (positional.empty()) usage("no command given");
    o.command = positional.front();
    const auto command =
        std::find_if(kCommands.begin(), kCommands.end(), [&](const CommandSpec& c) { return c.name == o.command; });
    if (command == kCommands.end()) usage(fmt::format("unknown command '{}'", o.command));
    o.arguments.assign(positional.begin() + 1, positional.end());
    if (o.arguments.size() != command->arguments) {
        usage(command->arguments == 0 ? fmt::format("{} takes no arguments", o.command)
                                      : fmt::format("{} needs {} arguments: SCOPE KEY", o.command, command->arguments));
    }
    for (const auto& [spec, value] : given) {
        const auto& allowed = spec->commands;
        const bool everywhere =
            std::all_of(allowed.begin(), allowed.end(), [](std::string_view c) { return c.empty(); });
        if (!everywhere && std::find(allowed.begin(), allowed.end(), o.command) == allowed.end()) {
            usage(fmt::format("{} does not take {}", o.command, spec->name));
        }
        apply(o, spec->name, value);
    }
    if (o.command == "release" && !o.fence) usage("release needs --fence F (the fence idemctl show prints)");
    if (o.scope && o.scope_prefix) usage("--scope and --scope-prefix exclude each other");
    return o;
}

}  // namespace idemctl
