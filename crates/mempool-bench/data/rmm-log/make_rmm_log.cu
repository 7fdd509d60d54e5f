// make_rmm_log: writes a real allocation log with RMM 26.10's logging_resource_adaptor, for mempool's
// replay tests (crates/mempool-bench/data/rmm-26.10.csv). Build and run with build.sh beside it:
//
//   bash crates/mempool-bench/data/rmm-log/build.sh .whl /tmp/out && /tmp/out/make_rmm_log out.csv
//
// What it logs (all of it deterministic except addresses, thread ids, stream handles and times):
//   - the main thread: one allocation and free on the default stream (stream column `0`);
//   - thread A, on its own stream: 24 allocations of varied sizes (1 B to 8 MiB); it fills each one, frees
//     every third itself and hands the others to thread B with an event recorded after the fill;
//   - thread B, on its own stream: 16 allocations of its own (filled, half freed at once, half at the
//     end), and the frees of A's blocks, each after waiting on the block's event (so the free on B's
//     stream is ordered after A's use of the block);
//   - the main thread, after both: one allocation of 1 PiB, which fails (`allocate failure,(nil),...`).
// Every allocation is freed: 41 allocations, 41 frees, 1 failure, plus the header.
//
// The log is RMM's own; nothing here formats a line. The resource stack: logging_resource_adaptor over
// cuda_async_memory_resource (the device's stream-ordered pool, cudaMallocFromPoolAsync).

#include <rmm/aligned.hpp>
#include <rmm/cuda_stream.hpp>
#include <rmm/error.hpp>
#include <rmm/mr/cuda_async_memory_resource.hpp>
#include <rmm/mr/logging_resource_adaptor.hpp>

#include <cuda/stream>
#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

#define CHECK_CUDA(call)                                                                      \
  do {                                                                                        \
    cudaError_t const status_ = (call);                                                       \
    if (status_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                      \
                   cudaGetErrorString(status_));                                              \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr std::size_t alignment = rmm::CUDA_ALLOCATION_ALIGNMENT;

// Sizes from 1 byte to 8 MiB: a power-of-two range picked by `i`, and a point in it from a fixed LCG.
std::size_t size_for(std::uint64_t& state, int i)
{
  state = state * 6364136223846793005ULL + 1442695040888963407ULL;
  int const bits = 1 + (i * 7) % 23;  // 2^1 .. 2^23
  std::uint64_t const range = std::uint64_t{1} << bits;
  return static_cast<std::size_t>(1 + (state >> 17) % range);
}

// A block thread A hands to thread B: B frees it on its own stream after waiting on `ready`.
struct handover {
  void* ptr;
  std::size_t bytes;
  cudaEvent_t ready;
};

struct mailbox {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<handover> blocks;
  bool closed{false};

  void push(handover h)
  {
    {
      std::lock_guard<std::mutex> lock{mutex};
      blocks.push_back(h);
    }
    cv.notify_one();
  }
  void close()
  {
    {
      std::lock_guard<std::mutex> lock{mutex};
      closed = true;
    }
    cv.notify_one();
  }
  // Waits for a block; false once closed and empty.
  bool pop(handover& out)
  {
    std::unique_lock<std::mutex> lock{mutex};
    cv.wait(lock, [this] { return closed || !blocks.empty(); });
    if (blocks.empty()) { return false; }
    out = blocks.front();
    blocks.pop_front();
    return true;
  }
};

void thread_a(rmm::mr::logging_resource_adaptor mr, mailbox& box)
{
  rmm::cuda_stream stream{rmm::cuda_stream::flags::non_blocking};
  cuda::stream_ref const s = stream;
  std::uint64_t state = 0xA;
  for (int i = 0; i < 24; ++i) {
    std::size_t const bytes = size_for(state, i);
    void* p = mr.allocate(s, bytes, alignment);
    CHECK_CUDA(cudaMemsetAsync(p, i, bytes, stream.value()));
    if (i % 3 == 0) {
      // Freed on the stream that used it: ordered after the fill.
      mr.deallocate(s, p, bytes, alignment);
    } else {
      cudaEvent_t ready{};
      CHECK_CUDA(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
      CHECK_CUDA(cudaEventRecord(ready, stream.value()));
      box.push(handover{p, bytes, ready});
    }
    // Let B's lines interleave with A's.
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  box.close();
  stream.synchronize();
}

void thread_b(rmm::mr::logging_resource_adaptor mr, mailbox& box)
{
  rmm::cuda_stream stream{rmm::cuda_stream::flags::non_blocking};
  cuda::stream_ref const s = stream;
  std::uint64_t state = 0xB;
  std::vector<std::pair<void*, std::size_t>> mine;
  for (int i = 0; i < 16; ++i) {
    std::size_t const bytes = size_for(state, i + 3);
    void* p = mr.allocate(s, bytes, alignment);
    CHECK_CUDA(cudaMemsetAsync(p, 0xB0 + i, bytes, stream.value()));
    if (i % 2 == 0) {
      mr.deallocate(s, p, bytes, alignment);
    } else {
      mine.emplace_back(p, bytes);
    }
    handover h{};
    // Take one of A's blocks when there is one (without waiting for it).
    {
      std::unique_lock<std::mutex> lock{box.mutex};
      if (!box.blocks.empty()) {
        h = box.blocks.front();
        box.blocks.pop_front();
      }
    }
    if (h.ptr != nullptr) {
      CHECK_CUDA(cudaStreamWaitEvent(stream.value(), h.ready, 0));
      CHECK_CUDA(cudaEventDestroy(h.ready));
      mr.deallocate(s, h.ptr, h.bytes, alignment);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(300));
  }
  // The rest of A's blocks, as A hands them over.
  handover h{};
  while (box.pop(h)) {
    // B's free must not overtake A's fill: B's stream waits for the event A recorded after it.
    CHECK_CUDA(cudaStreamWaitEvent(stream.value(), h.ready, 0));
    CHECK_CUDA(cudaEventDestroy(h.ready));
    mr.deallocate(s, h.ptr, h.bytes, alignment);
  }
  for (auto const& [p, bytes] : mine) {
    mr.deallocate(s, p, bytes, alignment);
  }
  stream.synchronize();
}

}  // namespace

int main(int argc, char** argv)
{
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s LOG.csv\n", argv[0]);
    return 2;
  }
  try {
    CHECK_CUDA(cudaSetDevice(0));
    rmm::mr::cuda_async_memory_resource pool{};
    // Copies of the adaptor share one logger and one upstream (cuda::mr::shared_resource).
    rmm::mr::logging_resource_adaptor mr{pool, std::string{argv[1]}, /*auto_flush=*/true};

    // The default (null) stream: RMM writes it as `0`.
    cuda::stream_ref const default_stream{cudaStream_t{nullptr}};
    void* p = mr.allocate(default_stream, 4096, alignment);
    CHECK_CUDA(cudaMemsetAsync(p, 0, 4096, cudaStream_t{nullptr}));
    mr.deallocate(default_stream, p, 4096, alignment);
    CHECK_CUDA(cudaDeviceSynchronize());

    mailbox box;
    std::thread a{thread_a, mr, std::ref(box)};
    std::thread b{thread_b, mr, std::ref(box)};
    a.join();
    b.join();

    // An allocation the pool cannot satisfy: RMM logs `allocate failure` with a null pointer, rethrows.
    std::size_t const too_much = std::size_t{1} << 50;  // 1 PiB
    try {
      void* q = mr.allocate(default_stream, too_much, alignment);
      std::fprintf(stderr, "error: allocating 1 PiB succeeded\n");
      mr.deallocate(default_stream, q, too_much, alignment);
      return 1;
    } catch (rmm::bad_alloc const& e) {
      std::fprintf(stderr, "expected failure: %s\n", e.what());
    }

    CHECK_CUDA(cudaDeviceSynchronize());
    mr.flush();
    std::printf("wrote %s\n", argv[1]);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
