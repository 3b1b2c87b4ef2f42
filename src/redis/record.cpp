#include "record.hpp"

#include "connection.hpp"

namespace idem::redis {

std::string member_of(const Key& key) {
    std::string m = std::to_string(key.scope().size());
    m += ':';
    m += key.scope();
    m += key.value();
    return m;
}

std::chrono::system_clock::time_point from_ms(std::int64_t ms) { return time_from_unix_ms(ms, "a Redis record"); }

std::optional<Record> decode_record(const redisReply& reply, std::size_t first, std::int64_t now) {
    auto field = [&](std::size_t i) -> std::optional<std::string_view> {
        const redisReply& e = element(reply, first + i);
        if (type_of(e) == ReplyType::nil) return std::nullopt;
        if (type_of(e) != ReplyType::string) {
            throw corrupt_record("idem: a Redis record field is neither text nor missing");
        }
        return text_of(e);
    };
    const auto state = field(0);
    if (!state) return std::nullopt;
    auto required = [&](std::size_t i, const char* name) {
        auto v = field(i);
        if (!v) throw corrupt_record(fmt::format("idem: Redis record has no field '{}'", name));
        return *v;
    };
    Record record;
    if (*state == "p") {
        record.state = RecordState::in_progress;
    } else if (*state == "c") {
        record.state = RecordState::completed;
    } else {
        throw corrupt_record(fmt::format("idem: Redis record has unknown state '{}'", *state));
    }
    record.fingerprint = Fingerprint::from_bytes(parse_int<std::int16_t>(required(1, "fa"), "fa"), required(2, "fp"));
    record.fence = parse_int<Fence>(required(3, "f"), "f");
    record.attempt = parse_int<std::int32_t>(required(4, "a"), "a");
    if (record.state == RecordState::completed) record.result = std::string(required(5, "r"));
    if (auto ph = field(6)) record.phase = std::string(*ph);
    if (auto pd = field(7)) record.phase_data = std::string(*pd);
    record.created_at = from_ms(parse_int<std::int64_t>(required(8, "c"), "c"));
    const auto lease_ms = parse_int<std::int64_t>(required(9, "l"), "l");
    const auto expires_ms = parse_int<std::int64_t>(required(10, "e"), "e");
    record.lease_until = from_ms(lease_ms);
    record.expires_at = from_ms(expires_ms);
    record.read_at = from_ms(now);
    record.lease_expired = record.state == RecordState::in_progress && lease_ms < now;
    record.expired = record.state == RecordState::completed && expires_ms < now;
    return record;
}

}  // namespace idem::redis
