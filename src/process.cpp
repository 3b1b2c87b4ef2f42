#include "process.hpp"

#include <openssl/rand.h>
#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <thread>

#include "idem/errors.hpp"

namespace idem::detail {

namespace {

// Fork generation: bumped in the child of every fork(), so that the child draws a key of its own.
std::atomic<std::uint64_t> fork_generation_counter{0};

// The process's fence key and block counter, behind a spin lock (a forked child resets it: the
// fork may have happened while another thread, gone in the child, held it).
struct ProcessFences {
    std::atomic<bool> locked{false};
    std::uint64_t generation = ~std::uint64_t{0};  // none drawn yet
    std::uint64_t key = 0;
    std::uint64_t next_block = 0;
};
ProcessFences process_fences;

void on_fork_child() noexcept {
    process_fences.locked.store(false, std::memory_order_relaxed);
    fork_generation_counter.fetch_add(1, std::memory_order_relaxed);
}

const bool fork_handler_installed = [] { return pthread_atfork(nullptr, nullptr, &on_fork_child) == 0; }();

constexpr std::uint64_t kMask63 = 0x7FFFFFFFFFFFFFFFull;
// A thread takes 2^16 consecutive counter values at a time (one spin-locked step per 65 536
// claims). Small blocks, because a thread that exits wastes the rest of its block: with 2^16 the
// 2^47 blocks of a key last millennia even at thousands of short-lived threads a second (2^32-value
// blocks would wrap after 2^31 threads, ~25 days at 1 000 threads/s, repeating the first fences).
constexpr unsigned kBlockBits = 16;
constexpr std::uint64_t kBlocksPerKey = std::uint64_t{1} << (63 - kBlockBits);

std::uint64_t random_u64() {
    std::uint64_t v = 0;
    if (RAND_bytes(reinterpret_cast<unsigned char*>(&v), static_cast<int>(sizeof v)) != 1) {
        throw error("idem: RAND_bytes failed; cannot make a fence token");
    }
    return v;
}

// A bijection of [0, 2^63): xor-shifts and odd multipliers (splitmix64's finaliser) taken mod 2^63.
constexpr std::uint64_t mix63(std::uint64_t x) noexcept {
    x &= kMask63;
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull) & kMask63;
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EBull) & kMask63;
    return x ^ (x >> 31);
}

// Per thread: the key it uses and its current block of counter values.
struct ThreadFences {
    std::uint64_t generation = ~std::uint64_t{0};
    std::uint64_t key = 0;
    std::uint64_t counter = 0;
    std::uint64_t left = 0;

    void take_block(std::uint64_t g) {
        while (process_fences.locked.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
        struct Unlock {
            ~Unlock() { process_fences.locked.store(false, std::memory_order_release); }
        } unlock;
        // First use in this process (or this forked child), or every block of the key handed out
        // (2^63 fences): a new key, so the counter never wraps onto values issued under the same key.
        if (process_fences.generation != g || process_fences.next_block == kBlocksPerKey) {
            process_fences.key = random_u64();
            process_fences.next_block = 0;
            process_fences.generation = g;
        }
        generation = g;
        key = process_fences.key;
        counter = process_fences.next_block++ << kBlockBits;  // < 2^63
        left = std::uint64_t{1} << kBlockBits;
    }
};

}  // namespace

std::uint64_t fork_generation() noexcept { return fork_generation_counter.load(std::memory_order_relaxed); }

// One key per process from OpenSSL's CSPRNG, and per claim a counter value through a bijection
// (no buffer of random bytes per thread, whose cold cache lines and refills a claim would pay):
// within a process no two claims get the same fence (2^63 values before a repeat), and
// across processes fences are as unlikely to meet as 63 random bits. Nothing secret rests on it:
// a fence is never shown to a client, it only tells an owner's writes from a stale owner's.
Fence new_fence() {
    // Without a fork handler a child could not know it must draw its own key: one draw per fence.
    if (!fork_handler_installed) {
        for (;;) {
            if (const std::uint64_t v = random_u64() & kMask63; v != 0) return static_cast<Fence>(v);
        }
    }
    thread_local ThreadFences t;
    const std::uint64_t g = fork_generation_counter.load(std::memory_order_relaxed);
    for (;;) {
        if (t.generation != g || t.left == 0) t.take_block(g);
        --t.left;
        // key + counter * odd is a bijection of the counter mod 2^63, and so is mix63.
        const std::uint64_t v = mix63(t.key + t.counter++ * 0x9E3779B97F4A7C15ull);
        if (v != 0) return static_cast<Fence>(v);
    }
}

}  // namespace idem::detail
