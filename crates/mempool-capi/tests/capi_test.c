/* The C ABI as a C program meets it. `capi_test host` checks what holds on any machine (argument checks,
 * PyTorch's refusals); `capi_test nodriver` adds the error paths of a machine without a CUDA driver;
 * `capi_test gpu` allocates on device 0. Prints one line per failed check and exits 1 on any failure. */
#include <stdio.h>
#include <string.h>

#include "mempool.h"

static int failures = 0;

#define CHECK(cond, ...)                                           \
  do {                                                             \
    if (!(cond)) {                                                 \
      failures++;                                                  \
      printf("FAIL line %d: %s: ", __LINE__, #cond);               \
      printf(__VA_ARGS__);                                         \
      printf(" (last error: '%s')\n", mempool_last_error());       \
    }                                                              \
  } while (0)

static void common(void) {
  mempool_resource_t* r = (mempool_resource_t*)0x1;
  CHECK(strcmp(mempool_status_name(MEMPOOL_ERROR_OUT_OF_MEMORY), "MEMPOOL_ERROR_OUT_OF_MEMORY") == 0, "name");
  CHECK(strcmp(mempool_status_name(MEMPOOL_ERROR_PEER_ACCESS), "MEMPOOL_ERROR_PEER_ACCESS") == 0, "peer access name");
  CHECK(strcmp(mempool_status_name(12345), "MEMPOOL_UNKNOWN_STATUS") == 0, "unknown status");
  /* NULL arguments are refused, never dereferenced. */
  CHECK(mempool_pool_resource_create(NULL, 0, 0, 0, &r) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null upstream");
  CHECK(strstr(mempool_last_error(), "upstream is null") != NULL, "message names the argument");
  CHECK(r == (mempool_resource_t*)0x1, "out untouched on failure");
  void* p = (void*)0x1;
  CHECK(mempool_allocate(NULL, 16, NULL, &p) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null resource");
  CHECK(mempool_deallocate(NULL, NULL, 0, NULL) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null resource");
  CHECK(mempool_statistics_get(NULL, NULL) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null resource");
  CHECK(mempool_set_current_device_resource(0, NULL) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null resource");
  CHECK(mempool_cuda_resource_create(-1, &r) == MEMPOOL_ERROR_INVALID_ARGUMENT, "negative device");
  CHECK(strstr(mempool_last_error(), "negative") != NULL, "message");
  CHECK(mempool_device_count(NULL) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null out, refused before the driver is asked");
  CHECK(strstr(mempool_last_error(), "out is null") != NULL, "message names the argument");
  CHECK(mempool_get_current_device_resource(-3, &r) == MEMPOOL_ERROR_INVALID_ARGUMENT, "negative device");
  CHECK(r == (mempool_resource_t*)0x1, "out untouched on failure");
  mempool_resource_destroy(NULL);
  /* PyTorch's entry points: 0 bytes is NULL; an unknown pointer is refused, not freed. */
  CHECK(mempool_torch_alloc_nullable(0, 0, NULL) == NULL, "0 bytes");
  mempool_torch_free((void*)0x100000, 256, 0, NULL);
  CHECK(strstr(mempool_last_error(), "did not hand out") != NULL, "unknown pointer refused");
  CHECK(mempool_torch_alloc_nullable(0, -1, NULL) == NULL, "0 bytes on any device");
  CHECK(mempool_torch_alloc_nullable(16, -1, NULL) == NULL, "negative device");
  CHECK(strstr(mempool_last_error(), "16 bytes") != NULL && strstr(mempool_last_error(), "negative") != NULL,
        "the message names the size and the cause");
}

static int host(void) {
  common();
  return failures;
}

static int nodriver(void) {
  common();
  int n = -1;
  CHECK(mempool_device_count(&n) == MEMPOOL_ERROR_DRIVER_NOT_FOUND, "device count");
  CHECK(strstr(mempool_last_error(), "driver") != NULL, "message names the driver");
  mempool_resource_t* r = NULL;
  CHECK(mempool_cuda_resource_create(0, &r) == MEMPOOL_ERROR_DRIVER_NOT_FOUND, "cuda resource");
  CHECK(r == NULL, "no handle");
  CHECK(mempool_async_resource_create(0, 0, &r) == MEMPOOL_ERROR_DRIVER_NOT_FOUND, "async resource");
  CHECK(mempool_get_current_device_resource(0, &r) == MEMPOOL_ERROR_DRIVER_NOT_FOUND, "current");
  CHECK(mempool_torch_alloc_nullable(1024, 0, NULL) == NULL, "torch alloc without a driver");
  CHECK(strstr(mempool_last_error(), "1024 bytes") != NULL, "torch message names the size");
  return failures;
}

static int gpu(void) {
  common();
  int n = 0;
  CHECK(mempool_device_count(&n) == MEMPOOL_SUCCESS && n >= 1, "device count %d", n);
  mempool_resource_t *base = NULL, *pool = NULL, *stats = NULL, *cur = NULL;
  CHECK(mempool_async_resource_create(0, 0, &base) == MEMPOOL_SUCCESS, "async");
  CHECK(mempool_pool_resource_create(base, 0, 1 << 20, 1 << 24, &pool) == MEMPOOL_SUCCESS, "pool");
  CHECK(mempool_statistics_adaptor_create(pool, &stats) == MEMPOOL_SUCCESS, "stats");
  void* p = NULL;
  CHECK(mempool_allocate(stats, 1000, NULL, &p) == MEMPOOL_SUCCESS && p != NULL, "allocate");
  CHECK(((uintptr_t)p % 256) == 0, "aligned");
  mempool_statistics_t s;
  CHECK(mempool_statistics_get(stats, &s) == MEMPOOL_SUCCESS && s.current_bytes == 1000, "stats");
  CHECK(mempool_deallocate(stats, p, 1000, NULL) == MEMPOOL_SUCCESS, "deallocate");
  CHECK(mempool_allocate(stats, (size_t)1 << 30, NULL, &p) == MEMPOOL_ERROR_OUT_OF_MEMORY, "over the maximum");
  CHECK(strstr(mempool_last_error(), "1073741824") != NULL, "message names the size");
  CHECK(mempool_set_current_device_resource(0, stats) == MEMPOOL_SUCCESS, "set current");
  CHECK(mempool_get_current_device_resource(0, &cur) == MEMPOOL_SUCCESS, "get current");
  /* The handle to the current resource reads the statistics adaptor set as current. */
  CHECK(mempool_statistics_get(cur, &s) == MEMPOOL_SUCCESS && s.total_count == 1, "stats through current");
  /* Handles know their device: a resource of device 0 is refused for device 1 (whether or not it exists). */
  mempool_resource_t* wrong = (mempool_resource_t*)0x1;
  CHECK(mempool_set_current_device_resource(1, stats) == MEMPOOL_ERROR_INVALID_ARGUMENT, "other device");
  CHECK(strstr(mempool_last_error(), "device 0, not on device 1") != NULL, "message names both devices");
  CHECK(mempool_pool_resource_create(base, 1, 0, 0, &wrong) == MEMPOOL_ERROR_INVALID_ARGUMENT, "pool device");
  CHECK(wrong == (mempool_resource_t*)0x1, "no handle");
  void* t = mempool_torch_alloc_nullable(4096, 0, NULL);
  CHECK(t != NULL, "torch alloc");
  CHECK(mempool_statistics_get(stats, &s) == MEMPOOL_SUCCESS && s.current_bytes == 4096, "torch through stats");
  /* A free with the wrong size is refused and frees nothing; the right one then succeeds; a second free
   * of the same pointer is refused. */
  mempool_torch_free(t, 4095, 0, NULL);
  CHECK(strstr(mempool_last_error(), "4095 bytes") != NULL, "wrong size refused");
  CHECK(mempool_statistics_get(stats, &s) == MEMPOOL_SUCCESS && s.current_bytes == 4096, "nothing freed");
  mempool_torch_free(t, 4096, 0, NULL);
  CHECK(strcmp(mempool_last_error(), "") == 0, "torch free");
  CHECK(mempool_statistics_get(stats, &s) == MEMPOOL_SUCCESS && s.current_bytes == 0, "freed");
  mempool_torch_free(t, 4096, 0, NULL);
  CHECK(strstr(mempool_last_error(), "did not hand out") != NULL, "double free refused");
  CHECK(mempool_statistics_get(stats, &s) == MEMPOOL_SUCCESS && s.total_count == 2, "counts");
  mempool_resource_destroy(cur);
  mempool_resource_destroy(stats);
  mempool_resource_destroy(pool);
  mempool_resource_destroy(base);
  return failures;
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  int f;
  if (strcmp(argv[1], "gpu") == 0) {
    f = gpu();
  } else if (strcmp(argv[1], "host") == 0) {
    f = host();
  } else if (strcmp(argv[1], "nodriver") == 0) {
    f = nodriver();
  } else {
    return 2;
  }
  printf("%d failures\n", f);
  return f == 0 ? 0 : 1;
}
