// Issue 33's per-thread hang, without mempool: does the driver's stream-ordered pool hang when a thread
// allocated from it on its per-thread default stream and then exited? Raw driver calls only; each step
// prints before and after, so the last line of a hung run names the call that did not return.
//
//   per_thread_pool MODE ROUNDS
//   MODE a: thread A allocates on its per-thread stream, launches a 200 ms spin there and exits; thread C
//           frees on the legacy stream after a cuCtxSynchronize; thread B allocates on its per-thread stream
//           and synchronizes it (the mempool test's "freed after its thread ended" with the async resource)
//   MODE b: as a, but A frees on its own per-thread stream before it exits
//   MODE c: as a, without the pool (cuMemAlloc / cuMemFree): the control
//   MODE d: as a, with the device's default pool instead of a pool of its own
//   MODE e: as a, A querying its per-thread stream (cuStreamQuery, which submits what is queued) before it
//           lets go of the context and ends: a candidate workaround, should A's queued work be lost with
//           its thread
//   An upper-case MODE (A, B, C, D): the same, each thread pushing the context around its calls and popping
//   it before it ends (what mempool's calls do: `Context::bind`), instead of setting it current for good.
//
// Built and run by scripts/repro-per-thread.sh on the GPU machine.
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <ctype.h>
#include <string.h>

#define CK(x) do { CUresult r_ = (x); if (r_) { const char *s_ = "?"; cuGetErrorName(r_, &s_); \
  printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); fflush(stdout); exit(1); } } while (0)
#define STEP(who, what, x) do { printf("%s: %s ...\n", who, what); fflush(stdout); x; \
  printf("%s: %s done\n", who, what); fflush(stdout); } while (0)

static const char *PTX =
  ".version 6.0\n.target sm_50\n.address_size 64\n"
  ".visible .entry spin(.param .u64 ns)\n{\n .reg .pred %p<2>; .reg .b64 %rd<8>;\n"
  " ld.param.u64 %rd2, [ns]; mov.u64 %rd4, %globaltimer;\n"
  "SPIN:\n mov.u64 %rd5, %globaltimer; sub.u64 %rd6, %rd5, %rd4; setp.lt.u64 %p1, %rd6, %rd2; @%p1 bra SPIN;\n"
  " ret;\n}\n";

static CUcontext ctx;
static CUfunction fn;
static CUmemoryPool pool;
static char mode;
static int push_pop;
static int flush;

static void enter(void) {
  if (push_pop) CK(cuCtxPushCurrent(ctx));
  else CK(cuCtxSetCurrent(ctx));
}

static void leave(void) {
  CUcontext c;
  if (push_pop) CK(cuCtxPopCurrent(&c));
}
static CUdeviceptr a_ptr;
static const size_t BYTES = 256 << 10;

static void alloc_on(const char *who, CUdeviceptr *p, CUstream s) {
  if (mode == 'c') STEP(who, "cuMemAlloc", CK(cuMemAlloc(p, BYTES)));
  else STEP(who, "cuMemAllocFromPoolAsync", CK(cuMemAllocFromPoolAsync(p, BYTES, pool, s)));
}

static void free_on(const char *who, CUdeviceptr p, CUstream s) {
  if (mode == 'c') STEP(who, "cuMemFree", CK(cuMemFree(p)));
  else STEP(who, "cuMemFreeAsync", CK(cuMemFreeAsync(p, s)));
}

static void *thread_a(void *arg) {
  (void)arg;
  enter();
  alloc_on("A", &a_ptr, CU_STREAM_PER_THREAD);
  unsigned long long ns = 200000000ULL;
  void *args[] = {&ns};
  STEP("A", "launch the 200 ms spin", CK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, CU_STREAM_PER_THREAD, args, NULL)));
  if (mode == 'b') free_on("A", a_ptr, CU_STREAM_PER_THREAD);
  if (flush) {
    CUresult q = cuStreamQuery(CU_STREAM_PER_THREAD);
    if (q != CUDA_ERROR_NOT_READY) CK(q);
    printf("A: queried its per-thread stream\n"); fflush(stdout);
  }
  leave();
  printf("A: exiting\n"); fflush(stdout);
  return NULL;
}

static void *thread_c(void *arg) {
  (void)arg;
  enter();
  STEP("C", "cuCtxSynchronize", CK(cuCtxSynchronize()));
  if (mode != 'b') free_on("C", a_ptr, CU_STREAM_LEGACY);
  leave();
  return NULL;
}

static void *thread_b(void *arg) {
  (void)arg;
  enter();
  CUdeviceptr q;
  alloc_on("B", &q, CU_STREAM_PER_THREAD);
  STEP("B", "cuMemsetD32Async", CK(cuMemsetD32Async(q, 7, BYTES / 4, CU_STREAM_PER_THREAD)));
  STEP("B", "cuStreamSynchronize(per-thread)", CK(cuStreamSynchronize(CU_STREAM_PER_THREAD)));
  free_on("B", q, CU_STREAM_PER_THREAD);
  STEP("B", "cuStreamSynchronize(per-thread)", CK(cuStreamSynchronize(CU_STREAM_PER_THREAD)));
  leave();
  return NULL;
}

static void run(void *(*f)(void *)) {
  pthread_t t;
  pthread_create(&t, NULL, f, NULL);
  pthread_join(t, NULL);
}

int main(int argc, char **argv) {
  mode = argc > 1 ? argv[1][0] : 'a';
  push_pop = isupper((unsigned char)mode);
  mode = (char)tolower((unsigned char)mode);
  if (mode == 'e') {
    flush = 1;
    mode = 'a';
  }
  int rounds = argc > 2 ? atoi(argv[2]) : 3;
  CK(cuInit(0));
  CUdevice dev; CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUmodule mod; CK(cuModuleLoadData(&mod, PTX)); CK(cuModuleGetFunction(&fn, mod, "spin"));
  if (mode == 'd') {
    CK(cuDeviceGetDefaultMemPool(&pool, dev));
  } else if (mode != 'c') {
    CUmemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = 0;
    CK(cuMemPoolCreate(&pool, &props));
  }
  for (int r = 0; r < rounds; r++) {
    printf("mode %c%s%s round %d\n", mode, push_pop ? " (push/pop)" : "", flush ? " (A queries)" : "", r);
    fflush(stdout);
    run(thread_a);
    run(thread_c);
    run(thread_b);
    STEP("main", "cuCtxSynchronize", CK(cuCtxSynchronize()));
  }
  if (mode == 'a' || mode == 'b') STEP("main", "cuMemPoolDestroy", CK(cuMemPoolDestroy(pool)));
  printf("mode %c: %d rounds ok\n", mode, rounds);
  return 0;
}
