// tests/tools/idemctl_test.cpp — idemctl (tools/idemctl), the real binary run as its own process.
//
// Records are made through the library in a private table — a fresh claim, a completed HTTP
// response, a stale in-progress key with a recovery point, expired records — and each command's
// output (text lines and --json fields), exit code and effect on the table is checked exactly,
// with the bad inputs an operator will type: an unknown key, a wrong fence, an invalid scope, a
// release without --yes and without a terminal, an unreachable database whose conninfo holds a
// password. Time is never waited for: leases and retentions are moved into the past with SQL.
#include "idem/errors.hpp"
#include "idem/postgres_store.hpp"
#include "idem/response.hpp"
#include "pg.hpp"
#include "require_db.hpp"
#include "test_env.hpp"

#include <fcntl.h>
#include <libpq-fe.h>
#include <pty.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#ifdef IDEMCTL_TEST_HTTPLIB
#include "../http/http_support.hpp"
#include "idem/http/httplib.hpp"
#endif

extern char** environ;

namespace {

using nlohmann::json;
using namespace std::chrono_literals;

/// What one run of idemctl printed, and how it ended.
struct Run {
    int exit_code = -1;
    std::string out;
    std::string err;

    [[nodiscard]] json doc() const { return json::parse(out); }
    /// Whether stdout has `line` as one whole line.
    [[nodiscard]] bool has_line(const std::string& line) const {
        std::istringstream in(out);
        for (std::string l; std::getline(in, l);) {
            if (l == line) return true;
        }
        return false;
    }
};

std::string slurp(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
}

/// idemctl's argv: the binary, then `args` (owns the strings the pointers point into).
struct Argv {
    explicit Argv(const std::vector<std::string>& args) : strings{IDEMCTL} {
        strings.insert(strings.end(), args.begin(), args.end());
        for (auto& s : strings) pointers.push_back(s.data());
        pointers.push_back(nullptr);
    }
    [[nodiscard]] char* const* data() { return pointers.data(); }
    std::vector<std::string> strings;
    std::vector<char*> pointers;
};

/// Runs idemctl with `args`, stdin from /dev/null (not a terminal), stdout and stderr to files.
/// `env` replaces variables of this process's environment ("" unsets one).
Run idemctl(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {}) {
    const auto dir = std::filesystem::temp_directory_path() / idem_test::unique_name("idemctl_run");
    std::filesystem::create_directories(dir);
    const std::string out_path = (dir / "out").string(), err_path = (dir / "err").string();
    Argv argv(args);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
        const std::string entry = *e;
        if (!env.contains(entry.substr(0, entry.find('=')))) env_strings.push_back(entry);
    }
    for (const auto& [name, value] : env) {
        if (!value.empty()) env_strings.push_back(name + "=" + value);
    }
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);

    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    pid_t pid = 0;
    const int spawned = posix_spawn(&pid, IDEMCTL, &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    REQUIRE(spawned == 0);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    REQUIRE(WIFEXITED(status));
    Run run{WEXITSTATUS(status), slurp(out_path), slurp(err_path)};
    std::filesystem::remove_all(dir);
    return run;
}

/// Runs idemctl on a pseudo-terminal (stdin, stdout and stderr), typing `input` into it; returns
/// the exit code and everything the terminal showed (its echo of `input` included, "\r\n" line
/// ends).
Run idemctl_on_tty(const std::vector<std::string>& args, const std::string& input) {
    Argv argv(args);
    int master = -1;
    const pid_t pid = ::forkpty(&master, nullptr, nullptr, nullptr);
    REQUIRE(pid >= 0);
    if (pid == 0) {
        ::execv(IDEMCTL, argv.data());
        ::_exit(127);
    }
    // The line discipline holds the typed line until idemctl reads it.
    REQUIRE(::write(master, input.data(), input.size()) == static_cast<ssize_t>(input.size()));
    Run run;
    char buffer[4096];
    for (ssize_t n; (n = ::read(master, buffer, sizeof buffer)) > 0;)
        run.out.append(buffer, static_cast<std::size_t>(n));
    ::close(master);  // (read ends with EIO once idemctl has exited and closed its side)
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    REQUIRE(WIFEXITED(status));
    run.exit_code = WEXITSTATUS(status);
    return run;
}

/// The test oracle for idemctl's timestamps: UTC, ISO 8601, milliseconds.
std::string iso(std::chrono::system_clock::time_point t) {
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
    const std::time_t secs = static_cast<std::time_t>(ms / 1000);
    std::tm tm{};
    gmtime_r(&secs, &tm);
    char buffer[32];
    std::strftime(buffer, sizeof buffer, "%Y-%m-%dT%H:%M:%S", &tm);
    char out[40];
    std::snprintf(out, sizeof out, "%s.%03dZ", buffer, static_cast<int>(ms % 1000));
    return out;
}

/// A private table with one record of each kind an operator meets, made through the library.
struct Fixture {
    std::string url = idem_test::require_db();
    std::string table = idem_test::unique_name("idemctl");
    idem_test::DropTable drop{url, table};
    idem::PostgresStore store{url, make_options(table)};
    idem_test::PgConn sql{url};

    const std::string scope = "acct_1:POST /payments";
    const idem::Key claimed{scope, "claimed-1"};                   // in progress, lease ahead
    const idem::Key completed{scope, "completed-1"};               // an HTTP response
    const idem::Key stale{scope, "stale-1"};                       // in progress, lease passed, phase recorded
    const idem::Key expired{"acct_2:POST /refunds", "expired-1"};  // completed, retention passed
    const idem::Key expired2{"acct_2:POST /refunds", "expired-2"};
    const idem::Response response{201, R"({"id":"ch_1"})", {{"Content-Type", "application/json"}}};
    idem::Fence claimed_fence = 0, completed_fence = 0, stale_fence = 0;

    static idem::PostgresOptions make_options(const std::string& table) {
        idem::PostgresOptions o;
        o.table = table;
        o.pool_size = 2;
        o.default_lease = 10min;  // a lease that must not pass during the test has minutes of margin
        return o;
    }

    Fixture() {
        store.ensure_schema();
        claimed_fence = claim(claimed);
        completed_fence = claim(completed);
        store.save(completed, completed_fence, idem::codec<idem::Response>::encode(response));
        stale_fence = claim(stale);
        store.record_phase(stale, stale_fence, "charged", "ch_777");
        move(stale, "lease_until = now() - interval '5 minutes'");
        for (const auto* k : {&expired, &expired2}) {
            store.save(*k, claim(*k), "raw result");
            move(*k, "created_at = now() - interval '2 days', expires_at = now() - interval '1 hour'");
        }
    }

    idem::Fence claim(const idem::Key& key) {
        const auto c = store.claim(key, idem::fingerprint(std::string("request")));
        REQUIRE(c.status == idem::ClaimStatus::claimed);
        return c.fence;
    }

    /// Sets columns of `key`'s row (times moved into the past: what the database then sees as
    /// passed).
    void move(const idem::Key& key, const std::string& assignments) {
        sql.exec("UPDATE \"" + table + "\" SET " + assignments + " WHERE scope = $1 AND key = $2",
                 {key.scope(), key.value()});
    }

    /// idemctl on this table and database, with `args` after the command's own.
    Run ctl(std::vector<std::string> args) {
        args.insert(args.end(), {"--db", url, "--table", table});
        return idemctl(args);
    }

    std::string label(const idem::Key& key) const { return "scope '" + key.scope() + "' key '" + key.value() + "'"; }
};

}  // namespace

TEST_CASE("idemctl show: a completed HTTP response, decoded", "[idemctl]") {
    Fixture f;
    const auto record = f.store.read(f.completed);
    REQUIRE(record);
    const std::size_t encoded = idem::codec<idem::Response>::encode(f.response).size();

    const Run json_run = f.ctl({"show", f.completed.scope(), f.completed.value(), "--json"});
    REQUIRE(json_run.exit_code == 0);
    CHECK(json_run.err.empty());
    const json j = json_run.doc();
    CHECK(j["scope"] == f.completed.scope());
    CHECK(j["key"] == f.completed.value());
    CHECK(j["state"] == "completed");
    CHECK(j["attempt"] == 1);
    CHECK(j["fence"] == f.completed_fence);
    CHECK(j["fingerprint"] == "sha256:" + record->fingerprint.hex());
    CHECK(j["created_at"] == iso(record->created_at));
    CHECK(j["lease_until"] == iso(record->lease_until));
    CHECK(j["expires_at"] == iso(record->expires_at));
    CHECK(j["lease_passed"] == false);
    CHECK(j["stale"] == false);
    CHECK(j["expired"] == false);
    CHECK(j["phase"].is_null());
    CHECK(j["phase_data"].is_null());
    CHECK(j["result_bytes"] == encoded);
    CHECK(j["response"]["status"] == 201);
    CHECK(j["response"]["headers"] == json::parse(R"([{"name":"Content-Type","value":"application/json"}])"));
    CHECK(j["response"]["body"] == R"({"id":"ch_1"})");
    CHECK(j["response"]["body_bytes"] == 13);

    const Run text = f.ctl({"show", f.completed.scope(), f.completed.value()});
    REQUIRE(text.exit_code == 0);
    CHECK(text.has_line("scope        acct_1:POST /payments"));
    CHECK(text.has_line("key          completed-1"));
    CHECK(text.has_line("state        completed"));
    CHECK(text.has_line("attempt      1"));
    CHECK(text.has_line("fence        " + std::to_string(f.completed_fence)));
    CHECK(text.has_line("phase        -"));
    CHECK(text.has_line("result       " + std::to_string(encoded) + " bytes: an HTTP response"));
    CHECK(text.has_line("status       201"));
    CHECK(text.has_line("header       Content-Type: application/json"));
    CHECK(text.has_line(R"(body         13 bytes: {"id":"ch_1"})"));
}

TEST_CASE("idemctl show: a sealed result is opened only with --keyring", "[idemctl]") {
    Fixture f;
    const auto dir = std::filesystem::temp_directory_path() / idem_test::unique_name("idemctl_keys");
    std::filesystem::create_directories(dir);
    const auto write = [&](const std::string& name, const std::string& text) {
        std::ofstream(dir / name) << text;
        // The service's user only: a keyring its group or others may read is refused.
        std::filesystem::permissions(dir / name,
                                     std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
        return (dir / name).string();
    };
    const std::string right = write("right", "# test keys\n1 " + std::string(64, 'a') + "\n");
    const std::string wrong = write("wrong", "1 " + std::string(64, 'b') + "\n");
    auto options = Fixture::make_options(f.table);
    options.sealing.keyring = std::make_shared<const idem::Keyring>(idem::Keyring::from_file(right));
    idem::PostgresStore sealed(f.url, options);
    const idem::Key key(f.scope, "sealed-1");
    const auto c = sealed.claim(key, idem::fingerprint(std::string("request")));
    REQUIRE(c.status == idem::ClaimStatus::claimed);
    sealed.save(key, c.fence, idem::codec<idem::Response>::encode(f.response));
    const std::size_t stored = idem::codec<idem::Response>::encode(f.response).size() + idem::seal_overhead;

    const Run closed = f.ctl({"show", key.scope(), key.value()});
    REQUIRE(closed.exit_code == 0);
    CHECK(closed.has_line("result       " + std::to_string(stored) +
                          " bytes, sealed with key id 1 (give --keyring FILE to open it)"));
    CHECK(closed.out.find("ch_1") == std::string::npos);
    const json j = f.ctl({"show", key.scope(), key.value(), "--json"}).doc();
    CHECK(j["sealed_key_id"] == 1);
    CHECK(j["opened"] == false);
    CHECK(j["response"].is_null());
    CHECK(j["result_bytes"] == stored);

    const Run opened = f.ctl({"show", key.scope(), key.value(), "--keyring", right});
    REQUIRE(opened.exit_code == 0);
    CHECK(opened.has_line(R"(body         13 bytes: {"id":"ch_1"})"));
    CHECK(opened.has_line("sealing      sealed with key id 1, opened and authenticated with --keyring"));
    const json jo = f.ctl({"show", key.scope(), key.value(), "--json", "--keyring", right}).doc();
    CHECK(jo["opened"] == true);
    CHECK(jo["response"]["body"] == R"({"id":"ch_1"})");
    // with a keyring, an unsealed record of the same table is shown as stored, and said to be so
    const Run plain = f.ctl({"show", f.completed.scope(), f.completed.value(), "--keyring", right});
    REQUIRE(plain.exit_code == 0);
    CHECK(plain.has_line(R"(body         13 bytes: {"id":"ch_1"})"));
    CHECK(plain.has_line("sealing      stored unsealed: not authenticated (written without sealing, or planted)"));

    const Run refused = f.ctl({"show", key.scope(), key.value(), "--keyring", wrong});
    CHECK(refused.exit_code != 0);
    CHECK(refused.err.find("does not authenticate") != std::string::npos);
    CHECK(refused.out.find("ch_1") == std::string::npos);
    const Run missing = f.ctl({"show", key.scope(), key.value(), "--keyring", (dir / "absent").string()});
    CHECK(missing.exit_code != 0);
    CHECK(missing.err.find("cannot read the keyring file") != std::string::npos);
    std::filesystem::remove_all(dir);
}

TEST_CASE("idemctl show and list: a keyed fingerprint (fingerprint_secret) shows its algorithm", "[idemctl]") {
    Fixture f;
    auto options = Fixture::make_options(f.table);
    options.fingerprint_secret = idem::FingerprintSecret("an idemctl test secret of 32 bytes or more");
    idem::PostgresStore keyed(f.url, options);
    const idem::Key key{f.scope, "keyed-1"};
    const auto c = keyed.claim(key, idem::fingerprint(std::string("request")));
    REQUIRE(c.status == idem::ClaimStatus::claimed);
    keyed.save(key, c.fence, "raw result");
    const auto record = keyed.read(key);
    REQUIRE(record);

    const Run json_run = f.ctl({"show", key.scope(), key.value(), "--json"});
    REQUIRE(json_run.exit_code == 0);
    CHECK(json_run.doc()["fingerprint"] == "hmac-sha256:" + record->fingerprint.hex());
    const Run text = f.ctl({"show", key.scope(), key.value()});
    REQUIRE(text.exit_code == 0);
    CHECK(text.has_line("fingerprint  hmac-sha256:" + record->fingerprint.hex()));
    // The plain records beside it still say sha256.
    CHECK(f.ctl({"show", f.completed.scope(), f.completed.value(), "--json"}).doc()["fingerprint"] ==
          "sha256:" + f.store.read(f.completed)->fingerprint.hex());
    const Run listed = f.ctl({"list", "--scope", f.scope});
    CHECK(listed.exit_code == 0);
    CHECK(listed.out.find("keyed-1") != std::string::npos);
}

TEST_CASE("idemctl show: a stale in-progress key with its recovery point", "[idemctl]") {
    Fixture f;
    const Run run = f.ctl({"--json", "show", f.stale.scope(), f.stale.value()});
    REQUIRE(run.exit_code == 0);
    const json j = run.doc();
    CHECK(j["state"] == "in_progress");
    CHECK(j["fence"] == f.stale_fence);
    CHECK(j["phase"] == "charged");
    CHECK(j["phase_data"] == "ch_777");
    CHECK(j["lease_passed"] == true);
    CHECK(j["stale"] == true);
    CHECK(j["expired"] == false);
    CHECK(j["result_bytes"].is_null());
    CHECK(j["response"].is_null());

    const Run text = f.ctl({"show", f.stale.scope(), f.stale.value()});
    REQUIRE(text.exit_code == 0);
    CHECK(text.has_line("phase        charged"));
    CHECK(text.has_line("phase_data   ch_777 (6 bytes)"));
    CHECK(text.has_line("result       - (none yet: in progress)"));
    CHECK(text.out.find("; stale: a reconciler may take it over)") != std::string::npos);

    // A completed record whose result is not an HTTP response: its size and bytes, no response.
    const Run raw = f.ctl({"show", f.expired.scope(), f.expired.value(), "--json"});
    REQUIRE(raw.exit_code == 0);
    CHECK(raw.doc()["expired"] == true);
    CHECK(raw.doc()["response"].is_null());
    CHECK(raw.doc()["result"] == "raw result");
    CHECK(raw.doc()["result_bytes"] == 10);

    // Bytes that are not text: base64 in JSON, escaped on a terminal (nothing reaches it raw).
    const idem::Key binary{f.scope, "binary-1"};
    const std::string body("\x00\xffok\x1b[31m", 9);
    f.store.save(binary, f.claim(binary), idem::codec<idem::Response>::encode(idem::Response{200, body}));
    const Run binary_json = f.ctl({"show", binary.scope(), binary.value(), "--json"});
    REQUIRE(binary_json.exit_code == 0);
    CHECK(binary_json.doc()["response"]["body"].is_null());
    CHECK(binary_json.doc()["response"]["body_base64"] == "AP9vaxtbMzFt");
    CHECK(binary_json.doc()["response"]["body_bytes"] == 9);
    const Run binary_text = f.ctl({"show", binary.scope(), binary.value()});
    CHECK(binary_text.has_line(R"(body         9 bytes: \x00\xffok\x1b[31m)"));
}

/// What a client's request with `Idempotency-Key: "<sent>"` leaves in the table through idem's
/// cpp-httplib adapter, which sees the header value percent-decoded: over real HTTP on 127.0.0.1
/// when cpp-httplib is installed, else written as the adapter writes it (`stored`). The handler
/// answers 201 "created".
void post_through_httplib(Fixture& f, const std::string& scope, const std::string& sent, const std::string& stored) {
#ifdef IDEMCTL_TEST_HTTPLIB
    (void)stored;
    const idem::http::Route route;
    http_test::Server server([&](const httplib::Request& req, httplib::Response& res) {
        idem::http::httplib::serve(f.store, req, res, scope, route, [] { return idem::Response{201, "created"}; });
    });
    const http_test::Wire wire =
        http_test::exchange(server.port(), {"POST", "/orders", {{"Idempotency-Key", "\"" + sent + "\""}}, "{}"});
    REQUIRE(wire.status == 201);
#else
    (void)sent;
    const idem::Key key{scope, stored};
    f.store.save(key, f.claim(key), idem::codec<idem::Response>::encode(idem::Response{201, "created"}));
#endif
}

TEST_CASE("idemctl show: a key that cpp-httplib percent-decoded is found under its decoded form", "[idemctl]") {
    Fixture f;
    const std::string scope = "acct_4:POST /orders";
    post_through_httplib(f, scope, "k%41", "kA");
    const std::string note =
        "note: no record for key 'k%41'; showing key 'kA', its percent-decoded form (cpp-httplib decodes "
        "%XX in header values before idem sees them; --exact looks up only the key as given)";

    const Run text = f.ctl({"show", scope, "k%41"});
    REQUIRE(text.exit_code == 0);
    CHECK(text.out.starts_with(note + "\n"));
    CHECK(text.has_line("key          kA"));
    CHECK(text.has_line("state        completed"));
    CHECK(text.has_line("body         7 bytes: created"));
    CHECK(text.err.empty());

    const Run as_json = f.ctl({"show", scope, "k%41", "--json"});
    REQUIRE(as_json.exit_code == 0);
    const json j = as_json.doc();
    CHECK(j["key"] == "kA");
    CHECK(j.at("requested_key") == "k%41");
    CHECK(j.at("lookup") == "percent_decoded");
    CHECK(j["response"]["status"] == 201);

    // The key as given wins when it has a record; --exact never looks further.
    const Run exact_json = f.ctl({"show", scope, "kA", "--json"});
    CHECK(exact_json.doc().at("lookup") == "exact");
    CHECK(exact_json.doc().at("requested_key") == "kA");
    const Run exact = f.ctl({"show", scope, "k%41", "--exact"});
    CHECK(exact.exit_code == 1);
    CHECK(exact.err == "idemctl: no record for scope 'acct_4:POST /orders' key 'k%41' in table " + f.table + "\n");

    // Neither form has a record: the message names both.
    const Run neither = f.ctl({"show", scope, "k%42"});
    CHECK(neither.exit_code == 1);
    CHECK(neither.err == "idemctl: no record for scope 'acct_4:POST /orders' key 'k%42' in table " + f.table +
                             ", nor for its percent-decoded form 'kB'\n");
    // A decoded form idem would refuse as a key (a NUL byte) is not looked up.
    const Run nul = f.ctl({"show", scope, "k%00"});
    CHECK(nul.exit_code == 1);
    CHECK(nul.err == "idemctl: no record for scope 'acct_4:POST /orders' key 'k%00' in table " + f.table + "\n");
}

TEST_CASE("idemctl show: unknown key, invalid scope or key, bad command lines", "[idemctl]") {
    Fixture f;
    const Run missing = f.ctl({"show", f.scope, "nope"});
    CHECK(missing.exit_code == 1);
    CHECK(missing.out.empty());
    CHECK(missing.err == "idemctl: no record for scope 'acct_1:POST /payments' key 'nope' in table " + f.table + "\n");

    const Run missing_json = f.ctl({"show", f.scope, "nope", "--json"});
    CHECK(missing_json.exit_code == 1);
    CHECK(missing_json.doc()["error"]["code"] == "not_found");
    CHECK(missing_json.doc()["error"]["exit"] == 1);

    const Run bad_scope = f.ctl({"show", "bad\x01scope", "k"});
    CHECK(bad_scope.exit_code == 2);
    CHECK(bad_scope.out.empty());
    CHECK(bad_scope.err.starts_with("idemctl: invalid scope or key: "));

    const Run long_key = f.ctl({"show", f.scope, std::string(256, 'k')});
    CHECK(long_key.exit_code == 2);
    CHECK(long_key.err.starts_with("idemctl: invalid scope or key: "));

    const Run no_args = idemctl({"show", "only-scope"});
    CHECK(no_args.exit_code == 2);
    CHECK(no_args.err == "idemctl: show needs 2 arguments: SCOPE KEY (idemctl --help lists commands and options)\n");
    CHECK(idemctl({"frobnicate"}).exit_code == 2);
    CHECK(idemctl({"list", "--fence", "1"}).exit_code == 2);
    CHECK(idemctl({"list", "--older-than", "10x"}).exit_code == 2);
    CHECK(f.ctl({"list", "--scope-prefix", ""}).exit_code == 2);

    const Run bad_table = idemctl({"show", "s", "k", "--db", f.url, "--table", "no such; table"});
    CHECK(bad_table.exit_code == 2);
    CHECK(bad_table.err.starts_with("idemctl: --table: invalid table name 'no such; table'"));

    const Run no_table = idemctl({"stats", "--db", f.url, "--table", "idemctl_no_such_table"});
    CHECK(no_table.exit_code == 5);
    CHECK(no_table.err.starts_with("idemctl: table idemctl_no_such_table does not exist"));
    CHECK(idemctl({"show", "s", "k", "--db", f.url, "--table", "idemctl_no_such_table"}).exit_code == 5);

    const Run help = idemctl({"--help"});
    CHECK(help.exit_code == 0);
    CHECK(help.out.find("Exit codes:\n  0  ok\n  1  not found") != std::string::npos);
}

TEST_CASE("idemctl help: the commands, each command's options, and where options may go", "[idemctl]") {
    Fixture f;
    const Run help = idemctl({"--help"});
    REQUIRE(help.exit_code == 0);
    CHECK(
        help.out.starts_with("idemctl — inspect and operate idem's idempotency keys in PostgreSQL.\n"
                             "Usage: idemctl [OPTIONS] COMMAND\n"));
    CHECK(help.out.find("\n  reconcile-report        in-progress keys past their lease") != std::string::npos);
    CHECK(help.out.find("\n  --fence") == std::string::npos);  // a command's option: in its own help

    const Run release = idemctl({"release", "--help"});
    REQUIRE(release.exit_code == 0);
    CHECK(release.has_line("Usage: idemctl release [OPTIONS] SCOPE KEY"));
    CHECK(
        release.has_line("  --fence F               required: the fence the key must still have (idemctl show "
                         "prints it)"));
    CHECK(release.has_line("  --yes                   do not ask for confirmation"));
    CHECK(release.out.find("--stale") == std::string::npos);

    const Run all = idemctl({"--help-all"});
    REQUIRE(all.exit_code == 0);
    CHECK(all.has_line("    --older-than DURATION   only keys created longer ago than DURATION (90s, 10m, 2h, 3d)"));
    CHECK(all.has_line("    --batch N               rows per transaction (default 1000)"));

    // A command's own option before the command is taken as after it, and refused by the others.
    const Run before = f.ctl({"--stale", "--json", "list"});
    REQUIRE(before.exit_code == 0);
    CHECK(before.doc()["count"] == 1);
    CHECK(before.doc()["records"][0]["key"] == "stale-1");
    const Run misplaced = idemctl({"--fence", "1", "list"});
    CHECK(misplaced.exit_code == 2);
    CHECK(misplaced.err == "idemctl: list does not take --fence (idemctl --help lists commands and options)\n");
    const Run unknown = idemctl({"frobnicate"});
    CHECK(unknown.exit_code == 2);
    CHECK(unknown.err == "idemctl: unknown command 'frobnicate' (idemctl --help lists commands and options)\n");
    const Run bogus = idemctl({"list", "--bogus=1"});
    CHECK(bogus.exit_code == 2);
    CHECK(bogus.err == "idemctl: unknown option '--bogus' (idemctl --help lists commands and options)\n");
    // After --, a key may start with '-'.
    const Run dashed = idemctl({"show", "--json", "--db", f.url, "--table", f.table, "--", f.scope, "-k"});
    CHECK(dashed.exit_code == 1);
    CHECK(dashed.doc()["error"]["code"] == "not_found");
}

TEST_CASE("idemctl list: filters, limit, stale only, older than", "[idemctl]") {
    Fixture f;
    const auto keys_of = [](const Run& run) {
        REQUIRE(run.exit_code == 0);
        std::vector<std::string> keys;
        const json doc = run.doc();  // (not iterated as a temporary: it would be gone)
        for (const auto& r : doc["records"]) keys.push_back(r["key"].get<std::string>());
        return keys;
    };
    // Oldest first: the expired records were created two days ago.
    using Keys = std::vector<std::string>;
    CHECK(keys_of(f.ctl({"list", "--json"})) == Keys{"expired-1", "expired-2", "claimed-1", "completed-1", "stale-1"});
    CHECK(keys_of(f.ctl({"list", "--json", "--state", "in_progress"})) == Keys{"claimed-1", "stale-1"});
    CHECK(keys_of(f.ctl({"list", "--json", "--state", "expired"})) == Keys{"expired-1", "expired-2"});
    CHECK(keys_of(f.ctl({"list", "--json", "--stale"})) == Keys{"stale-1"});
    CHECK(keys_of(f.ctl({"list", "--json", "--older-than", "1d"})) == Keys{"expired-1", "expired-2"});
    CHECK(keys_of(f.ctl({"list", "--json", "--scope-prefix", "acct_1:"})) ==
          Keys{"claimed-1", "completed-1", "stale-1"});
    CHECK(keys_of(f.ctl({"list", "--json", "--scope", "acct_2:POST /refunds"})) == Keys{"expired-1", "expired-2"});
    CHECK(keys_of(f.ctl({"list", "--json", "--scope-prefix", "acct_1%"})).empty());  // literal, no wildcard

    const Run limited = f.ctl({"list", "--json", "--limit", "2"});
    REQUIRE(limited.exit_code == 0);
    CHECK(limited.doc()["count"] == 2);
    CHECK(limited.doc()["more"] == true);
    const json stale = f.ctl({"list", "--json", "--stale"}).doc()["records"][0];
    CHECK(stale["scope"] == f.scope);
    CHECK(stale["state"] == "in_progress");
    CHECK(stale["stale"] == true);
    CHECK(stale["fence"] == f.stale_fence);
    CHECK(stale["phase"] == "charged");
    CHECK(stale["result_bytes"].is_null());

    const Run text = f.ctl({"list", "--stale"});
    REQUIRE(text.exit_code == 0);
    CHECK(text.out.starts_with("SCOPE "));
    CHECK(text.out.find("stale-1  in_progress (stale)  1 ") != std::string::npos);
    CHECK(f.ctl({"list", "--scope", "acct_9"}).out == "no records match\n");
}

/// A table line's cells (cells are separated by two spaces or more; none holds two in a row).
std::vector<std::string> cells_of(const std::string& line) {
    std::vector<std::string> cells;
    std::size_t i = 0;
    while (i < line.size()) {
        const std::size_t gap = line.find("  ", i);
        cells.push_back(line.substr(i, gap == std::string::npos ? std::string::npos : gap - i));
        if (gap == std::string::npos) break;
        i = line.find_first_not_of(' ', gap);
    }
    return cells;
}

TEST_CASE("idemctl list: LEASE says what a lease means in each state", "[idemctl]") {
    Fixture f;
    const Run text = f.ctl({"list"});
    REQUIRE(text.exit_code == 0);
    std::istringstream lines(text.out);
    std::string line;
    std::getline(lines, line);
    const auto header = cells_of(line);
    const auto lease_at = std::find(header.begin(), header.end(), "LEASE") - header.begin();
    const auto key_at = std::find(header.begin(), header.end(), "KEY") - header.begin();
    std::map<std::string, std::string> lease;
    while (std::getline(lines, line)) {
        const auto cells = cells_of(line);
        REQUIRE(cells.size() == header.size());
        lease[cells[key_at]] = cells[lease_at];
    }
    REQUIRE(lease.size() == 5);
    CHECK(lease["claimed-1"].starts_with("in 9m"));    // in progress: the time it has left
    CHECK(lease["stale-1"].starts_with("passed 5m"));  // in progress, past it: how long ago it passed
    CHECK(lease["stale-1"].ends_with("s ago"));
    // A completed key holds no lease, whatever time its row kept from the claim.
    CHECK(lease["completed-1"] == "-");
    CHECK(lease["expired-1"] == "-");
    CHECK(lease["expired-2"] == "-");

    const Run show = f.ctl({"show", f.completed.scope(), f.completed.value()});
    REQUIRE(show.exit_code == 0);
    CHECK(show.has_line("lease_until  - (none: the key is completed)"));
}

/// Terminal columns of `text` up to byte `end` (the test's oracle: one per code point, two for the
/// CJK ideographs the test uses).
std::size_t columns(const std::string& text, std::size_t end) {
    std::size_t n = 0;
    for (std::size_t i = 0; i < end; ++i) {
        const auto b = static_cast<unsigned char>(text[i]);
        if ((b & 0xC0) == 0x80) continue;  // a continuation byte
        n += b == 0xE6 ? 2 : 1;            // 日 (U+65E5) and 本 (U+672C) start with 0xE6
    }
    return n;
}

TEST_CASE("idemctl list: long, wide and hostile keys keep the columns and the terminal intact", "[idemctl]") {
    Fixture f;
    const std::string scope = "acct_3:POST /keys";
    const std::string long_key = "long-" + std::string(250, 'x');  // idem's longest: 255 bytes
    const idem::Key long_one{scope, long_key}, wide{scope, "clé-ü-日本"}, bidi{scope, "bidi-\u202e-x"},
        esc{scope, "esc-placeholder"};
    for (const auto* k : {&long_one, &wide, &bidi, &esc}) f.claim(*k);
    // Bytes idem refuses in a key, written by SQL: an escape sequence that would turn text red.
    // (A row of its own, not an UPDATE of the key: on a table Citus distributes by key, the
    // distribution column cannot change.)
    f.sql.exec("INSERT INTO \"" + f.table +
                   "\" (scope, key, state, fingerprint, fingerprint_alg, fence, lease_until, expires_at) "
                   "SELECT scope, $3, state, fingerprint, fingerprint_alg, fence, lease_until, expires_at FROM \"" +
                   f.table + "\" WHERE scope = $1 AND key = $2",
               {scope, esc.value(), "esc-\x1b[31m-red"});
    f.sql.exec("DELETE FROM \"" + f.table + "\" WHERE scope = $1 AND key = $2", {scope, esc.value()});
    f.move(long_one, "lease_until = now() - interval '1 minute'");  // stale: reconcile-report lists it

    const std::string cut_note =
        "(a value wider than 40 columns is cut short with …: --wide prints it whole, as --json always does)";
    const Run text = f.ctl({"list", "--scope", scope});
    REQUIRE(text.exit_code == 0);
    CHECK(text.out.find('\x1b') == std::string::npos);
    CHECK(text.out.find("\u202e") == std::string::npos);
    CHECK(text.out.find(R"(esc-\x1b[31m-red)") != std::string::npos);
    CHECK(text.out.find(R"(bidi-\u{202e}-x)") != std::string::npos);
    CHECK(text.out.find("clé-ü-日本") != std::string::npos);
    // The key is cut to 40 columns, the widest of its column: STATE follows after two spaces.
    CHECK(text.out.find("long-" + std::string(34, 'x') + "…  in_progress (stale)") != std::string::npos);
    CHECK(text.out.find(long_key) == std::string::npos);
    CHECK(text.has_line(cut_note));
    // Every row's STATE starts in the header's STATE column, whatever bytes the key holds.
    std::istringstream lines(text.out);
    std::string header;
    std::getline(lines, header);
    const std::size_t state_column = columns(header, header.find("STATE"));
    int rows = 0;
    for (std::string line; std::getline(lines, line) && line != cut_note; ++rows) {
        CHECK(columns(line, line.find("in_progress")) == state_column);
    }
    CHECK(rows == 4);

    const Run wide_run = f.ctl({"list", "--scope", scope, "--wide"});
    REQUIRE(wide_run.exit_code == 0);
    CHECK(wide_run.out.find(long_key + "  in_progress (stale)") != std::string::npos);
    CHECK_FALSE(wide_run.has_line(cut_note));

    const Run json_run = f.ctl({"list", "--scope", scope, "--json"});
    REQUIRE(json_run.exit_code == 0);
    CHECK(json_run.doc()["records"][0]["key"] == long_key);
    // JSON escapes what a terminal would not show faithfully too (as \u escapes: the same string
    // once parsed), and leaves other characters as they are.
    CHECK(json_run.out.find("\u202e") == std::string::npos);  // before: the raw U+202E
    CHECK(json_run.out.find(R"(bidi-\u202e-x)") != std::string::npos);
    CHECK(json_run.out.find("clé-ü-日本") != std::string::npos);
    bool bidi_parsed = false;
    const auto listed = json_run.doc();
    for (const auto& r : listed["records"]) bidi_parsed = bidi_parsed || r["key"] == bidi.value();
    CHECK(bidi_parsed);
    const Run shown = f.ctl({"show", scope, bidi.value(), "--json"});
    REQUIRE(shown.exit_code == 0);
    CHECK(shown.out.find("\u202e") == std::string::npos);
    CHECK(shown.doc()["key"] == bidi.value());

    const Run report = f.ctl({"reconcile-report", "--scope", scope});
    REQUIRE(report.exit_code == 0);
    CHECK(report.out.find("long-" + std::string(34, 'x') + "…  1 ") != std::string::npos);
    CHECK(report.has_line(cut_note));
    CHECK(f.ctl({"reconcile-report", "--scope", scope, "--wide"}).out.find(long_key + "  1 ") != std::string::npos);
}

TEST_CASE("idemctl stats and reconcile-report", "[idemctl]") {
    Fixture f;
    const Run stats = f.ctl({"stats", "--json"});
    REQUIRE(stats.exit_code == 0);
    const json s = stats.doc();
    CHECK(s["in_progress"] == 2);
    CHECK(s["stale"] == 1);
    CHECK(s["completed"] == 3);
    CHECK(s["expired"] == 2);
    CHECK(s["total"] == 5);
    CHECK(s["oldest_in_progress"]["key"] == "claimed-1");
    CHECK(s["table_bytes"].get<long long>() > 0);
    CHECK(s["index_bytes"].get<long long>() > 0);
    CHECK(s["total_bytes"] == s["table_bytes"].get<long long>() + s["index_bytes"].get<long long>());
    const Run stats_text = f.ctl({"stats"});
    REQUIRE(stats_text.exit_code == 0);
    CHECK(stats_text.has_line("in_progress  2 (1 past their lease: stale, for the reconciler)"));
    CHECK(stats_text.has_line("completed    3 (2 past retention: expired, for purge)"));

    const Run report = f.ctl({"reconcile-report", "--json"});
    REQUIRE(report.exit_code == 0);
    const json r = report.doc();
    CHECK(r["count"] == 1);
    CHECK(r["undecodable"] == 0);
    const json k = r["stale"][0];
    CHECK(k["scope"] == f.scope);
    CHECK(k["key"] == "stale-1");
    CHECK(k["attempt"] == 1);
    CHECK(k["fence"] == f.stale_fence);
    CHECK(k["phase"] == "charged");
    CHECK(k["phase_data"] == "ch_777");
    // The lease was set to 5 minutes before the fixture's UPDATE; the report ran after it.
    CHECK(k["lease_passed_ms"].get<long long>() >= 300000);
    CHECK(f.ctl({"reconcile-report", "--json", "--scope", "acct_2:POST /refunds"}).doc()["count"] == 0);
    CHECK(f.ctl({"reconcile-report", "--scope", "acct_2:POST /refunds"}).out ==
          "no stale keys: every in-progress key is within its lease\n");
}

TEST_CASE("idemctl release: fenced, confirmed, or refused with the record unchanged", "[idemctl]") {
    Fixture f;
    const auto unchanged = [&](const idem::Key& key, idem::Fence fence) {
        const auto r = f.store.read(key);
        REQUIRE(r);
        CHECK(r->state == idem::RecordState::in_progress);
        CHECK(r->fence == fence);
    };
    const std::string fence = std::to_string(f.stale_fence);

    // No terminal and no --yes: refused before anything is read or changed.
    const Run refused = f.ctl({"release", f.stale.scope(), f.stale.value(), "--fence", fence});
    CHECK(refused.exit_code == 2);
    CHECK(refused.err ==
          "idemctl: release not confirmed: stdin is not a terminal; pass --yes to "
          "release without a prompt "
          "(nothing was changed)\n");
    unchanged(f.stale, f.stale_fence);

    // A wrong fence: exit 4, nothing changed.
    const Run wrong =
        f.ctl({"release", f.stale.scope(), f.stale.value(), "--fence", std::to_string(f.stale_fence + 1), "--yes"});
    CHECK(wrong.exit_code == 4);
    CHECK(wrong.err == "idemctl: fence " + std::to_string(f.stale_fence + 1) + " does not own " + f.label(f.stale) +
                           ": it is in_progress with fence " + fence + " (nothing was changed)\n");
    unchanged(f.stale, f.stale_fence);

    // A completed key cannot be released, whatever the fence.
    const Run done = f.ctl({"release", f.completed.scope(), f.completed.value(), "--fence",
                            std::to_string(f.completed_fence), "--yes", "--json"});
    CHECK(done.exit_code == 4);
    CHECK(done.doc()["error"]["code"] == "fence_mismatch");
    CHECK(f.store.read(f.completed)->state == idem::RecordState::completed);

    const Run unknown = f.ctl({"release", f.scope, "nope", "--fence", "1", "--yes"});
    CHECK(unknown.exit_code == 1);
    CHECK(f.ctl({"release", f.scope, "k", "--fence", "x1", "--yes"}).exit_code == 2);

    // --yes does not release a key still within its lease: its effect may be running right now.
    const Run live =
        f.ctl({"release", f.claimed.scope(), f.claimed.value(), "--fence", std::to_string(f.claimed_fence), "--yes"});
    CHECK(live.exit_code == 2);
    CHECK(live.err.find("is still within its lease") != std::string::npos);
    unchanged(f.claimed, f.claimed_fence);
    // Limits far past what the SQL can hold are usage errors, not wrapped numbers.
    CHECK(f.ctl({"list", "--limit", "18446744073709551615"}).exit_code == 2);

    // The right fence with --yes: released; the other in-progress key is untouched.
    const Run released = f.ctl({"release", f.stale.scope(), f.stale.value(), "--fence", fence, "--yes", "--json"});
    REQUIRE(released.exit_code == 0);
    CHECK(released.doc() == json{{"released", true}, {"scope", f.scope}, {"key", "stale-1"}, {"fence", f.stale_fence}});
    CHECK_FALSE(f.store.read(f.stale));
    unchanged(f.claimed, f.claimed_fence);
}

TEST_CASE("idemctl release on a terminal asks, and only \"yes\" releases", "[idemctl]") {
    Fixture f;
    const std::vector<std::string> args{
        "release", f.stale.scope(), f.stale.value(), "--fence", std::to_string(f.stale_fence),
        "--db",    f.url,           "--table",       f.table};
    const Run declined = idemctl_on_tty(args, "no\n");
    CHECK(declined.exit_code == 2);
    CHECK(declined.out.find("Release " + f.label(f.stale) + " (state in_progress, attempt 1, phase charged, fence " +
                            std::to_string(f.stale_fence) + ")?") != std::string::npos);
    CHECK(declined.out.find("Type yes to release: ") != std::string::npos);
    CHECK(declined.out.find("idemctl: release not confirmed (nothing was changed)") != std::string::npos);
    REQUIRE(f.store.read(f.stale));
    CHECK(f.store.read(f.stale)->fence == f.stale_fence);

    // A key whose lease has not passed: refused before any prompt (its effect may be running)...
    std::vector<std::string> live_args{"release",
                                       f.claimed.scope(),
                                       f.claimed.value(),
                                       "--fence",
                                       std::to_string(f.claimed_fence),
                                       "--db",
                                       f.url,
                                       "--table",
                                       f.table};
    const Run live = idemctl_on_tty(live_args, "yes\n");
    CHECK(live.exit_code == 2);
    CHECK(live.out.find("is still within its lease") != std::string::npos);
    CHECK(live.out.find("Type yes to release: ") == std::string::npos);
    CHECK(f.store.read(f.claimed)->fence == f.claimed_fence);
    // ... and with --force the prompt says an attempt may be running.
    live_args.push_back("--force");
    const Run forced = idemctl_on_tty(live_args, "no\n");
    CHECK(forced.exit_code == 2);
    CHECK(forced.out.find("Its lease has not passed: an attempt may be running right now.") != std::string::npos);
    CHECK(declined.out.find("Its lease has not passed") == std::string::npos);
    CHECK(f.store.read(f.claimed)->fence == f.claimed_fence);

    const Run accepted = idemctl_on_tty(args, "yes\n");
    CHECK(accepted.exit_code == 0);
    CHECK(accepted.out.find("released " + f.label(f.stale) + " (fence " + std::to_string(f.stale_fence) + ")") !=
          std::string::npos);
    CHECK_FALSE(f.store.read(f.stale));
}

TEST_CASE("idemctl purge deletes exactly the expired records", "[idemctl]") {
    Fixture f;
    const Run purge = f.ctl({"purge", "--json", "--batch", "1"});
    REQUIRE(purge.exit_code == 0);
    CHECK(purge.err.empty());  // stderr is not a terminal: no progress
    CHECK(purge.doc()["purged"] == 2);
    CHECK(purge.doc()["batches"] == 3);  // 1 + 1 + the empty one that found nothing left
    const auto rows = f.sql.exec("SELECT key FROM \"" + f.table + "\" ORDER BY key");
    REQUIRE(rows.rows() == 3);
    CHECK(rows.text(0, 0) == "claimed-1");
    CHECK(rows.text(1, 0) == "completed-1");
    CHECK(rows.text(2, 0) == "stale-1");
    CHECK(f.ctl({"purge"}).out == "purged 0 expired records from " + f.table + " in 1 batches of up to 1000\n");
}

TEST_CASE("idemctl purge shows its progress when stderr is a terminal", "[idemctl]") {
    Fixture f;
    const Run run = idemctl_on_tty({"purge", "--batch", "1", "--db", f.url, "--table", f.table}, "");
    CHECK(run.exit_code == 0);
    CHECK(run.out.find("\rpurged 1 expired records (1 batches)\rpurged 2 expired records (2 batches)"
                       "\rpurged 2 expired records (3 batches)\r\n") != std::string::npos);
    CHECK(run.out.find("purged 2 expired records from " + f.table + " in 3 batches of up to 1\r\n") !=
          std::string::npos);
}

TEST_CASE("idemctl: conninfo from the environment; unreachable databases; no password printed", "[idemctl]") {
    Fixture f;
    // No --db: libpq's environment (PGHOST, PGPORT, ...), taken from the test database's conninfo.
    std::map<std::string, std::string> env;
    PQconninfoOption* options = PQconninfoParse(f.url.c_str(), nullptr);
    REQUIRE(options != nullptr);
    for (PQconninfoOption* o = options; o->keyword != nullptr; ++o) {
        if (o->val != nullptr && o->envvar != nullptr) env[o->envvar] = o->val;
    }
    PQconninfoFree(options);
    const Run from_env = idemctl({"show", f.claimed.scope(), f.claimed.value(), "--table", f.table, "--json"}, env);
    REQUIRE(from_env.exit_code == 0);
    CHECK(from_env.doc()["fence"] == f.claimed_fence);

    const std::string password = "s3cretPW-idemctl";
    const std::vector<std::string> unreachable{
        "host=/nonexistent-idemctl-dir port=1 dbname=app user=ops password=" + password,
        "postgresql://ops:" + password + "@127.0.0.1:1/app",
        // sslpassword is a secret too (the key file's passphrase).
        "host=/nonexistent-idemctl-dir port=1 dbname=app user=ops sslpassword=" + password,
    };
    for (const auto& conninfo : unreachable) {
        for (const std::string command : {"show", "list"}) {
            std::vector<std::string> args{command};
            if (command == "show") args.insert(args.end(), {"s", "k"});
            args.insert(args.end(), {"--db", conninfo});
            const Run text = idemctl(args);
            CHECK(text.exit_code == 3);
            CHECK(text.err.starts_with("idemctl: database unavailable ("));
            CHECK(text.err.find("user=ops") != std::string::npos);  // the redacted conninfo is shown
            CHECK(text.err.find(password) == std::string::npos);
            CHECK(text.out.find(password) == std::string::npos);
            args.push_back("--json");
            const Run as_json = idemctl(args);
            CHECK(as_json.exit_code == 3);
            CHECK(as_json.doc()["error"]["code"] == "unavailable");
            CHECK(as_json.out.find(password) == std::string::npos);
            CHECK(as_json.err.find(password) == std::string::npos);
        }
    }
    // A reachable database and a configuration error: the message names the database without the
    // password (the test server does not ask for one).
    const Run config =
        idemctl({"show", "s", "k", "--db", f.url + " password=" + password, "--table", "idemctl_no_such_table"});
    CHECK(config.exit_code == 5);
    CHECK(config.err.starts_with("idemctl: configuration error ("));
    CHECK(config.err.find(password) == std::string::npos);
    // PGPASSWORD is scrubbed from messages too, and a conninfo libpq cannot parse is never echoed.
    const Run env_password =
        idemctl({"show", "s", "k", "--db", "host=/nonexistent-idemctl-dir port=1"}, {{"PGPASSWORD", password}});
    CHECK(env_password.exit_code == 3);
    CHECK(env_password.err.find(password) == std::string::npos);
    const Run garbled = idemctl({"show", "s", "k", "--db", "host=x password='" + password});
    CHECK(garbled.exit_code == 2);
    CHECK(garbled.err == "idemctl: --db: libpq cannot parse the conninfo (not shown: it may hold a password)\n");
    // An unencoded '@' in a URI's password: libpq would take the rest of it for the host.
    const Run two_at = idemctl({"show", "s", "k", "--db", "postgresql://ops:pa@" + password + "@127.0.0.1:1/app"});
    CHECK(two_at.exit_code == 2);
    CHECK(two_at.err.find(password) == std::string::npos);
    CHECK(two_at.err.find("%40") != std::string::npos);
    // A bad connection option is a configuration error, not an outage to retry.
    CHECK(idemctl({"show", "s", "k", "--db", f.url + " sslmode=bogus"}).exit_code == 5);
}

TEST_CASE("idemctl --json: every error is one JSON document on stdout, nothing on stderr", "[idemctl]") {
    Fixture f;
    const auto error_of = [](const Run& run) {
        CHECK(run.err.empty());
        const json doc = run.doc();
        REQUIRE(doc.size() == 1);
        return doc["error"];
    };
    const Run missing = f.ctl({"show", f.scope, "nope", "--json"});
    CHECK(missing.exit_code == 1);
    CHECK(error_of(missing) ==
          json{{"code", "not_found"},
               {"exit", 1},
               {"message", "no record for scope 'acct_1:POST /payments' key 'nope' in table " + f.table},
               {"sqlstate", nullptr}});

    // A bad command line, before any connection.
    const Run usage = idemctl({"--json", "list", "--fence", "1"});
    CHECK(usage.exit_code == 2);
    CHECK(error_of(usage) == json{{"code", "usage"},
                                  {"exit", 2},
                                  {"message", "list does not take --fence (idemctl --help lists commands and options)"},
                                  {"sqlstate", nullptr}});

    // No such table: PostgreSQL's SQLSTATE, from idemctl's own SQL (stats) and through the library
    // (show).
    for (const auto& command : {std::vector<std::string>{"stats"}, {"show", "s", "k"}}) {
        std::vector<std::string> args = command;
        args.insert(args.end(), {"--json", "--db", f.url, "--table", "idemctl_no_such_table"});
        const Run config = idemctl(args);
        CHECK(config.exit_code == 5);
        const json e = error_of(config);
        CHECK(e["code"] == "config_error");
        CHECK(e["exit"] == 5);
        CHECK(e.at("sqlstate") == "42P01");
    }

    const Run unavailable = idemctl({"list", "--json", "--db", "host=/nonexistent-idemctl-dir port=1"});
    CHECK(unavailable.exit_code == 3);
    const json e = error_of(unavailable);
    CHECK(e["code"] == "unavailable");
    CHECK(e.at("sqlstate").is_null());
    CHECK(e["message"].get<std::string>().starts_with("database unavailable (host=/nonexistent-idemctl-dir port=1): "));

    // Without --json the same failure is one line on stderr, nothing on stdout.
    const Run text = f.ctl({"show", f.scope, "nope"});
    CHECK(text.out.empty());
    CHECK(text.err == "idemctl: no record for scope 'acct_1:POST /payments' key 'nope' in table " + f.table + "\n");
}

TEST_CASE("idemctl --json stays valid JSON whatever bytes it is given", "[idemctl]") {
    Fixture f;
    const Run bad = f.ctl({"--json", "list", "--state", "\xff\xc3"});
    CHECK(bad.exit_code == 2);
    const auto doc = json::parse(bad.out);  // throws on invalid UTF-8
    CHECK(doc["error"]["exit"] == 2);
    CHECK(doc["error"]["message"].get<std::string>().find("\xef\xbf\xbd") != std::string::npos);
}
