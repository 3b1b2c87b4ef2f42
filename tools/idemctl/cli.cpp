// tools/idemctl/cli.cpp — idemctl's command line, parsed and explained by CLI11 (see cli.hpp).
#include "cli.hpp"

#include "table.hpp"

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <functional>
#include <limits>

namespace idemctl {
namespace {

constexpr std::string_view kDescription = "idemctl — inspect and operate idem's idempotency keys in PostgreSQL.";

constexpr std::string_view kFooter =
    R"(The global options (--db, --table, --json) may come before or after the command; a command's
own options may too. After --, every argument is an argument (a key may start with '-').
`idemctl COMMAND --help` shows one command's options; `idemctl --help-all` shows every one.

With --json, stdout has one JSON document, a failure too:
  {"error": {"code": "not_found", "exit": 1, "message": "...", "sqlstate": null}}
(code names the exit code below; sqlstate is PostgreSQL's code when the database refused a
statement). stderr then stays empty but for purge's progress and release's confirmation prompt,
which appear only on a terminal.

Examples:
  idemctl show 'acct_42:POST /payments' 9f1c0e       state, fence, phase, lease, stored response
  idemctl list --scope-prefix 'acct_42:' --stale     that tenant's keys stuck in progress
  idemctl release 'acct_42:POST /payments' 9f1c0e --fence 7
  idemctl stats --json

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

Passwords are never printed: conninfo in messages is shown without its password.)";

constexpr std::string_view kCommandFooter =
    "Global options, before or after the command: --db CONNINFO, --table NAME, --keyring FILE,\n"
    "--seal-context NAME, --json\n"
    "(idemctl --help has them and the exit codes).";

struct CommandSpec {
    std::string_view name;
    bool takes_key;  ///< SCOPE KEY positional arguments
    std::string_view description;
};

constexpr CommandSpec kCommands[] = {
    {"show", true,
     "one key: state, attempt, fence, phase and its data, lease and expiry\n"
     "(passed or not, by the database's clock), result size, and the stored\n"
     "HTTP response decoded when the result is one. When KEY has no record\n"
     "but its percent-decoded form (k%41 -> kA) has, that record is shown,\n"
     "with a note: an HTTP adapter over cpp-httplib stores keys decoded"},
    {"list", false,
     "keys, oldest first: --scope, --scope-prefix, --state, --stale,\n"
     "--older-than, --limit (default 50), --wide"},
    {"stats", false,
     "counts by state, keys past their lease, expired records awaiting purge,\n"
     "the oldest in-progress key, table and index size"},
    {"purge", false,
     "deletes completed records past their retention, --batch rows (default\n"
     "1000) per transaction, until none is left; progress on stderr when it is\n"
     "a terminal"},
    {"release", true,
     "deletes an in-progress key whose effect CERTAINLY did not happen, so a\n"
     "retry runs it again; only while --fence F is still the key's fence. Asks\n"
     "for confirmation on a terminal; without one it needs --yes. Refused while\n"
     "the key's lease has not passed (its effect may be running) unless --force"},
    {"reconcile-report", false,
     "in-progress keys past their lease, oldest lease first, with attempt,\n"
     "phase, phase data and lease age: what a reconciler faces (--scope,\n"
     "--scope-prefix, --limit, default 100, --wide)"},
};

// --limit and --batch: far below what the SQL's bigint (and limit + 1) can hold.
constexpr std::size_t kMostRows = 1'000'000'000;

[[noreturn]] void usage(const std::string& message) {
    throw ToolError(Exit::usage, message + " (idemctl --help lists commands and options)");
}

/// A command's own option: which commands take it, and how to add it to one (CLI11) app.
struct CommandOption {
    std::string_view name;
    std::vector<std::string_view> commands;
    std::function<CLI::Option*(CLI::App&)> add;
};

/// The commands' own options, bound to `o`. Each is added to its commands and, hidden, to the
/// top-level app, where it is taken when given before the command (checked against the command
/// once it is known).
std::vector<CommandOption> command_options(Options& o) {
    const CLI::Validator duration(
        [](std::string& text) -> std::string {
            try {
                (void)parse_duration(text);
                return {};
            } catch (const ToolError& e) {
                return e.what();
            }
        },
        "");
    return {
        {"--fence",
         {"release"},
         [&o](CLI::App& app) {
             return app
                 .add_option_function<std::int64_t>(
                     "--fence", [&o](const std::int64_t& f) { o.fence = f; },
                     "required: the fence the key must still have (idemctl show prints it)")
                 ->type_name("F");
         }},
        {"--yes",
         {"release"},
         [&o](CLI::App& app) { return app.add_flag("--yes", o.yes, "do not ask for confirmation"); }},
        {"--force",
         {"release"},
         [&o](CLI::App& app) { return app.add_flag("--force", o.force, "also while the key's lease has not passed"); }},
        {"--exact",
         {"show"},
         [&o](CLI::App& app) {
             return app.add_flag("--exact", o.exact, "only the key as given, never its percent-decoded form");
         }},
        {"--scope",
         {"list", "reconcile-report"},
         [&o](CLI::App& app) {
             return app
                 .add_option_function<std::string>(
                     "--scope", [&o](const std::string& s) { o.scope = s; }, "only this scope (exact)")
                 ->type_name("SCOPE");
         }},
        {"--scope-prefix",
         {"list", "reconcile-report"},
         [&o](CLI::App& app) {
             return app
                 .add_option_function<std::string>(
                     "--scope-prefix", [&o](const std::string& s) { o.scope_prefix = s; },
                     "only scopes starting with PREFIX (literally: no wildcards)")
                 ->type_name("PREFIX");
         }},
        {"--state",
         {"list"},
         [&o](CLI::App& app) {
             return app
                 .add_option_function<std::string>(
                     "--state", [&o](const std::string& s) { o.state = s; },
                     "in_progress, completed or expired (completed, past retention)")
                 ->check(CLI::IsMember({"in_progress", "completed", "expired"}).description(""))
                 ->type_name("STATE");
         }},
        {"--stale",
         {"list"},
         [&o](CLI::App& app) { return app.add_flag("--stale", o.stale, "only in-progress keys past their lease"); }},
        {"--wide",
         {"list", "reconcile-report"},
         [&o](CLI::App& app) {
             return app.add_flag("--wide", o.wide,
                                 fmt::format("scopes, keys and phases whole, however wide (the table cuts one\n"
                                             "wider than {} columns short with …)",
                                             kMostColumns));
         }},
        {"--older-than",
         {"list"},
         [&o, duration](CLI::App& app) {
             return app
                 .add_option_function<std::string>(
                     "--older-than", [&o](const std::string& s) { o.older_than = parse_duration(s); },
                     "only keys created longer ago than DURATION (90s, 10m, 2h, 3d)")
                 ->check(duration)
                 ->type_name("DURATION");
         }},
        {"--limit",
         {"list", "reconcile-report"},
         [&o](CLI::App& app) {
             return app.add_option("--limit", o.limit, "at most N keys")
                 ->check(CLI::Range(std::size_t{1}, kMostRows).description(""))
                 ->type_name("N");
         }},
        {"--batch",
         {"purge"},
         [&o](CLI::App& app) {
             return app.add_option("--batch", o.batch, "rows per transaction (default 1000)")
                 ->check(CLI::Range(std::size_t{1}, kMostRows).description(""))
                 ->type_name("N");
         }},
    };
}

/// What is left on the command line that no option or argument took: an unknown option, an
/// unknown command, or an argument too many.
/// `before_dashes`: the words before the first "--" (after it every word is an argument).
void refuse_leftovers(const CLI::App& app, const CLI::App* command, const std::vector<std::string>& before_dashes) {
    std::vector<std::string> left = app.remaining();
    if (command != nullptr) {
        const auto more = command->remaining();
        left.insert(left.end(), more.begin(), more.end());
    }
    left.erase(std::remove(left.begin(), left.end(), "--"), left.end());
    if (left.empty()) return;
    const std::string& first = left.front();
    const auto given_as_option = [&](const std::string& word) {
        return word == first || word.starts_with(first + "=");
    };
    if (first.size() > 1 && first[0] == '-' &&
        std::any_of(before_dashes.begin(), before_dashes.end(), given_as_option)) {
        usage(fmt::format("unknown option '{}'", first.substr(0, first.find('='))));
    }
    if (command == nullptr) usage(fmt::format("unknown command '{}'", first));
    const auto spec = std::find_if(std::begin(kCommands), std::end(kCommands),
                                   [&](const CommandSpec& c) { return c.name == command->get_name(); });
    usage(spec->takes_key ? fmt::format("{} needs 2 arguments: SCOPE KEY", spec->name)
                          : fmt::format("{} takes no arguments", spec->name));
}

}  // namespace

std::chrono::seconds parse_duration(std::string_view text) {
    const auto bad = [&] {
        throw ToolError(
            Exit::usage,
            fmt::format("'{}' is not a duration: a positive whole number and a unit, s, m, h or d (e.g. 10m)", text));
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
    CLI::App app{std::string(kDescription), "idemctl"};
    // As the hand-written parser did: an option given twice takes its last value.
    app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    app.fallthrough();   // (inherited by the commands) global options after the command
    app.allow_extras();  // leftovers are refused below, with idemctl's own words
    app.require_subcommand(1);
    app.set_help_all_flag("--help-all", "this help with every command's options");
    app.get_formatter()->column_width(26);
    app.get_formatter()->label("SUBCOMMAND", "COMMAND");
    app.footer(std::string(kFooter));

    app.add_option("--db", o.conninfo,
                   "libpq conninfo or URI; default: libpq's environment (PGHOST, PGPORT,\n"
                   "PGDATABASE, PGUSER, PGPASSWORD, PGSERVICE, ...)")
        ->type_name("CONNINFO");
    app.add_option("--table", o.table, "idem's table, [schema.]table (default idem_keys)")->type_name("NAME");
    app.add_option("--keyring", o.keyring, "a keyring file (lines `<id> <64 hex digits>`) to open sealed results with")
        ->type_name("FILE");
    app.add_option("--seal-context", o.seal_context,
                   "the SealingOptions::context the service seals with (default: the table's name)")
        ->type_name("NAME");
    app.add_flag("--json", o.json, "one JSON document on stdout, errors too; nothing on stderr");

    std::vector<std::pair<std::string_view, CLI::App*>> commands;
    std::string scope, key;
    for (const CommandSpec& spec : kCommands) {
        CLI::App* command = app.add_subcommand(std::string(spec.name), std::string(spec.description));
        command->group("Commands");
        command->footer(std::string(kCommandFooter));
        if (spec.takes_key) {
            command->add_option("SCOPE", scope, "the key's scope, e.g. 'acct_42:POST /payments'")
                ->required()
                ->type_name("");
            command->add_option("KEY", key, "the idempotency key")->required()->type_name("");
        }
        commands.emplace_back(spec.name, command);
    }
    const std::vector<CommandOption> own = command_options(o);
    std::vector<CLI::Option*> given_first;  // the hidden top-level copies
    for (const CommandOption& option : own) {
        for (const auto name : option.commands) {
            const auto it =
                std::find_if(commands.begin(), commands.end(), [&](const auto& c) { return c.first == name; });
            option.add(*it->second);
        }
        given_first.push_back(option.add(app)->group(""));
    }

    std::vector<std::string> before_dashes;
    for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) before_dashes.emplace_back(argv[i]);
    const auto selected = [&]() -> CLI::App* {
        const auto chosen = app.get_subcommands();
        return chosen.empty() ? nullptr : chosen.front();
    };
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp&) {
        o.help = app.help();
        return o;
    } catch (const CLI::CallForAllHelp&) {
        o.help = app.help("", CLI::AppFormatMode::All);
        return o;
    } catch (const CLI::RequiredError& e) {
        const CLI::App* command = selected();
        refuse_leftovers(app, command, before_dashes);
        if (command == nullptr) usage("no command given");
        if (command->count("SCOPE") == 0 || command->count("KEY") == 0) {
            usage(fmt::format("{} needs 2 arguments: SCOPE KEY", command->get_name()));
        }
        usage(e.what());
    } catch (const CLI::ParseError& e) {
        usage(e.what());
    }
    const CLI::App* command = selected();
    refuse_leftovers(app, command, before_dashes);
    o.command = command->get_name();
    if (command->get_option_no_throw("SCOPE") != nullptr) o.arguments = {scope, key};
    for (std::size_t i = 0; i < own.size(); ++i) {
        const auto& allowed = own[i].commands;
        if (given_first[i]->count() > 0 && std::find(allowed.begin(), allowed.end(), o.command) == allowed.end()) {
            usage(fmt::format("{} does not take {}", o.command, own[i].name));
        }
    }
    if (o.command == "release" && !o.fence) usage("release needs --fence F (the fence idemctl show prints)");
    if (o.scope && o.scope_prefix) usage("--scope and --scope-prefix exclude each other");
    return o;
}

}  // namespace idemctl
