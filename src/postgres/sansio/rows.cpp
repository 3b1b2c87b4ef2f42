#include "rows.hpp"

#include "record.hpp"
#include "sql.hpp"

namespace idem::pg {

int segment_failure(const StepResults& res, std::size_t begin, std::size_t end) noexcept {
    int first = -1;
    for (std::size_t i = begin; i < end; ++i) {
        if (res[i].failed) return static_cast<int>(i);
        if (!res[i].ok() && first < 0) first = static_cast<int>(i);
    }
    return first;
}

// ---- claims -------------------------------------------------------------------------------------------

ClaimRowsPlan::ClaimRowsPlan(const std::vector<StatementDef>& defs, Layout layout, std::span<const ClaimRow> rows)
    : rows_(rows.size()) {
    const std::size_t n = rows.size();
    // Scopes in order with the rows of each (rows are sorted by (scope, key)).
    std::vector<std::pair<std::size_t, std::size_t>> scope_ranges;
    for (std::size_t i = 0; i < n; ++i) {
        if (i == 0 || rows[i].scope != rows[i - 1].scope) scope_ranges.emplace_back(i, i);
        scope_ranges.back().second = i + 1;
    }
    if (layout == Layout::plain) {
        bool uniform = true;
        std::vector<std::string_view> scopes(n), keys(n), digests(n);
        std::vector<std::int16_t> algs(n);
        std::vector<std::int64_t> fences(n), leases(n), retentions(n);
        for (std::size_t i = 0; i < n; ++i) {
            const ClaimRow& r = rows[i];
            scopes[i] = r.scope, keys[i] = r.key, digests[i] = r.digest, algs[i] = r.alg, fences[i] = r.fence;
            leases[i] = r.lease_ms, retentions[i] = r.retention_s;
            uniform = uniform && r.lease_ms == rows[0].lease_ms && r.retention_s == rows[0].retention_s;
        }
        Params& ins = params_.emplace_back();
        ins.text_array(scopes).text_array(keys).bytea_array(digests).int2_array(algs).int8_array(fences);
        if (uniform) {
            ins.int8(rows[0].lease_ms).int8(rows[0].retention_s);
        } else {
            ins.int8_array(leases).int8_array(retentions);
        }
        steps_.push_back({&defs[uniform ? kClaimBatchInsert : kClaimGroupInsert], &ins});
        first_step_of_.assign(n, 0);
        Params& sel = params_.emplace_back();
        sel.text_array(scopes).text_array(keys);
        steps_.push_back({&defs[kSelectBatch], &sel});
        return;
    }
    const auto insert = [&](const ClaimRow& r) {
        Params& ins = params_.emplace_back();
        ins.text(r.scope).text(r.key).bytes(r.digest).int2(r.alg).int8(r.fence).int8(r.lease_ms).int8(r.retention_s);
        steps_.push_back({&defs[kClaimInsert], &ins, false});
    };
    // After a block, each segment begins with a ROLLBACK: a failed block leaves the session in it
    // (Sync does not end an explicit block), and every later segment would fail with 25P02. After
    // a committed block the ROLLBACK is a no-op (a warning, no error).
    const auto end_failed_block = [&] {
        if (blocks_) steps_.push_back({&defs[kRollback], &none_, false});
    };
    first_step_of_.resize(n);
    for (auto [begin, end] : scope_ranges) {
        // by key: each row alone; by scope: the scope's rows in one block (one shard)
        for (std::size_t from = begin; from < end;) {
            const std::size_t to = layout == Layout::by_scope ? end : from + 1;
            const bool block = to - from > 1;
            for (std::size_t i = from; i < to; ++i) first_step_of_[i] = steps_.size();
            end_failed_block();
            blocks_ = blocks_ || block;
            if (block) steps_.push_back({&defs[kBegin], &none_, false});
            for (std::size_t i = from; i < to; ++i) insert(rows[i]);
            if (block) steps_.push_back({&defs[kCommit], &none_, false});
            steps_.back().sync_after = true;
            from = to;
        }
    }
    write_steps_ = steps_.size();
    end_failed_block();
    for (auto [begin, end] : scope_ranges) {
        std::vector<std::string_view> keys;
        for (std::size_t i = begin; i < end; ++i) keys.push_back(rows[i].key);
        Params& sel = params_.emplace_back();
        sel.text(rows[begin].scope).text_array(keys);
        steps_.push_back({&defs[kSelectScopeKeys], &sel, false});
    }
    steps_.back().sync_after = true;
    segments_ = layout == Layout::by_scope ? scope_ranges.size() : n;
}

ClaimAnswers ClaimRowsPlan::read(StepResults res) const {
    ClaimAnswers a;
    a.res = std::move(res);
    a.write_failure = segment_failure(a.res, 0, write_steps_);
    a.read_failure = segment_failure(a.res, write_steps_, a.res.size());
    a.row_failed.assign(rows_, false);
    // A segment committed iff its first statement is ok() (ok() means "and the rest of the segment
    // committed"). After a failed block, later segments fail as well (25P02 until the ROLLBACK):
    // none of them committed either.
    for (std::size_t i = 0; i < rows_; ++i) a.row_failed[i] = !a.res[first_step_of_[i]].ok();
    for (std::size_t i = 0; i < write_steps_; ++i) {
        if (!a.res[i].ok()) continue;  // its segment rolled back
        const PGresult* r = a.res[i].result.get();
        if (r == nullptr || result_columns(r) != 1) continue;  // BEGIN / COMMIT
        for (int row = 0; row < result_rows(r); ++row) a.won.insert(get_int8(r, row, 0));
    }
    if (a.read_failure >= 0) return a;
    for (std::size_t i = write_steps_; i < a.res.size(); ++i) {
        const PGresult* r = a.res[i].result.get();
        for (int row = 0; row < result_rows(r); ++row) {
            a.found.emplace(KeyRef(get_bytes(r, row, kRecordColumns), get_bytes(r, row, kRecordColumns + 1)),
                            RowRef(r, row));
        }
    }
    return a;
}

MemberAnswer claim_member_answer(const ClaimAnswers& a, std::size_t j, Fence fence, const Key& key,
                                 std::optional<Record>& existing, std::exception_ptr& error) {
    // A member whose claim segment failed (a conflict, a cancel, one member's bad bytes...) — on
    // one node, every member — goes again alone, with its fence, and meets its own outcome:
    // nothing of that segment committed.
    if (a.row_failed[j]) return MemberAnswer::alone;
    if (a.won.contains(fence)) return MemberAnswer::won;
    if (a.read_failure >= 0) return MemberAnswer::alone;  // no read to answer from
    const auto it = a.found.find(KeyRef(key.scope(), key.value()));
    if (it == a.found.end()) return MemberAnswer::absent;  // released or rolled back in between
    try {
        parse_record(it->second.first, it->second.second, existing.emplace());
        return MemberAnswer::found;
    } catch (...) {
        existing.reset();
        error = std::current_exception();  // corrupt_record
        return MemberAnswer::error;
    }
}

// ---- saves --------------------------------------------------------------------------------------------

SaveRowsPlan::SaveRowsPlan(const std::vector<StatementDef>& defs, Layout layout, std::span<const SaveRow> rows)
    : rows_(rows.size()), step_of_(rows.size()) {
    const std::size_t n = rows.size();
    const auto statement = [&](Stmt stmt, std::size_t from, std::size_t to) {
        std::vector<std::string_view> scopes, keys, results;
        std::vector<std::int64_t> fences;
        for (std::size_t i = from; i < to; ++i) {
            scopes.push_back(rows[i].scope), keys.push_back(rows[i].key), results.push_back(rows[i].result);
            fences.push_back(rows[i].fence);
            step_of_[i] = steps_.size();
        }
        Params& p = params_.emplace_back();
        if (stmt == kSaveBatch) p.text_array(scopes);
        if (stmt == kSaveScoped) p.text(rows[from].scope);
        if (stmt == kSaveReturningFence) {
            p.text(rows[from].scope).text(rows[from].key).int8(rows[from].fence).bytes(rows[from].result);
        } else {
            p.text_array(keys).int8_array(fences).bytea_array(results);
        }
        steps_.push_back({&defs[stmt], &p});
    };
    if (layout == Layout::plain) {
        statement(kSaveBatch, 0, n);
        return;
    }
    for (std::size_t begin = 0; begin < n;) {
        std::size_t end = begin + 1;
        if (layout == Layout::by_scope) {
            while (end < n && rows[end].scope == rows[begin].scope) ++end;
        }
        statement(layout == Layout::by_scope ? kSaveScoped : kSaveReturningFence, begin, end);
        begin = end;
    }
}

SaveAnswers SaveRowsPlan::read(StepResults res) const {
    SaveAnswers a;
    a.res = std::move(res);
    a.failure = segment_failure(a.res, 0, a.res.size());
    a.row_failed.resize(rows_);
    for (std::size_t i = 0; i < rows_; ++i) a.row_failed[i] = !a.res[step_of_[i]].ok();
    for (const StepResult& step : a.res) {
        if (!step.ok()) continue;
        const PGresult* r = step.result.get();
        for (int row = 0; row < result_rows(r); ++row) a.saved.emplace(get_int8(r, row, 0), get_bool(r, row, 1));
    }
    return a;
}

}  // namespace idem::pg
