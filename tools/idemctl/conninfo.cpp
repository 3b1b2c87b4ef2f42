// tools/idemctl/conninfo.cpp — redacting conninfo and messages (see conninfo.hpp).
#include "conninfo.hpp"

#include "cli.hpp"

#include <cstdlib>
#include <libpq-fe.h>
#include <memory>
#include <vector>

namespace idemctl {
namespace {

using Parsed = std::unique_ptr<PQconninfoOption, decltype(&PQconninfoFree)>;

Parsed parse_conninfo(const std::string& conninfo) {
    char* error = nullptr;
    Parsed parsed(PQconninfoParse(conninfo.c_str(), &error), &PQconninfoFree);
    PQfreemem(error); // never shown: it may quote the password
    return parsed;
}

// libpq's quoting of a value: single quotes when needed, backslash before ' and \.
std::string quoted(std::string_view value) {
    const bool plain = !value.empty() && value.find_first_of(" '\\\t\n") == std::string_view::npos;
    if (plain)
        return std::string(value);
    std::string out = "'";
    for (const char c : value) {
        if (c == '\'' || c == '\\')
            out += '\\';
        out += c;
    }
    return out + "'";
}

void replace_all(std::string& text, const std::string& secret) {
    if (secret.empty())
        return;
    for (std::size_t at = text.find(secret); at != std::string::npos;
         at = text.find(secret, at + 3)) {
        text.replace(at, secret.size(), "***");
    }
}

} // namespace

void require_parsable(const std::string& conninfo) {
    if (!conninfo.empty() && parse_conninfo(conninfo) == nullptr) {
        throw ToolError(
            Exit::usage,
            "--db: libpq cannot parse the conninfo (not shown: it may hold a password)");
    }
}

std::string redacted(const std::string& conninfo) {
    if (conninfo.empty())
        return "(libpq environment)";
    const Parsed parsed = parse_conninfo(conninfo);
    if (!parsed)
        return "(a conninfo libpq cannot parse; not shown)";
    std::string out;
    for (const PQconninfoOption* o = parsed.get(); o->keyword != nullptr; ++o) {
        if (o->val == nullptr || std::string_view(o->keyword) == "password")
            continue;
        if (!out.empty())
            out += ' ';
        out += o->keyword;
        out += '=';
        out += quoted(o->val);
    }
    return out.empty() ? "(libpq environment)" : out;
}

std::string scrub(std::string message, const std::string& conninfo) {
    std::vector<std::string> secrets;
    if (const char* env = std::getenv("PGPASSWORD"))
        secrets.emplace_back(env);
    if (const Parsed parsed = parse_conninfo(conninfo)) {
        for (const PQconninfoOption* o = parsed.get(); o->keyword != nullptr; ++o) {
            if (o->val != nullptr && std::string_view(o->keyword) == "password")
                secrets.emplace_back(o->val);
        }
    }
    for (const auto& secret : secrets)
        replace_all(message, secret);
    return message;
}

} // namespace idemctl
