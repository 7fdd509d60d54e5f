// The RMM bridge (mempool/rmm.hpp) as far as a machine without a GPU can check it, compiled against the
// pinned librmm 26.10 wheel and linked with librmm and libmempool_capi (scripts/rmm-bridge-check.sh, run by
// CI): what RMM 26.10 asks of a resource, at compile time; how mempool's statuses become RMM's exceptions;
// and, where no CUDA driver is installed, that the C ABI's refusals arrive as rmm::cuda_error with mempool's
// message. Prints one line per failed check and "N passed, N failed"; exits 1 on a failure.
#include <mempool/rmm.hpp>

#include <rmm/device_buffer.hpp>
#include <rmm/device_uvector.hpp>
#include <rmm/mr/per_device_resource.hpp>
#include <rmm/resource_ref.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>

// What RMM 26.10 requires of a resource (rmm/mr/per_device_resource.hpp takes a
// cuda::mr::any_resource<cuda::mr::device_accessible>; rmm/resource_ref.hpp's refs take any
// cuda::mr::resource_with<T, device_accessible>), checked where RMM's own resources check it.
static_assert(cuda::mr::resource<mempool::rmm_resource>);
static_assert(cuda::mr::synchronous_resource<mempool::rmm_resource>);
static_assert(cuda::mr::resource_with<mempool::rmm_resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::synchronous_resource_with<mempool::rmm_resource, cuda::mr::device_accessible>);
static_assert(!cuda::mr::resource_with<mempool::rmm_resource, cuda::mr::host_accessible>);
static_assert(std::is_copy_constructible_v<mempool::rmm_resource> &&
              std::is_nothrow_move_constructible_v<mempool::rmm_resource>);
static_assert(
  std::is_constructible_v<cuda::mr::any_resource<cuda::mr::device_accessible>, mempool::rmm_resource>);
static_assert(std::is_constructible_v<rmm::device_async_resource_ref, mempool::rmm_resource&>);
static_assert(std::is_constructible_v<rmm::device_resource_ref, mempool::rmm_resource&>);
static_assert(std::is_constructible_v<rmm::device_buffer,
                                      std::size_t,
                                      cuda::stream_ref,
                                      mempool::rmm_resource>);
static_assert(std::is_constructible_v<rmm::device_uvector<int>,
                                      std::size_t,
                                      cuda::stream_ref,
                                      mempool::rmm_resource>);
// The bridge installs as RMM's current resource (compiled, not called: it asks the CUDA runtime for the
// current device).
[[maybe_unused]] static void install(mempool::rmm_resource const& mr)
{
  rmm::mr::set_current_device_resource(mr);
  rmm::mr::set_per_device_resource(rmm::cuda_device_id{mr.device()}, mr);
}

static int passed = 0;
static int failed = 0;

#define CHECK(cond, what)                                                   \
  do {                                                                      \
    if (cond) {                                                             \
      ++passed;                                                             \
    } else {                                                                \
      ++failed;                                                             \
      std::printf("FAIL line %d: %s: %s\n", __LINE__, #cond, std::string(what).c_str()); \
    }                                                                       \
  } while (0)

// Runs f and reports which exception it threw: "none", or the most derived of RMM's classes, and its text.
template <class F>
static std::string thrown(F&& f, std::string* text = nullptr)
{
  try {
    f();
  } catch (rmm::out_of_memory const& e) {
    if (text) { *text = e.what(); }
    return "rmm::out_of_memory";
  } catch (rmm::bad_alloc const& e) {
    if (text) { *text = e.what(); }
    return "rmm::bad_alloc";
  } catch (rmm::cuda_error const& e) {
    if (text) { *text = e.what(); }
    return "rmm::cuda_error";
  } catch (rmm::logic_error const& e) {
    if (text) { *text = e.what(); }
    return "rmm::logic_error";
  } catch (std::exception const& e) {
    if (text) { *text = e.what(); }
    return "std::exception";
  }
  return "none";
}

static bool contains(std::string const& text, char const* part)
{
  return text.find(part) != std::string::npos;
}

int main()
{
  std::string text;
  // Statuses to exceptions.
  CHECK(thrown([] { mempool::check(MEMPOOL_SUCCESS, "x"); }) == "none", "success");
  CHECK(thrown([] { mempool::check(MEMPOOL_ERROR_OUT_OF_MEMORY, "mempool_allocate"); }, &text) ==
          "rmm::out_of_memory",
        text);
  CHECK(contains(text, "mempool_allocate") && contains(text, "MEMPOOL_ERROR_OUT_OF_MEMORY"), text);
  for (int s : {MEMPOOL_ERROR_DRIVER_NOT_FOUND,
                MEMPOOL_ERROR_DRIVER_TOO_OLD,
                MEMPOOL_ERROR_NO_DEVICE,
                MEMPOOL_ERROR_DRIVER,
                MEMPOOL_ERROR_PEER_ACCESS}) {
    CHECK(thrown([s] { mempool::check(s, "x"); }) == "rmm::cuda_error", mempool_status_name(s));
  }
  for (int s : {MEMPOOL_ERROR_INVALID_ARGUMENT,
                MEMPOOL_ERROR_UNSUPPORTED,
                MEMPOOL_ERROR_INVALID_DEALLOCATION,
                MEMPOOL_ERROR_PANIC,
                MEMPOOL_ERROR_OTHER}) {
    CHECK(thrown([s] { mempool::check(s, "x"); }) == "rmm::logic_error", mempool_status_name(s));
  }
  // out_of_memory is a bad_alloc, as RMM's callers catch it.
  try {
    mempool::check(MEMPOOL_ERROR_OUT_OF_MEMORY, "x");
  } catch (std::bad_alloc const&) {
    ++passed;
  } catch (...) {
    ++failed;
    std::printf("FAIL: out_of_memory is not a std::bad_alloc\n");
  }

  // Null handles are refused before anything else.
  CHECK(thrown([] { (void)mempool::rmm_resource::adopt(nullptr); }, &text) == "rmm::logic_error", text);
  CHECK(contains(text, "null"), text);
  CHECK(thrown([] { (void)mempool::rmm_resource::share(nullptr); }, &text) == "rmm::logic_error", text);
  CHECK(contains(text, "mempool_resource_retain") && contains(text, "resource is null"), text);

  int devices = 0;
  int status  = mempool_device_count(&devices);
  if (status == MEMPOOL_ERROR_DRIVER_NOT_FOUND) {
    // No driver (CI): every way to a resource says so, as rmm::cuda_error with mempool's message.
    CHECK(thrown([] { (void)mempool::rmm_resource::current(0); }, &text) == "rmm::cuda_error", text);
    CHECK(contains(text, "mempool_get_current_device_resource") &&
            contains(text, "MEMPOOL_ERROR_DRIVER_NOT_FOUND"),
          text);
    mempool_resource_t* h = nullptr;
    CHECK(thrown([&] {
            mempool::check(mempool_async_resource_create(0, 0, &h), "mempool_async_resource_create");
          }) == "rmm::cuda_error",
          "async resource without a driver");
    CHECK(h == nullptr, "no handle");
    std::printf("no CUDA driver: the driver-absent paths were checked\n");
  } else {
    std::printf("a CUDA driver is present (%s, %d devices): the driver-absent paths were not checked\n",
                mempool_status_name(status),
                devices);
  }
  CHECK(thrown([] { (void)mempool::rmm_resource::current(-1); }, &text) == "rmm::logic_error", text);
  CHECK(contains(text, "negative"), text);

  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
