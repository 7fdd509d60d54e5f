/* mempool/rmm.hpp: any mempool resource of the C ABI (mempool.h) as a memory resource RMM 26.06 and later
 * take (docs/rmm.md).
 *
 *   mempool_resource_t* h = nullptr;
 *   mempool::check(mempool_async_resource_create(0, 0, &h), "mempool_async_resource_create");
 *   auto mr = mempool::rmm_resource::adopt(h);   // owns h from here on
 *   rmm::mr::set_current_device_resource(mr);     // rmm::device_buffer, libcudf, ... allocate from mempool
 *
 * mempool::rmm_resource satisfies CCCL's cuda::mr::resource_with<T, cuda::mr::device_accessible>, which is
 * what RMM asks of a resource since device_memory_resource went away (RMM 26.06): allocate(stream_ref, bytes,
 * alignment), deallocate(stream_ref, ptr, bytes, alignment) noexcept, allocate_sync, deallocate_sync,
 * operator==, and the device_accessible property. It is a value type: copies share one handle (a
 * std::shared_ptr), which is released with the last copy; never during process exit
 * (rmm::process_is_exiting()), since RMM keeps the current resource until then and the driver may be gone.
 *
 * Errors, as RMM's own resources report them: out of memory (mempool's message names the size and what the
 * resource holds) is rmm::out_of_memory; a refused argument is rmm::logic_error; any other failure to
 * allocate is rmm::bad_alloc. deallocate is noexcept: a free mempool refuses (a pointer it did not hand
 * out, a wrong size) is counted (failed_deallocations(), last_deallocation_error()), never thrown.
 *
 * Alignment: mempool returns 256-byte aligned memory (rmm::CUDA_ALLOCATION_ALIGNMENT). A power of two up to
 * 256 is served as it is; a larger power of two is served by over-allocating alignment - 256 bytes and
 * remembering the block (as RMM's aligned_resource_adaptor does; one table for the process, so
 * any equal resource frees it): deallocate must be given the same alignment; anything else is refused with rmm::bad_alloc, as RMM's cuda_memory_resource refuses an
 * alignment it does not support.
 *
 * Like every RMM resource, use it with its device current (cudaSetDevice); allocate_sync and
 * deallocate_sync synchronize the legacy default stream of the resource's device.
 *
 * Needs RMM's headers (librmm 26.06 or later, and CCCL, rapids-logger and the CUDA runtime's headers it
 * includes), C++17 or later, and linking with librmm and libmempool_capi. */
#ifndef MEMPOOL_RMM_HPP
#define MEMPOOL_RMM_HPP

#include <mempool.h>

#include <rmm/aligned.hpp>
#include <rmm/error.hpp>
#include <rmm/process_is_exiting.hpp>

#include <cuda/memory_resource>
#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace mempool {

namespace detail {

/* "mempool: WHAT: MEMPOOL_ERROR_X: <mempool_last_error()>" (the last error is per thread: read it right
 * after the call that failed). */
inline std::string message(int status, char const* what)
{
  std::string text{"mempool: "};
  text += what;
  text += ": ";
  text += mempool_status_name(status);
  char const* last = mempool_last_error();
  if (last != nullptr && *last != '\0') {
    text += ": ";
    text += last;
  }
  return text;
}

/* The failure of an allocation, as RMM's resources throw it (RMM_CUDA_TRY_ALLOC). */
[[noreturn]] inline void throw_allocation_failure(int status, char const* what)
{
  auto text = message(status, what);
  switch (status) {
    case MEMPOOL_ERROR_OUT_OF_MEMORY: throw rmm::out_of_memory{text};
    case MEMPOOL_ERROR_INVALID_ARGUMENT: throw rmm::logic_error{text};
    default: throw rmm::bad_alloc{text};
  }
}

/* An over-aligned block: what mempool allocated for it. */
struct block {
  void* ptr;
  std::size_t bytes;
};

/* Every over-aligned block of the process, by its aligned address (unique among live allocations), so that
 * any resource equal to the one that allocated a block frees it. Never destroyed: a free during exit still
 * finds it. */
struct shifted_blocks {
  std::mutex mutex;
  std::unordered_map<void*, block> blocks;
};
inline shifted_blocks& shifted()
{
  static auto* blocks = new shifted_blocks{};
  return *blocks;
}

}  // namespace detail

/* Throws for a status other than MEMPOOL_SUCCESS: rmm::out_of_memory for out of memory, rmm::cuda_error for
 * the driver's failures (no driver, too old, no device, a driver call, peer access), rmm::logic_error for
 * the rest (a refused argument, an unsupported request, ...). what names the call in the message. */
inline void check(int status, char const* what)
{
  if (status == MEMPOOL_SUCCESS) { return; }
  auto text = detail::message(status, what);
  switch (status) {
    case MEMPOOL_ERROR_OUT_OF_MEMORY: throw rmm::out_of_memory{text};
    case MEMPOOL_ERROR_DRIVER_NOT_FOUND:
    case MEMPOOL_ERROR_DRIVER_TOO_OLD:
    case MEMPOOL_ERROR_NO_DEVICE:
    case MEMPOOL_ERROR_DRIVER:
    case MEMPOOL_ERROR_PEER_ACCESS: throw rmm::cuda_error{text};
    default: throw rmm::logic_error{text};
  }
}

/* A mempool resource (any mempool_resource_t: the driver pool, pool, binning, arena, an adaptor, the current
 * resource, a tag of the service resource) as an RMM memory resource. */
class rmm_resource {
 public:
  /* Takes ownership of handle, a handle of a *_create or mempool_get_* call: the last copy releases it
   * (mempool_resource_destroy). A null handle is rmm::logic_error. */
  static rmm_resource adopt(mempool_resource_t* handle)
  {
    if (handle == nullptr) {
      throw rmm::logic_error{"mempool: rmm_resource::adopt: the handle is null"};
    }
    int device = 0;
    int status = mempool_resource_device(handle, &device);
    if (status != MEMPOOL_SUCCESS) {
      auto text = detail::message(status, "mempool_resource_device");
      mempool_resource_destroy(handle);
      throw rmm::logic_error{text};
    }
    return rmm_resource{std::make_shared<state>(handle, device)};
  }

  /* Keeps a handle of its own to the resource handle refers to (mempool_resource_retain); the caller keeps
   * handle and may release it at any time. */
  static rmm_resource share(mempool_resource_t const* handle)
  {
    mempool_resource_t* own = nullptr;
    check(mempool_resource_retain(handle, &own), "mempool_resource_retain");
    return adopt(own);
  }

  /* The device's current mempool resource (mempool_get_current_device_resource), as it is now. */
  static rmm_resource current(int device)
  {
    mempool_resource_t* own = nullptr;
    check(mempool_get_current_device_resource(device, &own), "mempool_get_current_device_resource");
    return adopt(own);
  }

  /* bytes ordered on stream, aligned to alignment (see the top of this file); 0 bytes is nullptr. */
  void* allocate(cuda::stream_ref stream,
                 std::size_t bytes,
                 std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT)
  {
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
      throw rmm::bad_alloc{"mempool: alignment " + std::to_string(alignment) +
                           " is not a power of two"};
    }
    if (bytes == 0) { return nullptr; }
    void* stream_handle = static_cast<void*>(stream.get());
    if (alignment <= rmm::CUDA_ALLOCATION_ALIGNMENT) {
      void* ptr  = nullptr;
      int status = mempool_allocate(state_->handle, bytes, stream_handle, &ptr);
      if (status != MEMPOOL_SUCCESS) { detail::throw_allocation_failure(status, "mempool_allocate"); }
      return ptr;
    }
    std::size_t const extra = alignment - rmm::CUDA_ALLOCATION_ALIGNMENT;
    if (bytes > SIZE_MAX - extra) {
      throw rmm::out_of_memory{"mempool: " + std::to_string(bytes) + " bytes aligned to " +
                               std::to_string(alignment) + " overflow the address space"};
    }
    void* raw  = nullptr;
    int status = mempool_allocate(state_->handle, bytes + extra, stream_handle, &raw);
    if (status != MEMPOOL_SUCCESS) { detail::throw_allocation_failure(status, "mempool_allocate"); }
    auto const address = reinterpret_cast<std::uintptr_t>(raw);
    void* aligned      = reinterpret_cast<void*>((address + alignment - 1) & ~(alignment - 1));
    try {
      auto& table = detail::shifted();
      std::lock_guard<std::mutex> lock{table.mutex};
      table.blocks.emplace(aligned, detail::block{raw, bytes + extra});
    } catch (...) {
      mempool_deallocate(state_->handle, raw, bytes + extra, stream_handle);
      throw rmm::bad_alloc{"mempool: no memory to record an over-aligned block"};
    }
    return aligned;
  }

  /* Returns ptr (of bytes, allocated with alignment) ordered on stream; nullptr is a no-op. Never throws: a
   * free mempool refuses is counted in failed_deallocations(). */
  void deallocate(cuda::stream_ref stream,
                  void* ptr,
                  std::size_t bytes,
                  std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) noexcept
  {
    if (ptr == nullptr) { return; }
    void* stream_handle = static_cast<void*>(stream.get());
    if (alignment > rmm::CUDA_ALLOCATION_ALIGNMENT) {
      detail::block b{};
      {
        auto& table = detail::shifted();
        std::lock_guard<std::mutex> lock{table.mutex};
        auto it = table.blocks.find(ptr);
        if (it == table.blocks.end()) {
          state_->failed("mempool: deallocate: " + std::to_string(bytes) +
                         " bytes at an address no mempool resource allocated with alignment " +
                         std::to_string(alignment));
          return;
        }
        b = it->second;
        table.blocks.erase(it);
      }
      ptr   = b.ptr;
      bytes = b.bytes;
    }
    int status = mempool_deallocate(state_->handle, ptr, bytes, stream_handle);
    if (status != MEMPOOL_SUCCESS) { state_->failed(detail::message(status, "mempool_deallocate")); }
  }

  /* allocate on the legacy default stream, then synchronize it: the memory is ready for any stream. */
  void* allocate_sync(std::size_t bytes, std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT)
  {
    void* ptr = allocate(cuda::stream_ref{cudaStream_t{nullptr}}, bytes, alignment);
    cudaError_t const err = synchronize_default_stream();
    if (err != cudaSuccess) {
      deallocate(cuda::stream_ref{cudaStream_t{nullptr}}, ptr, bytes, alignment);
      throw rmm::cuda_error{std::string{"mempool: allocate_sync: cudaStreamSynchronize: "} +
                            cudaGetErrorName(err) + ": " + cudaGetErrorString(err)};
    }
    return ptr;
  }

  /* deallocate on the legacy default stream, then synchronize it. */
  void deallocate_sync(void* ptr,
                       std::size_t bytes,
                       std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT) noexcept
  {
    deallocate(cuda::stream_ref{cudaStream_t{nullptr}}, ptr, bytes, alignment);
    cudaError_t const err = synchronize_default_stream();
    if (err != cudaSuccess) {
      state_->failed(std::string{"mempool: deallocate_sync: cudaStreamSynchronize: "} +
                     cudaGetErrorName(err));
    }
  }

  /* Equal when memory allocated through one may be freed through the other: copies, handles of the same
   * resource (mempool_resource_is_equal). */
  bool operator==(rmm_resource const& other) const noexcept
  {
    if (state_ == other.state_) { return true; }
    int equal = 0;
    return mempool_resource_is_equal(state_->handle, other.state_->handle, &equal) == MEMPOOL_SUCCESS &&
           equal == 1;
  }
  bool operator!=(rmm_resource const& other) const noexcept { return !(*this == other); }

  /* Memory of every mempool resource is device memory. */
  friend void get_property(rmm_resource const&, cuda::mr::device_accessible) noexcept {}

  /* The handle (owned by this resource and its copies: do not destroy it). */
  [[nodiscard]] mempool_resource_t const* handle() const noexcept { return state_->handle; }
  /* The device the resource allocates on. */
  [[nodiscard]] int device() const noexcept { return state_->device; }
  /* How many frees mempool refused through this resource and its copies, and the last one's message. */
  [[nodiscard]] std::size_t failed_deallocations() const noexcept { return state_->failures.load(); }
  [[nodiscard]] std::string last_deallocation_error() const
  {
    std::lock_guard<std::mutex> lock{state_->mutex};
    return state_->last_failure;
  }

 private:
  /* What copies share: the handle, the device, the refused frees. */
  struct state {
    state(mempool_resource_t* h, int d) : handle{h}, device{d} {}
    state(state const&)            = delete;
    state& operator=(state const&) = delete;
    ~state()
    {
      /* RMM keeps the current resource until exit; by then the driver may be torn down: leak it then. */
      if (!rmm::process_is_exiting()) { mempool_resource_destroy(handle); }
    }
    void failed(std::string text) noexcept
    {
      failures.fetch_add(1);
      try {
        std::lock_guard<std::mutex> lock{mutex};
        last_failure = std::move(text);
      } catch (...) {
      }
    }
    mempool_resource_t* handle;
    int device;
    mutable std::mutex mutex;
    std::atomic<std::size_t> failures{0};
    std::string last_failure;
  };

  explicit rmm_resource(std::shared_ptr<state> s) : state_{std::move(s)} {}

  /* The legacy default stream of the resource's device, which allocate and deallocate used. */
  cudaError_t synchronize_default_stream() const noexcept
  {
    int current = 0;
    cudaError_t err = cudaGetDevice(&current);
    if (err != cudaSuccess) { return err; }
    if (current == state_->device) { return cudaStreamSynchronize(cudaStream_t{nullptr}); }
    err = cudaSetDevice(state_->device);
    if (err != cudaSuccess) { return err; }
    err = cudaStreamSynchronize(cudaStream_t{nullptr});
    cudaError_t const back = cudaSetDevice(current);
    return err != cudaSuccess ? err : back;
  }

  std::shared_ptr<state> state_;
};

static_assert(std::is_copy_constructible_v<rmm_resource> && std::is_move_constructible_v<rmm_resource>);
static_assert(cuda::mr::synchronous_resource_with<rmm_resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::resource_with<rmm_resource, cuda::mr::device_accessible>);

}  // namespace mempool

#endif /* MEMPOOL_RMM_HPP */
