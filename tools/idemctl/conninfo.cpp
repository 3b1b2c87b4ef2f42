// tools/idemctl/conninfo.cpp — redacting conninfo and messages (see conninfo.hpp).
#include "conninfo.hpp"

#include "cli.hpp"

#include <libpq-fe.h>
#include <cstdlib>
#include <memory>
#include <string_view>
#include <vector>

namespace idemctl {
namespace {

using Parsed = std::unique_ptr<PQconninfoOption, decltype(&PQconninfoFree)>;

Parsed parse_conninfo(const std::string& conninfo) {
    char* error = nullptr;
    Parsed parsed(PQconninfoParse(conninfo.c_str(), &error), &PQconninfoFree);
    PQfreemem(error);  // never shown: it may quote the password
    return parsed;
}

// libpq's quoting of a value: single quotes when needed, backslash before ' and \.
std::string quoted(std::string_view value) {
    const bool plain = !value.empty() && value.find_first_of(" '\\\t\n") == std::string_view::npos;
    if (plain) return std::string(value);
    std::string out = "'";
    for (const char c : value) {
        if (c == '\'' || c == '\\') out += '\\';
        out += c;
    }
    return out + "'";
}

// password, sslpassword, and any later libpq keyword of the kind.
bool secret_keyword(std::string_view keyword) { return keyword.find("password") != std::string_view::npos; }

void replace_all(std::string& text, const std::string& secret) {
    if (secret.empty()) return;
    for (std::size_t at = text.find(secret); at != std::string::npos; at = text.find(secret, at + 3)) {
        text.replace(at, secret.size(), "***");
    }
}

}  // namespace

void require_parsable(const std::string& conninfo) {
    // A URI whose user info holds an unencoded '@': libpq splits at the first one and takes the
    // rest of the password for the host, which its messages would then show.
    for (const std::string_view scheme : {"postgresql://", "postgres://"}) {
        if (conninfo.compare(0, scheme.size(), scheme) != 0) continue;
        const std::string_view rest = std::string_view(conninfo).substr(scheme.size());
        const std::string_view authority = rest.substr(0, rest.find_first_of("/?"));
        if (authority.find('@') != authority.rfind('@')) {
            throw ToolError(Exit::usage,
                            "--db: the URI has more than one '@' before the host: "
                            "percent-encode '@' in the password as %40 (not shown: it "
                            "may hold a password)");
        }
    }
    if (!conninfo.empty() && parse_conninfo(conninfo) == nullptr) {
        throw ToolError(Exit::usage, "--db: libpq cannot parse the conninfo (not shown: it may hold a password)");
    }
}

std::string redacted(const std::string& conninfo) {
    if (conninfo.empty()) return "(libpq environment)";
    const Parsed parsed = parse_conninfo(conninfo);
    if (!parsed) return "(a conninfo libpq cannot parse; not shown)";
    std::string out;
    for (const PQconninfoOption* o = parsed.get(); o->keyword != nullptr; ++o) {
        if (o->val == nullptr || secret_keyword(o->keyword)) continue;
        if (!out.empty()) out += ' ';
        out += o->keyword;
        out += '=';
        out += quoted(o->val);
    }
    return out.empty() ? "(libpq environment)" : out;
}

std::string scrub(std::string message, const std::string& conninfo) {
    std::vector<std::string> secrets;
    if (const char* env = std::getenv("PGPASSWORD")) secrets.emplace_back(env);
    if (const Parsed parsed = parse_conninfo(conninfo)) {
        for (const PQconninfoOption* o = parsed.get(); o->keyword != nullptr; ++o) {
            if (o->val != nullptr && secret_keyword(o->keyword)) secrets.emplace_back(o->val);
        }
    }
    for (const auto& secret : secrets) replace_all(message, secret);
    return message;
}

}  // namespace idemctl
