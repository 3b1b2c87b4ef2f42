// idem/errors.hpp — the one exception tree of idem.
//
// Expected outcomes of a call (replayed, in progress, mismatch) are values (see outcome.hpp); what is
// thrown is a real failure. Every exception derives from idem::error, so `catch (const idem::error&)`
// catches everything idem throws, and `sqlstate()` carries PostgreSQL's five-character code when the
// database produced the error (empty otherwise).
//
//   error
//   ├── invalid_key            the key or scope is not acceptable; thrown before any I/O
//   ├── config_error           a permanent misconfiguration, never healed by retrying: a bad option
//   │                          (table name, pool size...), or the database's word: no such database,
//   │                          role or table (call ensure_schema()), authentication failed,
//   │                          permission denied, a TLS certificate that does not verify; also a
//   │                          store used in a fork()ed child
//   ├── store_unavailable      cannot reach a healthy database (or it timed out); fn was not called.
//   │                          A claim may still have been recorded if every answer was lost: it
//   │                          stays in progress with a fence nobody holds, for the reconciler.
//   │   └── pool_timeout       every pooled connection stayed busy past the configured wait
//   ├── database_error         the database refused a statement (sqlstate() tells why)
//   ├── corrupt_record         a stored row cannot be decoded (truncated, wrong length, unknown state)
//   ├── lease_lost             save/release named a fence that no longer owns the key; nothing changed
//   ├── call_cancelled         an asynchronous call was cancelled, or passed its deadline, before its
//   │                          effect started: the effect did not run, a claim it held was released
//   └── outcome_unknown        the effect may have happened but its result is not stored;
//       └── response_not_saved the effect ran and returned, saving its result failed (key stays in progress)
//           └── response_too_large  the encoded result exceeds the store's limit (checked before I/O)
//
// Thread-safety: exception objects are immutable after construction.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

namespace idem {

/// Root of every exception idem throws.
class error : public std::runtime_error {
public:
    /// `what` is the message (it starts with "idem: "); `sqlstate` PostgreSQL's code when the
    /// database produced the error.
    explicit error(const std::string& what, std::string sqlstate = {})
        : std::runtime_error(what), sqlstate_(std::move(sqlstate)) {}

    /// PostgreSQL SQLSTATE ("40001", "57P01", ...) when the database produced the error, else empty.
    [[nodiscard]] const std::string& sqlstate() const noexcept { return sqlstate_; }

private:
    std::string sqlstate_;
};

/// The key (scope or value) is empty, too long, not UTF-8 or contains control characters.
class invalid_key : public error {
public:
    using error::error;
};

/// A permanent misconfiguration: an invalid option or argument (table name, pool size, ...), or the
/// database refusing idem for good — no such database, role, table or column, failed
/// authentication, missing privilege, a server certificate that does not verify or TLS the server
/// does not offer (sqlstate() says which) — or a store used from a process it
/// does not belong to (a fork()ed child). Retrying does not help: map it to a 500, not a 503.
class config_error : public error {
public:
    using error::error;
};

/// The store cannot be reached (connection refused, server shut down, network timeout).
/// When execute_once throws it, the effect was not run.
class store_unavailable : public error {
public:
    using error::error;
};

/// All pooled connections stayed busy longer than the pool's wait limit.
class pool_timeout : public store_unavailable {
public:
    using store_unavailable::store_unavailable;
};

/// The database rejected a statement for a reason other than unavailability (sqlstate() says which).
class database_error : public error {
public:
    using error::error;
};

/// A stored record could not be decoded (truncated result, unknown state, bad fingerprint length).
class corrupt_record : public error {
public:
    using error::error;
};

/// A save or release carried a fence token that no longer owns the key (another attempt took it over,
/// or it was released). The store changed nothing.
class lease_lost : public error {
public:
    using error::error;
};

/// An asynchronous call (idem::asio::async_execute_once) was cancelled — Asio's per-operation
/// cancellation, or its deadline — before its effect started. The effect did not run; a claim the
/// call had won was released, so the same key may run again (a resume-mode takeover excepted: that
/// key keeps the earlier attempt, whose outcome is unknown, and stays in progress). (Cancelled once the effect has
/// started, the call reports whatever the effect threw: the outcome is unknown, the key is kept.)
class call_cancelled : public error {
public:
    using error::error;
};

/// The effect may or may not have happened, and its result is not stored. The key stays
/// in progress — it is never released — until reconciliation learns what really happened.
class outcome_unknown : public error {
public:
    using error::error;
};

/// The effect ran and returned a result, but storing that result failed. The key stays in progress.
/// `encoded_result()` holds the bytes that were to be stored (decode them with the codec of the
/// result type) so the caller can still answer its client truthfully.
class response_not_saved : public outcome_unknown {
public:
    /// `encoded_result`: the bytes the save was to store; `sqlstate` as for error.
    response_not_saved(const std::string& what, std::string encoded_result, std::string sqlstate = {})
        : outcome_unknown(what, std::move(sqlstate)), encoded_(std::move(encoded_result)) {}

    /// The encoded result that was to be stored: decode it with codec<R>::decode to answer the
    /// client.
    [[nodiscard]] const std::string& encoded_result() const noexcept { return encoded_; }

private:
    std::string encoded_;
};

/// The encoded result is larger than the store accepts. Decided before any I/O for the save.
class response_too_large : public response_not_saved {
public:
    using response_not_saved::response_not_saved;
};

namespace detail {
/// `what` without its leading "idem: ": for a message that wraps another idem error's message, so
/// that every message carries the prefix once ("idem: save: cannot connect …").
[[nodiscard]] inline std::string_view without_prefix(std::string_view what) noexcept {
    constexpr std::string_view prefix = "idem: ";
    return what.substr(0, prefix.size()) == prefix ? what.substr(prefix.size()) : what;
}

/// The response_too_large of every store: carries the result, worded "idem: result of N bytes
/// exceeds max_result_bytes M", then `note` when given.
[[nodiscard]] response_too_large result_too_large(std::string result, std::size_t max_bytes,
                                                  std::string_view note = {});
/// Every store's check of a result against its max_result_bytes, made before any I/O.
inline void check_result_size(std::string_view result, std::size_t max_bytes, std::string_view note = {}) {
    if (result.size() > max_bytes) throw result_too_large(std::string(result), max_bytes, note);
}
}  // namespace detail

/// Thrown by the effect (`fn`) to say it certainly did NOT perform its side effect (validation failed,
/// rate limited, the provider refused the connection). execute_once then releases the claim, so the
/// same key may run again, and rethrows this exception unchanged. Derive from it to carry your own data.
class not_performed : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

}  // namespace idem
