// RAII owner of a libpq connection handle (internal). Results are owned by ResultPtr
// (sansio/result.hpp), which is also where the clock of every deadline is named.
#pragma once

#include <libpq-fe.h>

#include <memory>

#include "sansio/result.hpp"

namespace idem::pg {

struct ConnDeleter {
    void operator()(PGconn* conn) const noexcept { PQfinish(conn); }
};
using ConnPtr = std::unique_ptr<PGconn, ConnDeleter>;

}  // namespace idem::pg
