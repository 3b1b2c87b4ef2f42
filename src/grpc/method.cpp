// idem::grpc::Method and the storage policies: a method's configuration, checked once.
#include <google/protobuf/descriptor.h>

#include <string>

#include "idem/grpc/method.hpp"

namespace idem::grpc {
namespace {

[[noreturn]] void refuse(const std::string& what) { throw config_error("idem::grpc: " + what); }

// A gRPC ASCII header name as the transport delivers it: lowercase [0-9a-z_.-] (gRPC's
// PROTOCOL-HTTP2 "Header-Name"), not reserved ("grpc-…", ":…") and not binary ("-bin").
bool ascii_header_name(std::string_view name) {
    if (name.empty() || name.starts_with("grpc-") || name.ends_with("-bin")) return false;
    for (const char c : name) {
        const bool ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.';
        if (!ok) return false;
    }
    return true;
}

// "/pkg.Service/Method" → "pkg.Service.Method"; a full name is returned as is.
std::string full_name_of(std::string_view name) {
    if (!name.starts_with('/')) return std::string(name);
    std::string out(name.substr(1));
    const auto slash = out.find('/');
    if (slash == std::string::npos || out.find('/', slash + 1) != std::string::npos) {
        refuse("'" + std::string(name) + "' is not a gRPC method path (/package.Service/Method)");
    }
    out[slash] = '.';
    return out;
}

}  // namespace

StoragePolicy StoragePolicy::store_all() { return {}; }

StoragePolicy StoragePolicy::server_errors_unknown() {
    return {[](const ::grpc::Status& status) {
        switch (status.error_code()) {
            case ::grpc::StatusCode::UNKNOWN:
            case ::grpc::StatusCode::INTERNAL:
            case ::grpc::StatusCode::UNAVAILABLE:
            case ::grpc::StatusCode::DEADLINE_EXCEEDED:
            case ::grpc::StatusCode::DATA_LOSS: return Disposition::unknown;
            default: return Disposition::store;
        }
    }};
}

StoragePolicy StoragePolicy::success_only() {
    return {[](const ::grpc::Status& status) { return status.ok() ? Disposition::store : Disposition::release; }};
}

Method::Method(std::string_view full_name, MethodOptions options) : options_(std::move(options)) {
    const std::string name = full_name_of(full_name);
    descriptor_ = google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(name);
    if (descriptor_ == nullptr) {
        refuse("no method '" + name + "' in the generated descriptors (is its .pb.cc linked in?)");
    }
    path_ = "/" + descriptor_->service()->full_name() + "/" + descriptor_->name();
    if (descriptor_->client_streaming() || descriptor_->server_streaming()) {
        const char* kind = descriptor_->client_streaming() && descriptor_->server_streaming()
                               ? "bidirectional streaming"
                           : descriptor_->client_streaming() ? "client streaming"
                                                             : "server streaming";
        refuse(path_ + " is a " + kind + " method; only unary methods can be made idempotent");
    }
    if (!ascii_header_name(options_.key_metadata)) {
        refuse("key_metadata '" + options_.key_metadata + "' of " + path_ +
               " is not a lowercase gRPC ASCII header name ([0-9a-z_.-], not grpc-…, not …-bin)");
    }
    if (!options_.key_field.empty()) {
        const auto* field = descriptor_->input_type()->FindFieldByName(options_.key_field);
        if (field == nullptr || field->is_repeated() ||
            field->type() != google::protobuf::FieldDescriptor::TYPE_STRING) {
            refuse("key_field '" + options_.key_field + "' is not a singular string field of " +
                   descriptor_->input_type()->full_name());
        }
    }
}

}  // namespace idem::grpc
