// The RMM bridge (mempool/rmm.hpp) on a GPU, with GoogleTest: RMM's containers allocating from mempool
// resources, stream-ordered frees on other streams, alignment, out of memory as rmm::out_of_memory,
// equality, the service resource's tags, two devices (TwoGpu.*: two GPUs needed; they fail on fewer),
// and a resource left current until exit. Built and run by scripts/rmm-gpu-tests.sh (docs/rmm.md).
#include <mempool/rmm.hpp>

#include <rmm/cuda_stream.hpp>
#include <rmm/device_buffer.hpp>
#include <rmm/device_uvector.hpp>
#include <rmm/error.hpp>
#include <rmm/mr/per_device_resource.hpp>
#include <rmm/resource_ref.hpp>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// A new handle of a C ABI create call, or the test fails with mempool's message.
mempool_resource_t* made(int status, mempool_resource_t* handle, char const* what)
{
  EXPECT_EQ(status, MEMPOOL_SUCCESS) << what << ": " << mempool_last_error();
  return handle;
}

mempool_resource_t* async_handle(int device)
{
  mempool_resource_t* h = nullptr;
  return made(mempool_async_resource_create(device, 0, &h), h, "mempool_async_resource_create");
}

// A statistics adaptor over h (h is released: the adaptor holds its resource).
mempool_resource_t* stats_over(mempool_resource_t* h)
{
  mempool_resource_t* s = nullptr;
  int status            = mempool_statistics_adaptor_create(h, &s);
  mempool_resource_destroy(h);
  return made(status, s, "mempool_statistics_adaptor_create");
}

mempool_statistics_t stats_of(mempool::rmm_resource const& mr)
{
  mempool_statistics_t s{};
  EXPECT_EQ(mempool_statistics_get(mr.handle(), &s), MEMPOOL_SUCCESS) << mempool_last_error();
  return s;
}

int pointer_device(void const* p)
{
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) { return -2; }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

struct Bridge : ::testing::Test {
  void SetUp() override { CUDA_OK(cudaSetDevice(0)); }
  mempool::rmm_resource mr{mempool::rmm_resource::adopt(stats_over(async_handle(0)))};
  rmm::cuda_stream stream{};
};

TEST_F(Bridge, DeviceBufferAllocatesFromMempoolAndRoundTrips)
{
  auto previous = rmm::mr::set_current_device_resource(mr);
  {
    rmm::device_buffer buf{1000, stream};  // the current resource
    ASSERT_NE(buf.data(), nullptr);
    EXPECT_EQ(stats_of(mr).current_bytes, 1000);
    EXPECT_EQ(pointer_device(buf.data()), 0);
    auto current = rmm::mr::get_current_device_resource_ref();
    void* p      = current.allocate(stream, 24, rmm::CUDA_ALLOCATION_ALIGNMENT);
    EXPECT_EQ(stats_of(mr).current_bytes, 1024);  // the current resource is mr
    current.deallocate(stream, p, 24, rmm::CUDA_ALLOCATION_ALIGNMENT);
    std::vector<std::uint8_t> in(1000), out(1000, 0);
    for (std::size_t i = 0; i < in.size(); ++i) { in[i] = static_cast<std::uint8_t>(i * 7); }
    CUDA_OK(cudaMemcpyAsync(buf.data(), in.data(), in.size(), cudaMemcpyHostToDevice, stream.value()));
    rmm::device_buffer copy{buf, stream};  // copied on the device, allocated from mempool
    EXPECT_EQ(stats_of(mr).current_bytes, 2000);
    CUDA_OK(cudaMemcpyAsync(out.data(), copy.data(), out.size(), cudaMemcpyDeviceToHost, stream.value()));
    stream.synchronize();
    EXPECT_EQ(in, out);
    buf.resize(5000, stream);
    EXPECT_EQ(stats_of(mr).current_bytes, 6000);
  }
  stream.synchronize();
  EXPECT_EQ(stats_of(mr).current_bytes, 0);
  EXPECT_EQ(stats_of(mr).total_count, 4);
  rmm::mr::set_current_device_resource(std::move(previous));
}

TEST_F(Bridge, DeviceUvectorSetsAndReadsElements)
{
  rmm::device_uvector<std::int64_t> v(1 << 20, stream, mr);
  EXPECT_EQ(stats_of(mr).current_bytes, std::int64_t{8} << 20);
  v.set_element(12345, 42, stream);
  std::int64_t const minus_seven = -7;  // lives until the copy is done (set_element_async takes no temporary)
  v.set_element_async(0, minus_seven, stream);
  EXPECT_EQ(v.element(12345, stream), 42);
  EXPECT_EQ(v.front_element(stream), -7);
  v.resize(10, stream);
  v.shrink_to_fit(stream);
  EXPECT_EQ(v.element(0, stream), -7);
  stream.synchronize();
  EXPECT_EQ(stats_of(mr).current_bytes, 80);
}

TEST_F(Bridge, FreesOrderedOnAnotherStream)
{
  rmm::cuda_stream other{};
  constexpr std::size_t n = 8 << 20;
  for (int round = 0; round < 20; ++round) {
    void* p = mr.allocate(stream, n);
    CUDA_OK(cudaMemsetAsync(p, round, n, stream.value()));
    cudaEvent_t done{};
    CUDA_OK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    CUDA_OK(cudaEventRecord(done, stream.value()));
    CUDA_OK(cudaStreamWaitEvent(other.value(), done, 0));
    mr.deallocate(other, p, n);  // ordered after the memset through the event
    CUDA_OK(cudaEventDestroy(done));
  }
  // A device_buffer moved to another stream frees there.
  rmm::device_buffer buf{4096, stream, mr};
  stream.synchronize();
  buf.set_stream(other);
  buf = rmm::device_buffer{};
  other.synchronize();
  EXPECT_EQ(stats_of(mr).current_bytes, 0);
  EXPECT_EQ(mr.failed_deallocations(), 0u) << mr.last_deallocation_error();
}

TEST_F(Bridge, FreesFromAnotherThread)
{
  std::vector<void*> ptrs;
  for (int i = 0; i < 64; ++i) { ptrs.push_back(mr.allocate(stream, 1000 + i)); }
  stream.synchronize();
  std::thread t{[&] {
    for (int i = 0; i < 64; ++i) { mr.deallocate(cuda::stream_ref{cudaStreamPerThread}, ptrs[i], 1000 + i); }
  }};
  t.join();
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(stats_of(mr).current_bytes, 0);
}

TEST_F(Bridge, AlignmentUpTo256IsNativeAndLargerIsOverAllocated)
{
  for (std::size_t a = 1; a <= 256; a *= 2) {
    void* p = mr.allocate(stream, 100, a);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u) << a;
    EXPECT_EQ(stats_of(mr).current_bytes, 100);
    mr.deallocate(stream, p, 100, a);
  }
  for (std::size_t a : {std::size_t{512}, std::size_t{4096}, std::size_t{1} << 16, std::size_t{1} << 21}) {
    std::vector<void*> ptrs;
    for (int i = 0; i < 8; ++i) {
      void* p = mr.allocate(stream, 1000, a);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % a, 0u) << a;
      EXPECT_EQ(pointer_device(p), 0);
      CUDA_OK(cudaMemsetAsync(p, 1, 1000, stream.value()));
      ptrs.push_back(p);
    }
    EXPECT_EQ(stats_of(mr).current_bytes, std::int64_t(8 * (1000 + a - 256)));
    // A copy (and any equal resource) frees what this one over-aligned.
    auto copy = mr;
    for (void* p : ptrs) { copy.deallocate(stream, p, 1000, a); }
    EXPECT_EQ(stats_of(mr).current_bytes, 0);
  }
  // device_buffer's own alignment argument reaches the resource.
  rmm::device_buffer buf{3000, 8192, stream, mr};
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buf.data()) % 8192, 0u);
  // Not a power of two: refused as RMM refuses an alignment it does not serve.
  EXPECT_THROW((void)mr.allocate(stream, 100, 3), rmm::bad_alloc);
  EXPECT_THROW((void)mr.allocate(stream, 100, 0), rmm::bad_alloc);
  // An over-aligned free of an address no resource over-aligned is refused and counted, never thrown.
  mr.deallocate(stream, reinterpret_cast<void*>(std::uintptr_t{1} << 40), 100, 1024);
  EXPECT_EQ(mr.failed_deallocations(), 1u);
  EXPECT_NE(mr.last_deallocation_error().find("alignment 1024"), std::string::npos)
    << mr.last_deallocation_error();
  // 0 bytes is nullptr, at any alignment, and its free a no-op.
  EXPECT_EQ(mr.allocate(stream, 0), nullptr);
  EXPECT_EQ(mr.allocate(stream, 0, 4096), nullptr);
  mr.deallocate(stream, nullptr, 0, 4096);
}

TEST_F(Bridge, OutOfMemoryIsRmmOutOfMemoryWithMempoolsMessage)
{
  constexpr std::size_t huge = std::size_t{1} << 50;  // 1 PiB
  try {
    (void)mr.allocate(stream, huge);
    FAIL() << "1 PiB was allocated";
  } catch (rmm::out_of_memory const& e) {
    std::string text = e.what();
    EXPECT_NE(text.find("MEMPOOL_ERROR_OUT_OF_MEMORY"), std::string::npos) << text;
    EXPECT_NE(text.find(std::to_string(huge)), std::string::npos) << text;
  }
  EXPECT_THROW((void)mr.allocate_sync(huge), rmm::out_of_memory);
  EXPECT_THROW((rmm::device_buffer{huge, stream, mr}), rmm::out_of_memory);
  EXPECT_THROW((rmm::device_uvector<double>{huge / 8, stream, mr}), rmm::out_of_memory);
  // Over a limiting adaptor's limit.
  mempool_resource_t* limited = nullptr;
  ASSERT_EQ(mempool_limiting_adaptor_create(mr.handle(), 1 << 20, &limited), MEMPOOL_SUCCESS);
  auto small = mempool::rmm_resource::adopt(limited);
  void* p    = small.allocate(stream, 1 << 19);
  EXPECT_THROW((void)small.allocate(stream, 1 << 20), rmm::out_of_memory);
  small.deallocate(stream, p, 1 << 19);
  // And through the current resource, as libcudf meets it.
  auto previous = rmm::mr::set_current_device_resource(small);
  EXPECT_THROW((rmm::device_buffer{2 << 20, stream}), rmm::out_of_memory);
  rmm::mr::set_current_device_resource(std::move(previous));
}

TEST_F(Bridge, SyncAllocationsAreReadyOnAnyStream)
{
  void* p = mr.allocate_sync(1 << 20);
  CUDA_OK(cudaMemsetAsync(p, 0, 1 << 20, stream.value()));
  stream.synchronize();
  mr.deallocate_sync(p, 1 << 20);
  void* q = mr.allocate_sync(1 << 20, 4096);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(q) % 4096, 0u);
  mr.deallocate_sync(q, 1 << 20, 4096);
  EXPECT_EQ(stats_of(mr).current_bytes, 0);
}

TEST_F(Bridge, EqualityFollowsTheResource)
{
  auto copy = mr;
  EXPECT_TRUE(copy == mr);
  auto shared = mempool::rmm_resource::share(mr.handle());
  EXPECT_NE(shared.handle(), mr.handle());
  EXPECT_TRUE(shared == mr);  // another handle of the same resource
  auto other = mempool::rmm_resource::adopt(async_handle(0));
  EXPECT_FALSE(other == mr);
  EXPECT_TRUE(other != mr);
  cuda::mr::any_resource<cuda::mr::device_accessible> a{mr}, b{shared}, c{other};
  EXPECT_TRUE(a == b);
  EXPECT_FALSE(a == c);
  rmm::device_async_resource_ref ra{mr}, rb{shared};
  EXPECT_TRUE(ra == rb);
  // Memory from one handle is freed through the other.
  void* p = mr.allocate(stream, 4096);
  shared.deallocate(stream, p, 4096);
  stream.synchronize();
  EXPECT_EQ(stats_of(mr).current_bytes, 0);
  EXPECT_EQ(shared.failed_deallocations(), 0u) << shared.last_deallocation_error();
}

TEST_F(Bridge, ACopyKeepsTheResourceAlive)
{
  void* p = nullptr;
  mempool::rmm_resource keep = [&] {
    auto local = mempool::rmm_resource::adopt(stats_over(async_handle(0)));
    p          = local.allocate(stream, 1 << 20);
    return local;
  }();
  EXPECT_EQ(stats_of(keep).current_bytes, 1 << 20);
  keep.deallocate(stream, p, 1 << 20);
  stream.synchronize();
}

TEST_F(Bridge, MempoolsCurrentResourceAndAPoolAndAServiceTag)
{
  auto current = mempool::rmm_resource::current(0);
  rmm::device_buffer a{12345, stream, current};
  mempool_resource_t* pool = nullptr;
  ASSERT_EQ(mempool_pool_resource_create(mr.handle(), 0, 1 << 24, 1 << 26, &pool), MEMPOOL_SUCCESS);
  auto pooled = mempool::rmm_resource::adopt(pool);
  rmm::device_uvector<float> v(1000, stream, pooled);
  EXPECT_GE(stats_of(mr).current_bytes, 1 << 24);  // the pool reserved its initial size from mr
  mempool_resource_t* svc = nullptr;
  ASSERT_EQ(mempool_service_resource_create(0, 4, 0, std::size_t{1} << 32, 15, -1, &svc), MEMPOOL_SUCCESS)
    << mempool_last_error();
  std::uint32_t tag = 0;
  ASSERT_EQ(mempool_service_tag(svc, "kv_cache", &tag), MEMPOOL_SUCCESS);
  mempool_resource_t* tagged = nullptr;
  ASSERT_EQ(mempool_service_tagged_resource(svc, tag, &tagged), MEMPOOL_SUCCESS);
  auto kv = mempool::rmm_resource::adopt(tagged);
  mempool_resource_destroy(svc);  // the tagged handle holds the service resource
  rmm::device_buffer b{3 << 20, stream, kv};
  mempool_service_stats_t st{};
  mempool_service_tag_stats_t rows[4]{};
  ASSERT_EQ(mempool_service_stats(kv.handle(), &st, rows, 4), MEMPOOL_SUCCESS);
  EXPECT_EQ(rows[tag].live_allocations, 1u);
  EXPECT_GE(rows[tag].used_bytes, 3u << 20);
}

TEST_F(Bridge, BinningAndArenaServeDeviceBuffersOfEverySize)
{
  // mempool's default stack (bins of 2^8 to 2^20 bytes over a pool over mr) and an arena over mr.
  mempool_resource_t* pool = nullptr;
  ASSERT_EQ(mempool_pool_resource_create(mr.handle(), 0, 1 << 26, 0, &pool), MEMPOOL_SUCCESS)
    << mempool_last_error();
  auto pooled             = mempool::rmm_resource::adopt(pool);
  mempool_resource_t* bin = nullptr;
  ASSERT_EQ(mempool_binning_resource_create(pooled.handle(), 8, 20, &bin), MEMPOOL_SUCCESS)
    << mempool_last_error();
  auto bins                 = mempool::rmm_resource::adopt(bin);
  mempool_resource_t* arena = nullptr;
  ASSERT_EQ(mempool_arena_resource_create(mr.handle(), std::size_t{64} << 20, &arena), MEMPOOL_SUCCESS)
    << mempool_last_error();
  auto arenas = mempool::rmm_resource::adopt(arena);
  for (auto const* each : {&bins, &arenas}) {
    std::vector<rmm::device_buffer> bufs;
    for (std::size_t size : {std::size_t{1}, std::size_t{256}, std::size_t{4097}, std::size_t{1} << 20,
                             (std::size_t{3} << 20) + 5}) {
      std::vector<std::uint8_t> host(size, static_cast<std::uint8_t>(size * 7));
      bufs.emplace_back(host.data(), size, stream, *each);
      std::vector<std::uint8_t> back(size);
      CUDA_OK(cudaMemcpyAsync(back.data(), bufs.back().data(), size, cudaMemcpyDeviceToHost, stream.value()));
      CUDA_OK(cudaStreamSynchronize(stream.value()));
      EXPECT_EQ(back, host) << size << " bytes";
    }
  }
  // The arena does not grow: more than it holds is rmm::out_of_memory.
  EXPECT_THROW(rmm::device_buffer(std::size_t{128} << 20, stream, arenas), rmm::out_of_memory);
}

TEST(TwoGpu, EachDeviceAllocatesFromItsOwnResource)
{
  int n = 0;
  CUDA_OK(cudaGetDeviceCount(&n));
  ASSERT_GE(n, 2) << "this test needs two GPUs";
  std::vector<mempool::rmm_resource> mrs;
  for (int d = 0; d < 2; ++d) {
    CUDA_OK(cudaSetDevice(d));
    mrs.push_back(mempool::rmm_resource::adopt(stats_over(async_handle(d))));
    EXPECT_EQ(mrs.back().device(), d);
    rmm::mr::set_per_device_resource(rmm::cuda_device_id{d}, mrs.back());
  }
  EXPECT_FALSE(mrs[0] == mrs[1]);
  for (int d = 0; d < 2; ++d) {
    CUDA_OK(cudaSetDevice(d));
    rmm::cuda_stream s{};
    rmm::device_buffer buf{std::size_t(d + 1) << 20, s};  // device d's current resource
    EXPECT_EQ(pointer_device(buf.data()), d);
    EXPECT_EQ(stats_of(mrs[d]).current_bytes, (d + 1) << 20);
    EXPECT_EQ(stats_of(mrs[1 - d]).current_bytes, 0);
    // allocate_sync synchronizes the resource's own device, whichever is current.
    CUDA_OK(cudaSetDevice(1 - d));
    void* p = mrs[d].allocate_sync(4096);
    EXPECT_EQ(pointer_device(p), d);
    mrs[d].deallocate_sync(p, 4096);
    CUDA_OK(cudaSetDevice(d));
  }
  for (int d = 0; d < 2; ++d) { EXPECT_EQ(stats_of(mrs[d]).current_bytes, 0); }
  for (int d = 0; d < 2; ++d) { rmm::mr::reset_per_device_resource(rmm::cuda_device_id{d}); }
  CUDA_OK(cudaSetDevice(0));
}

// Last (GoogleTest runs a file's tests in order): a mempool resource stays RMM's current resource until the
// process exits; its release then must not call into a driver that may be gone (rmm::process_is_exiting).
TEST(ZzExit, AResourceLeftCurrentUntilExit)
{
  CUDA_OK(cudaSetDevice(0));
  rmm::mr::set_current_device_resource(mempool::rmm_resource::adopt(async_handle(0)));
  rmm::device_buffer kept{1 << 20, cuda::stream_ref{cudaStream_t{nullptr}}};
  EXPECT_NE(kept.data(), nullptr);
}

}  // namespace
