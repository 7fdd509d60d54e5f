// pool_stall: raw CUDA driver calls from N threads, no mempool code, to tell whether the stall seen in
// mempool-rmm's conformance suite (every thread waiting on a lock inside libcuda, none running) is the
// driver's own. Each worker loops over the operations its mode names, on its own stream, and a watchdog
// reports a stall when no worker has finished an operation for STALL_S seconds, printing what every
// worker was doing (then it waits, so that scripts/repro-stall.sh can take every thread's stack).
//
//   pool_stall THREADS SECONDS MODE [STALL_S]
//
// MODE is a set of letters; each iteration of a worker runs, in this order, those present:
//   p  create a pool of device memory (cuMemPoolCreate), allocate from it, fill, free, trim, destroy it
//   m  the same with a pool of managed memory (CU_MEM_ALLOCATION_TYPE_MANAGED, CUDA 13.0)
//   x  destroy the pool with its free still queued (no stream synchronize before cuMemPoolDestroy)
//   d  allocate from the device's default pool (cuMemAllocAsync), fill, free
//   g  allocate from the device's default managed pool (cuMemGetDefaultMemPool, managed), fill, free
//   u  cuMemAllocManaged, fill, cuMemFree (synchronous, managed)
//   v  cuMemAlloc, fill, cuMemFree (synchronous)
//   b  blocking streams (flags 0, as mempool's Stream::new), not CU_STREAM_NON_BLOCKING
//   l  free on the legacy default stream (CU_STREAM_LEGACY) instead of the worker's stream
//   H  copy the whole allocation to pageable host memory (cuMemcpyDtoHAsync) and synchronize
//   2  workers alternate between devices 0 and 1 (each its primary context), where there are two
//   o  ask each pool used (and cuMemAlloc) for an impossible size (1 << 52 bytes and twice the device's
//      memory) and expect CUDA_ERROR_OUT_OF_MEMORY, as the conformance suite's out-of-memory test does
//   M  load the fill kernel's module (cuModuleLoadData, PTX JIT) and unload it (cuModuleUnload) every
//      iteration, launching from it in between, as the GPU tests' check kernels are loaded per test
//   G  giant sizes: 4 KiB to 1 GiB (times four each step), as the suite's size test asks of every
//      resource, so synchronizes have gigabytes to trim
//   t  created pools keep a release threshold of 0 (the driver's default: every synchronize trims
//      them), not everything
//   k  fill by a kernel (fill.ptx, cuLaunchKernel) rather than cuMemsetD32Async
//   h  copy 4 bytes back to the host (cuMemcpyDtoHAsync) and check them
//   s  cuStreamSynchronize on the worker's stream
//   c  cuCtxSynchronize
//   n  create and destroy a stream (as mempool's pool priming does)
//   e  record an event on the worker's stream and synchronize on it instead of the stream
//
// Exit status: 0 when every worker ran SECONDS without error, 1 on a driver error, 3 on a stall (after
// STALL_WAIT_S seconds of waiting for a debugger).
//
// Build: gcc -O2 -pthread -I$CUDA/include pool_stall.c -o pool_stall -lcuda

#include <cuda.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 256

static const char *mode;
static int seconds;
static CUcontext ctxs[2];
static CUdevice devs[2];
static int ndev = 1;
static CUfunction fill_fns[2];
static _Atomic unsigned long progress;
static _Atomic int stop;
static _Atomic int failed;

struct worker {
    pthread_t thread;
    int id;
    _Atomic(const char *) doing;
    _Atomic unsigned long iterations;
};
static struct worker workers[MAX_THREADS];

static int has(char c) { return strchr(mode, c) != NULL; }

static char *ptx_image;  // the fill kernel's PTX, for mode M
static __thread CUfunction thread_fill;  // mode M: the function of this worker's current module

#define CHECK_OR(ret, w, what, call)                                                          \
    do {                                                                                      \
        atomic_store(&(w)->doing, what);                                                      \
        CUresult r_ = (call);                                                                 \
        atomic_fetch_add(&progress, 1);                                                       \
        if (r_ != CUDA_SUCCESS) {                                                             \
            const char *s_ = "?";                                                             \
            cuGetErrorName(r_, &s_);                                                          \
            fprintf(stderr, "worker %d: %s failed: %s (%d)\n", (w)->id, what, s_, (int)r_);  \
            atomic_store(&failed, 1);                                                         \
            atomic_store(&stop, 1);                                                           \
            return ret;                                                                       \
        }                                                                                     \
    } while (0)
#define CHECK(w, what, call) CHECK_OR(NULL, w, what, call)
#define CHECK0(w, what, call) CHECK_OR(0, w, what, call)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// Fills `words` 32-bit words at `p` with `value` on `stream`, by kernel or memset.
static CUresult fill(CUdeviceptr p, unsigned value, size_t words, CUstream stream) {
    if (!has('k')) return cuMemsetD32Async(p, value, words, stream);
    CUcontext cur;
    cuCtxGetCurrent(&cur);
    CUfunction fill_fn = thread_fill ? thread_fill : cur == ctxs[0] ? fill_fns[0] : fill_fns[1];
    unsigned long long n = words;
    void *args[] = {&p, &value, &n};
    unsigned blocks = (unsigned)((words + 255) / 256);
    if (blocks > 1024) blocks = 1024;
    return cuLaunchKernel(fill_fn, blocks, 1, 1, 256, 1, 1, 0, stream, args, NULL);
}

// Allocates `bytes` from `pool` (NULL: the default pool), fills, optionally reads back, frees, all on
// `stream`.
static size_t device_bytes;

// Asks for sizes no device has; anything but CUDA_ERROR_OUT_OF_MEMORY is a failure.
static int impossible(struct worker *w, CUmemoryPool pool, CUstream stream) {
    size_t sizes[2] = {(size_t)1 << 52, 2 * device_bytes};
    for (int i = 0; i < 2; i++) {
        CUdeviceptr p = 0;
        atomic_store(&w->doing, pool ? "impossible cuMemAllocFromPoolAsync" : "impossible cuMemAllocAsync");
        CUresult r = pool ? cuMemAllocFromPoolAsync(&p, sizes[i], pool, stream) : cuMemAllocAsync(&p, sizes[i], stream);
        atomic_fetch_add(&progress, 1);
        if (r != CUDA_ERROR_OUT_OF_MEMORY) {
            fprintf(stderr, "worker %d: an impossible allocation of %zu bytes returned %d\n", w->id, sizes[i], (int)r);
            atomic_store(&failed, 1);
            atomic_store(&stop, 1);
            return 0;
        }
    }
    return 1;
}

static int use_pool(struct worker *w, CUmemoryPool pool, CUstream stream, size_t bytes, unsigned value) {
    CUdeviceptr p = 0;
    if (has('o') && !impossible(w, pool, stream)) return 0;
    if (pool)
        CHECK0(w, "cuMemAllocFromPoolAsync", cuMemAllocFromPoolAsync(&p, bytes, pool, stream));
    else
        CHECK0(w, "cuMemAllocAsync", cuMemAllocAsync(&p, bytes, stream));
    CHECK0(w, "fill", fill(p, value, bytes / 4, stream));
    if (has('h')) {
        unsigned got = 0;
        CHECK0(w, "cuMemcpyDtoHAsync", cuMemcpyDtoHAsync(&got, p + bytes - 4, 4, stream));
        CHECK0(w, "cuStreamSynchronize(copy)", cuStreamSynchronize(stream));
        if (got != value) {
            fprintf(stderr, "worker %d: read %u, wrote %u\n", w->id, got, value);
            atomic_store(&failed, 1);
            atomic_store(&stop, 1);
            return 0;
        }
    }
    if (has('H')) {
        void *host = malloc(bytes);
        CHECK0(w, "cuMemcpyDtoHAsync(whole)", cuMemcpyDtoHAsync(host, p, bytes, stream));
        CHECK0(w, "cuStreamSynchronize(whole)", cuStreamSynchronize(stream));
        free(host);
    }
    CHECK0(w, "cuMemFreeAsync", cuMemFreeAsync(p, has('l') ? CU_STREAM_LEGACY : stream));
    return 1;
}

static void *work(void *arg) {
    struct worker *w = arg;
    int d = has('2') ? w->id % ndev : 0;
    CUdevice dev = devs[d];
    CHECK(w, "cuCtxSetCurrent", cuCtxSetCurrent(ctxs[d]));
    unsigned flags = has('b') ? CU_STREAM_DEFAULT : CU_STREAM_NON_BLOCKING;
    CUstream stream;
    CHECK(w, "cuStreamCreate", cuStreamCreate(&stream, flags));
    CUevent event;
    CHECK(w, "cuEventCreate", cuEventCreate(&event, CU_EVENT_DISABLE_TIMING));
    CUmemoryPool managed_default = NULL;
    if (has('g')) {
        CUmemLocation loc = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = (int)dev};
        CHECK(w, "cuMemGetDefaultMemPool", cuMemGetDefaultMemPool(&managed_default, &loc, CU_MEM_ALLOCATION_TYPE_MANAGED));
    }
    double end = now() + seconds;
    unsigned value = (unsigned)w->id * 1000003u;
    while (!atomic_load(&stop) && now() < end) {
        // 4 KiB .. 2 MiB (64 MiB with H; 1 GiB with G, a factor of four a step)
        size_t bytes = has('G') ? (size_t)4096 << (2 * (value % 10)) : (size_t)4096 << (value % (has('H') ? 15 : 10));
        value++;
        CUmodule module = NULL;
        if (has('M')) {
            CHECK(w, "cuModuleLoadData", cuModuleLoadData(&module, ptx_image));
            CHECK(w, "cuModuleGetFunction", cuModuleGetFunction(&thread_fill, module, "fill_u32"));
        }
        for (int kind = 0; kind < 2; kind++) {
            char k = kind == 0 ? 'p' : 'm';
            if (!has(k)) continue;
            CUmemPoolProps props;
            memset(&props, 0, sizeof props);
            props.allocType = k == 'p' ? CU_MEM_ALLOCATION_TYPE_PINNED : CU_MEM_ALLOCATION_TYPE_MANAGED;
            props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            props.location.id = (int)dev;
            CUmemoryPool pool;
            CHECK(w, k == 'p' ? "cuMemPoolCreate(pinned)" : "cuMemPoolCreate(managed)", cuMemPoolCreate(&pool, &props));
            cuuint64_t keep = has('t') ? 0 : ~(cuuint64_t)0;
            CHECK(w, "cuMemPoolSetAttribute(threshold)",
                  cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep));
            if (!use_pool(w, pool, stream, bytes, value)) return NULL;
            if (!has('x')) {
                CHECK(w, "cuStreamSynchronize(pool)", cuStreamSynchronize(stream));
                CHECK(w, "cuMemPoolTrimTo", cuMemPoolTrimTo(pool, 0));
            }
            if (has('c')) CHECK(w, "cuCtxSynchronize(pool)", cuCtxSynchronize());
            CHECK(w, "cuMemPoolDestroy", cuMemPoolDestroy(pool));
        }
        if (has('d') && !use_pool(w, NULL, stream, bytes, value)) return NULL;
        if (has('g') && !use_pool(w, managed_default, stream, bytes, value)) return NULL;
        for (int kind = 0; kind < 2; kind++) {
            char k = kind == 0 ? 'u' : 'v';
            if (!has(k)) continue;
            CUdeviceptr p = 0;
            if (k == 'u')
                CHECK(w, "cuMemAllocManaged", cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL));
            else
                CHECK(w, "cuMemAlloc", cuMemAlloc(&p, bytes));
            CHECK(w, "fill(sync)", fill(p, value, bytes / 4, stream));
            CHECK(w, "cuStreamSynchronize(sync)", cuStreamSynchronize(stream));
            CHECK(w, "cuMemFree", cuMemFree(p));
        }
        if (has('n')) {
            CUstream extra;
            CHECK(w, "cuStreamCreate(extra)", cuStreamCreate(&extra, flags));
            CHECK(w, "cuStreamSynchronize(extra)", cuStreamSynchronize(extra));
            CHECK(w, "cuStreamDestroy(extra)", cuStreamDestroy(extra));
        }
        if (has('e')) {
            CHECK(w, "cuEventRecord", cuEventRecord(event, stream));
            CHECK(w, "cuEventSynchronize", cuEventSynchronize(event));
        }
        if (has('s')) CHECK(w, "cuStreamSynchronize", cuStreamSynchronize(stream));
        if (has('c')) CHECK(w, "cuCtxSynchronize", cuCtxSynchronize());
        if (module) {
            thread_fill = NULL;
            CHECK(w, "cuModuleUnload", cuModuleUnload(module));
        }
        atomic_store(&w->doing, "(between iterations)");
        atomic_fetch_add(&w->iterations, 1);
    }
    CHECK(w, "cuStreamSynchronize(end)", cuStreamSynchronize(stream));
    CHECK(w, "cuEventDestroy", cuEventDestroy(event));
    CHECK(w, "cuStreamDestroy", cuStreamDestroy(stream));
    atomic_store(&w->doing, "(done)");
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s THREADS SECONDS MODE [STALL_S]\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]);
    seconds = atoi(argv[2]);
    mode = argv[3];
    int stall_s = argc > 4 ? atoi(argv[4]) : 20;
    int stall_wait = getenv("STALL_WAIT_S") ? atoi(getenv("STALL_WAIT_S")) : 60;
    if (threads < 1 || threads > MAX_THREADS || seconds < 1 || stall_s < 1) {
        fprintf(stderr, "pool_stall: THREADS 1..%d, SECONDS and STALL_S at least 1\n", MAX_THREADS);
        return 2;
    }
    int count = 0;
    if (cuInit(0) != CUDA_SUCCESS || cuDeviceGetCount(&count) != CUDA_SUCCESS || count < 1) {
        fprintf(stderr, "pool_stall: no CUDA device\n");
        return 1;
    }
    ndev = strchr(mode, '2') && count > 1 ? 2 : 1;
    if (strchr(mode, 'M')) {
        FILE *f = fopen(getenv("FILL_PTX") ? getenv("FILL_PTX") : "fill.ptx", "rb");
        if (!f) {
            fprintf(stderr, "pool_stall: cannot read fill.ptx (FILL_PTX)\n");
            return 1;
        }
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        ptx_image = calloc(1, (size_t)n + 1);
        if (fread(ptx_image, 1, (size_t)n, f) != (size_t)n) return 1;
        fclose(f);
    }
    {
        CUdevice d0;
        cuDeviceGet(&d0, 0);
        cuDeviceTotalMem(&device_bytes, d0);
    }
    for (int d = 0; d < ndev; d++) {
        if (cuDeviceGet(&devs[d], d) != CUDA_SUCCESS || cuDevicePrimaryCtxRetain(&ctxs[d], devs[d]) != CUDA_SUCCESS ||
            cuCtxSetCurrent(ctxs[d]) != CUDA_SUCCESS) {
            fprintf(stderr, "pool_stall: cannot use device %d\n", d);
            return 1;
        }
        CUmodule module;
        if (strchr(mode, 'k') &&
            (cuModuleLoad(&module, getenv("FILL_PTX") ? getenv("FILL_PTX") : "fill.ptx") != CUDA_SUCCESS ||
             cuModuleGetFunction(&fill_fns[d], module, "fill_u32") != CUDA_SUCCESS)) {
            fprintf(stderr, "pool_stall: cannot load fill.ptx (FILL_PTX)\n");
            return 1;
        }
    }
    for (int i = 0; i < threads; i++) {
        workers[i].id = i;
        atomic_store(&workers[i].doing, "(starting)");
        pthread_create(&workers[i].thread, NULL, work, &workers[i]);
    }
    unsigned long last = atomic_load(&progress);
    double last_change = now();
    for (;;) {
        usleep(100000);
        int running = 0;
        for (int i = 0; i < threads; i++)
            if (strcmp(atomic_load(&workers[i].doing), "(done)") != 0) running++;
        if (!running || atomic_load(&failed)) break;
        unsigned long p = atomic_load(&progress);
        if (p != last) {
            last = p;
            last_change = now();
        } else if (now() - last_change > stall_s) {
            printf("STALL pid %d: no driver call returned for %d s; mode %s, %d threads\n", (int)getpid(),
                   stall_s, mode, threads);
            for (int i = 0; i < threads; i++)
                printf("  worker %d: in %s after %lu iterations\n", i, atomic_load(&workers[i].doing),
                       atomic_load(&workers[i].iterations));
            fflush(stdout);
            sleep(stall_wait);
            _exit(3);
        }
    }
    unsigned long total = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(workers[i].thread, NULL);
        total += atomic_load(&workers[i].iterations);
    }
    printf("ok: mode %s, %d threads, %d s, %lu iterations%s\n", mode, threads, seconds, total,
           atomic_load(&failed) ? " (a driver call FAILED)" : "");
    return atomic_load(&failed) ? 1 : 0;
}
