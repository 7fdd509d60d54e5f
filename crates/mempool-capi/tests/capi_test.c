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
  CHECK(mempool_binning_resource_create(NULL, 8, 20, &r) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null upstream");
  CHECK(mempool_arena_resource_create(NULL, 1 << 20, &r) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null upstream");
  CHECK(strstr(mempool_last_error(), "upstream is null") != NULL, "message names the argument");
  CHECK(r == (mempool_resource_t*)0x1, "out untouched on failure");
  mempool_resource_destroy(NULL);
  /* retain, is_equal and device refuse NULL handles and outputs, leaving the output untouched. */
  CHECK(mempool_resource_retain(NULL, &r) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null resource");
  CHECK(strstr(mempool_last_error(), "resource is null") != NULL, "message names the argument");
  CHECK(r == (mempool_resource_t*)0x1, "out untouched on failure");
  int eq = 7, dev = 7;
  CHECK(mempool_resource_is_equal(NULL, NULL, &eq) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null a");
  CHECK(strstr(mempool_last_error(), "a is null") != NULL, "message names the argument");
  CHECK(eq == 7, "out untouched on failure");
  CHECK(mempool_resource_device(NULL, &dev) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null resource");
  CHECK(dev == 7, "out untouched on failure");
  /* PyTorch's entry points: 0 bytes is NULL; an unknown pointer is refused, not freed. */
  CHECK(mempool_torch_alloc_nullable(0, 0, NULL) == NULL, "0 bytes");
  mempool_torch_free((void*)0x100000, 256, 0, NULL);
  CHECK(strstr(mempool_last_error(), "did not hand out") != NULL, "unknown pointer refused");
  CHECK(mempool_torch_alloc_nullable(0, -1, NULL) == NULL, "0 bytes on any device");
  CHECK(mempool_torch_alloc_nullable(16, -1, NULL) == NULL, "negative device");
  CHECK(strstr(mempool_last_error(), "16 bytes") != NULL && strstr(mempool_last_error(), "negative") != NULL,
        "the message names the size and the cause");
  /* The service resource's entry points refuse NULL handles and outputs, and options checked before the
   * driver is asked. */
  uint32_t tag = 7;
  CHECK(mempool_service_tag(NULL, "weights", &tag) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null service");
  CHECK(strstr(mempool_last_error(), "service is null") != NULL, "message names the argument");
  CHECK(tag == 7, "out untouched on failure");
  CHECK(mempool_service_tagged_resource(NULL, 0, &r) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null service");
  CHECK(r == (mempool_resource_t*)0x1, "out untouched on failure");
  mempool_service_sleep_report_t sleep_report;
  mempool_service_wake_report_t wake_report;
  CHECK(mempool_service_sleep(NULL, &tag, 1, MEMPOOL_SLEEP_OFFLOAD, NULL, &sleep_report) ==
            MEMPOOL_ERROR_INVALID_ARGUMENT,
        "null service");
  CHECK(mempool_service_wake(NULL, &tag, 1, NULL, &wake_report) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null service");
  uint64_t released = 0;
  CHECK(mempool_service_trim(NULL, &released) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null service");
  CHECK(mempool_service_reset_peaks(NULL) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null service");
  mempool_service_stats_t stats;
  CHECK(mempool_service_stats(NULL, &stats, NULL, 0) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null service");
  CHECK(mempool_service_resource_create(-1, 0, 0, 0, 15, -1, &r) == MEMPOOL_ERROR_INVALID_ARGUMENT, "negative device");
  CHECK(mempool_service_resource_create(0, 0, 0, 0, -2, -1, &r) == MEMPOOL_ERROR_INVALID_ARGUMENT, "watermark");
  CHECK(strstr(mempool_last_error(), "watermark_percent -2") != NULL, "message names the argument");
  CHECK(mempool_service_resource_create(0, 0, 0, 0, MEMPOOL_RECLAIM_ON_OUT_OF_MEMORY, 2, &r) ==
            MEMPOOL_ERROR_INVALID_ARGUMENT,
        "shareable");
  CHECK(strstr(mempool_last_error(), "shareable is 2") != NULL, "message names the argument");
  CHECK(r == (mempool_resource_t*)0x1, "out untouched on failure");
}

/* The service resource on device 0: tags, statistics, sleep and wake, trim, out of memory. */
static void service_gpu(void) {
  mempool_resource_t *svc = NULL, *weights_mr = NULL, *base = NULL;
  CHECK(mempool_service_resource_create(0, 4, 0, (size_t)1 << 30, 15, -1, &svc) == MEMPOOL_SUCCESS, "service");
  if (svc == NULL) return;
  uint32_t weights = 99, again = 98, def = 97;
  CHECK(mempool_service_tag(svc, "weights", &weights) == MEMPOOL_SUCCESS && weights == 1, "tag %u", weights);
  CHECK(mempool_service_tag(svc, "weights", &again) == MEMPOOL_SUCCESS && again == 1, "same tag %u", again);
  CHECK(mempool_service_tag(svc, "default", &def) == MEMPOOL_SUCCESS && def == 0, "default tag %u", def);
  CHECK(mempool_service_tag(svc, "no spaces", &again) == MEMPOOL_ERROR_INVALID_ARGUMENT, "bad name");
  CHECK(strstr(mempool_last_error(), "no spaces") != NULL, "message names the name");
  CHECK(mempool_service_tag(svc, NULL, &again) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null name");
  CHECK(mempool_service_tagged_resource(svc, 9, &weights_mr) == MEMPOOL_ERROR_INVALID_ARGUMENT, "unknown tag");
  CHECK(strstr(mempool_last_error(), "tag 9") != NULL && strstr(mempool_last_error(), "`weights`") != NULL,
        "message names the tag and the tags there are");
  CHECK(mempool_service_tagged_resource(svc, weights, &weights_mr) == MEMPOOL_SUCCESS, "tagged");
  /* Another resource is not a service resource. */
  CHECK(mempool_async_resource_create(0, 0, &base) == MEMPOOL_SUCCESS, "async");
  uint64_t released = 0;
  CHECK(mempool_service_trim(base, &released) == MEMPOOL_ERROR_INVALID_ARGUMENT, "not a service resource");
  CHECK(strstr(mempool_last_error(), "not a service resource") != NULL, "message");

  size_t n = (size_t)3 << 20;
  void *p = NULL, *q = NULL, *r = NULL;
  CHECK(mempool_allocate(weights_mr, n, NULL, &p) == MEMPOOL_SUCCESS && p != NULL, "allocate under weights");
  CHECK(mempool_allocate(svc, 1000, NULL, &q) == MEMPOOL_SUCCESS && q != NULL, "allocate under default");
  mempool_service_stats_t st;
  mempool_service_tag_stats_t ts[4];
  memset(ts, 0, sizeof ts);
  CHECK(mempool_service_stats(svc, &st, ts, 4) == MEMPOOL_SUCCESS && st.num_tags == 2, "stats: %zu tags",
        st.num_tags);
  CHECK(mempool_service_stats(svc, &st, NULL, 1) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null tags with capacity");
  CHECK(st.used_bytes >= n + 1000 && st.mapped_bytes >= n && st.chunk_size > 0, "totals");
  CHECK(strcmp(ts[0].name, "default") == 0 && ts[0].tag == 0 && ts[0].live_allocations == 1, "default row");
  CHECK(strcmp(ts[1].name, "weights") == 0 && ts[1].tag == 1 && ts[1].live_allocations == 1 &&
            ts[1].used_bytes >= n && ts[1].mapped_bytes >= n && ts[1].asleep == -1,
        "weights row");

  mempool_service_sleep_report_t sr;
  mempool_service_wake_report_t wr;
  CHECK(mempool_service_sleep(svc, &weights, 1, 5, NULL, &sr) == MEMPOOL_ERROR_INVALID_ARGUMENT, "bad mode");
  CHECK(strstr(mempool_last_error(), "sleep mode 5") != NULL, "message names the mode");
  CHECK(mempool_service_sleep(svc, NULL, 1, MEMPOOL_SLEEP_OFFLOAD, NULL, &sr) == MEMPOOL_ERROR_INVALID_ARGUMENT,
        "null tags");
  CHECK(mempool_service_sleep(svc, &weights, 1, MEMPOOL_SLEEP_OFFLOAD, NULL, &sr) == MEMPOOL_SUCCESS, "sleep");
  CHECK(sr.released_bytes >= n && sr.offloaded_bytes >= n, "released %llu offloaded %llu",
        (unsigned long long)sr.released_bytes, (unsigned long long)sr.offloaded_bytes);
  CHECK(mempool_allocate(weights_mr, 256, NULL, &r) == MEMPOOL_ERROR_UNSUPPORTED, "allocate from a sleeping tag");
  CHECK(strstr(mempool_last_error(), "asleep") != NULL, "message says why");
  CHECK(mempool_service_stats(svc, &st, ts, 4) == MEMPOOL_SUCCESS, "stats");
  CHECK(ts[1].asleep == MEMPOOL_SLEEP_OFFLOAD && ts[1].mapped_bytes == 0 && ts[1].offloaded_bytes == sr.offloaded_bytes,
        "asleep row");
  CHECK(ts[0].asleep == -1 && ts[0].mapped_bytes > 0, "the default tag stays awake");
  CHECK(mempool_service_wake(svc, &weights, 1, NULL, &wr) == MEMPOOL_SUCCESS, "wake");
  CHECK(wr.mapped_bytes == sr.offloaded_bytes && wr.restored_bytes == sr.offloaded_bytes, "woken %llu restored %llu",
        (unsigned long long)wr.mapped_bytes, (unsigned long long)wr.restored_bytes);
  CHECK(mempool_service_wake(svc, &weights, 1, NULL, &wr) == MEMPOOL_SUCCESS && wr.mapped_bytes == 0, "awake: no-op");

  /* PyTorch's and CuPy's frees while their tag sleeps are taken (issue 33): both entry points drop their
   * table entry before they free, so a refused free would lose the allocation for good. The wake then maps
   * back only what p, still live, touches. */
  mempool_resource_t* prev = NULL;
  CHECK(mempool_get_current_device_resource(0, &prev) == MEMPOOL_SUCCESS, "current");
  CHECK(mempool_set_current_device_resource(0, weights_mr) == MEMPOOL_SUCCESS, "weights as the current resource");
  CHECK(mempool_service_stats(svc, &st, ts, 4) == MEMPOOL_SUCCESS, "stats");
  uint64_t p_mapped = ts[1].mapped_bytes, frees = ts[1].frees;
  size_t big = (size_t)8 << 20;
  void* tp = mempool_torch_alloc_nullable(big, 0, NULL);
  void* cp = mempool_cupy_malloc(NULL, big, 0);
  CHECK(tp != NULL && cp != NULL && cp != (void*)-1, "torch and cupy allocate under weights: %s", mempool_last_error());
  CHECK(mempool_service_stats(svc, &st, ts, 4) == MEMPOOL_SUCCESS && ts[1].live_allocations == 3 &&
            ts[1].mapped_bytes > p_mapped,
        "three live under weights");
  CHECK(mempool_service_sleep(svc, &weights, 1, MEMPOOL_SLEEP_OFFLOAD, NULL, &sr) == MEMPOOL_SUCCESS, "sleep again");
  mempool_torch_free(tp, big, 0, NULL);
  CHECK(strcmp(mempool_last_error(), "") == 0, "torch free while asleep: %s", mempool_last_error());
  mempool_cupy_free(NULL, cp, 0);
  CHECK(strcmp(mempool_last_error(), "") == 0, "cupy free while asleep: %s", mempool_last_error());
  CHECK(mempool_service_stats(svc, &st, ts, 4) == MEMPOOL_SUCCESS && ts[1].live_allocations == 1 &&
            ts[1].frees == frees + 2 && ts[1].asleep == MEMPOOL_SLEEP_OFFLOAD,
        "the frees were taken while asleep: live %llu frees %llu",
        (unsigned long long)ts[1].live_allocations, (unsigned long long)ts[1].frees);
  CHECK(mempool_service_wake(svc, &weights, 1, NULL, &wr) == MEMPOOL_SUCCESS, "wake");
  CHECK(wr.mapped_bytes == p_mapped && wr.restored_bytes == p_mapped, "wake mapped %llu (p's chunks: %llu)",
        (unsigned long long)wr.mapped_bytes, (unsigned long long)p_mapped);
  CHECK(mempool_service_stats(svc, &st, ts, 4) == MEMPOOL_SUCCESS && ts[1].mapped_bytes == p_mapped, "mapped");
  CHECK(mempool_set_current_device_resource(0, prev) == MEMPOOL_SUCCESS, "the current resource restored");
  mempool_resource_destroy(prev);

  CHECK(mempool_deallocate(weights_mr, p, n, NULL) == MEMPOOL_SUCCESS, "free under weights");
  CHECK(mempool_deallocate(svc, q, 1000, NULL) == MEMPOOL_SUCCESS, "free under default");
  CHECK(mempool_service_trim(svc, &released) == MEMPOOL_SUCCESS && released >= n, "trim released %llu",
        (unsigned long long)released);
  CHECK(mempool_service_reset_peaks(svc) == MEMPOOL_SUCCESS, "reset peaks");
  CHECK(mempool_service_stats(svc, &st, NULL, 0) == MEMPOOL_SUCCESS && st.peak_used_bytes == 0 &&
            st.used_bytes == 0 && st.mapped_bytes == 0,
        "peaks reset");
  /* More than a tag's region: out of memory, naming what the resource holds. */
  CHECK(mempool_allocate(weights_mr, (size_t)2 << 30, NULL, &r) == MEMPOOL_ERROR_OUT_OF_MEMORY, "too large");
  CHECK(strstr(mempool_last_error(), "2147483648 bytes") != NULL && strstr(mempool_last_error(), "largest free") != NULL,
        "message names the size and what is held");
  mempool_resource_destroy(weights_mr);
  mempool_resource_destroy(base);
  mempool_resource_destroy(svc);
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
  CHECK(mempool_service_resource_create(0, 0, 0, 0, 15, -1, &r) == MEMPOOL_ERROR_DRIVER_NOT_FOUND, "service");
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
  /* A retained handle is the same resource: equal, same device, and frees what the other allocated; a
   * handle of another resource is not equal; NULL outputs are refused. */
  mempool_resource_t* again = NULL;
  int eq = -1, dev = -1;
  CHECK(mempool_resource_retain(stats, &again) == MEMPOOL_SUCCESS && again != NULL && again != stats, "retain");
  CHECK(mempool_resource_is_equal(stats, again, &eq) == MEMPOOL_SUCCESS && eq == 1, "retained is equal");
  CHECK(mempool_resource_is_equal(stats, pool, &eq) == MEMPOOL_SUCCESS && eq == 0, "another is not");
  CHECK(mempool_resource_is_equal(stats, again, NULL) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null out");
  CHECK(mempool_resource_retain(stats, NULL) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null out");
  CHECK(mempool_resource_device(again, &dev) == MEMPOOL_SUCCESS && dev == 0, "device %d", dev);
  CHECK(mempool_resource_device(again, NULL) == MEMPOOL_ERROR_INVALID_ARGUMENT, "null out");
  CHECK(mempool_allocate(stats, 512, NULL, &p) == MEMPOOL_SUCCESS && p != NULL, "allocate");
  mempool_resource_destroy(stats); /* the retained handle keeps the adaptor */
  CHECK(mempool_statistics_get(again, &s) == MEMPOOL_SUCCESS && s.current_bytes == 512, "stats through retained");
  CHECK(mempool_deallocate(again, p, 512, NULL) == MEMPOOL_SUCCESS, "freed through the retained handle");
  stats = again;
  CHECK(mempool_set_current_device_resource(0, stats) == MEMPOOL_SUCCESS, "set current");
  CHECK(mempool_get_current_device_resource(0, &cur) == MEMPOOL_SUCCESS, "get current");
  /* The handle to the current resource reads the statistics adaptor set as current. */
  CHECK(mempool_statistics_get(cur, &s) == MEMPOOL_SUCCESS && s.total_count == 2, "stats through current");
  CHECK(mempool_resource_is_equal(cur, stats, &eq) == MEMPOOL_SUCCESS && eq == 1, "current is the one set");
  /* Handles know their device: a resource of device 0 is refused for device 1 (whether or not it exists). */
  mempool_resource_t* wrong = (mempool_resource_t*)0x1;
  CHECK(mempool_set_current_device_resource(1, stats) == MEMPOOL_ERROR_INVALID_ARGUMENT, "other device");
  CHECK(strstr(mempool_last_error(), "device 0, not on device 1") != NULL, "message names both devices");
  CHECK(mempool_pool_resource_create(base, 1, 0, 0, &wrong) == MEMPOOL_ERROR_INVALID_ARGUMENT, "pool device");
  CHECK(wrong == (mempool_resource_t*)0x1, "no handle");
  /* Binning (mempool's default stack: bins 8 to 20 over the pool) and arena; their refusals. */
  mempool_resource_t *bins = NULL, *arena = NULL;
  CHECK(mempool_binning_resource_create(pool, 8, 20, &bins) == MEMPOOL_SUCCESS, "binning");
  CHECK(mempool_arena_resource_create(base, 8 << 20, &arena) == MEMPOOL_SUCCESS, "arena");
  for (int i = 0; i < 2; i++) {
    mempool_resource_t* each = i == 0 ? bins : arena;
    void* a = NULL;
    void* b = NULL;
    CHECK(mempool_allocate(each, 100, NULL, &a) == MEMPOOL_SUCCESS && a != NULL, "small");
    CHECK(mempool_allocate(each, 2 << 20, NULL, &b) == MEMPOOL_SUCCESS && b != NULL && b != a, "large");
    CHECK(mempool_deallocate(each, a, 100, NULL) == MEMPOOL_SUCCESS, "free small");
    CHECK(mempool_deallocate(each, b, 2 << 20, NULL) == MEMPOOL_SUCCESS, "free large");
  }
  CHECK(mempool_allocate(arena, 16 << 20, NULL, &p) == MEMPOOL_ERROR_OUT_OF_MEMORY, "over the arena");
  CHECK(mempool_binning_resource_create(pool, 21, 20, &wrong) == MEMPOOL_ERROR_INVALID_ARGUMENT, "min > max");
  CHECK(strstr(mempool_last_error(), "21..=20") != NULL, "message names the exponents");
  CHECK(mempool_binning_resource_create(pool, -1, 20, &wrong) == MEMPOOL_ERROR_INVALID_ARGUMENT, "negative");
  CHECK(mempool_binning_resource_create(pool, 8, 41, &wrong) == MEMPOOL_ERROR_INVALID_ARGUMENT, "over 40");
  CHECK(mempool_arena_resource_create(base, 0, &wrong) == MEMPOOL_ERROR_INVALID_ARGUMENT, "arena of 0");
  CHECK(wrong == (mempool_resource_t*)0x1, "no handle");
  mempool_resource_destroy(bins);
  mempool_resource_destroy(arena);
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
  CHECK(mempool_statistics_get(stats, &s) == MEMPOOL_SUCCESS && s.total_count == 3, "counts");
  mempool_resource_destroy(cur);
  mempool_resource_destroy(stats);
  mempool_resource_destroy(pool);
  mempool_resource_destroy(base);
  service_gpu();
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
