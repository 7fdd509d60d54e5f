"""mempool: CUDA stream-ordered memory pools and RMM-style memory resources, with RMM's Python API.

- ``mempool.DeviceBuffer``: untyped device memory, with ``__cuda_array_interface__`` and DLPack.
- ``mempool.mr``: memory resources and adaptors under RMM's names, and the per-device current resource.
- ``mempool.allocators``: hooks that route CuPy, Numba and PyTorch allocations through mempool.
- ``mempool.reinitialize``: set up every device's resource in one call.
- ``mempool.ipc``: share buffers between processes (``Exporter``, ``Importer``).
- ``mempool.memory``: snapshots of a resource stack, the viewer page, out-of-memory retry (docs/observe.md).

The package imports without a GPU or a driver; the first call that needs the driver raises a
``mempool.MempoolError`` subclass naming the cause. It needs its compiled extension, ``mempool._lib``,
which the wheel holds: imported from the source tree (crates/mempool-py/python) it raises an
``ImportError`` that says how to build the wheel.
"""

try:
    # The compiled extension, first: every module below imports it.
    from ._lib import DeviceBuffer
except ModuleNotFoundError as _missing:
    if _missing.name != __name__ + "._lib":
        raise
    raise ImportError(
        "mempool's compiled extension mempool._lib is missing: this mempool is the Python source in "
        + __path__[0]
        + ", not the built package. Build the wheel with maturin and install it (from the repository root):\n"
        + '    python3 -m pip install "maturin>=1.9.4,<2"\n'
        + "    (cd crates/mempool-py && maturin build --release -o ../../target/wheels)\n"
        + "    python3 -m pip install target/wheels/mempool-*.whl\n"
        + "then import mempool with crates/mempool-py/python neither the current directory nor on PYTHONPATH "
        + "(README.md, \"Python\"; in a virtual environment, `maturin develop --release` in crates/mempool-py "
        + "builds and installs it in one step).",
        name=__name__ + "._lib",
    ) from None

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
