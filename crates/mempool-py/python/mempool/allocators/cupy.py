"""CuPy's allocations through mempool.

Two allocators, both over the current device's mempool resource:

- ``cupy.cuda.set_allocator(mempool_cupy_c_allocator)``: CuPy calls mempool's C entry points
  (``mempool_cupy_malloc`` / ``mempool_cupy_free``) through ``cupy.cuda.memory.CFunctionAllocator``, with
  no Python code per allocation. The stream is CuPy's current stream of the calling thread, read through
  CuPy's own C function for it (``with stream:`` and ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM`` are
  honoured); the memory is freed on the stream it was allocated on when CuPy lets it go. A stream other
  than the default ones is kept alive until then (that allocation takes one Python call to hold it).
  Built on first use: a CuPy that does not export that C function raises ``RuntimeError`` naming what was
  looked for.
- ``cupy.cuda.set_allocator(mempool_cupy_allocator)``: a Python function per allocation, which allocates
  a ``mempool.DeviceBuffer`` on ``cupy.cuda.get_current_stream()``; the buffer owns the memory (and keeps
  the stream object alive).

A failed allocation raises the exception of its cause (``mempool.OutOfMemoryError``, also a
``MemoryError``, when the resource is out of memory) from the CuPy call that allocated, with the size and
the device in its message. The C allocator depends for this on CuPy's Cython (3 or later) checking for a
pending exception, as it does; a CuPy built with Cython 0.29 reports it as a ``SystemError`` whose cause
is mempool's exception.
"""

from typing import Any

from .. import _lib
from .._lib import DeviceBuffer
from ._require import require

cupy = require("cupy", "mempool.allocators.cupy", "CuPy")

__all__ = ["c_allocator", "mempool_cupy_allocator", "mempool_cupy_c_allocator"]


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


_c_allocator = None


def c_allocator() -> Any:
    """The process's ``cupy.cuda.memory.CFunctionAllocator`` over mempool's C entry points (made on the
    first call); ``mempool_cupy_c_allocator`` is its ``malloc``."""
    global _c_allocator
    if _c_allocator is None:
        param, malloc, free = _lib._cupy_c_allocator()
        # The owner keeps the extension module (which holds the entry points and the param) referenced
        # for as long as CuPy keeps the allocator.
        _c_allocator = cupy.cuda.memory.CFunctionAllocator(param, malloc, free, _lib)
    return _c_allocator


def allocator_state() -> tuple:
    """``(live, failed_allocations, failed_frees)``: allocations CuPy holds through the C allocator now,
    allocations that failed, and frees mempool refused (a pointer it did not hand out) or that failed,
    since the process started."""
    return _lib._cupy_allocator_state()


def __getattr__(name: str) -> Any:
    if name == "mempool_cupy_c_allocator":
        return c_allocator().malloc
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
