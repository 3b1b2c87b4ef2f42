#include "pipeline.hpp"

namespace idem::pg {

// ---- PipelineAnswers ---------------------------------------------------------------------------------

void PipelineAnswers::take_error(StepResult& step, ResultPtr r) {
    const char* sqlstate = PQresultErrorField(r.get(), PG_DIAG_SQLSTATE);
    step.result = std::move(r);
    step.fail(sqlstate != nullptr ? sqlstate : "");
    if (is_connection_sqlstate(step.sqlstate())) {
        throw connection_broken("idem: PostgreSQL closed the connection: " + step.message(),
                                std::string(step.sqlstate()));
    }
}

void PipelineAnswers::close_segment() {
    // A failure anywhere in the segment rolled back the statements before it.
    for (std::size_t f = segment_; f <= i_; ++f) {
        if (!out_[f].failed) continue;
        for (std::size_t j = segment_; j < f; ++j) {
            if (out_[j].ok()) {
                out_[j].result.reset();
                out_[j].rolled_back = true;
            }
        }
        break;
    }
    segment_ = i_ + 1;
}

bool PipelineAnswers::feed(ResultPtr r, bool sync_after) {
    const auto surprise = [](const char* what) { throw pipeline_surprise(what); };
    if (i_ >= out_.size()) surprise("unexpected extra result");
    switch (expect_) {
        case Expect::result:
            if (!r) surprise("missing result");
            switch (PQresultStatus(r.get())) {
                case PGRES_TUPLES_OK:
                case PGRES_COMMAND_OK: out_[i_].result = std::move(r); break;
                case PGRES_PIPELINE_ABORTED: out_[i_].aborted = true; break;
                case PGRES_FATAL_ERROR: take_error(out_[i_], std::move(r)); break;
                default:
                    throw pipeline_surprise(std::string("unexpected result status ") +
                                            PQresStatus(PQresultStatus(r.get())));
            }
            expect_ = Expect::null;
            return false;
        case Expect::null:
        case Expect::null_after_commit_error:
            if (r)
                surprise(expect_ == Expect::null ? "unexpected extra result"
                                                 : "unexpected extra result after a failed commit");
            if (expect_ == Expect::null && !sync_after) {
                ++i_;
                expect_ = Expect::result;
                return i_ == out_.size();
            }
            expect_ = Expect::sync;
            return false;
        case Expect::sync:
            if (r && PQresultStatus(r.get()) == PGRES_FATAL_ERROR) {
                // The COMMIT at the Sync failed (a deferred constraint, a serialization failure): every
                // statement of the segment is undone. Reported as the last statement's failure.
                take_error(out_[i_], std::move(r));
                expect_ = Expect::null_after_commit_error;
                return false;
            }
            if (!r || PQresultStatus(r.get()) != PGRES_PIPELINE_SYNC) surprise("pipeline out of sync");
            close_segment();
            ++i_;
            expect_ = Expect::result;
            return i_ == out_.size();
    }
    return false;
}

std::optional<std::string> queue_step(PGconn* conn, const Step& step, bool prepared) {
    const StatementDef& def = *step.def;
    const Params& p = *step.params;
    const int ok = prepared && !def.name.empty()
                       ? PQsendQueryPrepared(conn, def.name.c_str(), p.size(), p.values(), p.lengths(), p.formats(),
                                             step.result_format)
                       : PQsendQueryParams(conn, def.sql.c_str(), p.size(),
                                           def.param_types.empty() ? nullptr : def.param_types.data(), p.values(),
                                           p.lengths(), p.formats(), step.result_format);
    if (ok != 1) return "send " + def.name;
    if (step.sync_after && PQpipelineSync(conn) != 1) return "PQpipelineSync";
    return std::nullopt;
}

}  // namespace idem::pg
