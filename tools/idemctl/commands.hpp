// tools/idemctl/commands.hpp — idemctl's commands. Each writes its answer to `out` (text, or one
// JSON document with --json) and returns the exit code; failures are thrown (ToolError, or the
// library's idem::error, which main.cpp maps to exit codes).
//
// show, purge, release and reconcile-report go through the library's API (PostgresStore::read,
// purge_expired, release, list_stale), so they see and change records exactly as idem does; list
// and stats, which the API lacks, are plain parameterised SELECTs on idemctl's own connection.
#pragma once

#include "cli.hpp"

#include <iosfwd>

namespace idemctl {

/// Runs o.command. Progress (purge) and confirmation prompts (release) use stderr / stdin, and only
/// when they are terminals.
Exit run(const Options& o, std::ostream& out);

}  // namespace idemctl
