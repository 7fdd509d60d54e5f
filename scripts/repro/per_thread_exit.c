// Does a 200 ms %globaltimer spin end, and does the context's work end, when the thread that queued it on
// its per-thread default stream has exited? Raw driver calls, no mempool code. Build on the GPU machine:
//   nvcc -ptx scripts/repro/fill.cu ... (not needed: the PTX is inline)
//   gcc -O2 -pthread -I$CUDA/include per_thread_exit.c -L$CUDA/lib64/stubs -lcuda
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define CK(x) do { CUresult r_ = (x); if (r_) { const char *s_ = "?"; cuGetErrorName(r_, &s_); \
  printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); exit(1); } } while (0)

static const char *PTX =
  ".version 6.0\n.target sm_50\n.address_size 64\n"
  ".visible .entry spin(.param .u64 out, .param .u64 ns)\n{\n"
  " .reg .pred %p<2>; .reg .b64 %rd<8>;\n"
  " ld.param.u64 %rd1, [out]; ld.param.u64 %rd2, [ns]; cvta.to.global.u64 %rd3, %rd1;\n"
  " mov.u64 %rd4, %globaltimer; st.global.u64 [%rd3], %rd4;\n"
  "SPIN:\n mov.u64 %rd5, %globaltimer; sub.u64 %rd6, %rd5, %rd4; setp.lt.u64 %p1, %rd6, %rd2; @%p1 bra SPIN;\n"
  " st.global.u64 [%rd3+8], %rd5;\n ret;\n}\n";

static CUcontext ctx;
static CUfunction fn;
static CUdeviceptr out;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void launch(CUstream s) {
  unsigned long long ns = 200000000ULL;
  void *args[] = {&out, &ns};
  CK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
}

// Polls until the context is idle (every stream done) or `limit` s passed; returns the seconds waited or -1.
static double wait_idle(CUstream s, double limit) {
  double t0 = now();
  for (;;) {
    CUresult r = cuStreamQuery(s);
    if (r == CUDA_SUCCESS) return now() - t0;
    if (r != CUDA_ERROR_NOT_READY) CK(r);
    if (now() - t0 > limit) return -1;
    usleep(1000);
  }
}

static void *thread_a(void *arg) {
  (void)arg;
  CK(cuCtxSetCurrent(ctx));
  launch(CU_STREAM_PER_THREAD);
  return NULL;  // exits with the spin still queued on its per-thread stream
}

int main(void) {
  CK(cuInit(0));
  CUdevice dev; CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUmodule mod; CK(cuModuleLoadData(&mod, PTX)); CK(cuModuleGetFunction(&fn, mod, "spin"));
  CK(cuMemAlloc(&out, 16));
  unsigned long long t[2];
  // 1. On the legacy stream, this thread.
  launch(CU_STREAM_LEGACY);
  double w = wait_idle(CU_STREAM_LEGACY, 10);
  CK(cuMemcpyDtoH(t, out, 16));
  printf("legacy: waited %.3f s; globaltimer advanced %llu ns\n", w, t[1] - t[0]);
  // 2. On this thread's per-thread stream.
  launch(CU_STREAM_PER_THREAD);
  w = wait_idle(CU_STREAM_PER_THREAD, 10);
  printf("per-thread (this thread): waited %.3f s\n", w);
  // 3. Thread A queues on its per-thread stream and exits; the legacy stream here must wait for it.
  pthread_t a; pthread_create(&a, NULL, thread_a, NULL); pthread_join(a, NULL);
  w = wait_idle(CU_STREAM_LEGACY, 10);
  printf("per-thread of an exited thread, seen from the legacy stream: waited %.3f s\n", w);
  double t0 = now(); CK(cuCtxSynchronize());
  printf("cuCtxSynchronize after it: %.3f s\n", now() - t0);
  return 0;
}
