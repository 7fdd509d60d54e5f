/* mempool's C ABI: stream-ordered memory resources for C and C++ programs.
 *
 * Link with -lmempool_capi (crates/mempool-capi, built by cargo as libmempool_capi.so). The Python
 * extension module of the `mempool` package exports the same symbols, so C code loaded into a Python
 * process that uses mempool shares its per-device current resource.
 *
 * Every function that can fail returns a mempool_status_t and leaves a message naming the cause in
 * mempool_last_error() (per thread). No function lets an exception or panic escape, with one
 * documented exception: mempool_torch_alloc, which PyTorch calls, throws a C++ std::runtime_error on
 * failure because PyTorch ignores a NULL return.
 *
 * Streams are CUstream / cudaStream_t values passed as void*; NULL is the legacy default stream.
 * mempool never creates or destroys a stream it is given: the caller keeps it alive until the work
 * and frees ordered on it are queued.
 */
#ifndef MEMPOOL_H
#define MEMPOOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The status a call returns, each with its one-line summary; mempool_last_error() names the cause. (The
 * codes are defined in crates/mempool-capi/src/error.rs; tests/abi.rs checks this header against it.) */
typedef enum mempool_status {
  /* the call succeeded */
  MEMPOOL_SUCCESS = 0,
  /* a NULL or out-of-range argument; the message names it and why */
  MEMPOOL_ERROR_INVALID_ARGUMENT = 1,
  /* no CUDA driver (libcuda.so) could be loaded */
  MEMPOOL_ERROR_DRIVER_NOT_FOUND = 2,
  /* the driver lacks a call this needs; the message names the call and the versions */
  MEMPOOL_ERROR_DRIVER_TOO_OLD = 3,
  /* no device, or no device with that ordinal */
  MEMPOOL_ERROR_NO_DEVICE = 4,
  /* out of memory, or over a limiting adaptor's limit; the message names the size asked for */
  MEMPOOL_ERROR_OUT_OF_MEMORY = 5,
  /* the device or resource cannot serve the request (a missing capability, a size it does not serve) */
  MEMPOOL_ERROR_UNSUPPORTED = 6,
  /* a free that matched no live allocation */
  MEMPOOL_ERROR_INVALID_DEALLOCATION = 7,
  /* another driver call failed; the message names the call and the CUDA error */
  MEMPOOL_ERROR_DRIVER = 8,
  /* a bug in mempool: a panic caught at the C boundary */
  MEMPOOL_ERROR_PANIC = 9,
  /* anything else (the logging adaptor's I/O, ...); the message names it */
  MEMPOOL_ERROR_OTHER = 10,
  /* a device cannot access the other's memory (no peer capability); the message names both devices */
  MEMPOOL_ERROR_PEER_ACCESS = 11
} mempool_status_t;

/* A counted reference to a resource, which knows the device the resource allocates on. Every handle a
 * *_create or mempool_get_* call returns is released with mempool_resource_destroy; the resource lives
 * while any handle, adaptor over it or registry entry holds it. A pointer from mempool_allocate does NOT
 * hold its resource: free every such allocation (mempool_deallocate) before the last of those references
 * goes. (Allocations of the PyTorch entry points below do hold the resource that made them.) */
typedef struct mempool_resource mempool_resource_t;

typedef struct mempool_statistics {
  int64_t current_bytes, peak_bytes, total_bytes;
  int64_t current_count, peak_count, total_count;
} mempool_statistics_t;

/* The calling thread's last error message ("" after a success); valid until its next mempool call. */
const char* mempool_last_error(void);
/* "MEMPOOL_ERROR_OUT_OF_MEMORY", ...; "MEMPOOL_UNKNOWN_STATUS" for other values. */
const char* mempool_status_name(int status);
int mempool_device_count(int* out);

/* Resources (RMM's names in brackets). */
int mempool_cuda_resource_create(int device, mempool_resource_t** out);    /* cuda_memory_resource */
int mempool_managed_resource_create(int device, mempool_resource_t** out); /* managed_memory_resource */
/* cuda_async_memory_resource: a new driver pool that keeps what it reserves; initial_pool_size 0 = none */
int mempool_async_resource_create(int device, size_t initial_pool_size, mempool_resource_t** out);
/* pool_memory_resource over upstream; maximum_pool_size 0 = no maximum; device must be upstream's device
 * (MEMPOOL_ERROR_INVALID_ARGUMENT otherwise) */
int mempool_pool_resource_create(const mempool_resource_t* upstream, int device, size_t initial_pool_size,
                                 size_t maximum_pool_size, mempool_resource_t** out);
/* binning_memory_resource over upstream: bins of 2^min_size_exponent to 2^max_size_exponent bytes (under 8:
 * the 256-byte bin), larger requests to upstream; 0 <= min <= max <= 40 (MEMPOOL_ERROR_INVALID_ARGUMENT
 * otherwise). mempool's default stack: bins 8 to 20 over a pool over the driver's pool. */
int mempool_binning_resource_create(const mempool_resource_t* upstream, int min_size_exponent,
                                    int max_size_exponent, mempool_resource_t** out);
/* arena_memory_resource over upstream: a global arena of arena_size bytes (not 0), per-stream arenas. */
int mempool_arena_resource_create(const mempool_resource_t* upstream, size_t arena_size, mempool_resource_t** out);
int mempool_statistics_adaptor_create(const mempool_resource_t* upstream, mempool_resource_t** out);
int mempool_limiting_adaptor_create(const mempool_resource_t* upstream, size_t limit, mempool_resource_t** out);
/* On out of memory: trim the stack under it, synchronize the stream, retry once (docs/observe.md). */
int mempool_oom_retry_adaptor_create(const mempool_resource_t* upstream, mempool_resource_t** out);
/* Records allocations and frees in a ring of capacity events (capacity 0: MEMPOOL_ERROR_INVALID_ARGUMENT). */
int mempool_history_adaptor_create(const mempool_resource_t* upstream, size_t capacity, mempool_resource_t** out);
/* MEMPOOL_ERROR_INVALID_ARGUMENT unless resource is a statistics adaptor */
int mempool_statistics_get(const mempool_resource_t* resource, mempool_statistics_t* out);
void mempool_resource_destroy(mempool_resource_t* resource); /* NULL is a no-op */
/* A new handle to the same resource (a counted reference of its own, released with
 * mempool_resource_destroy): how a wrapper keeps a handle it was lent (mempool/rmm.hpp). */
int mempool_resource_retain(const mempool_resource_t* resource, mempool_resource_t** out);
/* *out = 1 when memory allocated through a may be freed through b (the same resource, or resources that
 * say they are equal, RMM's is_equal, on the same device), else 0. */
int mempool_resource_is_equal(const mempool_resource_t* a, const mempool_resource_t* b, int* out);
/* *out = the ordinal of the device the resource allocates on. */
int mempool_resource_device(const mempool_resource_t* resource, int* out);

/* Allocation, ordered on stream. 0 bytes gives NULL. deallocate's ptr must come from allocate of the same
 * resource with the same size, once, with no use ordered after the free on stream, while the resource is
 * still held (see mempool_resource_t: the pointer does not keep it alive). */
int mempool_allocate(const mempool_resource_t* resource, size_t bytes, void* stream, void** out);
int mempool_deallocate(const mempool_resource_t* resource, void* ptr, size_t bytes, void* stream);

/* The per-device current resource (RMM's set/get_current_device_resource). set keeps its own reference
 * and refuses a resource of another device (MEMPOOL_ERROR_INVALID_ARGUMENT); get returns a new handle to
 * destroy, which mempool_statistics_get reads when the current resource is a statistics adaptor. The
 * default, made on first use, is over the device's default pool. */
int mempool_set_current_device_resource(int device, const mempool_resource_t* resource);
int mempool_get_current_device_resource(int device, mempool_resource_t** out);

/* The service resource (mempool-rmm's ServiceResource): one virtual reservation on the device, divided into
 * a region per tag ("default" is tag 0; others are made by name), physical memory mapped in chunks where
 * allocations land (addresses never move), and whole tags put to sleep (their memory released, addresses
 * kept) and woken. Its handle allocates under the default tag and is usable wherever a resource is; so is
 * the handle of mempool_service_tagged_resource, which allocates under one tag. Out of memory
 * (MEMPOOL_ERROR_OUT_OF_MEMORY) names the size, the tag, what the resource holds and has live, the
 * largest free block and the device's free memory. Every mempool_service_* call below takes a handle of
 * either kind (any other resource is MEMPOOL_ERROR_INVALID_ARGUMENT), and tags by number. */
typedef enum mempool_sleep_mode {
  MEMPOOL_SLEEP_DISCARD = 0, /* the contents are lost; wake maps fresh memory at the same addresses */
  MEMPOOL_SLEEP_OFFLOAD = 1  /* the contents go to pinned host memory; wake copies them back */
} mempool_sleep_mode_t;

/* watermark_percent of mempool_service_resource_create: idle chunks are unmapped only on out of memory. */
#define MEMPOOL_RECLAIM_ON_OUT_OF_MEMORY (-1)

typedef struct mempool_service_sleep_report {
  uint64_t released_bytes, offloaded_bytes;
} mempool_service_sleep_report_t;

typedef struct mempool_service_wake_report {
  uint64_t mapped_bytes, restored_bytes;
} mempool_service_wake_report_t;

typedef struct mempool_service_stats {
  uint64_t mapped_bytes, peak_mapped_bytes, used_bytes, peak_used_bytes;
  uint64_t reservation_bytes, chunk_size, reclaims, reclaimed_bytes;
  size_t num_tags; /* how many tags there are (mempool_service_stats writes at most tags_capacity of them) */
} mempool_service_stats_t;

typedef struct mempool_service_tag_stats {
  char name[65]; /* NUL-terminated */
  uint32_t tag;
  int asleep; /* -1 while awake, else the mempool_sleep_mode_t it sleeps in */
  uint64_t used_bytes, peak_used_bytes, live_allocations, allocations, frees;
  uint64_t mapped_bytes, offloaded_bytes, largest_free_mapped, exports;
} mempool_service_tag_stats_t;

/* max_tags 0: 8; chunk_size 0: the recommended granularity, at least 2 MiB; region_size 0: twice the
 * device's memory (address space per tag); watermark_percent: at most that much mapped above the peak of
 * live bytes (15 is the Rust default), or MEMPOOL_RECLAIM_ON_OUT_OF_MEMORY; shareable: 1, 0, or -1 where
 * the device supports it. */
int mempool_service_resource_create(int device, size_t max_tags, size_t chunk_size, size_t region_size,
                                    int watermark_percent, int shareable, mempool_resource_t** out);
/* The tag named name, made if there is none (1 to 64 ASCII letters, digits, '_', '-', '.', ':'). */
int mempool_service_tag(const mempool_resource_t* service, const char* name, uint32_t* out);
/* A new handle allocating under tag (destroy it with mempool_resource_destroy). */
int mempool_service_tagged_resource(const mempool_resource_t* service, uint32_t tag, mempool_resource_t** out);
/* Releases the tags' physical memory (mode: a mempool_sleep_mode_t), after waiting for the frees into them
 * still in flight and, where a tag still has live allocations, for the whole device (a tag with nothing live
 * does not wait for the device). Refused, changing nothing, for an unknown tag, one asleep or shared with
 * another process, and a stream with work still queued. A free into a sleeping tag is taken; allocating from
 * it is refused. */
int mempool_service_sleep(const mempool_resource_t* service, const uint32_t* tags, size_t num_tags, int mode,
                          void* stream, mempool_service_sleep_report_t* out);
/* Maps the sleeping tags back at the same addresses, restoring offloaded contents; awake tags are skipped;
 * returns once stream is done. */
int mempool_service_wake(const mempool_resource_t* service, const uint32_t* tags, size_t num_tags, void* stream,
                         mempool_service_wake_report_t* out);
/* Unmaps every idle chunk of the awake tags (after waiting for the frees in flight); *out: the bytes released. */
int mempool_service_trim(const mempool_resource_t* service, uint64_t* out);
int mempool_service_reset_peaks(const mempool_resource_t* service);
/* Totals to *out, and the first tags_capacity tags (in tag order) to tags (NULL when tags_capacity is 0). */
int mempool_service_stats(const mempool_resource_t* service, mempool_service_stats_t* out,
                          mempool_service_tag_stats_t* tags, size_t tags_capacity);

/* PyTorch's pluggable allocator (torch.cuda.memory.CUDAPluggableAllocator): allocate from the device's
 * current resource; free returns the memory to the resource that allocated it (an unknown pointer or a
 * wrong size is refused, not freed). mempool_torch_alloc throws std::runtime_error on failure (message
 * naming the size); mempool_torch_alloc_nullable returns NULL instead: use it for torch.cuda.MemPool, whose
 * caching allocator frees its cache and retries on NULL. */
void* mempool_torch_alloc(size_t size, int device, void* stream);
void* mempool_torch_alloc_nullable(size_t size, int device, void* stream);
void mempool_torch_free(void* ptr, size_t size, int device, void* stream);

/* CuPy's C allocator (cupy.cuda.memory.CFunctionAllocator(param, malloc, free, owner)): allocate from the
 * device's current resource on the stream param's current_stream returns (the legacy default stream when
 * param or the function is NULL), and free on the stream of the allocation (an unknown pointer is refused,
 * not freed). param points to a mempool_cupy_param_t that lives for the rest of the process. On failure,
 * malloc calls param's raise (status, message) and returns (void*)-1, or returns NULL without a raise. */
typedef struct mempool_cupy_param {
  intptr_t (*current_stream)(void);       /* the calling thread's stream; negative: could not be read */
  void* (*hold)(intptr_t stream);         /* keeps a non-default stream alive; NULL: failed */
  void (*release)(void* token);           /* ends a hold */
  void (*raise)(int status, const char* message); /* reports a failed allocation */
} mempool_cupy_param_t;
void* mempool_cupy_malloc(void* param, size_t size, int device);
void mempool_cupy_free(void* param, void* ptr, int device);

#ifdef __cplusplus
}
#endif

#endif /* MEMPOOL_H */
