"""GPU tests of the recommended stack (``mempool.mr.default_stack``, ``mempool.reinitialize(stack=True)``):
its shape, both routes (a bin for small sizes, the pool for large ones), and the pool's maximum bounding
the whole stack. Marked gpu: they fail, never skip, without a GPU."""

import pytest

import mempool
from mempool import mr

pytestmark = pytest.mark.gpu


def test_default_stack_is_bins_over_a_pool_and_serves_every_size():
    stack = mr.default_stack(initial_pool_size=2**24, maximum_pool_size=2**26)
    assert isinstance(stack, mr.BinningMemoryResource)
    pool = stack.upstream_mr
    assert isinstance(pool, mr.PoolMemoryResource)
    assert isinstance(pool.upstream_mr, mr.CudaAsyncMemoryResource)
    small = mempool.DeviceBuffer(size=1000, mr=stack)
    large = mempool.DeviceBuffer(size=4 << 20, mr=stack)
    small.copy_from_host(b"s" * 1000)
    large.copy_from_host(b"L" * (4 << 20))
    assert small.tobytes() == b"s" * 1000 and large.tobytes() == b"L" * (4 << 20)
    assert pool.pool_size() >= 2**24
    # Everything comes from the pool: past its maximum the stack is out of memory, naming the size.
    with pytest.raises(mempool.OutOfMemoryError) as e:
        mempool.DeviceBuffer(size=2**27, mr=stack)
    assert str(2**27) in str(e.value), str(e.value)
    del small, large


def test_default_stack_refuses_an_upstream_of_another_device():
    upstream = mr.CudaAsyncMemoryResource()
    with pytest.raises(ValueError, match="device"):
        mr.default_stack(upstream, device=upstream.device + 1)


def test_reinitialize_with_stack_sets_the_stack_over_its_base_resource():
    old = mr.get_current_device_resource()
    try:
        mempool.reinitialize(stack=True, initial_pool_size=2**24, maximum_pool_size=2**26)
        cur = mr.get_current_device_resource()
        assert isinstance(cur, mr.BinningMemoryResource)
        assert isinstance(cur.upstream_mr, mr.PoolMemoryResource)
        assert isinstance(cur.upstream_mr.upstream_mr, mr.CudaMemoryResource)
        b = mempool.DeviceBuffer(size=3000)
        assert b.size == 3000 and b.ptr % 256 == 0
        del b
        # RMM's own arguments keep giving RMM's resource.
        mempool.reinitialize(pool_allocator=True, initial_pool_size=2**24)
        assert isinstance(mr.get_current_device_resource(), mr.PoolMemoryResource)
    finally:
        mr.set_current_device_resource(old)
