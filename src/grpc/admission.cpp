// idem::grpc's admission of a call: the key (metadata or request field), its checks, the scope and
// the request's fingerprint — all decided before anything is claimed.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/message.h>

#include <iterator>
#include <stdexcept>
#include <string>

#include "idem/grpc/detail.hpp"

namespace idem::grpc::detail {
namespace {

::grpc::Status invalid(const std::string& what) { return {::grpc::StatusCode::INVALID_ARGUMENT, "idem: " + what}; }

// gRPC's ASCII-Value: printable ASCII, space included (PROTOCOL-HTTP2, "Custom-Metadata").
bool printable_ascii(std::string_view value) {
    for (const char c : value) {
        if (c < 0x20 || c > 0x7e) return false;
    }
    return true;
}

std::string_view view(const ::grpc::string_ref& s) { return {s.data(), s.size()}; }

// The key's value, or the INVALID_ARGUMENT for the call; both empty: no key at all.
struct KeyValue {
    std::optional<std::string> value;
    std::optional<::grpc::Status> refusal;
};

KeyValue key_from_metadata(const ::grpc::ServerContextBase& context, const std::string& name) {
    const auto& metadata = context.client_metadata();
    if (metadata.find(::grpc::string_ref(name + "-bin")) != metadata.end()) {
        return {std::nullopt, invalid("the key must be sent as ASCII metadata '" + name + "', not '" + name + "-bin'")};
    }
    const auto [first, last] = metadata.equal_range(::grpc::string_ref(name));
    const auto count = std::distance(first, last);
    if (count == 0) return {};
    if (count > 1) return {std::nullopt, invalid("several '" + name + "' metadata entries; send one key")};
    const std::string_view value = view(first->second);
    if (auto fault = metadata_key_fault(name, value)) return {std::nullopt, invalid(*fault)};
    return {std::string(value), std::nullopt};
}

KeyValue key_from_field(const google::protobuf::Message& request, const std::string& field_name) {
    const auto* field = request.GetDescriptor()->FindFieldByName(field_name);
    std::string value = request.GetReflection()->GetString(request, field);
    if (value.empty()) return {};
    try {
        validate_key_part(value, "value");
    } catch (const invalid_key& e) {
        return {std::nullopt, invalid("the request field '" + field_name +
                                      "' is not a valid key: " + std::string(idem::detail::without_prefix(e.what())))};
    }
    return {std::move(value), std::nullopt};
}

}  // namespace

std::optional<std::string> metadata_key_fault(std::string_view name, std::string_view value) {
    if (value.empty() || value.size() > Key::max_bytes) {
        return "the '" + std::string(name) + "' metadata entry must be 1 to 255 bytes";
    }
    if (!printable_ascii(value)) return "the '" + std::string(name) + "' metadata entry must be printable ASCII";
    return std::nullopt;
}

std::string deterministic_bytes(const google::protobuf::Message& message) {
    std::string bytes;
    {
        google::protobuf::io::StringOutputStream stream(&bytes);
        google::protobuf::io::CodedOutputStream out(&stream);
        out.SetSerializationDeterministic(true);
        if (!message.SerializeToCodedStream(&out)) {
            throw std::invalid_argument("idem::grpc: " + message.GetTypeName() + " cannot be serialized");
        }
    }
    return bytes;
}

Admission admit(const ::grpc::ServerContextBase& context, const google::protobuf::Message& request,
                const google::protobuf::Message& reply, const Method& method) {
    const MethodOptions& options = method.options();
    if (request.GetDescriptor() != method.descriptor().input_type() ||
        reply.GetDescriptor() != method.descriptor().output_type()) {
        return {internal(method, "idem::grpc: serve() for " + method.path() + " was given a " +
                                     request.GetDescriptor()->full_name() + " and a " +
                                     reply.GetDescriptor()->full_name() + ", not the method's messages"),
                std::nullopt, std::nullopt};
    }
    KeyValue key = key_from_metadata(context, options.key_metadata);
    if (!key.value && !key.refusal && !options.key_field.empty()) key = key_from_field(request, options.key_field);
    if (key.refusal) return {std::move(key.refusal), std::nullopt, std::nullopt};
    if (!key.value) {
        std::string what = "missing '" + options.key_metadata + "' metadata";
        if (!options.key_field.empty()) what += " (or request field '" + options.key_field + "')";
        return {invalid(what + ": every call of " + method.path() + " needs an idempotency key"), std::nullopt,
                std::nullopt};
    }

    std::string scope = method.path();
    try {
        if (options.tenant) {
            const std::string tenant = options.tenant(context);
            if (!tenant.empty()) scope = tenant + ":" + scope;
        }
    } catch (const std::exception& e) {
        return {internal(method,
                         std::string("idem::grpc: the tenant function of ") + method.path() + " threw: " + e.what()),
                std::nullopt, std::nullopt};
    } catch (...) {
        return {internal(method, std::string("idem::grpc: the tenant function of ") + method.path() +
                                     " threw something not derived from std::exception"),
                std::nullopt, std::nullopt};
    }
    std::optional<Key> made;
    try {
        made.emplace(std::move(scope), std::move(*key.value));
    } catch (const invalid_key& e) {
        // The value passed its checks above: the scope (tenant + path) is what is wrong.
        return {internal(method, std::string("idem::grpc: invalid scope for ") + method.path() + ": " + e.what()),
                std::nullopt, std::nullopt};
    }
    return {std::nullopt, std::move(made), idem::fingerprint(deterministic_bytes(request))};
}

void check_trailer(std::string_view name, std::string_view value) {
    bool ok = !name.empty() && !name.starts_with("grpc-") && name != "idempotent-replayed";
    for (const char c : name) {
        ok = ok && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_' || c == '.');
    }
    if (!ok) {
        throw std::invalid_argument("idem::grpc: trailing metadata name '" + std::string(name) +
                                    "' is not lowercase [0-9a-z_.-], or is reserved");
    }
    if (!name.ends_with("-bin") && !printable_ascii(value)) {
        throw std::invalid_argument("idem::grpc: the value of trailing metadata '" + std::string(name) +
                                    "' is not printable ASCII (name it …-bin for bytes)");
    }
}

}  // namespace idem::grpc::detail
