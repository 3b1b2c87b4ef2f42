// A coroutine that runs to completion when it is called (internal): the blocking store's coroutine
// type for the runner templates shared with idem::asio (sansio/runner.hpp).
//
// The runners are written once, as coroutines: idem::asio runs them as net::awaitable, suspending
// at each round trip; the blocking store runs them as Immediate, whose every co_await is ready at
// once — the blocking driver's calls return their values, which await_transform hands straight
// back. So an Immediate never suspends before its end: when the call returns, get() has the value
// or rethrows what the body threw. Not thread-safe; one owner, move-only.
#pragma once

#include <array>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <new>
#include <optional>
#include <type_traits>
#include <utility>

namespace idem::pg {

template <class T>
class Immediate;

/// What a blocking driver call that has no value returns, for its caller to co_await.
struct Done {};

namespace immediate_detail {

/// co_await of a value already there: never suspends.
template <class T>
struct Ready {
    T value;
    static constexpr bool await_ready() noexcept { return true; }
    static void await_suspend(std::coroutine_handle<>) noexcept {}
    T await_resume() { return std::forward<T>(value); }
};

template <class T>
struct IsImmediate : std::false_type {};
template <class T>
struct IsImmediate<Immediate<T>> : std::true_type {};

/// The frames of a thread's Immediates, kept for reuse: a blocking call runs one or two of them
/// (a claim, an operation's attempt), one at a time per size, so a few blocks per thread spare
/// the heap every time. Blocks are matched by exact size; what the cache cannot hold is freed.
class FrameCache {
public:
    static void* allocate(std::size_t size) {
        if (FrameCache* cache = local()) {
            for (Slot& s : cache->slots_) {
                if (s.block != nullptr && s.size == size) return std::exchange(s.block, nullptr);
            }
        }
        return ::operator new(size);
    }
    static void deallocate(void* block, std::size_t size) noexcept {
        if (FrameCache* cache = local()) {
            for (Slot& s : cache->slots_) {
                if (s.block == nullptr) {
                    s.block = block, s.size = size;
                    return;
                }
            }
        }
        ::operator delete(block);  // unsized: clang (before 19) declares the sized form only on request
    }
    FrameCache() = default;
    FrameCache(const FrameCache&) = delete;
    FrameCache& operator=(const FrameCache&) = delete;
    ~FrameCache() {
        gone() = true;
        for (Slot& s : slots_) {
            if (s.block != nullptr) ::operator delete(s.block);
            s.block = nullptr;
        }
    }

private:
    struct Slot {
        void* block = nullptr;
        std::size_t size = 0;
    };
    // Set when the thread's cache is destroyed: a store called from a later destructor of the
    // thread (a static's, on the main thread) then uses the heap. Trivially destructible, so it
    // is still readable then.
    static bool& gone() noexcept {
        thread_local bool destroyed = false;
        return destroyed;
    }
    static FrameCache* local() noexcept {
        if (gone()) return nullptr;
        thread_local FrameCache cache;
        return &cache;
    }
    std::array<Slot, 4> slots_{};
};

struct PromiseBase {
    static void* operator new(std::size_t size) { return FrameCache::allocate(size); }
    static void operator delete(void* frame, std::size_t size) noexcept { FrameCache::deallocate(frame, size); }

    std::exception_ptr failure;
    static std::suspend_never initial_suspend() noexcept { return {}; }
    static std::suspend_always final_suspend() noexcept { return {}; }
    void unhandled_exception() noexcept { failure = std::current_exception(); }
    /// A blocking call's value (an lvalue is awaited by reference), or another Immediate's.
    template <class U>
    auto await_transform(U&& value) {
        if constexpr (IsImmediate<std::remove_cvref_t<U>>::value) {
            using V = decltype(std::move(value).get());
            if constexpr (std::is_void_v<V>) {
                std::move(value).get();
                return std::suspend_never{};
            } else {
                return Ready<V>{std::move(value).get()};
            }
        } else {
            // An lvalue by reference; a temporary moved in (the awaiter outlives it).
            using V = std::conditional_t<std::is_lvalue_reference_v<U>, U, std::remove_cvref_t<U>>;
            return Ready<V>{std::forward<U>(value)};
        }
    }
};

template <class T>
struct Promise : PromiseBase {
    std::optional<T> value;
    Immediate<T> get_return_object() noexcept;
    template <class U>
    void return_value(U&& v) {
        value.emplace(std::forward<U>(v));
    }
};

template <>
struct Promise<void> : PromiseBase {
    Immediate<void> get_return_object() noexcept;
    static void return_void() noexcept {}
};

}  // namespace immediate_detail

template <class T>
class [[nodiscard]] Immediate {
public:
    using promise_type = immediate_detail::Promise<T>;

    Immediate(Immediate&& other) noexcept : h_(std::exchange(other.h_, {})) {}
    Immediate& operator=(Immediate&&) = delete;
    ~Immediate() {
        if (h_) h_.destroy();
    }

    /// The body's value, or what it threw.
    T get() && {
        auto& p = h_.promise();
        if (p.failure) std::rethrow_exception(p.failure);
        if constexpr (!std::is_void_v<T>) return std::move(*p.value);
    }

private:
    friend promise_type;
    explicit Immediate(std::coroutine_handle<promise_type> h) noexcept : h_(h) {}
    std::coroutine_handle<promise_type> h_;
};

namespace immediate_detail {
template <class T>
Immediate<T> Promise<T>::get_return_object() noexcept {
    return Immediate<T>(std::coroutine_handle<Promise<T>>::from_promise(*this));
}
inline Immediate<void> Promise<void>::get_return_object() noexcept {
    return Immediate<void>(std::coroutine_handle<Promise<void>>::from_promise(*this));
}
}  // namespace immediate_detail

}  // namespace idem::pg
