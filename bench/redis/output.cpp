// The table and the JSON of --store redis | tiered (see output.hpp).
#include "output.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace bench::redis {
namespace {

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.6g}", v) : "null"; }

}  // namespace

void print_header(const char* base) {
    std::printf("%-7s %-8s %-13s %11s %8s %8s %8s %8s %8s %7s %s\n", "threads", "case", "side", "ops/s", base, "median",
                "p50 us", "p99 us", "RT/call", "cpu us", "(RT: store's round trips; tiered: the primary's)");
}

void print_run(const Run& r) {
    const double base = r.sides[0].ops();
    for (std::size_t i = 0; i < r.sides.size(); ++i) {
        const Side& s = r.sides[i];
        std::printf("%-7d %-8s %-13s %11.0f %8.3f %8.3f %8.0f %8.0f %8.3f %7.1f", r.threads, r.kind.c_str(),
                    s.name.c_str(), s.ops(), base > 0 ? s.ops() / base : NAN, r.median_round_ratio(i),
                    s.hist.percentile_us(0.5), s.hist.percentile_us(0.99), s.per_call(s.counts[0]), s.cpu_us());
        if (s.counts[1] || s.counts[2] || s.counts[3]) {
            std::printf("  redis hits %.3f, memory hits %.3f, tier errors %llu", s.per_call(s.counts[1]),
                        s.per_call(s.counts[2]), static_cast<unsigned long long>(s.counts[3]));
        }
        if (s.unexpected) std::printf("  UNEXPECTED OUTCOMES %llu", static_cast<unsigned long long>(s.unexpected));
        std::printf("\n");
    }
    std::fflush(stdout);
}

void write_json(const std::string& path, const Options& o, const std::vector<Run>& runs) {
    std::string s = fmt::format("{{\n  \"store\": \"{}\", \"seconds_per_case\": {}, \"rounds\": {},\n  \"runs\": [",
                                o.store, json_number(o.seconds), o.rounds);
    for (std::size_t i = 0; i < runs.size(); ++i) {
        const Run& r = runs[i];
        const double base = r.sides[0].ops();
        // The flat fields as the postgres runs have them: sides[1] (idem; the Redis tier) vs sides[0].
        const Side& lib = r.sides[1];
        s += fmt::format(
            "{}{{\"threads\": {}, \"case\": \"{}\", \"ops_per_s\": {}, \"floor_ops_per_s\": {}, "
            "\"ratio\": {}, \"round_trips_per_call\": {}, \"floor_round_trips_per_call\": {}, \"sides\": {{",
            i ? ",\n    " : "\n    ", r.threads, r.kind, json_number(lib.ops()), json_number(base),
            json_number(base > 0 ? lib.ops() / base : NAN), json_number(lib.per_call(lib.counts[0])),
            json_number(r.sides[0].per_call(r.sides[0].counts[0])));
        for (std::size_t j = 0; j < r.sides.size(); ++j) {
            const Side& d = r.sides[j];
            s += fmt::format(
                "{}\"{}\": {{\"ops_per_s\": {}, \"ratio\": {}, \"median_round_ratio\": {}, \"p50_us\": {}, \"p99_us\": "
                "{}, \"calls\": {}, "
                "\"unexpected_outcomes\": {}, \"round_trips_per_call\": {}, \"client_cpu_us_per_call\": {}, "
                "\"redis_tier_hits_per_call\": {}, \"memory_tier_hits_per_call\": {}, \"tier_errors\": {}}}",
                j ? ", " : "", d.name, json_number(d.ops()), json_number(base > 0 ? d.ops() / base : NAN),
                json_number(r.median_round_ratio(j)), json_number(d.hist.percentile_us(0.5)),
                json_number(d.hist.percentile_us(0.99)), d.calls, d.unexpected, json_number(d.per_call(d.counts[0])),
                json_number(d.cpu_us()), json_number(d.per_call(d.counts[1])), json_number(d.per_call(d.counts[2])),
                d.counts[3]);
        }
        s += "}}";
    }
    s += "\n  ]\n}\n";
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr || std::fwrite(s.data(), 1, s.size(), f) != s.size() || std::fclose(f) != 0) {
        throw std::runtime_error("cannot write " + path);
    }
}

}  // namespace bench::redis
