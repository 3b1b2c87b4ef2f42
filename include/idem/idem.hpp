// idem/idem.hpp — the whole public API of idem in one include.
#pragma once

#include "idem/attempt.hpp"               // IWYU pragma: export
#include "idem/batch.hpp"                 // IWYU pragma: export
#include "idem/cached_store.hpp"          // IWYU pragma: export
#include "idem/errors.hpp"                // IWYU pragma: export
#include "idem/execute_once.hpp"          // IWYU pragma: export
#include "idem/fingerprint.hpp"           // IWYU pragma: export
#include "idem/fingerprint_secret.hpp"    // IWYU pragma: export
#include "idem/http.hpp"                  // IWYU pragma: export
#include "idem/key.hpp"                   // IWYU pragma: export
#include "idem/memory_store.hpp"          // IWYU pragma: export
#include "idem/observer.hpp"              // IWYU pragma: export
#include "idem/outcome.hpp"               // IWYU pragma: export
#include "idem/pool_stats.hpp"            // IWYU pragma: export
#include "idem/postgres_store.hpp"        // IWYU pragma: export
#include "idem/postgres_transaction.hpp"  // IWYU pragma: export
#include "idem/prometheus.hpp"            // IWYU pragma: export
#include "idem/reconciler.hpp"            // IWYU pragma: export
#include "idem/replay_cache.hpp"          // IWYU pragma: export
#include "idem/response.hpp"              // IWYU pragma: export
#include "idem/sealing.hpp"               // IWYU pragma: export
#include "idem/store.hpp"                 // IWYU pragma: export
#include "idem/version.hpp"               // IWYU pragma: export

/// \namespace idem
/// Run a side effect once per idempotency key, over PostgreSQL. idem.hpp includes every public
/// header; docs/api.md lists each type and function with when to use it.
