// idem/transaction.hpp — the former path of idem/postgres_transaction.hpp, kept so that existing
// includes compile. New code includes idem/postgres_transaction.hpp (or idem/idem.hpp).
#pragma once

#include "idem/postgres_transaction.hpp"
