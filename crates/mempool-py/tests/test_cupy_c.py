"""GPU tests of CuPy's C allocator (``mempool.allocators.cupy.mempool_cupy_c_allocator``): CuPy's allocations
land in the current mempool resource with the bytes CuPy asked for, hold the right data, go back to the
resource that made them, on CuPy's current stream (a non-default stream is kept alive until the free), and a
failure raises with its cause. Marked gpu: they fail, never skip, without a GPU (or without CuPy)."""

import gc
import sys

import pytest

import mempool
from mempool import _lib, mr

pytestmark = pytest.mark.gpu


@pytest.fixture
def cupy_c():
    """CuPy with the C allocator, each test's resources restored after it."""
    import cupy

    from mempool.allocators import cupy as hook

    old = mr.get_current_device_resource()
    cupy.cuda.set_allocator(hook.mempool_cupy_c_allocator)
    try:
        yield cupy, hook
    finally:
        gc.collect()
        cupy.cuda.set_allocator(None)
        mr.set_current_device_resource(old)


def test_the_c_allocator_is_one_cfunctionallocator_over_mempools_entry_points(cupy_c):
    cupy, hook = cupy_c
    a = hook.c_allocator()
    assert a is hook.c_allocator()
    assert isinstance(a, cupy.cuda.memory.CFunctionAllocator)
    param, malloc, free = _lib._cupy_c_allocator()
    assert param != 0 and malloc != 0 and free != 0
    assert _lib._cupy_c_allocator() == (param, malloc, free), "one param for the process"


def test_allocations_land_in_mempool_with_their_bytes_and_go_back(cupy_c):
    cupy, hook = cupy_c
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    mr.set_current_device_resource(stats)
    live = hook.allocator_state()[0]
    a = cupy.empty(12345, dtype=cupy.uint8)
    assert stats.allocation_counts.current_bytes == 12345
    assert stats.allocation_counts.current_count == 1
    assert hook.allocator_state()[0] == live + 1
    stream, size = _lib._cupy_allocation(a.data.ptr)
    assert size == 12345
    assert stream == cupy.cuda.get_current_stream().ptr
    a.fill(7)
    assert int(a.sum()) == 7 * 12345
    x = cupy.arange(1000, dtype=cupy.float32)
    assert float((x * 2).sum()) == 999000.0
    del a, x
    gc.collect()
    assert stats.allocation_counts.current_bytes == 0, stats.allocation_counts
    assert hook.allocator_state()[0] == live


def test_a_free_goes_back_to_the_resource_that_allocated_after_the_current_one_changed(cupy_c):
    cupy, _ = cupy_c
    first = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    second = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    mr.set_current_device_resource(first)
    a = cupy.empty(4096, dtype=cupy.uint8)
    mr.set_current_device_resource(second)
    b = cupy.empty(8192, dtype=cupy.uint8)
    assert first.allocation_counts.current_bytes == 4096
    assert second.allocation_counts.current_bytes == 8192
    del a
    gc.collect()
    assert first.allocation_counts.current_bytes == 0
    assert second.allocation_counts.current_bytes == 8192
    del b
    gc.collect()
    assert second.allocation_counts.current_bytes == 0


def test_the_current_stream_is_used_and_a_non_default_stream_is_held_until_the_free(cupy_c):
    cupy, hook = cupy_c
    stats = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
    mr.set_current_device_resource(stats)
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        pass
    refs = sys.getrefcount(s)
    with s:
        b = cupy.empty(4096, dtype=cupy.uint8)
        b.fill(3)
    assert _lib._cupy_allocation(b.data.ptr) == (s.ptr, 4096)
    assert sys.getrefcount(s) == refs + 1, "the allocation holds the stream object"
    s.synchronize()
    assert int(b.sum()) == 3 * 4096
    del b
    gc.collect()
    assert sys.getrefcount(s) == refs, "the free released the stream object"
    assert stats.allocation_counts.current_bytes == 0

    # A stream whose last user reference goes while memory allocated on it lives: the free still runs on it.
    s2 = cupy.cuda.Stream(non_blocking=True)
    with s2:
        c = cupy.zeros(1 << 20, dtype=cupy.uint8)
    s2.synchronize()
    del s2
    gc.collect()
    assert int(c.sum()) == 0
    del c
    gc.collect()
    assert stats.allocation_counts.current_bytes == 0
    live, _, failed_frees = hook.allocator_state()
    d = cupy.empty(256, dtype=cupy.uint8)
    assert _lib._cupy_allocation(d.data.ptr) == (cupy.cuda.get_current_stream().ptr, 256)
    del d
    gc.collect()
    assert hook.allocator_state()[0] == live and hook.allocator_state()[2] == failed_frees


def test_arrays_freed_while_their_tag_sleeps_go_back_to_the_resource(cupy_c):
    # Issue 33: CuPy's free drops mempool's table entry before it frees; a free refused because the tag
    # slept lost the allocation for good. It is taken now, as bookkeeping.
    cupy, hook = cupy_c
    svc = mr.ServiceMemoryResource(0, region_size=1 << 30)
    t = svc.tagged("t")
    mr.set_current_device_resource(t)
    keep = cupy.full(1 << 20, 5, dtype=cupy.uint8)
    gone = cupy.empty(8 << 20, dtype=cupy.uint8)
    cupy.cuda.get_current_stream().synchronize()
    live, _, failed_frees = hook.allocator_state()
    kept = svc.stats()["tags"]["t"]["mapped_bytes"]
    svc.sleep("t", mode="offload")
    del gone
    gc.collect()
    assert hook.allocator_state()[0] == live - 1, hook.allocator_state()
    assert hook.allocator_state()[2] == failed_frees, "the free was refused while the tag slept"

    row = svc.stats()["tags"]["t"]
    assert row["live_allocations"] == 1 and row["frees"] == 1, row
    woken = svc.wake("t")
    assert woken["mapped_bytes"] == svc.stats()["tags"]["t"]["mapped_bytes"] < kept, (woken, kept)
    assert int(keep.sum()) == 5 << 20
    del keep
    gc.collect()
    assert svc.stats()["tags"]["t"]["live_allocations"] == 0


def test_a_failed_allocation_raises_naming_the_size_and_later_ones_work(cupy_c):
    cupy, hook = cupy_c
    limited = mr.LimitingResourceAdaptor(mr.CudaAsyncMemoryResource(), 1 << 20)
    mr.set_current_device_resource(limited)
    failed = hook.allocator_state()[1]
    with pytest.raises((MemoryError, SystemError)) as e:
        cupy.cuda.alloc(2 << 20)
    # CuPy built with Cython 3 raises mempool's exception itself; one built with Cython 0.29 reports a
    # SystemError caused by it.
    err = e.value if isinstance(e.value, MemoryError) else (e.value.__cause__ or e.value.__context__)
    assert isinstance(err, mempool.OutOfMemoryError), repr(e.value)
    assert "2097152" in str(err) and "CuPy" in str(err), str(err)
    assert hook.allocator_state()[1] == failed + 1
    a = cupy.empty(1000, dtype=cupy.uint8)
    # CuPy rounds every request up to a multiple of 512 bytes before it calls the allocator.
    assert limited.get_allocated_bytes() == 1024
    del a
    gc.collect()
    assert limited.get_allocated_bytes() == 0
