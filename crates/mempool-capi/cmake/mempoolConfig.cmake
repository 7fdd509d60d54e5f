# find_package(mempool) for C and C++ projects, from this source tree (docs/rmm.md, "Building against it"):
# point CMAKE_PREFIX_PATH (or mempool_DIR) at crates/mempool-capi/cmake.
#
# Targets:
#   mempool::capi  include/mempool.h and libmempool_capi.so (cargo build --release -p mempool-capi)
#   mempool::rmm   mempool::capi, include/mempool/rmm.hpp and rmm::rmm (RMM 26.06 or later; C++20 for RMM 26.10):
#                  defined when rmm::rmm exists (find_package(rmm) before, or found here)
# mempool_LIBRARY_DIR: the folder of libmempool_capi.so, when it is not $CARGO_TARGET_DIR/{release,debug} or
# the repository's target/{release,debug} (release first).
get_filename_component(_mempool_crate "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
get_filename_component(_mempool_repo "${_mempool_crate}/../.." ABSOLUTE)
set(mempool_INCLUDE_DIR "${_mempool_crate}/include")

set(_mempool_hints)
if(mempool_LIBRARY_DIR)
  list(APPEND _mempool_hints "${mempool_LIBRARY_DIR}")
endif()
if(DEFINED ENV{CARGO_TARGET_DIR})
  list(APPEND _mempool_hints "$ENV{CARGO_TARGET_DIR}/release" "$ENV{CARGO_TARGET_DIR}/debug")
endif()
list(APPEND _mempool_hints "${_mempool_repo}/target/release" "${_mempool_repo}/target/debug")
find_library(mempool_CAPI_LIBRARY NAMES mempool_capi PATHS ${_mempool_hints} NO_DEFAULT_PATH)

if(NOT mempool_CAPI_LIBRARY)
  set(mempool_FOUND FALSE)
  set(mempool_NOT_FOUND_MESSAGE
      "libmempool_capi.so not found in ${_mempool_hints}: run `cargo build --release -p mempool-capi` in ${_mempool_repo}, or set mempool_LIBRARY_DIR")
  return()
endif()

if(NOT TARGET mempool::capi)
  add_library(mempool::capi SHARED IMPORTED)
  set_target_properties(mempool::capi PROPERTIES
    IMPORTED_LOCATION "${mempool_CAPI_LIBRARY}"
    # cargo's cdylib has no SONAME: link it as -lmempool_capi, not by its path.
    IMPORTED_NO_SONAME TRUE
    INTERFACE_INCLUDE_DIRECTORIES "${mempool_INCLUDE_DIR}")
endif()

if(NOT TARGET rmm::rmm)
  find_package(rmm QUIET)
endif()
if(TARGET rmm::rmm AND NOT TARGET mempool::rmm)
  add_library(mempool::rmm INTERFACE IMPORTED)
  set_target_properties(mempool::rmm PROPERTIES
    INTERFACE_LINK_LIBRARIES "mempool::capi;rmm::rmm"
    INTERFACE_COMPILE_FEATURES "cxx_std_20")
endif()
set(mempool_FOUND TRUE)
