// PostgresStore and AsyncPostgresStore over TLS, against a real server: the cluster of
// scripts/with-postgres.sh restarted with `ssl = on`, listening on 127.0.0.1 as well, with a server
// certificate (CN localhost, SAN localhost and 127.0.0.1) from a test CA that this test makes with
// the openssl CLI, and a pg_hba.conf that takes TCP only over TLS (hostssl; hostnossl rejected).
// What it shows: sslmode=verify-full against the CA connects, every session of the store is TLS,
// execute_once runs the effect once and replays its bytes; a certificate that does not verify
// (another CA, another host name, a missing root certificate file), a server without TLS under
// sslmode=require and a connection without TLS that pg_hba.conf rejects are each config_error, the
// effect not run — a permanent misconfiguration, never an outage; and a Unix-socket conninfo is never
// TLS, whatever sslmode says. It needs the cluster of scripts/with-postgres.sh (IDEM_PG_DATA ...)
// and the openssl program, and fails without them.
#include "idem/idem.hpp"
#include "pg.hpp"
#include "shell.hpp"
#include "test_env.hpp"

#ifdef IDEM_TLS_ASIO
#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>
#include "idem/asio.hpp"
#endif

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>

using namespace std::chrono_literals;
using namespace std::string_literals;
using idem::Outcome;
using idem_test::PgConn;

namespace {

std::string env(const char* name) {
    const char* v = std::getenv(name);
    return v ? std::string(v) : std::string();
}

using idem_test::shell_quote;

/// Runs `cmd` in a shell, its output to `log`; REQUIREs exit status 0.
void run(const std::string& cmd, const std::string& log) {
    const std::string line = "( " + cmd + " ) >>" + shell_quote(log) + " 2>&1";
    INFO("command: " << cmd << " (output in " << log << ")");
    REQUIRE(std::system(line.c_str()) == 0);
}

/// pg_ctl as the cluster's owner (runuser when we are root); its exit status.
int pg_ctl(const std::string& args) {
    const std::string user = env("IDEM_PG_CTL_USER");
    const std::string bin = env("IDEM_PG_BIN").empty() ? "/usr/lib/postgresql/15/bin" : env("IDEM_PG_BIN");
    std::string cmd = shell_quote(bin + "/pg_ctl") + " -D " + shell_quote(env("IDEM_PG_DATA")) + " " + args;
    if (::geteuid() == 0 && !user.empty() && user != "root")
        cmd = "cd / && runuser -u " + shell_quote(user) + " -- " + cmd;
    cmd += " >/dev/null 2>&1";
    return std::system(cmd.c_str());
}

void write_file(const std::string& path, const std::string& text) {
    std::ofstream out(path, std::ios::trunc);
    out << text;
    REQUIRE(out.good());
}

std::string read_file(const std::string& path) {
    std::ifstream in(path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

/// The cluster of scripts/with-postgres.sh, reconfigured once per process for TLS (see the top of
/// this file); the certificates live in its temporary directory, removed with it.
struct TlsServer {
    std::string dir;       // certificates and keys
    std::string ca;        // the CA that signed the server's certificate
    std::string other_ca;  // a CA that signed nothing of this server's
    std::string socket;    // the Unix socket directory
    std::string port;

    TlsServer() {
        if (env("IDEM_PG_DATA").empty() || env("IDEM_PG_HOST").empty()) {
            FAIL(
                "IDEM_PG_DATA / IDEM_PG_HOST are not set: run this test under scripts/with-postgres.sh, whose "
                "cluster it restarts with TLS");
        }
        REQUIRE(std::system("command -v openssl >/dev/null 2>&1") == 0);  // scripts/install-deps.sh installs it
        socket = env("IDEM_PG_HOST");
        dir = socket + "/tls";
        REQUIRE(::mkdir(dir.c_str(), 0755) == 0);
        const std::string log = dir + "/openssl.log";
        ca = dir + "/ca.crt";
        other_ca = dir + "/other-ca.crt";
        const std::string key = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
        for (const std::string name : {"ca", "other-ca"}) {
            run("openssl req -x509" + key + " -keyout " + shell_quote(dir + "/" + name + ".key") + " -out " +
                    shell_quote(dir + "/" + name + ".crt") + " -days 2 -subj '/CN=idem test " + name +
                    "' -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign",
                log);
        }
        write_file(dir + "/server.ext", "subjectAltName = DNS:localhost, IP:127.0.0.1\n");
        run("openssl req" + key + " -keyout " + shell_quote(dir + "/server.key") + " -out " +
                shell_quote(dir + "/server.csr") + " -subj /CN=localhost",
            log);
        run("openssl x509 -req -in " + shell_quote(dir + "/server.csr") + " -CA " + shell_quote(ca) + " -CAkey " +
                shell_quote(dir + "/ca.key") + " -CAcreateserial -days 2 -extfile " + shell_quote(dir + "/server.ext") +
                " -out " + shell_quote(dir + "/server.crt"),
            log);
        // The server refuses a key that others may read, or that it does not own (0600).
        const std::string owner = env("IDEM_PG_CTL_USER");
        if (::geteuid() == 0 && !owner.empty()) {
            const passwd* pw = ::getpwnam(owner.c_str());
            REQUIRE(pw != nullptr);
            for (const char* f : {"/server.key", "/server.crt"})
                REQUIRE(::chown((dir + f).c_str(), pw->pw_uid, pw->pw_gid) == 0);
        }
        REQUIRE(::chmod((dir + "/server.key").c_str(), 0600) == 0);
        // A client key that group and others may read (libpq refuses it).
        write_file(dir + "/readable.key", read_file(dir + "/other-ca.key"));
        REQUIRE(::chmod((dir + "/readable.key").c_str(), 0644) == 0);

        // TCP only over TLS; the Unix socket as before.
        const std::string data = env("IDEM_PG_DATA");
        const std::string hba = read_file(data + "/pg_hba.conf");
        write_file(data + "/pg_hba.conf",
                   "hostssl all all 127.0.0.1/32 trust\nhostnossl all all 127.0.0.1/32 reject\n" + hba);
        write_file(data + "/postgresql.conf", read_file(data + "/postgresql.conf") + "include 'tls.conf'\n");
        // A port of the cluster's that another process holds on 127.0.0.1: another, at random.
        std::mt19937 rng(static_cast<unsigned>(::getpid()));
        port = env("IDEM_PG_PORT");
        REQUIRE(pg_ctl("-m fast -w -t 60 stop") == 0);
        bool started = false;
        for (int attempt = 0; attempt < 5 && !started; ++attempt) {
            if (attempt > 0) port = std::to_string(20000 + rng() % 40000);
            write_file(data + "/tls.conf", "listen_addresses = '127.0.0.1'\nport = " + port +
                                               "\nssl = on\nssl_cert_file = '" + dir +
                                               "/server.crt'\nssl_key_file = '" + dir + "/server.key'\n");
            started = pg_ctl("-l " + shell_quote(env("IDEM_PG_LOG")) + " -w -t 60 start") == 0;
        }
        INFO("server log: " << env("IDEM_PG_LOG"));
        REQUIRE(started);
    }

    /// A conninfo over TCP to 127.0.0.1, checked as host `host` (the name the certificate must
    /// carry under verify-full), then `extra` ("sslmode=... sslrootcert=...").
    [[nodiscard]] std::string tcp(const std::string& extra, const std::string& host = "localhost") const {
        return "host=" + host + " hostaddr=127.0.0.1 port=" + port + " dbname=postgres user=postgres " + extra;
    }
    /// verify-full against `root` (a CA's certificate file).
    [[nodiscard]] std::string verified(const std::string& root) const {
        return tcp("sslmode=verify-full sslrootcert=" + root);
    }
    /// Over the Unix socket (TLS never applies there).
    [[nodiscard]] std::string local(const std::string& extra = "") const {
        return "host=" + socket + " port=" + port + " dbname=postgres user=postgres " + extra;
    }
};

TlsServer& server() {
    static TlsServer s;
    return s;
}

/// Whether the session of `conninfo` (a connection of the test's own) is TLS, by the server's word.
bool session_is_tls(const std::string& conninfo) {
    PgConn conn(conninfo);
    return conn.exec("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").text(0, 0) == "t";
}

idem::PostgresOptions options_for(const std::string& table, const std::string& application_name = "idem") {
    idem::PostgresOptions o;
    o.table = table;
    o.pool_size = 2;
    o.connect_timeout = 5s;
    o.application_name = application_name;
    return o;
}

/// execute_once with `conninfo` throws config_error whose message contains `says`; the effect does
/// not run. The error's message is returned.
std::string refused(const std::string& conninfo, const std::string& table, const std::string& says) {
    idem::PostgresStore store(conninfo, options_for(table));
    int runs = 0;
    try {
        (void)idem::execute_once(store, idem::Key("tls", "refused"), idem::fingerprint("a"s), [&] {
            ++runs;
            return "charged"s;
        });
        FAIL_CHECK("no error");
    } catch (const idem::config_error& e) {
        CHECK_THAT(e.what(), Catch::Contains(says));
        CHECK(runs == 0);
        return e.what();
    } catch (const idem::store_unavailable& e) {
        FAIL_CHECK("a permanent misconfiguration reported as an outage (store_unavailable): " << e.what());
    }
    return {};
}

/// The refusals: what the conninfo gets wrong, and what libpq's message says.
struct Refusal {
    std::string what;
    std::string conninfo;
    std::string says;
};

std::vector<Refusal> refusals() {
    const TlsServer& s = server();
    return {
        {"a certificate of another CA (verify-full)", s.verified(s.other_ca), "certificate verify failed"},
        {"a certificate of another CA (verify-ca)", s.tcp("sslmode=verify-ca sslrootcert=" + s.other_ca),
         "certificate verify failed"},
        {"a certificate for another host name", s.tcp("sslmode=verify-full sslrootcert=" + s.ca, "db.example.com"),
         "does not match host name"},
        {"a root certificate file that does not exist", s.verified(s.dir + "/missing.crt"), "does not exist"},
        {"a root certificate file that is no certificate", s.verified(s.dir + "/server.ext"),
         "could not read root certificate file"},
        {"a client certificate without its key",
         s.verified(s.ca) + " sslcert=" + s.ca + " sslkey=" + s.dir + "/missing.key",
         "certificate present, but not private key file"},
        {"a client key that others may read",
         s.verified(s.ca) + " sslcert=" + s.ca + " sslkey=" + s.dir + "/readable.key", "has group or world access"},
        {"no TLS where pg_hba.conf requires it", s.tcp("sslmode=disable"), "no encryption"},
    };
}

}  // namespace

TEST_CASE("TLS: verify-full against the CA connects; every session is TLS; effect once, bytes replayed", "[tls]") {
    const TlsServer& s = server();
    const std::string conninfo = s.verified(s.ca);
    CHECK(session_is_tls(conninfo));
    const std::string table = idem_test::unique_name("idem_tls");
    const std::string application = idem_test::unique_name("idem_tls_app");
    idem_test::DropTable drop(s.local(), table);
    idem::PostgresStore store(conninfo, options_for(table, application));
    store.ensure_schema();
    int runs = 0;
    auto effect = [&] {
        ++runs;
        return std::string("charged \0 100 EUR", 17);
    };
    const idem::Key key("tls", "k1");
    const auto first = idem::execute_once(store, key, idem::fingerprint("a"s), effect);
    CHECK(first.outcome() == Outcome::executed);
    const auto again = idem::execute_once(store, key, idem::fingerprint("a"s), effect);
    CHECK(again.outcome() == Outcome::replayed);
    CHECK(again.response() == std::string("charged \0 100 EUR", 17));
    CHECK(runs == 1);
    // The store's own sessions, by the server's word (looked at over the Unix socket).
    PgConn admin(s.local());
    const auto sessions = admin.exec(
        "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) "
        "WHERE a.application_name = $1",
        {application});
    CHECK(sessions.integer(0, 0) >= 1);
    CHECK(sessions.integer(0, 1) == sessions.integer(0, 0));
}

TEST_CASE("TLS: a certificate that does not verify, or no TLS where it is required, is config_error", "[tls]") {
    for (const Refusal& r : refusals()) {
        INFO(r.what << ": " << r.conninfo);
        const std::string message = refused(r.conninfo, idem_test::unique_name("idem_tls"), r.says);
        CHECK_THAT(message, Catch::Contains("configuration error"));
    }
}

TEST_CASE("TLS: a Unix-socket conninfo is never TLS, whatever sslmode says", "[tls]") {
    const TlsServer& s = server();
    CHECK_FALSE(session_is_tls(s.local("sslmode=require")));
    CHECK_FALSE(session_is_tls(s.local("sslmode=verify-full sslrootcert=" + s.ca)));
}

/// Turns the server's TLS off (`on` false) or on again, by reload, and waits until new sessions
/// see it.
void set_ssl(bool on) {
    const TlsServer& s = server();
    const std::string conf = env("IDEM_PG_DATA") + "/tls.conf";
    std::string text = read_file(conf);
    const std::string off = "ssl = off\n";
    if (const auto at = text.find(off); at != std::string::npos) text.erase(at, off.size());
    write_file(conf, on ? text : text + off);
    REQUIRE(pg_ctl("reload") == 0);
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    while (PgConn(s.local()).exec("SHOW ssl").text(0, 0) != (on ? "on" : "off")) {
        REQUIRE(std::chrono::steady_clock::now() < deadline);
        std::this_thread::sleep_for(20ms);
    }
}

TEST_CASE("TLS: a server without TLS under sslmode=require is config_error", "[tls]") {
    const TlsServer& s = server();
    set_ssl(false);
    try {
        (void)refused(s.tcp("sslmode=require"), idem_test::unique_name("idem_tls"), "server does not support SSL");
    } catch (...) {
        set_ssl(true);  // for the test cases after this one
        throw;
    }
    set_ssl(true);
}

#ifdef IDEM_TLS_ASIO
TEST_CASE("TLS: AsyncPostgresStore verifies the same way: verify-full connects, a bad certificate is config_error",
          "[tls][asio]") {
    const TlsServer& s = server();
    const std::string table = idem_test::unique_name("idem_tls_async");
    idem_test::DropTable drop(s.local(), table);
    // An io_context run by one thread, stopped and joined however the test case ends.
    struct Loop {
        boost::asio::io_context io;
        std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work{io.get_executor()};
        std::thread runner{[this] { io.run(); }};
        ~Loop() {
            work.reset();
            runner.join();
        }
    } loop;
    boost::asio::io_context& io = loop.io;
    std::atomic<int> runs{0};
    auto effect = [&] {
        ++runs;
        return "charged"s;
    };
    {
        const std::string application = idem_test::unique_name("idem_tls_async_app");
        idem::asio::AsyncPostgresStore store(io.get_executor(), s.verified(s.ca), options_for(table, application));
        store.blocking().ensure_schema();
        const idem::Key key("tls-async", "k1");
        auto first =
            idem::asio::async_execute_once(store, key, idem::fingerprint("a"s), effect, boost::asio::use_future).get();
        CHECK(first.outcome() == Outcome::executed);
        auto again =
            idem::asio::async_execute_once(store, key, idem::fingerprint("a"s), effect, boost::asio::use_future).get();
        CHECK(again.outcome() == Outcome::replayed);
        CHECK(again.response() == "charged");
        CHECK(runs == 1);
        const auto sessions = PgConn(s.local()).exec(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) "
            "WHERE a.application_name = $1",
            {application});
        CHECK(sessions.integer(0, 0) >= 1);
        CHECK(sessions.integer(0, 1) == sessions.integer(0, 0));
    }
    for (const Refusal& r : refusals()) {
        INFO(r.what << ": " << r.conninfo);
        idem::asio::AsyncPostgresStore store(io.get_executor(), r.conninfo, options_for(table));
        try {
            (void)idem::asio::async_execute_once(store, idem::Key("tls-async", "refused"), idem::fingerprint("a"s),
                                                 effect, boost::asio::use_future)
                .get();
            FAIL_CHECK("no error");
        } catch (const idem::config_error& e) {
            CHECK_THAT(e.what(), Catch::Contains(r.says));
        } catch (const idem::store_unavailable& e) {
            FAIL_CHECK("a permanent misconfiguration reported as an outage (store_unavailable): " << e.what());
        }
    }
    CHECK(runs == 1);
}
#endif
