// The benchmark's own housekeeping connection: table creation (through PostgresStore::ensure_schema,
// so every table is exactly the library's), bulk preloads, CHECKPOINT, clean-up (Tables).
#pragma once

#include <libpq-fe.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace bench {

class Admin {
public:
    explicit Admin(std::string conninfo);
    ~Admin();
    Admin(const Admin&) = delete;
    Admin& operator=(const Admin&) = delete;

    /// Runs one statement (text params); throws std::runtime_error on failure. Returns the first
    /// column of the first row, if any.
    std::string exec(const std::string& sql, const std::vector<std::string>& params = {});

    /// A fresh table `name` made by PostgresStore::ensure_schema() (drops an older one first);
    /// generational (PostgresOptions::generations of `generation_length`, 2 ahead) unless it is 0.
    void create_table(const std::string& name, std::chrono::milliseconds generation_length = {});
    void drop_table(const std::string& name);

    enum class Preload { completed, in_progress };
    /// Bulk-loads `count` rows in `state`, in chunks of 1M rows (progress on stderr when large).
    /// Keys: decimal (base + i) when `md5_keys` is false, md5(i::text) (random-looking, 32 hex
    /// digits, like the new keys) when true, for i from `first`. Fingerprint `fp` (raw bytes),
    /// result "ok". With `generation` (a generational table's column, epoch ms of a generation's
    /// start): that generation, created_at at its start and expires_at a day later; without it
    /// created_at now() and expires_at a day later.
    void preload(const std::string& table, Preload state, std::int64_t base, std::int64_t count, std::string_view fp,
                 bool md5_keys, std::int64_t first = 0, std::optional<std::int64_t> generation = std::nullopt);

    /// CHECKPOINT, so every phase starts with no dirty buffers inherited from the previous one.
    /// Needs superuser or pg_checkpoint; warns once and becomes a no-op when refused.
    void checkpoint();

    /// The WAL write position (pg_current_wal_lsn), as a byte offset.
    std::uint64_t wal_lsn();
    /// Makes commit_records() work: CREATE EXTENSION pg_walinspect (contrib; needs superuser).
    /// Returns false, with a note on stderr, when the server refuses.
    bool enable_walinspect();
    /// Transaction commit records written between two WAL positions (pg_walinspect's
    /// pg_get_wal_stats): the commits that had to reach the disk — read-only transactions write
    /// none. Exact at once, unlike pg_stat_database (see docs/benchmarks.md).
    std::uint64_t commit_records(std::uint64_t from, std::uint64_t to);

    /// "name=value, ..." of the server settings that matter for these figures.
    std::string server_summary();
    std::string setting(const std::string& name);

private:
    std::string conninfo_;
    PGconn* conn_;
    bool checkpoint_ok_ = true;
};

/// The tables one run of idem-bench makes (through `admin`): dropped when it ends, unless `keep`
/// (--keep-tables).
struct Tables {
    Admin& admin;
    std::vector<std::string> names;
    bool keep;
    ~Tables();
    /// Creates table `name` (Admin::create_table) and returns its name.
    std::string add(const std::string& name, std::chrono::milliseconds generation_length = {});
};

}  // namespace bench
