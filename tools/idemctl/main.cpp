// tools/idemctl/main.cpp — idemctl, the operator's command-line tool for idem's PostgreSQL table.
//
//   idemctl show SCOPE KEY            was this key performed? what did it answer?
//   idemctl list --stale              keys stuck in progress
//   idemctl stats | purge | release SCOPE KEY --fence F | reconcile-report
//
// `idemctl --help` has every command and exit code (`--help-all` every option); docs/reliability.md
// ("Operating idem") says when to use which. This file maps every failure to one exit code and one
// message, with any password scrubbed out: "idemctl: MESSAGE" on stderr, or with --json one document
// on stdout, {"error": {"code", "exit", "message", "sqlstate"}}, and nothing on stderr.
#include "cli.hpp"
#include "commands.hpp"
#include "conninfo.hpp"
#include "idem/errors.hpp"
#include "json.hpp"

#include <fmt/format.h>
#include <exception>
#include <iostream>
#include <string>
#include <string_view>
#include <utility>

namespace {

using idemctl::Exit;

/// What idemctl reports for a failure.
struct Failure {
    Exit exit;
    std::string message;   ///< without "idemctl: "
    std::string sqlstate;  ///< PostgreSQL's code when the database refused a statement, else ""
};

/// The exit code, message and SQLSTATE for what a command threw.
Failure classify(const std::exception_ptr& thrown, const std::string& conninfo) {
    const auto lib = [](const std::exception& e) { return std::string(idem::detail::without_prefix(e.what())); };
    try {
        std::rethrow_exception(thrown);
    } catch (const idemctl::ToolError& e) {
        return {e.exit_code(), e.what(), e.sqlstate()};
    } catch (const idem::invalid_key& e) {
        return {Exit::usage, "invalid scope or key: " + lib(e), e.sqlstate()};
    } catch (const idem::lease_lost& e) {
        return {Exit::fence, "fence mismatch: " + lib(e), e.sqlstate()};
    } catch (const idem::store_unavailable& e) {
        return {Exit::unavailable, fmt::format("database unavailable ({}): {}", idemctl::redacted(conninfo), lib(e)),
                e.sqlstate()};
    } catch (const idem::config_error& e) {
        return {Exit::config, fmt::format("configuration error ({}): {}", idemctl::redacted(conninfo), lib(e)),
                e.sqlstate()};
    } catch (const idem::error& e) {
        return {Exit::failure, lib(e), e.sqlstate()};
    } catch (const std::exception& e) {
        return {Exit::failure, e.what(), {}};
    } catch (...) {
        return {Exit::failure, "unknown failure", {}};
    }
}

/// The exit code's name in --json errors ({"error": {"code": ...}}), indexed by its value.
constexpr std::string_view exit_name(Exit e) noexcept {
    constexpr std::string_view names[] = {"ok",           "not_found", "usage", "unavailable", "fence_mismatch",
                                          "config_error", "failure"};
    return names[static_cast<int>(e)];
}

}  // namespace

int main(int argc, char** argv) {
    // Known before parsing, so that a bad command line is answered in JSON too.
    bool json = false;
    for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i)
        json = json || std::string_view(argv[i]) == "--json";
    std::string conninfo;
    try {
        const idemctl::Options options = idemctl::parse(argc, argv);
        json = options.json;
        conninfo = options.conninfo;
        if (options.help) {
            std::cout << *options.help;
            return 0;
        }
        return static_cast<int>(idemctl::run(options, std::cout));
    } catch (...) {
        Failure failure = classify(std::current_exception(), conninfo);
        failure.message = idemctl::scrub(std::move(failure.message), conninfo);
        if (!json) {
            std::cerr << "idemctl: " << failure.message << '\n';
            return static_cast<int>(failure.exit);
        }
        // With --json the document on stdout is the whole answer: nothing on stderr.
        idemctl::Json error = idemctl::Json::object();
        error["code"] = exit_name(failure.exit);
        error["exit"] = static_cast<int>(failure.exit);
        error["message"] = failure.message;
        error["sqlstate"] = failure.sqlstate.empty() ? idemctl::Json() : idemctl::Json(failure.sqlstate);
        std::cout << idemctl::dump({{"error", std::move(error)}}) << '\n';
        return static_cast<int>(failure.exit);
    }
}
