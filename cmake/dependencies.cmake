# Third-party libraries, found the way the distribution ships them. Included once by the
# top-level CMakeLists.txt; everything below it links the targets defined here:
#
#   protobuf::libprotobuf-lite, protobuf::protoc   (REQUIRED)
#   GTest::gtest, GTest::gtest_main, GTest::gmock  (REQUIRED)
#   mooncake::httplib                              (optional: store/ builds mooncake_master
#                                                   only when MC_HTTPLIB_FOUND)
#
# Each is looked up as a CMake package first (what an upstream `make install`, vcpkg or a
# newer distribution ships), then the way Debian ships it (CMake's Find modules,
# pkg-config files, or a bare header and library), and a library that is found but cannot
# be used stops the configure step with a message instead of failing at link time.
# Checked on Debian 12 (protobuf 3.21, gtest 1.12, cpp-httplib 0.11) and Debian 13
# (protobuf 3.21, gtest 1.16, cpp-httplib 0.18; scripts/test_torch2.sh builds there).
include_guard(GLOBAL)
include(CheckCXXSourceCompiles)
include(CMakePushCheckState)

set(_mc_deps_summary)

# ---- protobuf ------------------------------------------------------------------------------
# protobuf >= 22 installs a CMake package (with its abseil dependencies); 3.21 as Debian ships
# it has none, and CMake's FindProtobuf module handles it.
find_package(Protobuf CONFIG QUIET)
if(Protobuf_FOUND)
  set(_mc_pb_how "CMake package")
else()
  find_package(Protobuf REQUIRED)
  set(_mc_pb_how "FindProtobuf")
endif()
if(NOT TARGET protobuf::libprotobuf-lite OR NOT TARGET protobuf::protoc)
  message(FATAL_ERROR "protobuf found (${_mc_pb_how}) without the protobuf::libprotobuf-lite and "
                      "protobuf::protoc targets; install libprotobuf-dev and protobuf-compiler")
endif()
list(APPEND _mc_deps_summary "protobuf ${Protobuf_VERSION} (${_mc_pb_how})")

# ---- googletest ----------------------------------------------------------------------------
# FindGTest prefers GTestConfig.cmake (Debian 12 and 13 both ship it) and falls back to the
# bare libraries; gmock only comes with the package.
if(MC_BUILD_TESTS)
  find_package(GTest REQUIRED)
  if(NOT TARGET GTest::gtest_main)
    message(FATAL_ERROR "GTest found without GTest::gtest_main; install libgtest-dev")
  endif()
  list(APPEND _mc_deps_summary "gtest ${GTest_VERSION}")
else()
  list(APPEND _mc_deps_summary "no tests (MC_BUILD_TESTS=OFF)")
endif()

# ---- cpp-httplib ---------------------------------------------------------------------------
# Upstream cpp-httplib is one header (everything inline). Debian builds it as a compiled
# library instead (libcpp-httplib.so, whose httplib.h only declares most functions) in both
# Debian 12 and Debian 13, and describes it in cpp-httplib.pc (which also carries the
# CPPHTTPLIB_*_SUPPORT definitions the library was built with: they change the classes'
# layout, so users must compile with the same ones). Order:
#   1. the httplib CMake package (upstream's install; target httplib::httplib);
#   2. pkg-config's cpp-httplib module;
#   3. no pkg-config program: the header, cpp-httplib.pc read by hand for its definitions,
#      and libcpp-httplib if it exists.
# Whatever was found must link a program that constructs an httplib::Server: a split header
# without its library (the Debian 13 failure this replaces: `undefined reference to
# httplib::Server::Server()` when pkg-config was not installed) is reported here.
set(MC_HTTPLIB_FOUND OFF)
set(_mc_httplib_how "")
set(_mc_httplib_link "")
set(_mc_httplib_defs "")
set(_mc_httplib_inc "")
set(_mc_httplib_extra "")
find_package(httplib CONFIG QUIET)
if(httplib_FOUND AND TARGET httplib::httplib)
  set(_mc_httplib_link httplib::httplib)
  set(_mc_httplib_how "CMake package ${httplib_VERSION}")
else()
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(MC_PC_HTTPLIB QUIET IMPORTED_TARGET cpp-httplib)
  endif()
  if(MC_PC_HTTPLIB_FOUND)
    # The header's inline code (e.g. its ThreadPool's workers, which call OPENSSL_thread_stop
    # in 0.18 when built with CPPHTTPLIB_OPENSSL_SUPPORT) is compiled into our objects, so the
    # modules of Requires.private (openssl, zlib, brotli) are ours to link, as shared libraries
    # (not --static's flags: those add their own private libraries, e.g. -lzstd, with no .so).
    set(_mc_httplib_link PkgConfig::MC_PC_HTTPLIB)
    execute_process(COMMAND ${PKG_CONFIG_EXECUTABLE} --print-requires-private cpp-httplib
                    OUTPUT_VARIABLE _mc_priv OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    string(REGEX REPLACE "[<>=!]+ *[^ \n]+" "" _mc_priv "${_mc_priv}")  # drop versions
    string(REGEX REPLACE "[ \n]+" ";" _mc_priv "${_mc_priv}")
    list(FILTER _mc_priv EXCLUDE REGEX "^$")
    if(_mc_priv)
      pkg_check_modules(MC_PC_HTTPLIB_PRIV QUIET IMPORTED_TARGET ${_mc_priv})
      if(MC_PC_HTTPLIB_PRIV_FOUND)
        list(APPEND _mc_httplib_link PkgConfig::MC_PC_HTTPLIB_PRIV)
      endif()
    endif()
    set(_mc_httplib_how "pkg-config ${MC_PC_HTTPLIB_VERSION}")
  else()
    find_path(MC_HTTPLIB_INCLUDE_DIR httplib.h)
    if(MC_HTTPLIB_INCLUDE_DIR)
      set(_mc_httplib_inc ${MC_HTTPLIB_INCLUDE_DIR})
      find_library(MC_HTTPLIB_LIBRARY NAMES cpp-httplib httplib)
      find_file(MC_HTTPLIB_PC cpp-httplib.pc
                PATH_SUFFIXES lib/${CMAKE_LIBRARY_ARCHITECTURE}/pkgconfig lib/pkgconfig
                              share/pkgconfig)
      if(MC_HTTPLIB_PC)
        file(STRINGS ${MC_HTTPLIB_PC} _mc_pc_cflags REGEX "^Cflags:")
        string(REGEX MATCHALL "-D[A-Za-z0-9_]+(=[^ ]*)?" _mc_pc_defs "${_mc_pc_cflags}")
        foreach(d ${_mc_pc_defs})
          string(SUBSTRING ${d} 2 -1 d)
          list(APPEND _mc_httplib_defs ${d})
        endforeach()
      endif()
      # The header's inline code needs the libraries its definitions switch on (see above).
      if("CPPHTTPLIB_OPENSSL_SUPPORT" IN_LIST _mc_httplib_defs)
        find_package(OpenSSL QUIET)
        if(OpenSSL_FOUND)
          list(APPEND _mc_httplib_extra OpenSSL::SSL OpenSSL::Crypto)
        endif()
      endif()
      if("CPPHTTPLIB_ZLIB_SUPPORT" IN_LIST _mc_httplib_defs)
        find_package(ZLIB QUIET)
        if(ZLIB_FOUND)
          list(APPEND _mc_httplib_extra ZLIB::ZLIB)
        endif()
      endif()
      if("CPPHTTPLIB_BROTLI_SUPPORT" IN_LIST _mc_httplib_defs)
        foreach(b brotlienc brotlidec brotlicommon)
          find_library(MC_LIB_${b} ${b})
          if(MC_LIB_${b})
            list(APPEND _mc_httplib_extra ${MC_LIB_${b}})
          endif()
        endforeach()
      endif()
      if(MC_HTTPLIB_LIBRARY)
        set(_mc_httplib_link ${MC_HTTPLIB_LIBRARY} ${_mc_httplib_extra})
        set(_mc_httplib_how "header + ${MC_HTTPLIB_LIBRARY}")
      else()
        set(_mc_httplib_link ${_mc_httplib_extra})
        set(_mc_httplib_how "header only")
      endif()
    endif()
  endif()
endif()

if(_mc_httplib_how)
  cmake_push_check_state(RESET)
  set(CMAKE_REQUIRED_QUIET ON)
  set(CMAKE_REQUIRED_INCLUDES ${_mc_httplib_inc})
  set(CMAKE_REQUIRED_DEFINITIONS)
  foreach(d ${_mc_httplib_defs})
    list(APPEND CMAKE_REQUIRED_DEFINITIONS -D${d})
  endforeach()
  set(CMAKE_REQUIRED_LIBRARIES ${_mc_httplib_link} Threads::Threads)
  check_cxx_source_compiles([=[
#include <httplib.h>
int main() {
  httplib::Server s;
  s.new_task_queue = [] { return new httplib::ThreadPool(2); };  // as mooncake_master does
  s.Get("/health", [](const httplib::Request&, httplib::Response& r) { r.set_content("ok", "text/plain"); });
  return s.is_running() ? 1 : 0;
}]=] MC_HTTPLIB_LINKS)
  cmake_pop_check_state()
  if(NOT MC_HTTPLIB_LINKS)
    message(FATAL_ERROR
      "cpp-httplib was found (${_mc_httplib_how}) but a program using httplib::Server does not "
      "link with it. A split httplib.h needs its library (Debian's libcpp-httplib-dev ships "
      "libcpp-httplib.so beside the header). See CMakeFiles/CMakeError.log, or configure "
      "with -DMC_HTTPLIB_LIBRARY=/path/to/libcpp-httplib.so.")
  endif()
  add_library(mooncake::httplib INTERFACE IMPORTED)
  if(_mc_httplib_link)
    target_link_libraries(mooncake::httplib INTERFACE ${_mc_httplib_link})
  endif()
  if(_mc_httplib_inc)
    target_include_directories(mooncake::httplib INTERFACE ${_mc_httplib_inc})
  endif()
  if(_mc_httplib_defs)
    target_compile_definitions(mooncake::httplib INTERFACE ${_mc_httplib_defs})
  endif()
  set(MC_HTTPLIB_FOUND ON)
  list(APPEND _mc_deps_summary "cpp-httplib (${_mc_httplib_how})")
else()
  list(APPEND _mc_deps_summary "cpp-httplib not found (no mooncake_master)")
endif()

string(REPLACE ";" ", " _mc_deps_summary "${_mc_deps_summary}")
message(STATUS "mooncake deps: ${_mc_deps_summary}")
