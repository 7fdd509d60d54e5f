"""Numba's allocations through mempool: an External Memory Management plugin.

Use it with ``NUMBA_CUDA_MEMORY_MANAGER=mempool.allocators.numba`` (Numba reads the module attribute
``_numba_memory_manager``) or ``numba.cuda.set_memory_manager(MempoolNumbaManager)``.
"""

import ctypes

from .._lib import DeviceBuffer, get_current_device, get_per_device_resource
from ._require import require

require("numba.cuda", "mempool.allocators.numba", "Numba (numba-cuda)")
from numba.cuda import HostOnlyCUDAMemoryManager, MemoryPointer  # noqa: E402

try:  # numba-cuda with the NVIDIA CUDA Python bindings (its default)
    from cuda.bindings.driver import CUdeviceptr as _DevicePtr
except ImportError:  # the ctypes binding
    _DevicePtr = ctypes.c_uint64

__all__ = ["MempoolNumbaManager"]


def _finalizer(handle: int, allocations: dict):
    def finalize() -> None:
        # At exit Numba may already have reset the context and emptied `allocations`.
        if allocations:
            allocations.pop(handle, None)

    return finalize


class MempoolNumbaManager(HostOnlyCUDAMemoryManager):
    """Device memory for Numba from the current device's mempool resource; host memory stays Numba's."""

    def initialize(self) -> None:
        pass

    def memalloc(self, size: int) -> MemoryPointer:
        buf = DeviceBuffer(size=size)
        # `self.allocations` (cleared on context reset) holds the buffer until the finalizer drops it.
        self.allocations[buf.ptr] = buf
        return MemoryPointer(
            self.context, _DevicePtr(buf.ptr), size, finalizer=_finalizer(buf.ptr, self.allocations)
        )

    def get_ipc_handle(self, memory):
        raise NotImplementedError(
            "mempool's Numba plugin does not export CUDA IPC handles: pool memory is shared with mempool.ipc"
        )

    def get_memory_info(self):
        """Not provided (as RMM's plugin): the current resource may be a pool, whose free memory the driver's
        count does not show. Read the resource's own counters instead."""
        raise NotImplementedError("mempool's Numba plugin does not report memory info; ask the resource")

    @property
    def interface_version(self) -> int:
        return 1


def current_resource():
    """The resource Numba's allocations come from now."""
    return get_per_device_resource(get_current_device())


# NUMBA_CUDA_MEMORY_MANAGER=mempool.allocators.numba
_numba_memory_manager = MempoolNumbaManager
