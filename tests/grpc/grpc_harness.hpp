// tests/grpc/grpc_harness.hpp — idemtest.Payments served over real gRPC on 127.0.0.1 (ephemeral
// ports) against real PostgreSQL, by each API: the synchronous one (idem::grpc::serve), the
// callback one on a worker pool (idem::grpc::serve_on) and, with the idem::asio component
// (IDEM_TEST_GRPC_ASIO), the callback one over AsyncPostgresStore (idem::grpc::async_serve). All
// serve the same methods on the same table, so a call to one and then to another is a retry of
// the same key.
//
// The handler counts its runs per key outside the library and answers with the key and its run
// number; ChargeRequest.behaviour makes it decline, throw, say "not performed", wait on a gate, add
// a bad trailer, or run the test's Effects::meanwhile before it answers. Each test case takes a
// tenant of its own (x-tenant metadata), so "nothing stored" is a count of its scopes' rows.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#ifdef IDEM_TEST_GRPC_ASIO
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>

#include "idem/asio/store.hpp"
#include "idem/grpc/asio.hpp"
#endif

#include "google/rpc/status.pb.h"
#include "idem/grpc.hpp"
#include "idem/postgres_store.hpp"
#include "idem_test.grpc.pb.h"
#include "pg.hpp"
#include "require_db.hpp"
#include "test_env.hpp"

namespace grpc_test {

using idemtest::ChargeReply;
using idemtest::ChargeRequest;

/// What the handlers did, counted outside the library, and a gate "hold" handlers wait on.
class Effects {
public:
    int run(const std::string& key) {
        std::lock_guard lock(mutex_);
        return ++runs_[key];
    }
    int runs(const std::string& key) {
        std::lock_guard lock(mutex_);
        return runs_[key];
    }
    /// Closes the gate: "hold" handlers wait until open() (or 30 s).
    void close() {
        std::lock_guard lock(mutex_);
        open_ = false;
        held_ = 0;
    }
    void open() {
        {
            std::lock_guard lock(mutex_);
            open_ = true;
        }
        changed_.notify_all();
    }
    /// Blocks until a handler is held at the gate.
    bool wait_held(std::chrono::seconds within = std::chrono::seconds(30)) {
        std::unique_lock lock(mutex_);
        return changed_.wait_for(lock, within, [&] { return held_ > 0; });
    }
    void hold() {
        std::unique_lock lock(mutex_);
        ++held_;
        changed_.notify_all();
        changed_.wait_for(lock, std::chrono::seconds(30), [&] { return open_; });
    }
    /// hold() for a handler that must not block (it polls is_open() on a timer).
    void arrive() {
        std::lock_guard lock(mutex_);
        ++held_;
        changed_.notify_all();
    }
    bool is_open() {
        std::lock_guard lock(mutex_);
        return open_;
    }

    /// What a "meanwhile" handler does after its run is counted, with the call's key (set before the
    /// call that uses it).
    std::function<void(const idem::Key&)> meanwhile;

private:
    std::mutex mutex_;
    std::condition_variable changed_;
    std::map<std::string, int> runs_;
    bool open_ = true;
    int held_ = 0;
};

/// The test handler's answer once it has waited (see the top of this file); CallT is Call or
/// AsyncCall.
template <class CallT>
::grpc::Status respond(Effects& effects, CallT& call, const ChargeRequest& request, ChargeReply& reply, int run) {
    const std::string& behaviour = request.behaviour();
    if (behaviour == "throw") throw std::runtime_error("provider timeout");
    if (behaviour == "outcome-unknown") throw idem::outcome_unknown("idem: the provider did not answer");
    if (behaviour == "not-performed") {
        throw idem::grpc::not_performed(::grpc::Status(::grpc::StatusCode::RESOURCE_EXHAUSTED, "rate limited"));
    }
    if (behaviour == "not-performed-ok") throw idem::grpc::not_performed(::grpc::Status::OK);
    if (behaviour == "meanwhile" && effects.meanwhile) effects.meanwhile(call.key());
    if (behaviour == "bad-trailer") call.add_trailing_metadata("Bad Name", "x");
    if (behaviour == "code-20") return {static_cast<::grpc::StatusCode>(20), "a code outside gRPC's"};
    if (behaviour == "decline") {
        call.add_trailing_metadata("decline-code", "insufficient_funds");
        return {::grpc::StatusCode::FAILED_PRECONDITION, "card declined"};
    }
    reply.set_charge_id("ch_" + call.key().value());
    reply.set_amount_cents(request.amount_cents());
    reply.set_run(run);
    call.add_trailing_metadata("charge-run", std::to_string(run));
    call.add_trailing_metadata("receipt-bin", std::string("\0\xff\x01", 3));
    return ::grpc::Status::OK;
}

/// The test handler on a thread of its own (serve, serve_on): it may block.
inline ::grpc::Status handle(Effects& effects, idem::grpc::Call& call, const ChargeRequest& request,
                             ChargeReply& reply) {
    const int run = effects.run(call.key().value());
    if (request.behaviour() == "hold") effects.hold();
    if (request.sleep_ms() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(request.sleep_ms()));
    return respond(effects, call, request, reply, run);
}

#ifdef IDEM_TEST_GRPC_ASIO
/// The test handler on the store's executor (async_serve): it awaits instead of blocking.
inline boost::asio::awaitable<::grpc::Status> handle_async(Effects& effects, idem::grpc::AsyncCall& call,
                                                           const ChargeRequest& request, ChargeReply& reply) {
    boost::asio::steady_timer timer(co_await boost::asio::this_coro::executor);
    const int run = effects.run(call.key().value());
    if (request.behaviour() == "hold") {
        effects.arrive();
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
        while (!effects.is_open() && std::chrono::steady_clock::now() < until) {
            timer.expires_after(std::chrono::milliseconds(5));
            co_await timer.async_wait(boost::asio::use_awaitable);
        }
    }
    if (request.sleep_ms() > 0) {
        timer.expires_after(std::chrono::milliseconds(request.sleep_ms()));
        co_await timer.async_wait(boost::asio::use_awaitable);
    }
    co_return respond(effects, call, request, reply, run);
}
#endif

/// The methods, as each rpc configures it.
struct Methods {
    static std::string tenant_of(const ::grpc::ServerContextBase& context) {
        const auto& metadata = context.client_metadata();
        const auto found = metadata.find("x-tenant");
        return found == metadata.end() ? std::string() : std::string(found->second.data(), found->second.size());
    }
    static idem::grpc::MethodOptions base() {
        idem::grpc::MethodOptions o;
        o.tenant = tenant_of;
        o.unavailable_retry_after = std::chrono::milliseconds(1500);
        o.unknown_retry_after = std::chrono::milliseconds(2500);
        return o;
    }
    static idem::grpc::MethodOptions by_id() {
        auto o = base();
        o.key_field = "request_id";
        return o;
    }
    static idem::grpc::MethodOptions strict() {
        auto o = base();
        o.storage = idem::grpc::StoragePolicy::success_only();
        return o;
    }
    static idem::grpc::MethodOptions waiting() {
        auto o = base();
        o.claim.wait = std::chrono::seconds(60);
        return o;
    }

    idem::grpc::Method charge{"idemtest.Payments.Charge", base()};
    idem::grpc::Method by_id_method{"/idemtest.Payments/ChargeById", by_id()};
    idem::grpc::Method strict_method{"idemtest.Payments.ChargeStrict", strict()};
    idem::grpc::Method wait_method{"idemtest.Payments.ChargeWait", waiting()};
    idem::grpc::Method down_method{"idemtest.Payments.ChargeDown", base()};
};

/// The synchronous service.
class SyncService final : public idemtest::Payments::Service {
public:
    SyncService(idem::IdempotencyStore& store, idem::IdempotencyStore& down, const Methods& methods, Effects& effects)
        : store_(store), down_(down), methods_(methods), effects_(effects) {}

    ::grpc::Status Charge(::grpc::ServerContext* c, const ChargeRequest* q, ChargeReply* r) override {
        return serve(store_, methods_.charge, c, q, r);
    }
    ::grpc::Status ChargeById(::grpc::ServerContext* c, const ChargeRequest* q, ChargeReply* r) override {
        return serve(store_, methods_.by_id_method, c, q, r);
    }
    ::grpc::Status ChargeStrict(::grpc::ServerContext* c, const ChargeRequest* q, ChargeReply* r) override {
        return serve(store_, methods_.strict_method, c, q, r);
    }
    ::grpc::Status ChargeWait(::grpc::ServerContext* c, const ChargeRequest* q, ChargeReply* r) override {
        return serve(store_, methods_.wait_method, c, q, r);
    }
    ::grpc::Status ChargeDown(::grpc::ServerContext* c, const ChargeRequest* q, ChargeReply* r) override {
        return serve(down_, methods_.down_method, c, q, r);
    }

private:
    ::grpc::Status serve(idem::IdempotencyStore& store, const idem::grpc::Method& method, ::grpc::ServerContext* c,
                         const ChargeRequest* q, ChargeReply* r) {
        return idem::grpc::serve(store, *c, *q, *r, method,
                                 [&](idem::grpc::Call& call) { return handle(effects_, call, *q, *r); });
    }
    idem::IdempotencyStore& store_;
    idem::IdempotencyStore& down_;
    const Methods& methods_;
    Effects& effects_;
};

/// A fixed pool of worker threads (the callback service's handlers run there).
class Workers {
public:
    explicit Workers(int n) {
        for (int i = 0; i < n; ++i) threads_.emplace_back([this] { work(); });
    }
    ~Workers() {
        {
            std::lock_guard lock(mutex_);
            stop_ = true;
        }
        ready_.notify_all();
        for (auto& t : threads_) t.join();
    }
    void post(std::function<void()> task) {
        {
            std::lock_guard lock(mutex_);
            tasks_.push_back(std::move(task));
        }
        ready_.notify_one();
    }

private:
    void work() {
        for (;;) {
            std::function<void()> task;
            {
                std::unique_lock lock(mutex_);
                ready_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
                if (tasks_.empty()) return;
                task = std::move(tasks_.front());
                tasks_.pop_front();
            }
            task();
        }
    }
    std::mutex mutex_;
    std::condition_variable ready_;
    std::deque<std::function<void()>> tasks_;
    bool stop_ = false;
    std::vector<std::thread> threads_;
};

/// The callback service: Charge and ChargeWait, through serve_on and the worker pool.
class CallbackService final : public idemtest::Payments::CallbackService {
public:
    CallbackService(idem::IdempotencyStore& store, const Methods& methods, Effects& effects, Workers& workers)
        : store_(store), methods_(methods), effects_(effects), workers_(workers) {}

    ::grpc::ServerUnaryReactor* Charge(::grpc::CallbackServerContext* c, const ChargeRequest* q,
                                       ChargeReply* r) override {
        return serve(methods_.charge, c, q, r);
    }
    ::grpc::ServerUnaryReactor* ChargeWait(::grpc::CallbackServerContext* c, const ChargeRequest* q,
                                           ChargeReply* r) override {
        return serve(methods_.wait_method, c, q, r);
    }

private:
    ::grpc::ServerUnaryReactor* serve(const idem::grpc::Method& method, ::grpc::CallbackServerContext* c,
                                      const ChargeRequest* q, ChargeReply* r) {
        return idem::grpc::serve_on([this](std::function<void()> task) { workers_.post(std::move(task)); }, store_, c,
                                    q, r, method,
                                    [this, q, r](idem::grpc::Call& call) { return handle(effects_, call, *q, *r); });
    }

    idem::IdempotencyStore& store_;
    const Methods& methods_;
    Effects& effects_;
    Workers& workers_;
};

#ifdef IDEM_TEST_GRPC_ASIO
/// The callback service over AsyncPostgresStore: Charge and ChargeWait, through async_serve.
class AsyncService final : public idemtest::Payments::CallbackService {
public:
    AsyncService(idem::asio::AsyncPostgresStore& store, const Methods& methods, Effects& effects)
        : store_(store), methods_(methods), effects_(effects) {}

    ::grpc::ServerUnaryReactor* Charge(::grpc::CallbackServerContext* c, const ChargeRequest* q,
                                       ChargeReply* r) override {
        return serve(methods_.charge, c, q, r);
    }
    ::grpc::ServerUnaryReactor* ChargeWait(::grpc::CallbackServerContext* c, const ChargeRequest* q,
                                           ChargeReply* r) override {
        return serve(methods_.wait_method, c, q, r);
    }

private:
    ::grpc::ServerUnaryReactor* serve(const idem::grpc::Method& method, ::grpc::CallbackServerContext* c,
                                      const ChargeRequest* q, ChargeReply* r) {
        return idem::grpc::async_serve(store_, c, q, r, method, [this, q, r](idem::grpc::AsyncCall& call) {
            return handle_async(effects_, call, *q, *r);
        });
    }
    idem::asio::AsyncPostgresStore& store_;
    const Methods& methods_;
    Effects& effects_;
};
#endif

/// What a client saw.
struct Answer {
    ::grpc::Status status;
    ChargeReply reply;
    std::multimap<std::string, std::string> trailers;

    [[nodiscard]] bool replayed() const {
        const auto found = trailers.find("idempotent-replayed");
        return found != trailers.end() && found->second == "true";
    }
    [[nodiscard]] std::string trailer(const std::string& name) const {
        const auto found = trailers.find(name);
        return found == trailers.end() ? std::string("<none>") : found->second;
    }
    /// The google.rpc.RetryInfo in the status details, if there is one.
    [[nodiscard]] std::optional<std::chrono::milliseconds> retry_delay() const {
        google::rpc::Status details;
        if (status.error_details().empty() || !details.ParseFromString(status.error_details())) return std::nullopt;
        if (details.code() != static_cast<int>(status.error_code()) || details.message() != status.error_message()) {
            return std::nullopt;
        }
        for (const auto& any : details.details()) {
            google::rpc::RetryInfo info;
            if (any.UnpackTo(&info)) {
                return std::chrono::milliseconds(info.retry_delay().seconds() * 1000 +
                                                 info.retry_delay().nanos() / 1000000);
            }
        }
        return std::nullopt;
    }
};

using Metadata = std::vector<std::pair<std::string, std::string>>;

/// The server API a call goes to.
enum class Api { sync, callback, async };

/// Every API this build serves (async: with the idem::asio component).
inline std::vector<Api> apis() {
#ifdef IDEM_TEST_GRPC_ASIO
    return {Api::sync, Api::callback, Api::async};
#else
    return {Api::sync, Api::callback};
#endif
}

inline std::string name(Api api) { return api == Api::sync ? "sync" : api == Api::callback ? "callback" : "async"; }

class Harness {
public:
    static constexpr const char* kNowhere = "host=127.0.0.1 port=1 dbname=none connect_timeout=1";

    Harness()
        : url_(idem_test::require_db()),
          db(url_),
          store(url_, options()),
          down_(kNowhere, down_options()),
          sync_(store, down_, methods, effects),
          workers_(16),
          callback_(store, methods, effects, workers_) {
        store.ensure_schema();
        sync_server_ = start(sync_, sync_port_);
        callback_server_ = start(callback_, callback_port_);
        sync_stub_ = idemtest::Payments::NewStub(channel(sync_port_));
        callback_stub_ = idemtest::Payments::NewStub(channel(callback_port_));
#ifdef IDEM_TEST_GRPC_ASIO
        io_thread_ = std::thread([this] { io_.run(); });
        async_store_ = std::make_unique<idem::asio::AsyncPostgresStore>(io_.get_executor(), url_, options());
        async_ = std::make_unique<AsyncService>(*async_store_, methods, effects);
        async_server_ = start(*async_, async_port_);
        async_stub_ = idemtest::Payments::NewStub(channel(async_port_));
#endif
    }
    ~Harness() {
        effects.open();
#ifdef IDEM_TEST_GRPC_ASIO
        async_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
        async_store_.reset();
        work_.reset();
        io_thread_.join();
#endif
        callback_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
        sync_server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    }
    Harness(const Harness&) = delete;
    Harness& operator=(const Harness&) = delete;

    /// A tenant no other test case or process uses.
    [[nodiscard]] static std::string tenant(const std::string& what) { return idem_test::unique_name("t_" + what); }

    /// One call of `rpc` ("Charge", "ChargeById", ...) with these metadata entries.
    Answer call(const std::string& rpc, const Metadata& metadata, const ChargeRequest& request, Api api = Api::sync,
                std::chrono::milliseconds deadline = std::chrono::seconds(30)) {
        ::grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + deadline);
        for (const auto& [name, value] : metadata) context.AddMetadata(name, value);
        Answer answer;
        auto& stub = api == Api::sync ? *sync_stub_ : api == Api::callback ? *callback_stub_ : async_stub();
        if (rpc == "Charge") answer.status = stub.Charge(&context, request, &answer.reply);
        else if (rpc == "ChargeById") answer.status = stub.ChargeById(&context, request, &answer.reply);
        else if (rpc == "ChargeStrict") answer.status = stub.ChargeStrict(&context, request, &answer.reply);
        else if (rpc == "ChargeWait") answer.status = stub.ChargeWait(&context, request, &answer.reply);
        else if (rpc == "ChargeDown") answer.status = stub.ChargeDown(&context, request, &answer.reply);
        else throw std::logic_error("no rpc " + rpc);
        for (const auto& [name, value] : context.GetServerTrailingMetadata()) {
            answer.trailers.emplace(std::string(name.data(), name.size()), std::string(value.data(), value.size()));
        }
        return answer;
    }

    /// The record of `key` under `tenant` and `rpc`: "in_progress", "completed" or "" (none).
    std::string state(const std::string& tenant, const std::string& rpc, const std::string& key) {
        auto r = db.exec("SELECT state FROM idem_keys WHERE scope = $1 AND key = $2",
                         {tenant + ":/idemtest.Payments/" + rpc, key});
        return r.rows() == 0 ? std::string() : r.text(0, 0);
    }
    /// How many records the tenant has, under any method.
    long long rows(const std::string& tenant) {
        return db.exec("SELECT count(*) FROM idem_keys WHERE starts_with(scope, $1)", {tenant + ":"}).integer(0, 0);
    }

    Methods methods;
    Effects effects;

private:
    static idem::PostgresOptions options() {
        idem::PostgresOptions o;
        o.pool_size = 48;  // the 32 waiting calls of the concurrency test each hold one
        return o;
    }
    static idem::PostgresOptions down_options() {
        idem::PostgresOptions o;
        o.connect_timeout = std::chrono::milliseconds(500);
        o.claim_attempts = 1;
        return o;
    }
    static std::unique_ptr<::grpc::Server> start(::grpc::Service& service, int& port) {
        ::grpc::ServerBuilder builder;
        builder.AddListeningPort("127.0.0.1:0", ::grpc::InsecureServerCredentials(), &port);
        builder.RegisterService(&service);
        builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, 64 * 1024);  // the 10 KB key reaches idem
        ::grpc::ResourceQuota quota("idem-grpc-test");
        quota.SetMaxThreads(80);
        builder.SetResourceQuota(quota);
        auto server = builder.BuildAndStart();
        if (!server || port == 0) throw std::runtime_error("the gRPC test server did not start");
        return server;
    }
    static std::shared_ptr<::grpc::Channel> channel(int port) {
        ::grpc::ChannelArguments args;
        args.SetInt(GRPC_ARG_MAX_METADATA_SIZE, 64 * 1024);
        args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);  // every attempt is the test's own
        return ::grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port), ::grpc::InsecureChannelCredentials(),
                                           args);
    }

    idemtest::Payments::Stub& async_stub() {
#ifdef IDEM_TEST_GRPC_ASIO
        return *async_stub_;
#else
        throw std::logic_error("no async_serve in this build (the idem::asio component)");
#endif
    }

    std::string url_;

public:
    idem_test::PgConn db;
    idem::PostgresStore store;

private:
    idem::PostgresStore down_;
    SyncService sync_;
    Workers workers_;
    CallbackService callback_;
    int sync_port_ = 0;
    int callback_port_ = 0;
    std::unique_ptr<::grpc::Server> sync_server_;
    std::unique_ptr<::grpc::Server> callback_server_;
    std::unique_ptr<idemtest::Payments::Stub> sync_stub_;
    std::unique_ptr<idemtest::Payments::Stub> callback_stub_;
#ifdef IDEM_TEST_GRPC_ASIO
    boost::asio::io_context io_;
    std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work_{io_.get_executor()};
    std::thread io_thread_;
    std::unique_ptr<idem::asio::AsyncPostgresStore> async_store_;
    std::unique_ptr<AsyncService> async_;
    int async_port_ = 0;
    std::unique_ptr<::grpc::Server> async_server_;
    std::unique_ptr<idemtest::Payments::Stub> async_stub_;
#endif
};

/// A request for `amount` cents.
inline ChargeRequest charge(long long amount, const std::string& behaviour = "") {
    ChargeRequest request;
    request.set_account("acct_1");
    request.set_amount_cents(amount);
    request.set_behaviour(behaviour);
    return request;
}

}  // namespace grpc_test
