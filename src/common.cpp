#include "common.hpp"

#include <openssl/rand.h>
#include <pthread.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "idem/errors.hpp"

namespace idem::detail {

namespace {

// Fork generation: bumped in the child of every fork(). A thread's buffer drawn in the parent is
// then discarded in the child, so parent and child never hand out the same fences.
std::atomic<std::uint64_t> fork_generation{0};

void on_fork_child() noexcept { fork_generation.fetch_add(1, std::memory_order_relaxed); }

const bool fork_handler_installed = [] {
    return pthread_atfork(nullptr, nullptr, &on_fork_child) == 0;
}();

// Fences are drawn from OpenSSL's CSPRNG 256 at a time (2 KiB per thread): one RAND_bytes call per
// claim took OpenSSL 3's global locks on every claim (measured: 6 % of a replay's client CPU at one
// thread, lock contention beyond). Past that, a draw costs a fixed overhead plus ~5 instructions
// per byte (callgrind); the first draw of each thread also sets up OpenSSL's per-thread DRBG
// (~3 M instructions, once). The buffer is per thread, so no lock at all between draws.
struct FenceBuffer {
    static constexpr std::size_t kSize = 256;
    std::array<std::uint64_t, kSize> values{};
    std::size_t next = kSize;  // empty
    std::uint64_t generation = 0;

    void refill() {
        if (RAND_bytes(reinterpret_cast<unsigned char*>(values.data()), static_cast<int>(sizeof values)) != 1) {
            throw error("idem: RAND_bytes failed; cannot make a fence token");
        }
        next = 0;
    }
};

}  // namespace

Fence new_fence() {
    thread_local FenceBuffer buffer;
    const std::uint64_t generation = fork_generation.load(std::memory_order_relaxed);
    if (generation != buffer.generation) {
        buffer.generation = generation;
        buffer.next = FenceBuffer::kSize;  // drawn before a fork: draw anew
    }
    for (;;) {
        // Without a fork handler a buffer could outlive a fork unnoticed: draw one value at a time.
        if (buffer.next == FenceBuffer::kSize || !fork_handler_installed) buffer.refill();
        std::uint64_t v = buffer.values[buffer.next];
        buffer.values[buffer.next++] = 0;  // never kept around once handed out
        v &= 0x7FFFFFFFFFFFFFFFull;        // fits PostgreSQL bigint, stays positive
        if (v != 0) return static_cast<Fence>(v);
    }
}

}  // namespace idem::detail
