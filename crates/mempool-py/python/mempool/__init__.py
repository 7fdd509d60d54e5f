"""mempool: CUDA stream-ordered memory pools and RMM-style memory resources, with RMM's Python API.

- ``mempool.DeviceBuffer``: untyped device memory, with ``__cuda_array_interface__`` and DLPack.
- ``mempool.mr``: memory resources and adaptors under RMM's names, and the per-device current resource.
- ``mempool.allocators``: hooks that route CuPy, Numba and PyTorch allocations through mempool.
- ``mempool.reinitialize``: set up every device's resource in one call.
- ``mempool.ipc``: share buffers between processes (``Exporter``, ``Importer``).
- ``mempool.memory``: snapshots of a resource stack, the viewer page, out-of-memory retry (docs/observe.md).

The package imports without a GPU or a driver; the first call that needs the driver raises a
``mempool.MempoolError`` subclass naming the cause.
"""

from . import ipc, memory, mr
from ._errors import (
    DriverError,
    DriverNotFoundError,
    DriverTooOldError,
    InvalidDeallocationError,
    IpcError,
    IpcProtocolError,
    IpcTimeoutError,
    MempoolError,
    NoDeviceError,
    OutOfMemoryError,
    PeerAccessError,
    PeerGoneError,
    RefusedError,
    UnsupportedError,
)
from ._lib import DeviceBuffer
from .mr import is_initialized, reinitialize

__all__ = [
    "DeviceBuffer",
    "DriverError",
    "DriverNotFoundError",
    "DriverTooOldError",
    "InvalidDeallocationError",
    "IpcError",
    "IpcProtocolError",
    "IpcTimeoutError",
    "MempoolError",
    "NoDeviceError",
    "OutOfMemoryError",
    "PeerAccessError",
    "PeerGoneError",
    "RefusedError",
    "UnsupportedError",
    "ipc",
    "is_initialized",
    "memory",
    "mr",
    "reinitialize",
]
