// idem/group_commit_stats.hpp — what group commit did: the shared transactions sent for concurrent
// claims and saves, the calls that went in them, and the largest group.
//
//   const idem::GroupCommitStats g = store.group_commit_stats();   // PostgresStore, AsyncPostgresStore
//   double(g.grouped_claims) / double(g.claim_groups)              // claims per shared transaction
//
// Group commit is PostgreSQL's (PostgresOptions::group_commit, for PostgresStore and
// AsyncPostgresStore; all 0 with it off): docs/design.md, "Group commit". A caller that went alone
// counts as a group of 1.
// Thread-safety: a plain value; group_commit_stats() may be called from any thread.
#pragma once

#include <cstdint>

namespace idem {

/// Group commit's counters since the store was made.
struct GroupCommitStats {
    std::uint64_t claim_groups = 0;         ///< shared transactions sent for concurrent claims
    std::uint64_t grouped_claims = 0;       ///< claims sent in those shared transactions
    std::uint64_t largest_claim_group = 0;  ///< the most claims one shared transaction carried
    std::uint64_t save_groups = 0;          ///< shared transactions sent for concurrent saves
    std::uint64_t grouped_saves = 0;        ///< saves sent in those shared transactions
    std::uint64_t largest_save_group = 0;   ///< the most saves one shared transaction carried
};

}  // namespace idem
