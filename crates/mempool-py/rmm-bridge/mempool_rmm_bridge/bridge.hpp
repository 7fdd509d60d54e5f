/* The C++ side of mempool_rmm_bridge (docs/rmm.md, "Python"): mempool/rmm.hpp over the C entry points of
 * the `mempool` Python package's extension module, which _bridge.pyx looks up by name
 * (mempool._lib._capi_functions()) and sets here once, at import. The entry points of mempool.h that
 * rmm.hpp calls are defined below as forwarders to those addresses, so the bridge shares the extension's
 * registry and its resources, and an allocation never enters Python. The forwarders are hidden (the
 * module is built with -fvisibility=hidden): nothing outside this shared object binds to them. */
#ifndef MEMPOOL_RMM_BRIDGE_HPP
#define MEMPOOL_RMM_BRIDGE_HPP

#include <mempool.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>

namespace mempool_py {

struct capi_table {
  int (*allocate)(const mempool_resource_t*, size_t, void*, void**);
  int (*deallocate)(const mempool_resource_t*, void*, size_t, void*);
  void (*resource_destroy)(mempool_resource_t*);
  int (*resource_retain)(const mempool_resource_t*, mempool_resource_t**);
  int (*resource_is_equal)(const mempool_resource_t*, const mempool_resource_t*, int*);
  int (*resource_device)(const mempool_resource_t*, int*);
  int (*get_current_device_resource)(int, mempool_resource_t**);
  const char* (*status_name)(int);
  const char* (*last_error)(void);
};

/* The entry points in use: set once, before the first resource is made (the module's import), from a
 * complete staging table (commit_functions), and only read after. */
inline capi_table& table() noexcept
{
  static capi_table t{};
  return t;
}

/* Where set_function puts the addresses until commit_functions finds them complete. */
inline capi_table& staging() noexcept
{
  static capi_table t{};
  return t;
}

inline void clear_staging() noexcept { staging() = capi_table{}; }

/* Stages the address of the entry point `name`; false for a name the bridge does not use. */
inline bool set_function(char const* name, std::uintptr_t address) noexcept
{
  auto& t = staging();
#define MEMPOOL_PY_SET(field, entry)                            \
  if (std::strcmp(name, entry) == 0) {                          \
    t.field = reinterpret_cast<decltype(t.field)>(address);     \
    return true;                                                \
  }
  MEMPOOL_PY_SET(allocate, "mempool_allocate")
  MEMPOOL_PY_SET(deallocate, "mempool_deallocate")
  MEMPOOL_PY_SET(resource_destroy, "mempool_resource_destroy")
  MEMPOOL_PY_SET(resource_retain, "mempool_resource_retain")
  MEMPOOL_PY_SET(resource_is_equal, "mempool_resource_is_equal")
  MEMPOOL_PY_SET(resource_device, "mempool_resource_device")
  MEMPOOL_PY_SET(get_current_device_resource, "mempool_get_current_device_resource")
  MEMPOOL_PY_SET(status_name, "mempool_status_name")
  MEMPOOL_PY_SET(last_error, "mempool_last_error")
#undef MEMPOOL_PY_SET
  return false;
}

/* The first entry point not staged yet ("" when all are). */
inline char const* missing_function() noexcept
{
  auto const& t = staging();
  if (t.allocate == nullptr) { return "mempool_allocate"; }
  if (t.deallocate == nullptr) { return "mempool_deallocate"; }
  if (t.resource_destroy == nullptr) { return "mempool_resource_destroy"; }
  if (t.resource_retain == nullptr) { return "mempool_resource_retain"; }
  if (t.resource_is_equal == nullptr) { return "mempool_resource_is_equal"; }
  if (t.resource_device == nullptr) { return "mempool_resource_device"; }
  if (t.get_current_device_resource == nullptr) { return "mempool_get_current_device_resource"; }
  if (t.status_name == nullptr) { return "mempool_status_name"; }
  if (t.last_error == nullptr) { return "mempool_last_error"; }
  return "";
}

/* Makes the staged entry points the ones in use; false (nothing changed) while one is missing. */
inline bool commit_functions() noexcept
{
  if (*missing_function() != '\0') { return false; }
  table() = staging();
  return true;
}

}  // namespace mempool_py

/* mempool.h's entry points, forwarded. Only called once missing_function() is "" (the module refuses to
 * import otherwise). */
extern "C" {
int mempool_allocate(const mempool_resource_t* r, size_t bytes, void* stream, void** out)
{
  return mempool_py::table().allocate(r, bytes, stream, out);
}
int mempool_deallocate(const mempool_resource_t* r, void* ptr, size_t bytes, void* stream)
{
  return mempool_py::table().deallocate(r, ptr, bytes, stream);
}
void mempool_resource_destroy(mempool_resource_t* r) { mempool_py::table().resource_destroy(r); }
int mempool_resource_retain(const mempool_resource_t* r, mempool_resource_t** out)
{
  return mempool_py::table().resource_retain(r, out);
}
int mempool_resource_is_equal(const mempool_resource_t* a, const mempool_resource_t* b, int* out)
{
  return mempool_py::table().resource_is_equal(a, b, out);
}
int mempool_resource_device(const mempool_resource_t* r, int* out)
{
  return mempool_py::table().resource_device(r, out);
}
int mempool_get_current_device_resource(int device, mempool_resource_t** out)
{
  return mempool_py::table().get_current_device_resource(device, out);
}
const char* mempool_status_name(int status) { return mempool_py::table().status_name(status); }
const char* mempool_last_error(void) { return mempool_py::table().last_error(); }
}

#include <mempool/rmm.hpp>

namespace mempool_py {

/* rmm.hpp's resource, on the heap (Cython keeps it in a unique_ptr: rmm_resource has no default
 * constructor). adopt takes the handle even when it throws. */
inline std::unique_ptr<mempool::rmm_resource> adopt(std::uintptr_t handle)
{
  return std::make_unique<mempool::rmm_resource>(
    mempool::rmm_resource::adopt(reinterpret_cast<mempool_resource_t*>(handle)));
}

}  // namespace mempool_py

#endif /* MEMPOOL_RMM_BRIDGE_HPP */
