# idem_grpc_proto_library(<name> <proto_dir> <proto>...): a static library of the C++ code protoc and
# grpc_cpp_plugin generate for <proto>... (paths relative to <proto_dir>), for idem's own tests and
# examples (not installed). Generated code is compiled with idem's build flags (a sanitized build
# instruments it too) but no warning (-w: it is protoc's code), and its headers are system headers
# to the targets that link the library.
function(idem_grpc_proto_library name proto_dir)
  set(out ${CMAKE_CURRENT_BINARY_DIR}/${name}-generated)
  file(MAKE_DIRECTORY ${out})
  set(sources "")
  foreach(proto ${ARGN})
    string(REGEX REPLACE "\\.proto$" "" stem ${proto})
    set(generated ${out}/${stem}.pb.cc ${out}/${stem}.pb.h ${out}/${stem}.grpc.pb.cc ${out}/${stem}.grpc.pb.h)
    add_custom_command(
      OUTPUT ${generated}
      COMMAND protobuf::protoc --proto_path=${proto_dir} --cpp_out=${out} --grpc_out=${out}
              --plugin=protoc-gen-grpc=$<TARGET_FILE:gRPC::grpc_cpp_plugin> ${proto_dir}/${proto}
      DEPENDS ${proto_dir}/${proto} protobuf::protoc gRPC::grpc_cpp_plugin
      COMMENT "protoc ${proto}" VERBATIM)
    list(APPEND sources ${out}/${stem}.pb.cc ${out}/${stem}.grpc.pb.cc)
  endforeach()
  add_library(${name} STATIC ${sources})
  target_include_directories(${name} SYSTEM PUBLIC ${out})
  target_link_libraries(${name} PUBLIC gRPC::grpc++ protobuf::libprotobuf PRIVATE idem_build_flags)
  target_compile_options(${name} PRIVATE -w)
endfunction()
