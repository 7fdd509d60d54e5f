"""PyTorch's allocations through mempool, with PyTorch's pluggable allocator.

- ``torch.cuda.memory.change_current_allocator(mempool_torch_allocator)`` (before PyTorch first touches
  CUDA) routes every CUDA tensor to the current device's mempool resource. Out of memory raises a
  ``RuntimeError`` naming the size and the cause (PyTorch ignores a null return from a pluggable allocator,
  so mempool's entry point throws a C++ exception, which PyTorch turns into this error).
- ``torch.cuda.MemPool(mempool_torch_pool_allocator.allocator())`` with ``torch.cuda.use_mem_pool(pool)``
  routes one region of code: PyTorch's caching allocator carves blocks from segments mempool allocates,
  and on a failure (a NULL from ``mempool_torch_alloc_nullable``) frees its cache, retries, and raises
  ``torch.OutOfMemoryError``. ``mempool_torch_allocator`` (which throws) is not supported under a
  ``MemPool``: use ``mempool_torch_pool_allocator`` there.

PyTorch's own ``torch.cuda.memory_stats`` raise under a pluggable allocator; read mempool's statistics
instead (a ``StatisticsResourceAdaptor`` set as the current resource counts PyTorch's allocations).
Frees return memory to the resource that allocated it, even after the current resource changed.
"""

from .. import _lib
from ._require import require

torch = require("torch", "mempool.allocators.torch", "PyTorch")
from torch.cuda.memory import CUDAPluggableAllocator  # noqa: E402

__all__ = ["mempool_torch_allocator", "mempool_torch_pool_allocator", "allocator_state"]

if not _lib._torch_alloc_raises():
    raise ImportError(
        "this build of mempool has no C++ shim (no C++ compiler when it was built, or built with "
        "panic=abort), so an out-of-memory in PyTorch could not raise; rebuild with g++ installed and "
        "panic=unwind"
    )

_so = _lib._shared_object_path()
mempool_torch_allocator = CUDAPluggableAllocator(_so, "mempool_torch_alloc", "mempool_torch_free")
mempool_torch_pool_allocator = CUDAPluggableAllocator(_so, "mempool_torch_alloc_nullable", "mempool_torch_free")


def allocator_state() -> tuple[int, int]:
    """``(live, failed_frees)``: allocations PyTorch holds through mempool now, and frees mempool refused (a
    pointer it did not hand out, or a wrong size) or that failed, since the process started."""
    return _lib._torch_allocator_state()
