"""mempool resources as RMM's current device resource, on a GPU: rmm.DeviceBuffer, RMM's CuPy and PyTorch
hooks and RMM's own adaptors allocate from mempool, with mempool's statistics as the proof, and never enter
Python per allocation."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mempool
import mempool.mr
import rmm
import rmm.mr
from mempool.rmm import MempoolResource

pytestmark = pytest.mark.gpu


def counts(mr: MempoolResource) -> mempool.mr.Statistics:
    """The mempool statistics adaptor under a MempoolResource made with statistics=True."""
    return mr.mempool_mr.allocation_counts


@pytest.fixture(autouse=True)
def rmm_default_after():
    yield
    gc.collect()
    rmm.mr.set_current_device_resource(rmm.mr.CudaMemoryResource())


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("kind", ["default", "async", "pool", "binning", "arena", "service"])
def test_device_buffer_allocates_from_mempool(kind):
    mr = MempoolResource(kind=kind, statistics=True)
    rmm.mr.set_current_device_resource(mr)
    assert rmm.mr.get_current_device_resource() is mr
    before = counts(mr)
    data = np.random.default_rng(7).integers(0, 256, size=3 << 20, dtype=np.uint8).tobytes()
    buf = rmm.DeviceBuffer.to_device(data)
    assert buf.size == len(data)
    during = counts(mr)
    assert during.current_count == before.current_count + 1
    assert during.current_bytes >= before.current_bytes + len(data)
    assert buf.tobytes() == data
    del buf
    gc.collect()
    after = counts(mr)
    assert after.current_count == before.current_count and after.total_count > before.total_count
    assert mr.failed_deallocations == 0


def test_wrapping_an_existing_mempool_resource_shares_it():
    pool = mempool.mr.StatisticsResourceAdaptor(mempool.mr.PoolMemoryResource(mempool.mr.CudaAsyncMemoryResource()))
    mr = MempoolResource(pool)
    assert mr.mempool_mr is pool
    rmm.mr.set_current_device_resource(mr)
    bufs = [rmm.DeviceBuffer(size=s) for s in (1, 255, 256, 4097, 1 << 20)]
    assert pool.allocation_counts.current_count == 5
    # Memory from the bridge and from mempool's own API come out of the same pool.
    own = mempool.DeviceBuffer(size=1000, mr=pool)
    assert pool.allocation_counts.current_count == 6
    del bufs, own
    gc.collect()
    assert pool.allocation_counts.current_count == 0


def test_frees_ordered_on_other_streams():
    mr = MempoolResource(kind="pool", statistics=True)
    s1, s2 = rmm.pylibrmm.stream.Stream(), rmm.pylibrmm.stream.Stream()
    ptrs = [mr.allocate(1 << 16, s1) for _ in range(64)]
    assert len(set(ptrs)) == 64 and all(p % 256 == 0 for p in ptrs)
    for p in ptrs:
        mr.deallocate(p, 1 << 16, s2)
    s2.synchronize()
    assert counts(mr).current_count == 0 and mr.failed_deallocations == 0


def test_a_refused_free_is_counted_not_raised():
    mr = MempoolResource(kind="pool")
    p = mr.allocate(4096)
    mr.deallocate(p + 256, 4096)  # not an address mempool handed out
    assert mr.failed_deallocations == 1
    assert "mempool_deallocate" in mr.last_deallocation_error
    mr.deallocate(p, 4096)
    assert mr.failed_deallocations == 1


def test_out_of_memory_is_memory_error_naming_the_size():
    mr = MempoolResource(kind="pool", limit=8 << 20)
    rmm.mr.set_current_device_resource(mr)
    keep = rmm.DeviceBuffer(size=6 << 20)
    with pytest.raises(MemoryError) as e:
        rmm.DeviceBuffer(size=4 << 20)
    # mempool's message, through rmm::out_of_memory: the size asked for and what the limit holds.
    assert "allocation of 4194304 bytes refused" in str(e.value), str(e.value)
    assert "of the limit of 8388608 bytes" in str(e.value), str(e.value)
    del keep


def test_rmm_adaptors_stack_over_the_bridge():
    mr = MempoolResource(kind="default", statistics=True)
    stats = rmm.mr.StatisticsResourceAdaptor(mr)
    rmm.mr.set_current_device_resource(stats)
    bufs = [rmm.DeviceBuffer(size=1 << 12) for _ in range(10)]
    assert stats.allocation_counts.current_count == 10
    assert counts(mr).current_count == 10
    del bufs
    gc.collect()
    assert stats.allocation_counts.current_count == 0 and counts(mr).current_count == 0


def test_cupy_through_rmm_hook_allocates_from_mempool():
    import cupy
    from rmm.allocators.cupy import rmm_cupy_allocator

    mr = MempoolResource(kind="default", statistics=True)
    rmm.mr.set_current_device_resource(mr)
    cupy.cuda.set_allocator(rmm_cupy_allocator)
    try:
        before = counts(mr).total_count
        a = cupy.arange(1 << 20, dtype=cupy.float32)
        b = (a * 2).sum()
        assert float(b) == float(np.arange(1 << 20, dtype=np.float64).sum() * 2)
        assert counts(mr).total_count >= before + 2
        del a, b
    finally:
        cupy.cuda.set_allocator(None)


def test_torch_through_rmm_hook_allocates_from_mempool():
    # PyTorch picks its allocator once per process, before CUDA starts: a fresh process.
    r = run_python(
        """
        import rmm, torch
        from rmm.allocators.torch import rmm_torch_allocator
        from mempool.rmm import MempoolResource
        mr = MempoolResource(kind="default", statistics=True)
        rmm.mr.set_current_device_resource(mr)
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
        x = torch.ones(1 << 20, device="cuda")
        y = (x * 3).sum().item()
        c = mr.mempool_mr.allocation_counts
        print("RESULT", y, c.total_count, c.current_count)
        del x
        torch.cuda.synchronize()
        print("AFTER", mr.mempool_mr.allocation_counts.current_count)
        """
    )
    assert r.returncode == 0, r.stdout + r.stderr
    result = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")).split()
    assert float(result[1]) == 3.0 * (1 << 20)
    assert int(result[2]) >= 2 and int(result[3]) >= 1
    after = next(ln for ln in r.stdout.splitlines() if ln.startswith("AFTER")).split()
    assert int(after[1]) < int(result[3])


def test_no_python_is_entered_per_allocation():
    mr = MempoolResource(kind="default")
    rmm.mr.set_current_device_resource(mr)
    rmm.DeviceBuffer(size=1)
    calls = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        for i in range(1000):
            b = rmm.DeviceBuffer(size=1 + i * 97)
            del b
    finally:
        sys.setprofile(None)
    assert calls == [], calls[:10]
    # The same loop through a CallbackMemoryResource does enter Python, so the check can see it.
    cb = rmm.mr.CallbackMemoryResource(lambda n, s: mr.allocate(n, s), lambda p, n, s: mr.deallocate(p, n, s))
    rmm.mr.set_current_device_resource(cb)
    sys.setprofile(profile)
    try:
        b = rmm.DeviceBuffer(size=100)
        del b
    finally:
        sys.setprofile(None)
    assert calls, "the profile hook saw no Python call through a CallbackMemoryResource"


def test_a_service_tag_counts_what_rmm_allocates():
    service = mempool.mr.ServiceMemoryResource()
    mr = MempoolResource(service.tagged("weights"))
    rmm.mr.set_current_device_resource(mr)
    buf = rmm.DeviceBuffer(size=32 << 20)
    row = service.stats()["tags"]["weights"]
    assert row["live_allocations"] == 1 and row["used_bytes"] >= 32 << 20
    del buf
    gc.collect()
    assert service.stats()["tags"]["weights"]["live_allocations"] == 0


def test_left_current_until_exit():
    r = run_python(
        """
        import rmm
        from mempool.rmm import MempoolResource
        rmm.mr.set_current_device_resource(MempoolResource(kind="pool"))
        kept = [rmm.DeviceBuffer(size=1 << 20) for _ in range(8)]  # never freed before exit
        print("OK")
        """
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "OK"
    assert "Segmentation" not in r.stderr and "terminate" not in r.stderr


@pytest.mark.two_gpu
def test_one_resource_per_device():
    import cupy

    assert cupy.cuda.runtime.getDeviceCount() >= 2, "two GPUs are needed"
    mrs = {}
    for d in (0, 1):
        with cupy.cuda.Device(d):
            mrs[d] = MempoolResource(kind="pool", device=d, statistics=True)
            rmm.mr.set_per_device_resource(d, mrs[d])
    for d in (0, 1):
        with cupy.cuda.Device(d):
            assert mrs[d].device == d
            buf = rmm.DeviceBuffer(size=1 << 20)
            assert counts(mrs[d]).current_count == 1
            del buf
    for d in (0, 1):
        with cupy.cuda.Device(d):
            rmm.mr.set_per_device_resource(d, rmm.mr.CudaMemoryResource())
