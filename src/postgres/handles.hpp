// RAII owners of libpq's handles, and the clock of every deadline (internal).
#pragma once

#include <libpq-fe.h>

#include <chrono>
#include <memory>

namespace idem::pg {

struct ConnDeleter {
    void operator()(PGconn* conn) const noexcept { PQfinish(conn); }
};
struct ResultDeleter {
    void operator()(PGresult* result) const noexcept { PQclear(result); }
};
using ConnPtr = std::unique_ptr<PGconn, ConnDeleter>;
using ResultPtr = std::unique_ptr<PGresult, ResultDeleter>;

using Clock = std::chrono::steady_clock;

}  // namespace idem::pg
