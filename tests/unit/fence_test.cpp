// Fence tokens: positive, distinct, and never shared between a process and its fork() children
// (a per-process key from OpenSSL and a counter: a forked child must draw its own key).
#include "idem/idem.hpp"

#include <sys/wait.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace std::string_literals;

namespace {

idem::Fence claim_fence(idem::MemoryStore& store, const std::string& key) {
    const auto claim = store.claim(idem::Key("fences", key), idem::fingerprint("x"s));
    REQUIRE(claim.status == idem::ClaimStatus::claimed);
    return claim.fence;
}

}  // namespace

TEST_CASE("fences are positive and distinct, across threads", "[fence]") {
    idem::MemoryStore store;
    std::vector<std::vector<idem::Fence>> drawn(8);
    std::vector<std::thread> threads;
    for (std::size_t t = 0; t < drawn.size(); ++t) {
        threads.emplace_back([&, t] {
            for (int i = 0; i < 2000; ++i) {
                drawn[t].push_back(store
                                       .claim(idem::Key("fences", std::to_string(t) + "-" + std::to_string(i)),
                                              idem::fingerprint("x"s))
                                       .fence);
            }
        });
    }
    for (auto& th : threads) th.join();
    std::set<idem::Fence> all;
    for (const auto& v : drawn) {
        for (auto f : v) {
            CHECK(f > 0);
            all.insert(f);
        }
    }
    CHECK(all.size() == 16000);
}

TEST_CASE("a forked child never draws the fences its parent draws next", "[fence]") {
    idem::MemoryStore parent_store;
    (void)claim_fence(parent_store, "before-fork");  // the parent's batch is now part used

    int pipe_fds[2];
    REQUIRE(::pipe(pipe_fds) == 0);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
        // Child: its next fences, written to the parent. No Catch2 here; exit codes only.
        ::close(pipe_fds[0]);
        idem::MemoryStore child_store;
        idem::Fence fences[8];
        for (int i = 0; i < 8; ++i) {
            fences[i] =
                child_store.claim(idem::Key("fences", "child-" + std::to_string(i)), idem::fingerprint("x"s)).fence;
        }
        const bool ok = ::write(pipe_fds[1], fences, sizeof fences) == static_cast<ssize_t>(sizeof fences);
        ::_exit(ok ? 0 : 1);
    }
    ::close(pipe_fds[1]);
    std::set<idem::Fence> parent_next;
    for (int i = 0; i < 8; ++i) parent_next.insert(claim_fence(parent_store, "parent-" + std::to_string(i)));

    idem::Fence child_fences[8] = {};
    std::size_t got = 0;
    while (got < sizeof child_fences) {
        const ssize_t n = ::read(pipe_fds[0], reinterpret_cast<char*>(child_fences) + got, sizeof child_fences - got);
        if (n <= 0) break;
        got += static_cast<std::size_t>(n);
    }
    ::close(pipe_fds[0]);
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);
    REQUIRE(got == sizeof child_fences);
    for (auto f : child_fences) CHECK(parent_next.count(f) == 0);
}
