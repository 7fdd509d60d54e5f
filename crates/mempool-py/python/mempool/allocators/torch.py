"""PyTorch's allocations through mempool, with PyTorch's pluggable allocator.

- ``torch.cuda.memory.change_current_allocator(mempool_torch_allocator)`` (before PyTorch first touches
  CUDA) routes every CUDA tensor to the current device's mempool resource. Out of memory raises a
  ``RuntimeError`` naming the size and the cause (PyTorch ignores a null return from a pluggable allocator,
  so mempool's entry point throws a C++ exception, which PyTorch turns into this error).
- ``torch.cuda.MemPool(mempool_torch_pool_allocator.allocator())`` with ``torch.cuda.use_mem_pool(pool)``
  routes one region of code: PyTorch's caching allocator carves blocks from segments mempool allocates,
  and on a failure (a NULL from ``mempool_torch_alloc_nullable``) frees its cache, retries, and raises
  ``torch.OutOfMemoryError``. ``mempool_torch_allocator`` (which throws) is not supported under a
  ``MemPool``: use ``mempool_torch_pool_allocator`` there. ``use(pool, resource)`` enters such a region
  with a given resource (one tag of a ``ServiceMemoryResource``, say) as the device's current resource.

Each segment comes from the device's current mempool resource when PyTorch asks for it, and goes back to
the resource that allocated it, even after the current resource changed.

Statistics: ``memory_stats`` (PyTorch's key names where they apply), ``reset_peak_memory_stats``,
``empty_cache`` (PyTorch's cached blocks, then the resource's idle memory) and ``last_error`` (why the
calling thread's last allocation failed). PyTorch's own ``torch.cuda.memory_stats`` raise under
``change_current_allocator``; under a ``MemPool`` they count PyTorch's blocks, not what mempool holds.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

from .. import _lib
from ._require import require

torch = require("torch", "mempool.allocators.torch", "PyTorch")
from torch.cuda.memory import CUDAPluggableAllocator  # noqa: E402

__all__ = [
    "allocator_state",
    "empty_cache",
    "last_error",
    "memory_stats",
    "mempool_torch_allocator",
    "mempool_torch_pool_allocator",
    "reset_peak_memory_stats",
    "trim",
    "use",
]

if not _lib._torch_alloc_raises():
    raise ImportError(
        "this build of mempool has no C++ shim (no C++ compiler when it was built, or built with "
        "panic=abort), so an out-of-memory in PyTorch could not raise; rebuild with g++ installed and "
        "panic=unwind"
    )

_so = _lib._shared_object_path()
mempool_torch_allocator = CUDAPluggableAllocator(_so, "mempool_torch_alloc", "mempool_torch_free")
mempool_torch_pool_allocator = CUDAPluggableAllocator(_so, "mempool_torch_alloc_nullable", "mempool_torch_free")

# MemPools entered through `use`, per device, whose cached segments `empty_cache` releases. Weak: a pool
# deleted by its owner is forgotten (PyTorch frees its segments then).
_pools: dict[int, "weakref.WeakSet[Any]"] = {}


def allocator_state() -> tuple[int, int]:
    """``(live, failed_frees)``: allocations PyTorch holds through mempool now, and frees mempool refused (a
    pointer it did not hand out, or a wrong size) or that failed, since the process started."""
    return _lib._torch_allocator_state()


def _device_index(device: Any) -> int:
    """An ordinal from ``None`` (mempool's current device, without initialising PyTorch's CUDA), an int, a
    ``torch.device`` or a string such as ``"cuda:1"``."""
    if device is None:
        return _lib.get_current_device()
    if isinstance(device, bool):
        raise TypeError(f"device must be an ordinal, a torch.device or a string, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device must be a non-negative ordinal, got {device}")
        return device
    if isinstance(device, (str, torch.device)):
        d = torch.device(device)
        if d.type != "cuda":
            raise ValueError(f"device {device!r} is not a CUDA device")
        return d.index if d.index is not None else _lib.get_current_device()
    raise TypeError(f"device must be an ordinal, a torch.device or a string, got {type(device).__name__}")


def _service_and_tag(resource: Any) -> tuple[Optional[Any], Optional[str]]:
    """The ``ServiceMemoryResource`` behind ``resource`` (itself, or the resource a
    ``TaggedMemoryResource`` allocates from) and the tag's name for a tagged one; ``(None, None)`` for
    other resources."""
    from .. import mr

    service_cls = getattr(mr, "ServiceMemoryResource", None)
    tagged_cls = getattr(mr, "TaggedMemoryResource", None)
    if service_cls is not None and isinstance(resource, service_cls):
        return resource, None
    if tagged_cls is not None and isinstance(resource, tagged_cls):
        parent = None
        for attr in ("resource", "upstream_mr"):
            candidate = getattr(resource, attr, None)
            if callable(candidate) and not isinstance(candidate, mr.DeviceMemoryResource):
                candidate = candidate()
            if service_cls is not None and isinstance(candidate, service_cls):
                parent = candidate
                break
        tag = getattr(resource, "tag_name", None)
        return parent, tag if isinstance(tag, str) else None
    return None, None


def _largest_free(tag_stats: dict) -> Optional[int]:
    for key in ("largest_free_block", "largest_free_mapped"):
        if key in tag_stats:
            return int(tag_stats[key])
    return None


def memory_stats(device: Any = None, resource: Any = None) -> dict[str, Any]:
    """What PyTorch holds through mempool on ``device`` (default: the current device), under
    ``torch.cuda.memory_stats``'s key names where they apply:

    - ``allocated_bytes.all.current`` / ``.peak``, ``allocation.all.current`` / ``.peak``: bytes and
      allocations that PyTorch holds from mempool's entry points (every tensor under
      ``change_current_allocator``; every segment of PyTorch's caching allocator under a ``MemPool``),
      counted by mempool as it hands them out and takes them back; ``allocation.all.allocated`` /
      ``.freed``: allocations and frees since the process started. Peaks since the process started or
      ``reset_peak_memory_stats``.
    - ``reserved_bytes.all.current`` / ``.peak``: what ``resource`` holds (default: the device's current
      mempool resource). For a ``ServiceMemoryResource``, or one of its ``TaggedMemoryResource`` views, its
      mapped physical memory (every tag), current and peak. For any other resource, the allocated bytes:
      such resources are read as holding nothing beyond what they hand out (a pool's cached memory is not
      seen here: read its own ``pool_size()``).
    - ``largest_free_block``: for a ``ServiceMemoryResource`` view, the largest free block lying in mapped
      memory (the largest allocation it serves without mapping more) of its tag, or of all its tags for
      the resource itself; ``None`` for other resources, which do not report free blocks.
    - ``num_alloc_failures``: mempool allocations for PyTorch that failed since the process started. Under a
      ``MemPool`` one ``torch.OutOfMemoryError`` can count up to three: PyTorch frees its cache and retries.
    - ``num_ooms`` and ``num_alloc_retries``: PyTorch's own device-wide counts, when PyTorch's caching
      allocator is the current allocator and has initialised CUDA (a ``MemPool`` runs inside it); absent
      under ``change_current_allocator``, where PyTorch keeps none.

    Reading takes no lock shared with allocations; while other threads allocate, the values may be from
    slightly different moments.
    """
    dev = _device_index(device)
    cur, peak, count, peak_count, allocs, frees, failures = _lib._torch_counters(dev)
    stats: dict[str, Any] = {
        "allocated_bytes.all.current": cur,
        "allocated_bytes.all.peak": peak,
        "allocation.all.current": count,
        "allocation.all.peak": peak_count,
        "allocation.all.allocated": allocs,
        "allocation.all.freed": frees,
        "num_alloc_failures": failures,
    }
    if resource is None:
        resource = _lib.get_per_device_resource(dev)
    service, tag = _service_and_tag(resource)
    if service is not None:
        s = service.stats()
        stats["reserved_bytes.all.current"] = int(s["mapped_bytes"])
        stats["reserved_bytes.all.peak"] = int(s["peak_mapped_bytes"])
        tags = s.get("tags", {})
        if tag is not None and tag in tags:
            stats["largest_free_block"] = _largest_free(tags[tag])
        else:
            sizes = [v for v in (_largest_free(t) for t in tags.values()) if v is not None]
            stats["largest_free_block"] = max(sizes) if sizes else None
    else:
        stats["reserved_bytes.all.current"] = cur
        stats["reserved_bytes.all.peak"] = peak
        stats["largest_free_block"] = None
    if torch.cuda.is_initialized() and torch.cuda.memory.get_allocator_backend() == "native":
        try:
            native = torch.cuda.memory_stats(dev)
        except RuntimeError:
            native = {}
        for key in ("num_ooms", "num_alloc_retries"):
            if key in native:
                stats[key] = native[key]
    return stats


def reset_peak_memory_stats(device: Any = None, resource: Any = None) -> None:
    """Sets the peaks of ``memory_stats(device)`` to their current values: mempool's counters of what PyTorch
    holds, and the peaks of ``resource`` (default: the device's current resource) when it is a
    ``ServiceMemoryResource`` or a view of one (``reset_peaks``, which also lowers its watermark's
    reference)."""
    dev = _device_index(device)
    _lib._torch_counters(dev, True)
    if resource is None:
        resource = _lib.get_per_device_resource(dev)
    service, _ = _service_and_tag(resource)
    if service is not None:
        service.reset_peaks()


def empty_cache(device: Any = None, resource: Any = None) -> int:
    """Does what ``torch.cuda.empty_cache`` promises, through mempool: PyTorch's cached, unused blocks go back
    to where they came from, then mempool's idle memory goes back to the driver. Returns the bytes of
    physical memory the resource released.

    1. ``torch.cuda.empty_cache()`` (when PyTorch has initialised CUDA), which returns the unused cached
       segments of PyTorch's pools (those of ``MemPool``\\ s whose owner deleted them included; segments
       from mempool come back through mempool's free); then the same inside each ``MemPool`` still alive
       that was entered through ``use`` on ``device``, for the PyTorch versions that empty the active pool
       only there. A segment a live tensor uses stays.
    2. ``resource`` (default: the device's current resource), when it can trim: a
       ``ServiceMemoryResource`` (or a view of one) waits for the frees in flight and unmaps every chunk no live
       allocation touches. Other resources release nothing here (0).

    Pass the resource you entered with ``use`` after leaving it: outside ``use``, the current resource is
    the one set before.
    """
    dev = _device_index(device)
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        for pool in list(_pools.get(dev, ())):
            with torch.cuda.use_mem_pool(pool, device=dev):
                torch.cuda.empty_cache()
    if resource is None:
        resource = _lib.get_per_device_resource(dev)
    service, _ = _service_and_tag(resource)
    if service is not None:
        return int(service.trim())
    return 0


trim = empty_cache


def last_error() -> str:
    """Why the calling thread's last failed allocation through mempool's PyTorch entry points failed ("" if
    none has): the size asked for, the device, and the resource's account (for a ``ServiceMemoryResource``:
    the tag, the memory it holds mapped and live, its largest free block in mapped memory, and the device's
    free memory). PyTorch's ``OutOfMemoryError`` under a ``MemPool`` carries PyTorch's own text only (it
    composes it itself, and an allocator's text does not reach it); ``use`` appends this one to it, and
    outside ``use`` read it here, on the thread that caught the error. Later successful calls do not clear
    it."""
    return _lib._torch_last_failure()[1]


def _remember(pool: Any, dev: int) -> None:
    try:
        _pools.setdefault(dev, weakref.WeakSet()).add(pool)
    except TypeError:  # not weakly referenceable: not remembered (its cache is released when it is deleted)
        pass


@contextlib.contextmanager
def use(pool: Any, resource: Any, device: Any = None) -> Iterator[Any]:
    """Allocates PyTorch's tensors on ``device`` from ``pool`` (a ``torch.cuda.MemPool`` built on
    ``mempool_torch_pool_allocator.allocator()``) over ``resource``, for the duration of the block:

    - sets ``resource`` as ``device``'s current mempool resource, and restores the previous one on exit;
    - enters ``torch.cuda.use_mem_pool(pool, device=...)`` (skipped when ``pool`` is ``None``: for
      ``torch.cuda.graph(g, pool=pool.id)``, which routes the capture's allocations to the pool itself and
      refuses a pool that ``use_mem_pool`` already routes to).

    A pool caches the segments it got from mempool and serves later tensors from them, whichever resource
    is current then: give each resource (each tag) its own pool. Yields ``pool``.

    A ``torch.OutOfMemoryError`` raised inside the block leaves it with mempool's reason appended to its
    message (``last_error()``: the size mempool was asked for, what the resource holds, its largest free
    block).
    """
    from .. import mr

    if not isinstance(resource, mr.DeviceMemoryResource):
        raise TypeError(f"use needs a mempool.mr resource, got {type(resource).__name__}")
    dev = _device_index(device)
    previous = _lib.get_per_device_resource(dev)
    _lib.set_per_device_resource(dev, resource)
    failures_before = _lib._torch_last_failure()[0]
    try:
        if pool is None:
            yield pool
        else:
            _remember(pool, dev)
            with torch.cuda.use_mem_pool(pool, device=dev):
                yield pool
    except torch.OutOfMemoryError as e:
        failures, message = _lib._torch_last_failure()
        if failures != failures_before and message and e.args:
            e.args = (f"{e.args[0]}\nmempool: {message}",) + tuple(e.args[1:])
        raise
    finally:
        _lib.set_per_device_resource(dev, previous)
