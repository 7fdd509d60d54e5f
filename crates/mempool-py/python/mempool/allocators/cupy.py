"""CuPy's allocations through mempool: ``cupy.cuda.set_allocator(mempool_cupy_allocator)``."""

from .._lib import DeviceBuffer
from ._require import require

cupy = require("cupy", "mempool.allocators.cupy", "CuPy")

__all__ = ["mempool_cupy_allocator"]


def mempool_cupy_allocator(nbytes: int):
    """Allocates ``nbytes`` for CuPy from the current device's mempool resource, on CuPy's current stream.

    The ``mempool.DeviceBuffer`` is the memory's owner: CuPy frees it (on that stream) when the last array
    using it goes away.
    """
    stream = cupy.cuda.get_current_stream()
    buf = DeviceBuffer(size=nbytes, stream=stream)
    dev_id = -1 if buf.ptr else cupy.cuda.device.get_device_id()
    mem = cupy.cuda.UnownedMemory(ptr=buf.ptr, size=buf.size, owner=buf, device_id=dev_id)
    return cupy.cuda.memory.MemoryPointer(mem, 0)
