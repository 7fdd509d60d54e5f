// The floor under an allocator's hot path: what one driver call, or one lock, costs on this machine.
// Raw driver calls, no mempool code. Built and run by scripts/bench/driver-floor.sh on the GPU machine.
//
//   driver_floor [ITERS] [THREADS...]
//
// Prints, per measurement, the median of 5 rounds of ITERS calls, in ns per call:
// - cuEventRecord on a non-blocking stream (DISABLE_TIMING event), cuStreamWaitEvent of that event on another
//   stream, cuStreamGetId, cuEventQuery of a completed event;
// - cuMemAllocFromPoolAsync + cuMemFreeAsync of 4 KiB on one stream (one pair, both calls);
// - an uncontended pthread mutex lock + unlock, and an atomic fetch-add on one shared line from THREADS
//   threads at once (per call, per thread);
// - cuEventRecord from THREADS threads at once, each on its own stream: whether the driver serializes it.
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK(x)                                                                                  \
  do {                                                                                         \
    CUresult r_ = (x);                                                                         \
    if (r_ != CUDA_SUCCESS) {                                                                  \
      const char *s_ = "?";                                                                    \
      cuGetErrorName(r_, &s_);                                                                 \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #x, s_);                   \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

#define ROUNDS 5
static double median(double *v) {
  qsort(v, ROUNDS, sizeof *v, cmp);
  return v[ROUNDS / 2];
}

static CUcontext ctx;
static long iters;

static void report(const char *what, double *v) {
  double lo = v[0], hi = v[0];
  for (int i = 1; i < ROUNDS; i++) {
    if (v[i] < lo) lo = v[i];
    if (v[i] > hi) hi = v[i];
  }
  printf("%-64s %9.1f ns  (min %.1f, max %.1f)\n", what, median(v), lo, hi);
}

static volatile uint64_t shared_line __attribute__((aligned(128)));
static pthread_barrier_t barrier;

struct worker {
  int kind; // 0: atomic add, 1: event record on own stream
  double ns;
};

static void *run_worker(void *p) {
  struct worker *w = p;
  CK(cuCtxSetCurrent(ctx));
  CUstream s = 0;
  CUevent e = 0;
  if (w->kind == 1) {
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  }
  pthread_barrier_wait(&barrier);
  double t0 = now_ns();
  for (long i = 0; i < iters; i++) {
    if (w->kind == 0)
      __atomic_fetch_add(&shared_line, 1, __ATOMIC_RELAXED);
    else
      CK(cuEventRecord(e, s));
  }
  w->ns = (now_ns() - t0) / iters;
  if (w->kind == 1) {
    CK(cuStreamSynchronize(s));
    CK(cuEventDestroy(e));
    CK(cuStreamDestroy(s));
  }
  return NULL;
}

static double threaded(int kind, int n) {
  pthread_t th[256];
  struct worker w[256];
  pthread_barrier_init(&barrier, NULL, n);
  for (int i = 0; i < n; i++) {
    w[i].kind = kind;
    pthread_create(&th[i], NULL, run_worker, &w[i]);
  }
  double sum = 0;
  for (int i = 0; i < n; i++) {
    pthread_join(th[i], NULL);
    sum += w[i].ns;
  }
  pthread_barrier_destroy(&barrier);
  return sum / n;
}

int main(int argc, char **argv) {
  iters = argc > 1 ? atol(argv[1]) : 200000;
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  char name[256];
  CK(cuDeviceGetName(name, sizeof name, dev));
  int drv;
  CK(cuDriverGetVersion(&drv));
  printf("device: %s, driver API %d, %ld calls per round, median of %d rounds\n", name, drv, iters, ROUNDS);
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUstream a, b;
  CK(cuStreamCreate(&a, CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&b, CU_STREAM_NON_BLOCKING));
  CUevent e;
  CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  CUmemoryPool pool;
  CK(cuDeviceGetDefaultMemPool(&pool, dev));
  double v[ROUNDS];

  for (int r = 0; r < ROUNDS; r++) {
    double t0 = now_ns();
    for (long i = 0; i < iters; i++) CK(cuEventRecord(e, a));
    v[r] = (now_ns() - t0) / iters;
    CK(cuStreamSynchronize(a));
  }
  report("cuEventRecord (non-blocking stream, DISABLE_TIMING)", v);

  CK(cuEventRecord(e, a));
  for (int r = 0; r < ROUNDS; r++) {
    double t0 = now_ns();
    for (long i = 0; i < iters; i++) CK(cuStreamWaitEvent(b, e, 0));
    v[r] = (now_ns() - t0) / iters;
    CK(cuStreamSynchronize(b));
  }
  report("cuStreamWaitEvent (another stream's event)", v);

  for (int r = 0; r < ROUNDS; r++) {
    double t0 = now_ns();
    for (long i = 0; i < iters / 2; i++) {
      CK(cuEventRecord(e, a));
      CK(cuStreamWaitEvent(b, e, 0));
    }
    v[r] = (now_ns() - t0) / (iters / 2);
    CK(cuStreamSynchronize(b));
  }
  report("cuEventRecord + cuStreamWaitEvent (one hand-off)", v);

  CK(cuStreamSynchronize(a));
  for (int r = 0; r < ROUNDS; r++) {
    double t0 = now_ns();
    for (long i = 0; i < iters; i++) {
      CUresult q = cuEventQuery(e);
      if (q != CUDA_SUCCESS) CK(q);
    }
    v[r] = (now_ns() - t0) / iters;
  }
  report("cuEventQuery (completed event)", v);

  for (int r = 0; r < ROUNDS; r++) {
    unsigned long long id;
    double t0 = now_ns();
    for (long i = 0; i < iters; i++) CK(cuStreamGetId(a, &id));
    v[r] = (now_ns() - t0) / iters;
  }
  report("cuStreamGetId", v);

  for (int r = 0; r < ROUNDS; r++) {
    unsigned long long id;
    double t0 = now_ns();
    for (long i = 0; i < iters; i++) CK(cuStreamGetId(CU_STREAM_PER_THREAD, &id));
    v[r] = (now_ns() - t0) / iters;
  }
  report("cuStreamGetId (CU_STREAM_PER_THREAD)", v);

  for (int r = 0; r < ROUNDS; r++) {
    CUdeviceptr p;
    double t0 = now_ns();
    for (long i = 0; i < iters / 2; i++) {
      CK(cuMemAllocFromPoolAsync(&p, 4096, pool, a));
      CK(cuMemFreeAsync(p, a));
    }
    v[r] = (now_ns() - t0) / (iters / 2);
    CK(cuStreamSynchronize(a));
  }
  report("cuMemAllocFromPoolAsync + cuMemFreeAsync, 4 KiB (a pair)", v);

  pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
  for (int r = 0; r < ROUNDS; r++) {
    double t0 = now_ns();
    for (long i = 0; i < iters; i++) {
      pthread_mutex_lock(&m);
      pthread_mutex_unlock(&m);
    }
    v[r] = (now_ns() - t0) / iters;
  }
  report("pthread mutex lock + unlock (uncontended)", v);

  for (int ai = 2; ai < argc; ai++) {
    int n = atoi(argv[ai]);
    if (n < 1 || n > 256) continue;
    char what[128];
    for (int r = 0; r < ROUNDS; r++) v[r] = threaded(0, n);
    snprintf(what, sizeof what, "atomic fetch-add on one shared line, %d threads (per thread)", n);
    report(what, v);
    for (int r = 0; r < ROUNDS; r++) v[r] = threaded(1, n);
    snprintf(what, sizeof what, "cuEventRecord, %d threads each on its own stream (per thread)", n);
    report(what, v);
  }
  CK(cuEventDestroy(e));
  CK(cuStreamDestroy(a));
  CK(cuStreamDestroy(b));
  CK(cuDevicePrimaryCtxRelease(dev));
  return 0;
}
