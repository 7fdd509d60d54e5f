// RMM's own typed resource suites (cpp/tests/mr/cccl_mr_ref_test_{basic,allocation,mt}.hpp of RMM at the
// commit the librmm-cu13 26.10.0 wheel was built from, fetched by scripts/rmm-gpu-tests.sh, never kept in
// this repository) instantiated over mempool resources through the bridge, exactly as RMM instantiates
// them over its own (cpp/tests/mr/mr_ref_pool_tests.cpp): a fixture with `ref` and `stream`.
#include "cccl_mr_ref_test_allocation.hpp"
#include "cccl_mr_ref_test_basic.hpp"
#include "cccl_mr_ref_test_mt.hpp"

#include <mempool/rmm.hpp>

namespace rmm::test {
namespace {

mempool::rmm_resource adopt_created(int status, mempool_resource_t* h, char const* what)
{
  mempool::check(status, what);
  return mempool::rmm_resource::adopt(h);
}

// mempool's driver pool (RMM's cuda_async_memory_resource).
inline mempool::rmm_resource make_mempool_async()
{
  mempool_resource_t* h = nullptr;
  return adopt_created(mempool_async_resource_create(0, 0, &h), h, "mempool_async_resource_create");
}

// mempool's pool suballocator over its driver pool (RMM's pool_memory_resource).
inline mempool::rmm_resource make_mempool_pool()
{
  auto upstream         = make_mempool_async();
  mempool_resource_t* h = nullptr;
  return adopt_created(
    mempool_pool_resource_create(upstream.handle(), 0, 0, 0, &h), h, "mempool_pool_resource_create");
}

// mempool's default stack: bins of 2^8 to 2^20 bytes over the pool over the driver pool (RMM's
// binning_memory_resource).
inline mempool::rmm_resource make_mempool_binning()
{
  auto pool             = make_mempool_pool();
  mempool_resource_t* h = nullptr;
  return adopt_created(
    mempool_binning_resource_create(pool.handle(), 8, 20, &h), h, "mempool_binning_resource_create");
}

// mempool's arena over its driver pool, half the free memory (RMM's arena_memory_resource's default).
inline mempool::rmm_resource make_mempool_arena()
{
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    throw rmm::cuda_error{"cudaMemGetInfo failed"};
  }
  auto upstream         = make_mempool_async();
  mempool_resource_t* h = nullptr;
  return adopt_created(mempool_arena_resource_create(upstream.handle(), (free_bytes / 2) & ~std::size_t{255}, &h),
                       h, "mempool_arena_resource_create");
}

// The device's current mempool resource (the default stack when nothing was set).
inline mempool::rmm_resource make_mempool_current() { return mempool::rmm_resource::current(0); }

// A tag of mempool's service resource.
inline mempool::rmm_resource make_mempool_service_tag()
{
  mempool_resource_t* svc = nullptr;
  mempool::check(mempool_service_resource_create(0, 4, 0, 0, 15, -1, &svc),
                 "mempool_service_resource_create");
  auto service = mempool::rmm_resource::adopt(svc);
  std::uint32_t tag{};
  mempool::check(mempool_service_tag(svc, "rmm_tests", &tag), "mempool_service_tag");
  mempool_resource_t* h = nullptr;
  return adopt_created(
    mempool_service_tagged_resource(svc, tag, &h), h, "mempool_service_tagged_resource");
}

template <mempool::rmm_resource (*Make)()>
struct MempoolFixture : public ::testing::Test {
  mempool::rmm_resource mr{Make()};
  rmm::device_async_resource_ref ref{mr};
  rmm::cuda_stream stream{};
};

using MempoolAsyncFixture      = MempoolFixture<make_mempool_async>;
using MempoolPoolFixture       = MempoolFixture<make_mempool_pool>;
using MempoolBinningFixture    = MempoolFixture<make_mempool_binning>;
using MempoolArenaFixture      = MempoolFixture<make_mempool_arena>;
using MempoolCurrentFixture    = MempoolFixture<make_mempool_current>;
using MempoolServiceTagFixture = MempoolFixture<make_mempool_service_tag>;

INSTANTIATE_TYPED_TEST_SUITE_P(MempoolAsync, CcclMrRefTest, MempoolAsyncFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolAsync, CcclMrRefAllocationTest, MempoolAsyncFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolAsync, CcclMrRefTestMT, MempoolAsyncFixture);

INSTANTIATE_TYPED_TEST_SUITE_P(MempoolPool, CcclMrRefTest, MempoolPoolFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolPool, CcclMrRefAllocationTest, MempoolPoolFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolPool, CcclMrRefTestMT, MempoolPoolFixture);

INSTANTIATE_TYPED_TEST_SUITE_P(MempoolBinning, CcclMrRefTest, MempoolBinningFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolBinning, CcclMrRefAllocationTest, MempoolBinningFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolBinning, CcclMrRefTestMT, MempoolBinningFixture);

INSTANTIATE_TYPED_TEST_SUITE_P(MempoolArena, CcclMrRefTest, MempoolArenaFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolArena, CcclMrRefAllocationTest, MempoolArenaFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolArena, CcclMrRefTestMT, MempoolArenaFixture);

INSTANTIATE_TYPED_TEST_SUITE_P(MempoolCurrent, CcclMrRefTest, MempoolCurrentFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolCurrent, CcclMrRefAllocationTest, MempoolCurrentFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolCurrent, CcclMrRefTestMT, MempoolCurrentFixture);

INSTANTIATE_TYPED_TEST_SUITE_P(MempoolServiceTag, CcclMrRefTest, MempoolServiceTagFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolServiceTag, CcclMrRefAllocationTest, MempoolServiceTagFixture);
INSTANTIATE_TYPED_TEST_SUITE_P(MempoolServiceTag, CcclMrRefTestMT, MempoolServiceTagFixture);

}  // namespace
}  // namespace rmm::test
