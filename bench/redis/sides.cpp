// The floor and the library's calls (see sides.hpp).
#include "sides.hpp"

#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "../common/util.hpp"
#include "redis/scripts.hpp"  // internal: the floor sends the library's own scripts

namespace bench::redis {

Floor::Floor(const Options& o, Names names, std::string_view fp_alg, std::string_view fp)
    : raw_(o), names_(std::move(names)), fp_alg_(fp_alg), fp_(fp) {
    claim_sha_ = text(*raw_.command({"SCRIPT", "LOAD", idem::redis::kScripts[idem::redis::kClaim]}));
    save_sha_ = text(*raw_.command({"SCRIPT", "LOAD", idem::redis::kScripts[idem::redis::kSave]}));
}

Floor::Answer Floor::claim(const std::string& key, std::int64_t fence) {
    const std::string member = member_of(key);
    const std::string record = names_.record(member);
    const std::string index = names_.index();
    const std::string f = std::to_string(fence), lease = std::to_string(kLeaseMs),
                      retention = std::to_string(kRetentionMs);
    raw_.append({"EVALSHA", claim_sha_, "2", record, index, f, fp_alg_, fp_, lease, retention, "0", member});
    ++round_trips_;
    Answer a;
    a.reply = raw_.get();
    const redisReply& r = *a.reply;
    if (r.type != REDIS_REPLY_ARRAY || r.elements < 2) throw std::runtime_error("floor: bad claim answer");
    a.tag = text(*r.element[0]);
    if (r.elements == 13) {
        a.state = text(*r.element[2]);
        a.result = text(*r.element[7]);
    }
    return a;
}

bool Floor::save(const std::string& key, std::int64_t fence) {
    const std::string member = member_of(key);
    const std::string record = names_.record(member);
    const std::string index = names_.index();
    const std::string f = std::to_string(fence);
    raw_.append({"EVALSHA", save_sha_, "2", record, index, f, kResult, member});
    ++round_trips_;
    const Reply r = raw_.get();
    return r->type == REDIS_REPLY_INTEGER && r->integer == 1;
}

void prewarm(idem::IdempotencyStore& store, int connections) {
    const idem::Key key(kScope, "warm-up");
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    const auto want = static_cast<std::uint64_t>(connections);
    std::vector<std::thread> workers;
    for (int t = 0; t < connections; ++t) {
        workers.emplace_back([&] {
            while (store.stats().connections_opened < want && Clock::now() < deadline) (void)store.read(key);
        });
    }
    for (auto& w : workers) w.join();
}

bool execute(idem::IdempotencyStore& store, const idem::Key& key, const idem::Fingerprint& fp, idem::Outcome want) {
    const auto r = idem::execute_once(store, key, fp, [] { return kResult; });
    return r.outcome() == want && (want != idem::Outcome::replayed || r.response() == kResult);
}

}  // namespace bench::redis
