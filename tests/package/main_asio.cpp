// Downstream consumer of an installed idem with the asio component: find_package(idem COMPONENTS
// asio) and idem::asio. No database here: an unreachable server must come back as
// store_unavailable, through a completion token, without running the effect.
#include <idem/asio.hpp>

#include <boost/asio/io_context.hpp>
#include <boost/asio/use_future.hpp>

#include <cstdio>

int main() {
    boost::asio::io_context io;
    idem::PostgresOptions options;
    options.connect_timeout = std::chrono::seconds(2);
    idem::asio::AsyncPostgresStore store(io.get_executor(), "host=127.0.0.1 port=1 dbname=none", options);
    bool ran = false;
    auto answer = idem::asio::async_execute_once(
        store, idem::Key{"scope", "value"}, idem::fingerprint("a"),
        [&] {
            ran = true;
            return idem::Response{201, "ok"};
        },
        boost::asio::use_future);
    io.run();
    try {
        (void)answer.get();
    } catch (const idem::store_unavailable&) {
        if (ran) return 1;
        std::puts("idem asio consumer: ok");
        return 0;
    }
    std::fprintf(stderr, "idem asio consumer: expected store_unavailable\n");
    return 1;
}
