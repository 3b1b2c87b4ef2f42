// Downstream consumer of an installed idem with the grpc component: find_package(idem COMPONENTS
// grpc) and idem::grpc. No .proto here: a Method for a method no linked code defines must be a
// config_error, and the RetryInfo details must be built.
#include <idem/grpc.hpp>
#include <idem/idem.hpp>

#include <cstdio>

int main() {
    try {
        idem::grpc::Method method("consumer.Nothing.Here");
        return 1;
    } catch (const idem::config_error&) {
    }
    const grpc::Status status =
        idem::grpc::retry_status(grpc::StatusCode::ABORTED, "in progress", std::chrono::milliseconds(1500));
    if (status.error_code() != grpc::StatusCode::ABORTED || status.error_details().empty()) return 1;
    std::puts("idem grpc consumer: ok");
    return 0;
}
