// payments-client — the reference article's client, done right.
//
//   payments-client --url http://127.0.0.1:8080 --account acct_1 --order 42 --amount 25000
//                   --currency BRL --card tok_ok [--key K] [--max-retries N] [--timeout-ms N]
//
// * One idempotency key per payment intent: a UUIDv4 made once, before the first attempt (or --key
//   to resume an intent), and sent unchanged on every retry. A new key means a new payment.
// * Retries network errors, timeouts, 5xx, 409 (still in progress) and 429 (rate limited) with
//   exponential backoff and full jitter (base 100 ms, cap 5 s), waiting at least Retry-After.
//   Never retries any other 4xx: the request itself is wrong and would fail the same way.
// * Prints "HTTP <status>" (plus " (replayed)" for a stored answer) and the body on stdout; one
//   line per retry on stderr. Exit status 0 for 2xx, 1 otherwise, 2 for bad arguments.
#include <httplib.h>
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>

namespace {

using std::chrono::milliseconds;

struct Options {
    std::string url;
    std::string account;
    std::int64_t order = 0;
    std::int64_t amount = 0;
    std::string currency;
    std::string card;
    std::string key;
    int max_retries = 8;
    milliseconds timeout{15'000};
};

[[noreturn]] void usage(int status) {
    (status == 0 ? std::cout : std::cerr)
        << "usage: payments-client --url URL --account A --order N --amount CENTS --currency BRL "
           "--card TOKEN\n"
           "                       [--key K] [--max-retries N] [--timeout-ms N]\n";
    std::exit(status);
}

[[noreturn]] void bad_option(const std::string& message) {
    std::cerr << "payments-client: " << message << "\n";
    usage(2);
}

std::int64_t parse_int(std::string_view name, std::string_view text) {
    std::int64_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size()) {
        bad_option(std::string(name) + ": expected an integer, got '" + std::string(text) + "'");
    }
    return value;
}

Options parse_options(int argc, char** argv) {
    Options o;
    bool have_order = false;
    bool have_amount = false;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        if (arg == "-h" || arg == "--help") usage(0);
        std::string value;
        if (const auto eq = arg.find('='); arg.starts_with("--") && eq != std::string::npos) {
            value = arg.substr(eq + 1);
            arg.resize(eq);
        } else if (i + 1 < argc) {
            value = argv[++i];
        } else {
            bad_option(arg + " needs a value");
        }
        if (arg == "--url") o.url = value;
        else if (arg == "--account") o.account = value;
        else if (arg == "--order") o.order = parse_int(arg, value), have_order = true;
        else if (arg == "--amount") o.amount = parse_int(arg, value), have_amount = true;
        else if (arg == "--currency") o.currency = value;
        else if (arg == "--card") o.card = value;
        else if (arg == "--key") o.key = value;
        else if (arg == "--max-retries")
            o.max_retries = static_cast<int>(std::clamp<std::int64_t>(parse_int(arg, value), 0, 100));
        else if (arg == "--timeout-ms") o.timeout = milliseconds(std::max<std::int64_t>(1, parse_int(arg, value)));
        else bad_option("unknown option " + arg);
    }
    if (o.url.empty() || o.account.empty() || !have_order || !have_amount || o.currency.empty() || o.card.empty()) {
        bad_option("--url, --account, --order, --amount, --currency and --card are required");
    }
    return o;
}

/// A random (version 4) UUID from the OS's entropy source.
std::string uuid_v4() {
    std::random_device device;
    unsigned char bytes[16];
    for (int i = 0; i < 16; i += 4) {
        const std::uint32_t word = device();
        for (int j = 0; j < 4; ++j) bytes[i + j] = static_cast<unsigned char>(word >> (8 * j));
    }
    bytes[6] = static_cast<unsigned char>((bytes[6] & 0x0f) | 0x40);  // version 4
    bytes[8] = static_cast<unsigned char>((bytes[8] & 0x3f) | 0x80);  // RFC 4122 variant
    static constexpr char hex[] = "0123456789abcdef";
    std::string out;
    for (int i = 0; i < 16; ++i) {
        if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
        out += hex[bytes[i] >> 4];
        out += hex[bytes[i] & 0xf];
    }
    return out;
}

/// Splits "http://host:port/path" into the part httplib::Client takes and the request path.
std::pair<std::string, std::string> split_url(const std::string& url) {
    const auto scheme_end = url.find("://");
    const auto path_start = url.find('/', scheme_end == std::string::npos ? 0 : scheme_end + 3);
    if (path_start == std::string::npos) return {url, "/payments"};
    std::string path = url.substr(path_start);
    if (path == "/") path = "/payments";
    return {url.substr(0, path_start), path};
}

bool retryable_status(int status) { return status >= 500 || status == 409 || status == 429; }

}  // namespace

int main(int argc, char** argv) {
    const Options options = parse_options(argc, argv);
    // The key identifies the intent: made once, before the first attempt, reused by every retry.
    const std::string key = options.key.empty() ? uuid_v4() : options.key;

    nlohmann::ordered_json request;
    request["order_id"] = options.order;
    request["amount_cents"] = options.amount;
    request["currency"] = options.currency;
    request["card"] = options.card;
    const std::string body = request.dump();

    const auto [base, path] = split_url(options.url);
    httplib::Client client(base);
    if (!client.is_valid()) bad_option("--url: cannot use '" + options.url + "'");
    client.set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(options.timeout));
    client.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(options.timeout));
    client.set_write_timeout(std::chrono::duration_cast<std::chrono::microseconds>(options.timeout));
    const httplib::Headers headers = {{"Authorization", "Bearer " + options.account}, {"Idempotency-Key", key}};

    std::cerr << "payments-client: Idempotency-Key " << key << "\n";
    std::mt19937_64 jitter(std::random_device{}());
    constexpr milliseconds base_delay{100};
    constexpr milliseconds max_delay{5'000};

    for (int attempt = 0;; ++attempt) {
        auto result = client.Post(path, headers, body, "application/json");
        std::string what;
        milliseconds retry_after{0};
        if (result) {
            const int status = result->status;
            if (!retryable_status(status) || attempt >= options.max_retries) {
                const bool replayed = result->get_header_value("Idempotent-Replayed") == "true";
                std::cout << "HTTP " << status << (replayed ? " (replayed)" : "") << "\n" << result->body << std::endl;
                return status >= 200 && status < 300 ? 0 : 1;
            }
            what = "HTTP " + std::to_string(status);
            const std::string header = result->get_header_value("Retry-After");
            std::int64_t seconds = 0;
            if (!header.empty() &&
                std::from_chars(header.data(), header.data() + header.size(), seconds).ec == std::errc() &&
                seconds > 0) {
                retry_after = milliseconds(std::min<std::int64_t>(seconds, 60) * 1000);
            }
        } else {
            what = "network error: " + httplib::to_string(result.error());
            if (attempt >= options.max_retries) {
                std::cout << "ERROR " << what << "\n";
                return 1;
            }
        }
        // Full jitter: uniform in [0, min(cap, base * 2^attempt)], but never before Retry-After.
        const auto ceiling = std::min<std::int64_t>(max_delay.count(), base_delay.count() << std::min(attempt, 20));
        milliseconds delay{std::uniform_int_distribution<std::int64_t>(0, ceiling)(jitter)};
        delay = std::max(delay, retry_after);
        std::cerr << "payments-client: attempt " << attempt + 1 << ": " << what << ", retrying in " << delay.count()
                  << " ms\n";
        std::this_thread::sleep_for(delay);
    }
}
