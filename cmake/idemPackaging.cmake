# Packaging, included from the top-level CMakeLists.txt when IDEM_INSTALL is on:
#   * idem.pc for pkg-config, installed to <libdir>/pkgconfig next to the CMake package;
#   * CPack settings for `cpack -G DEB` (a -dev package: headers, library, CMake package, idem.pc).

# --- pkg-config ----------------------------------------------------------------------------------
# The file finds its prefix from its own location (${pcfiledir}), so an installation moved as a
# whole (cmake --install --prefix, dpkg-deb -x) stays usable.
# A static libidem leaves libpq, libcrypto and fmt to the program's link, so they are `Requires`
# (plain `pkg-config --libs idem` lists them); a shared one links them itself (`Requires.private`).
file(RELATIVE_PATH IDEM_PC_RELATIVE_PREFIX "/idem-prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/idem-prefix")
string(REGEX REPLACE "/$" "" IDEM_PC_RELATIVE_PREFIX "${IDEM_PC_RELATIVE_PREFIX}")
foreach(dir LIBDIR INCLUDEDIR)
  if(IS_ABSOLUTE "${CMAKE_INSTALL_${dir}}")
    set(IDEM_PC_${dir} "${CMAKE_INSTALL_${dir}}")
  else()
    set(IDEM_PC_${dir} "\${prefix}/${CMAKE_INSTALL_${dir}}")
  endif()
endforeach()
get_target_property(idem_library_type idem TYPE)
if(idem_library_type STREQUAL "STATIC_LIBRARY")
  set(IDEM_PC_REQUIRES_SUFFIX "")
  set(IDEM_PC_LIBS_EXTRA " -pthread")
else()
  set(IDEM_PC_REQUIRES_SUFFIX ".private")
  set(IDEM_PC_LIBS_EXTRA "")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/idem.pc.in ${PROJECT_BINARY_DIR}/idem.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/idem.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# --- CPack: cpack -G DEB (run in the build directory, or cpack --config <build>/CPackConfig.cmake) -
set(CPACK_PACKAGE_NAME "libidem-dev")
set(CPACK_PACKAGE_VENDOR "idem")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION} (C++20 library, development files)")
string(CONCAT CPACK_PACKAGE_DESCRIPTION
       "idem runs a side effect once per idempotency key: PostgreSQL arbitrates the key, the response "
       "is stored byte for byte and every repeat is answered with it. This package holds the headers, "
       "the library, the CMake package (find_package(idem)) and idem.pc (pkg-config).")
set(CPACK_RESOURCE_FILE_LICENSE ${PROJECT_SOURCE_DIR}/LICENSE)
# Whoever builds the package puts their name in it (the default's .invalid domain reaches no one).
set(IDEM_PACKAGE_MAINTAINER "idem maintainers <maintainers@idem.invalid>" CACHE STRING
    "Maintainer field of the Debian package (Name <email>)")
set(CPACK_PACKAGE_CONTACT "${IDEM_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${IDEM_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_SECTION "libdevel")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_PACKAGING_INSTALL_PREFIX "/usr")
# Debian 12 names. The -dev packages: idemConfig.cmake re-finds libpq, OpenSSL and fmt, and a static
# libidem is linked with them; they pull in the run-time libraries libpq5, libssl3 and libfmt9.
set(CPACK_DEBIAN_PACKAGE_DEPENDS
    "libpq5 (>= 14), libssl3 (>= 3.0), libfmt9, libpq-dev (>= 14), libssl-dev (>= 3.0), libfmt-dev (>= 9)")
set(idem_deb_suggests "")
if(IDEM_HAVE_ASIO)
  list(APPEND idem_deb_suggests "libboost1.81-dev")
endif()
if(IDEM_HAVE_REDIS)
  list(APPEND idem_deb_suggests "libhiredis-dev")
endif()
if(IDEM_HAVE_GRPC)
  list(APPEND idem_deb_suggests "libgrpc++-dev")
endif()
list(JOIN idem_deb_suggests ", " CPACK_DEBIAN_PACKAGE_SUGGESTS)
include(CPack)
