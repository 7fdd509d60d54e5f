"""Memory resources under RMM's Python names, over mempool-rmm (see ``help(mempool.mr.PoolMemoryResource)``
and friends), and the per-device current resource.

Every resource allocates on one device: the current device when it is made (``device=`` picks another for
resources that allocate from the driver; adaptors and suballocators use their upstream's). Adaptors keep
their upstream alive.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable

from ._lib import (
    ArenaMemoryResource,
    BinningMemoryResource,
    CudaAsyncMemoryResource,
    CudaMemoryResource,
    DeviceMemoryResource,
    FailureCallbackResourceAdaptor,
    FixedSizeMemoryResource,
    LimitingResourceAdaptor,
    LoggingResourceAdaptor,
    ManagedMemoryResource,
    PoolMemoryResource,
    ServiceMemoryResource,
    Statistics,
    StatisticsResourceAdaptor,
    TaggedMemoryResource,
    TrackingResourceAdaptor,
    VmmMemoryResource,
    _flush_logs,
    device_count,
    get_current_device,
    get_per_device_resource,
    set_per_device_resource,
)

__all__ = [
    "ArenaMemoryResource",
    "BinningMemoryResource",
    "CudaAsyncMemoryResource",
    "CudaMemoryResource",
    "DeviceMemoryResource",
    "FailureCallbackResourceAdaptor",
    "FixedSizeMemoryResource",
    "LimitingResourceAdaptor",
    "LoggingResourceAdaptor",
    "ManagedMemoryResource",
    "PoolMemoryResource",
    "ServiceMemoryResource",
    "Statistics",
    "StatisticsResourceAdaptor",
    "TaggedMemoryResource",
    "TrackingResourceAdaptor",
    "VmmMemoryResource",
    "default_stack",
    "device_count",
    "get_current_device",
    "get_current_device_resource",
    "get_per_device_resource",
    "is_initialized",
    "reinitialize",
    "set_current_device_resource",
    "set_per_device_resource",
]

_initialized = False

# Every live LoggingResourceAdaptor's buffered lines reach its file at exit, as RMM flushes its logs: an
# adaptor kept as a current resource lives until the process ends, and is never dropped.
atexit.register(_flush_logs)


def set_current_device_resource(mr: DeviceMemoryResource) -> None:
    """Makes ``mr`` the current device's resource (refused for a resource of another device).

    Set it before allocating on the device: memory allocated from the previous resource stays valid (each
    allocation keeps its resource alive) and is freed through that resource.
    """
    if not isinstance(mr, DeviceMemoryResource):
        raise TypeError(f"set_current_device_resource needs a mempool.mr resource, got {type(mr).__name__}")
    set_per_device_resource(get_current_device(), mr)


def get_current_device_resource() -> DeviceMemoryResource:
    """The current device's resource: the one set, or the default (a ``CudaAsyncMemoryResource`` over the
    device's default pool)."""
    return get_per_device_resource(get_current_device())


def is_initialized() -> bool:
    """Whether ``reinitialize`` has run in this process."""
    return _initialized


#: The sizes the default stack serves from bins: powers of two from ``2**8`` (256 B) to ``2**20`` (1 MiB).
DEFAULT_STACK_BINS = (8, 20)


def default_stack(
    upstream_mr: DeviceMemoryResource | None = None,
    initial_pool_size: int | None = None,
    maximum_pool_size: int | None = None,
    *,
    device: int | None = None,
) -> BinningMemoryResource:
    """The recommended resource for allocations of every size, chosen by measuring the standard random
    workload (docs/resources.md, "The default stack"):
    ``BinningMemoryResource(PoolMemoryResource(upstream_mr, initial_pool_size, maximum_pool_size), 8, 20)``.

    Sizes up to 1 MiB come from power-of-two bins (``FixedSizeMemoryResource``), each carving fixed blocks
    from chunks it takes from the pool; larger sizes go straight to the pool. Everything is taken from
    the pool, so ``maximum_pool_size`` bounds the whole stack; ``initial_pool_size`` defaults as
    ``PoolMemoryResource``'s does (half the device's free memory, reserved at the first allocation).
    ``upstream_mr`` defaults to a new
    ``CudaAsyncMemoryResource`` of ``device`` (default: the current device). The bins keep the chunks
    they took until the stack is destroyed: a process whose small allocations peak high and then stop
    keeps that peak in the bins.
    """
    if upstream_mr is None:
        upstream_mr = CudaAsyncMemoryResource(device=device)
    elif device is not None and upstream_mr.device != device:
        raise ValueError(f"default_stack: upstream_mr is a resource of device {upstream_mr.device}, not {device}")
    pool = PoolMemoryResource(upstream_mr, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size)
    return BinningMemoryResource(pool, *DEFAULT_STACK_BINS)


def reinitialize(
    pool_allocator: bool = False,
    managed_memory: bool = False,
    initial_pool_size: int | None = None,
    maximum_pool_size: int | None = None,
    devices: int | Iterable[int] = 0,
    logging: bool = False,
    log_file_name: str | None = None,
    *,
    stack: bool = False,
) -> None:
    """Sets each of ``devices`` (an ordinal or several) to a new resource, as RMM's ``reinitialize``:

    - ``CudaMemoryResource``, or ``ManagedMemoryResource`` with ``managed_memory``;
    - under a ``PoolMemoryResource(initial_pool_size, maximum_pool_size)`` with ``pool_allocator``;
    - with ``stack`` (whether or not ``pool_allocator`` is given): the recommended stack,
      ``default_stack`` over that resource (bins up to 1 MiB over the pool, larger sizes to the pool),
      the fastest at every point of the standard random workload. Not the default: RMM's arguments
      promise a ``PoolMemoryResource`` (or the plain resource), and code checks for those types;
    - under a ``LoggingResourceAdaptor`` with ``logging``, writing to ``log_file_name`` (else the environment
      variable ``RMM_LOG_FILE``), which inserts ``.dev<N>`` before the extension (one log per device), as
      RMM names them.

    Every device's resource is made before any is set: an error (a device that does not exist, a pool that
    cannot be reserved) leaves every device's current resource as it was. Memory allocated before keeps
    the resource it came from alive until it is freed.
    """
    global _initialized
    if isinstance(devices, int):
        devices = [devices]
    devices = list(devices)
    if logging and not log_file_name and not os.environ.get("RMM_LOG_FILE"):
        raise ValueError("reinitialize(logging=True) needs log_file_name or the RMM_LOG_FILE environment variable")
    for dev in devices:
        if not isinstance(dev, int) or isinstance(dev, bool) or dev < 0:
            raise ValueError(f"devices must be non-negative ordinals, got {dev!r}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices lists a device twice: {devices}")
    made = []
    for dev in devices:
        base = ManagedMemoryResource(device=dev) if managed_memory else CudaMemoryResource(device=dev)
        mr: DeviceMemoryResource = base
        if stack:
            mr = default_stack(mr, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size)
        elif pool_allocator:
            mr = PoolMemoryResource(mr, initial_pool_size=initial_pool_size, maximum_pool_size=maximum_pool_size)
        if logging:
            mr = LoggingResourceAdaptor(mr, log_file_name=log_file_name)
        made.append((dev, mr))
    for dev, mr in made:
        set_per_device_resource(dev, mr)
    _initialized = True
