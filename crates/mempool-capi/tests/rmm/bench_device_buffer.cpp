/* rmm::device_buffer on the standard random workload (docs/rmm.md, "Measured: C++"): RMM 26.10's own pool,
 * binning and async resources against mempool's through the bridge (mempool/rmm.hpp), in one process, the
 * configurations interleaved round by round.
 *
 *   bench_device_buffer [--points small,mid,large] [--repeats N] [--only NAME,...]
 *   bench_device_buffer --self-check      (no GPU: the workload generator against the Rust one's pinned values)
 *
 * The workload is the project's standard one (mempool_suballoc::workload::random_workload, SplitMix64; point
 * i of small/mid/large uses seed 42 + i, as mempool-bench random): each draw allocates a size uniform in
 * [1, max_size] with probability 0.73 (dropped when live bytes would pass max_usage), else frees a uniformly
 * chosen live buffer (swap-remove). A run: every operation in order (an allocation constructs an
 * rmm::device_buffer on one stream with the configuration's resource ref; a free destroys one), then the
 * buffers left, then a synchronize of the stream; time per operation is the run's wall time over its
 * operation count. One warm-up run per configuration and point, then --repeats rounds, each timing every
 * configuration once in turn (interleaved, so drift on a shared machine hits all alike); the median is
 * reported.
 *
 * Configurations (each pool's initial size is the same: half the free device memory at start, rounded down
 * to 2 MiB):
 *   rmm-pool         rmm::mr::pool_memory_resource over rmm::mr::cuda_memory_resource
 *   rmm-binning      rmm::mr::binning_memory_resource(bins 2^8..2^20) over rmm-pool's kind of pool
 *   rmm-async        rmm::mr::cuda_async_memory_resource
 *   mempool-pool     mempool's pool over its driver pool, through mempool::rmm_resource
 *   mempool-binning  mempool's bins 2^8..2^20 over that (mempool's default stack), through the bridge
 *   mempool-async    mempool's driver pool, through the bridge */

#include <mempool/rmm.hpp>

#include <rmm/cuda_stream.hpp>
#include <rmm/device_buffer.hpp>
#include <rmm/mr/binning_memory_resource.hpp>
#include <rmm/mr/cuda_async_memory_resource.hpp>
#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/mr/pool_memory_resource.hpp>
#include <rmm/resource_ref.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

/* mempool_suballoc::workload::SplitMix64, bit for bit. */
struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next()
  {
    state += 0x9E3779B97F4A7C15ULL;
    std::uint64_t z = state;
    z               = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z               = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) { return next() % n; }
};

/* An allocation of `value` bytes, or the free of live buffer `value`. */
struct op {
  bool alloc;
  std::size_t value;
};

/* mempool_suballoc::workload::random_workload. */
std::vector<op> random_workload(std::size_t n, std::size_t max_size, std::size_t max_usage, std::uint64_t seed)
{
  splitmix64 rng{seed};
  std::vector<std::size_t> live;
  std::size_t live_bytes = 0;
  std::vector<op> ops;
  ops.reserve(n);
  for (std::size_t k = 0; k < n; ++k) {
    std::size_t const size = 1 + static_cast<std::size_t>(rng.below(max_size));
    bool const alloc       = rng.below(100) < 73;
    if ((alloc && live_bytes + size <= max_usage) || live.empty()) {
      if (live_bytes + size > max_usage) { continue; }
      live.push_back(size);
      live_bytes += size;
      ops.push_back({true, size});
    } else {
      auto const i = static_cast<std::size_t>(rng.below(live.size()));
      live_bytes -= live[i];
      live[i] = live.back();
      live.pop_back();
      ops.push_back({false, i});
    }
  }
  return ops;
}

/* The Rust generator's pinned values (crates/mempool-suballoc/src/workload.rs, the_sequences_are_pinned). */
int self_check()
{
  int failures = 0;
  splitmix64 r{0};
  std::uint64_t const first[3] = {r.next(), r.next(), r.next()};
  if (first[0] != 0xe220a8397b1dcdafULL || first[1] != 0x6e789e6aa1b965f4ULL || first[2] != 0x06c45d188009454fULL) {
    std::printf("FAIL: SplitMix64(0)'s first outputs differ from the Rust generator's\n");
    ++failures;
  }
  auto const small       = random_workload(12, 4096, 10000, 42);
  op const expected[12] = {{true, 3734}, {true, 3923}, {true, 1011}, {false, 1}, {true, 1967}, {false, 1},
                           {true, 3805}, {false, 0},   {true, 2145}, {false, 1}, {false, 1},  {true, 2336}};
  bool same = small.size() == 12;
  for (std::size_t i = 0; same && i < 12; ++i) {
    same = small[i].alloc == expected[i].alloc && small[i].value == expected[i].value;
  }
  if (!same) {
    std::printf("FAIL: random_workload(12, 4096, 10000, 42) differs from the Rust generator's\n");
    ++failures;
  }
  auto const big  = random_workload(200000, 64 << 10, std::size_t{4} << 30, 0x5EED0000ULL ^ (64 << 10));
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (auto const& o : big) {
    for (std::uint64_t x : {std::uint64_t{o.alloc ? 1u : 2u}, std::uint64_t{o.value}}) {
      h = (h ^ x) * 0x100000001b3ULL;
    }
  }
  if (big.size() != 200000 || h != 0x25c8e67ac19fa184ULL) {
    std::printf("FAIL: the 200000-operation sequence's hash differs from the Rust generator's\n");
    ++failures;
  }
  std::printf("%d passed, %d failed\n", 3 - failures, failures);
  return failures == 0 ? 0 : 1;
}

struct point {
  char const* name;
  std::size_t n, max_size, max_usage;
};
point const points[] = {{"small", 200000, 64 << 10, std::size_t{4} << 30},
                        {"mid", 100000, 1 << 20, std::size_t{16} << 30},
                        {"large", 20000, 64 << 20, std::size_t{16} << 30}};

/* One run of ops through mr on stream: nanoseconds per operation. */
double run(std::vector<op> const& ops, rmm::device_async_resource_ref mr, rmm::cuda_stream const& stream)
{
  std::vector<rmm::device_buffer> live;
  live.reserve(ops.size());
  auto const start = std::chrono::steady_clock::now();
  for (auto const& o : ops) {
    if (o.alloc) {
      live.emplace_back(o.value, cuda::stream_ref{stream}, mr);
    } else {
      std::swap(live[o.value], live.back());
      live.pop_back();
    }
  }
  live.clear();
  stream.synchronize();
  auto const ns =
    std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  return ns / static_cast<double>(ops.size());
}

struct config {
  std::string name;
  std::string what;
  std::function<rmm::device_async_resource_ref()> ref;
  std::shared_ptr<void> keep;  // the resource (and what it sits on)
};

std::vector<std::string> split(std::string const& s)
{
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= s.size()) {
    auto const end = s.find(',', start);
    auto piece     = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!piece.empty()) { out.push_back(piece); }
    if (end == std::string::npos) { break; }
    start = end + 1;
  }
  return out;
}

mempool_resource_t* checked(int status, mempool_resource_t* h, char const* what)
{
  mempool::check(status, what);
  return h;
}

}  // namespace

int main(int argc, char** argv)
{
  std::string point_list = "small,mid,large";
  std::string only;
  int repeats = 5;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--self-check") { return self_check(); }
    if (a == "--points" && i + 1 < argc) {
      point_list = argv[++i];
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--points small,mid,large] [--repeats N] [--only NAME,...] | --self-check\n",
                   argv[0]);
      return 2;
    }
  }
  if (repeats < 1) {
    std::fprintf(stderr, "--repeats must be at least 1\n");
    return 2;
  }
  std::vector<point> chosen;
  for (auto const& name : split(point_list)) {
    auto it = std::find_if(std::begin(points), std::end(points), [&](point const& p) { return name == p.name; });
    if (it == std::end(points)) {
      std::fprintf(stderr, "unknown point '%s' (small, mid, large)\n", name.c_str());
      return 2;
    }
    chosen.push_back(*it);
  }

  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    std::fprintf(stderr, "cudaMemGetInfo failed: no GPU?\n");
    return 1;
  }
  std::size_t const initial = (free_bytes / 2) & ~((std::size_t{2} << 20) - 1);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);

  std::vector<config> configs;
  auto add = [&](std::string name, std::string what, auto resource) {
    auto held = std::make_shared<decltype(resource)>(std::move(resource));
    configs.push_back(
      {std::move(name), std::move(what), [held] { return rmm::device_async_resource_ref{*held}; }, held});
  };
  add("rmm-pool", "rmm::mr::pool_memory_resource over rmm::mr::cuda_memory_resource",
      rmm::mr::pool_memory_resource{rmm::mr::cuda_memory_resource{}, initial});
  add("rmm-binning", "rmm::mr::binning_memory_resource(bins 2^8..2^20) over that kind of pool",
      rmm::mr::binning_memory_resource{rmm::mr::pool_memory_resource{rmm::mr::cuda_memory_resource{}, initial},
                                       8, 20});
  add("rmm-async", "rmm::mr::cuda_async_memory_resource", rmm::mr::cuda_async_memory_resource{});
  {
    mempool_resource_t* h = nullptr;
    auto base = mempool::rmm_resource::adopt(checked(mempool_async_resource_create(0, 0, &h), h, "async"));
    mempool_resource_t* p = nullptr;
    auto pool = mempool::rmm_resource::adopt(
      checked(mempool_pool_resource_create(base.handle(), 0, initial, 0, &p), p, "pool"));
    mempool_resource_t* b = nullptr;
    auto bins = mempool::rmm_resource::adopt(
      checked(mempool_binning_resource_create(pool.handle(), 8, 20, &b), b, "binning"));
    add("mempool-pool", "mempool's pool over its driver pool, through mempool::rmm_resource", pool);
    add("mempool-binning", "mempool's default stack (bins 2^8..2^20 over that pool), through the bridge", bins);
    add("mempool-async", "mempool's driver pool, through the bridge", base);
  }
  if (!only.empty()) {
    auto const names = split(only);
    for (auto const& n : names) {
      if (std::none_of(configs.begin(), configs.end(), [&](config const& c) { return c.name == n; })) {
        std::fprintf(stderr, "unknown configuration '%s'\n", n.c_str());
        return 2;
      }
    }
    configs.erase(std::remove_if(configs.begin(), configs.end(),
                                 [&](config const& c) {
                                   return std::find(names.begin(), names.end(), c.name) == names.end();
                                 }),
                  configs.end());
  }

  std::printf("device: %s; free %zu of %zu bytes; pools' initial size %zu bytes\n", prop.name, free_bytes,
              total_bytes, initial);
  std::printf("method: one warm-up run per configuration and point, then %d rounds, each timing every\n"
              "configuration once in turn; the median ns per operation (final frees and one stream\n"
              "synchronize included, not counted as operations)\n\n",
              repeats);
  rmm::cuda_stream stream{};
  // results[point][config] = ns per op of each round
  std::vector<std::vector<std::vector<double>>> results(chosen.size(),
                                                         std::vector<std::vector<double>>(configs.size()));
  for (std::size_t pi = 0; pi < chosen.size(); ++pi) {
    auto const& pt      = chosen[pi];
    auto const seed_idx = static_cast<std::uint64_t>(
      std::find_if(std::begin(points), std::end(points), [&](point const& p) { return p.name == pt.name; }) -
      std::begin(points));
    auto const ops = random_workload(pt.n, pt.max_size, pt.max_usage, 42 + seed_idx);
    for (auto& c : configs) {
      try {
        run(ops, c.ref(), stream);  // warm-up
      } catch (std::exception const& e) {
        std::printf("%s at %s: warm-up failed: %s\n", c.name.c_str(), pt.name, e.what());
        return 1;
      }
    }
    for (int r = 0; r < repeats; ++r) {
      for (std::size_t ci = 0; ci < configs.size(); ++ci) {
        results[pi][ci].push_back(run(ops, configs[ci].ref(), stream));
      }
    }
  }
  std::printf("| configuration |");
  for (auto const& pt : chosen) { std::printf(" %s ns/op |", pt.name); }
  std::printf(" what |\n|---|");
  for (std::size_t i = 0; i < chosen.size(); ++i) { std::printf("---:|"); }
  std::printf("---|\n");
  for (std::size_t ci = 0; ci < configs.size(); ++ci) {
    std::printf("| `%s` |", configs[ci].name.c_str());
    for (std::size_t pi = 0; pi < chosen.size(); ++pi) {
      auto v = results[pi][ci];
      std::sort(v.begin(), v.end());
      std::printf(" %.0f |", v[v.size() / 2]);
    }
    std::printf(" %s |\n", configs[ci].what.c_str());
  }
  std::printf("\npoints:");
  for (auto const& pt : chosen) {
    std::printf(" %s = %zu ops, sizes up to %zu, at most %zu bytes live;", pt.name, pt.n, pt.max_size,
                pt.max_usage);
  }
  std::printf("\n");
  return 0;
}
