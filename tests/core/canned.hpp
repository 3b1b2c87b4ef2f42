// Statement answers made by hand, for the tests of the I/O-free core (no database): a result with
// rows of binary cells, built with libpq's result constructors (no connection), or a failure with
// a SQLSTATE. What the drivers would have read from the wire.
#pragma once

#include <libpq-fe.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "idem/store.hpp"
#include "postgres/sansio/result.hpp"

namespace canned {

/// One binary cell; nullopt is NULL.
using Cell = std::optional<std::string>;

inline std::string be(std::uint64_t v, int width) {
    std::string out;
    for (int i = width - 1; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    return out;
}
inline std::string int8(std::int64_t v) { return be(static_cast<std::uint64_t>(v), 8); }
inline std::string int4(std::int32_t v) { return be(static_cast<std::uint32_t>(v), 4); }
inline std::string int2(std::int16_t v) { return be(static_cast<std::uint16_t>(v), 2); }
inline std::string boolean(bool v) { return std::string(1, v ? '\1' : '\0'); }
/// A binary timestamptz: microseconds since 2000-01-01 UTC.
inline std::string timestamptz(std::chrono::system_clock::time_point t) {
    using namespace std::chrono;
    const auto us = duration_cast<microseconds>(t.time_since_epoch()).count() - 946684800LL * 1000000LL;
    return int8(us);
}

/// A TUPLES_OK result with `columns` columns and these rows.
inline idem::pg::ResultPtr rows(int columns, const std::vector<std::vector<Cell>>& rows) {
    idem::pg::ResultPtr r(PQmakeEmptyPGresult(nullptr, PGRES_TUPLES_OK));
    if (!r) throw std::bad_alloc();
    std::vector<PGresAttDesc> attrs(static_cast<std::size_t>(columns));
    std::vector<std::string> names;
    for (int c = 0; c < columns; ++c) names.push_back("c" + std::to_string(c));
    for (int c = 0; c < columns; ++c) {
        attrs[static_cast<std::size_t>(c)] =
            PGresAttDesc{names[static_cast<std::size_t>(c)].data(), 0, 0, 1, 17, -1, -1};
    }
    if (PQsetResultAttrs(r.get(), columns, attrs.data()) == 0) throw std::runtime_error("PQsetResultAttrs");
    for (std::size_t row = 0; row < rows.size(); ++row) {
        for (int c = 0; c < columns; ++c) {
            const Cell& cell = rows[row].at(static_cast<std::size_t>(c));
            const int ok = cell ? PQsetvalue(r.get(), static_cast<int>(row), c, const_cast<char*>(cell->data()),
                                             static_cast<int>(cell->size()))
                                : PQsetvalue(r.get(), static_cast<int>(row), c, nullptr, -1);
            if (ok == 0) throw std::runtime_error("PQsetvalue");
        }
    }
    return r;
}

/// A statement that ran: its rows (an INSERT … RETURNING of one row, a SELECT).
inline idem::pg::StepResult ran(int columns, const std::vector<std::vector<Cell>>& r) {
    idem::pg::StepResult s;
    s.result = rows(columns, r);
    return s;
}
/// A statement that ran and returned nothing (an INSERT that met a conflict, an UPDATE of no row).
inline idem::pg::StepResult none(int columns = 1) { return ran(columns, {}); }
/// A statement that failed with `sqlstate`.
inline idem::pg::StepResult failed(std::string_view sqlstate) {
    idem::pg::StepResult s;
    s.fail(sqlstate);
    return s;
}
/// Skipped: an earlier statement of its segment failed.
inline idem::pg::StepResult aborted() {
    idem::pg::StepResult s;
    s.aborted = true;
    return s;
}

/// The answers of one round trip, in order.
template <class... R>
idem::pg::StepResults answers(R&&... r) {
    idem::pg::StepResults out(sizeof...(R));
    std::size_t i = 0;
    ((out[i++] = std::forward<R>(r)), ...);
    return out;
}

/// A stored row as idem's SELECT returns it (the kRecordColumns columns of sql.hpp).
struct Row {
    std::string state = "in_progress";
    idem::Fingerprint fingerprint = idem::fingerprint(std::string_view("request"));
    idem::Fence fence = 7;
    std::int32_t attempt = 1;
    std::optional<std::string> result{};
    std::chrono::system_clock::time_point created_at = std::chrono::system_clock::now();
    std::chrono::system_clock::time_point lease_until = std::chrono::system_clock::now() + std::chrono::seconds(30);
    std::chrono::system_clock::time_point expires_at = std::chrono::system_clock::now() + std::chrono::hours(24);
    std::optional<std::string> phase{}, phase_data{};
    bool lease_expired = false;
    bool expired = false;

    [[nodiscard]] std::vector<Cell> cells() const {
        return {state,
                std::string(fingerprint.bytes()),
                int2(static_cast<std::int16_t>(fingerprint.algorithm())),
                int8(fence),
                int4(attempt),
                result,
                timestamptz(created_at),
                timestamptz(lease_until),
                timestamptz(expires_at),
                phase,
                phase_data,
                boolean(lease_expired),
                boolean(expired),
                timestamptz(std::chrono::system_clock::now())};
    }
};

inline constexpr int kRecordColumns = 14;

/// The SELECT's answer: this row.
inline idem::pg::StepResult found(const Row& row) { return ran(kRecordColumns, {row.cells()}); }

}  // namespace canned
