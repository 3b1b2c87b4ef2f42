// idem-asio-bench's JSON (see output.hpp).
#include "output.hpp"

#include <fmt/format.h>

#include <cmath>

namespace bench::inflight {
namespace {

std::string json_round(const ScenarioRun& r, const std::string& p) {
    std::string s = fmt::format(
        "{{\"ops_per_s\": {}, \"wall_s\": {}, \"p50_ms\": {}, \"p99_ms\": {}, \"max_ms\": {}, \"answered\": {}, "
        "\"correct\": {}, \"wrong_outcome\": {}, \"wrong_body\": {}, \"errors\": {}, \"in_flight_max\": {}, "
        "\"effects_at_once_max\": {}, \"vmhwm_mb_after\": {}",
        json_number(r.num(p + "_ops_per_s")), json_number(r.num(p + "_wall_s")), json_number(r.num(p + "_p50_ms")),
        json_number(r.num(p + "_p99_ms")), json_number(r.num(p + "_max_ms")), json_number(r.num(p + "_answered")),
        json_number(r.num(p + "_correct")), json_number(r.num(p + "_wrong_outcome")),
        json_number(r.num(p + "_wrong_body")), json_number(r.num(p + "_errors")),
        json_number(r.num(p + "_in_flight_max")), json_number(r.num(p + "_effects_max")),
        json_number(r.num(p + "_vmhwm_mb")));
    if (const auto e = r.str(p + "_first_error"); !e.empty()) s += ", \"first_error\": " + json_string(e);
    return s + "}";
}

}  // namespace

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.6g}", v) : "null"; }

std::string json_string(const std::string& s) {
    std::string out = "\"";
    for (const char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
            out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
        } else {
            out += c;
        }
    }
    return out + "\"";
}

std::string json_scenario(const ScenarioRun& r, const Options& o) {
    const bool async = r.scenario == "async";
    std::string s = fmt::format(
        "{{\"threads\": {}, \"connections\": {}, \"requests\": {}, \"correct\": {}, \"exit_code\": {}, \"new\": {}",
        async ? 1 : o.threads, async ? o.connections : o.blocking_pool, o.requests,
        r.correct(o.requests, o.replay) ? "true" : "false", r.exit_code, json_round(r, "new"));
    if (o.replay) s += ", \"replay\": " + json_round(r, "replay");
    s += fmt::format(
        ", \"effects_run\": {}, \"keys_not_run_once\": {}, \"round_trips\": {}, \"retries\": {}, "
        "\"connections_opened\": {}, \"cpu_s\": {}, \"rss_before_mb\": {}, \"peak_rss_mb\": {}, \"vmhwm_mb\": {}}}",
        json_number(r.num("effects_run")), json_number(r.num("keys_not_run_once")), json_number(r.num("round_trips")),
        json_number(r.num("retries")), json_number(r.num("connections_opened")), json_number(r.num("cpu_s")),
        json_number(r.num("rss_before_mb")), json_number(r.peak_rss_mb), json_number(r.num("vmhwm_mb")));
    return s;
}

}  // namespace bench::inflight
