// tools/idemctl/main.cpp — idemctl, the operator's command-line tool for idem's PostgreSQL table.
//
//   idemctl show SCOPE KEY            was this key performed? what did it answer?
//   idemctl list --stale              keys stuck in progress
//   idemctl stats | purge | release SCOPE KEY --fence F | reconcile-report
//
// `idemctl --help` has every command and exit code (`--help-all` every option); docs/reliability.md
// ("Operating idem") says when to use which. This file maps every failure to one exit code and one message (on
// stderr; with --json also as {"error": {...}} on stdout), with any password scrubbed out.
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

/// The exit code and message for what a command threw.
std::pair<Exit, std::string> classify(const std::exception_ptr& thrown, const std::string& conninfo) {
    const auto lib = [](const std::exception& e) { return std::string(idem::detail::without_prefix(e.what())); };
    try {
        std::rethrow_exception(thrown);
    } catch (const idemctl::ToolError& e) {
        return {e.exit_code(), e.what()};
    } catch (const idem::invalid_key& e) {
        return {Exit::usage, "invalid scope or key: " + lib(e)};
    } catch (const idem::lease_lost& e) {
        return {Exit::fence, "fence mismatch: " + lib(e)};
    } catch (const idem::store_unavailable& e) {
        return {Exit::unavailable, fmt::format("database unavailable ({}): {}", idemctl::redacted(conninfo), lib(e))};
    } catch (const idem::config_error& e) {
        return {Exit::config, fmt::format("configuration error ({}): {}", idemctl::redacted(conninfo), lib(e))};
    } catch (const idem::error& e) {
        return {Exit::failure, lib(e)};
    } catch (const std::exception& e) {
        return {Exit::failure, e.what()};
    } catch (...) {
        return {Exit::failure, "unknown failure"};
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
        auto [code, message] = classify(std::current_exception(), conninfo);
        message = idemctl::scrub(std::move(message), conninfo);
        std::cerr << "idemctl: " << message << '\n';
        if (json) {
            idemctl::Json error = idemctl::Json::object();
            error["code"] = exit_name(code);
            error["exit"] = static_cast<int>(code);
            error["message"] = message;
            std::cout << idemctl::dump({{"error", std::move(error)}}) << '\n';
        }
        return static_cast<int>(code);
    }
}
