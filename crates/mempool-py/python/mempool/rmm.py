"""mempool resources as RMM resources (RMM 26.x's Python API), so that ``rmm.DeviceBuffer``,
``rmm.allocators.cupy``, ``rmm.allocators.torch``, cudf and anything else that allocates through RMM's current
device resource allocate from mempool, without entering Python per allocation (docs/rmm.md, "Python")::

    import rmm
    from mempool.rmm import MempoolResource

    rmm.mr.set_current_device_resource(MempoolResource())             # mempool's default stack
    rmm.mr.set_current_device_resource(MempoolResource(kind="pool", initial_pool_size=2**30))
    rmm.mr.set_current_device_resource(MempoolResource(mempool.mr.CudaAsyncMemoryResource()))

``MempoolResource`` is an ``rmm.mr.DeviceMemoryResource`` compiled against RMM's headers; it lives in the
``mempool-rmm-bridge`` package (``crates/mempool-py/rmm-bridge``, built by ``scripts/build-rmm-bridge.sh``),
which this module imports on first use, raising an ImportError that names what is missing (the bridge, RMM,
or the RMM release it was built for). Engines that make their resource from a qualified name and options
(cudf-polars' memory resource configuration) name ``mempool.rmm.MempoolResource`` with keyword options.

What this module does without RMM: :func:`make_resource` builds the mempool resource a ``kind`` and options
describe, checking them first.
"""

from __future__ import annotations

from typing import Any, Optional

from . import mr as _mr

__all__ = ["KINDS", "MempoolResource", "as_rmm_resource", "make_resource"]

# kind -> (what it is, the options it takes besides device, statistics and limit)
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "default": (
        "mempool's default stack: binning over the pool suballocator over the driver's pool",
        ("initial_pool_size", "maximum_pool_size"),
    ),
    "current": ("the device's current mempool resource (mempool.mr.get_current_device_resource)", ()),
    "async": (
        "the driver's stream-ordered pool (CudaAsyncMemoryResource)",
        ("initial_pool_size", "release_threshold", "enable_ipc"),
    ),
    "pool": (
        "the pool suballocator over the driver's pool (PoolMemoryResource)",
        ("initial_pool_size", "maximum_pool_size"),
    ),
    "binning": (
        "size-class bins over the pool suballocator (BinningMemoryResource)",
        ("min_size_exponent", "max_size_exponent", "initial_pool_size", "maximum_pool_size"),
    ),
    "arena": (
        "per-thread arenas over the driver's pool (ArenaMemoryResource)",
        ("arena_size", "dump_log_on_failure"),
    ),
    "cuda": ("cudaMalloc/cudaFree without a pool (CudaMemoryResource)", ()),
    "managed": ("managed memory (ManagedMemoryResource)", ()),
    "service": (
        "a tag of the service resource (ServiceMemoryResource(...).tagged(tag))",
        ("tag", "max_tags", "chunk_size", "region_size", "watermark", "shareable"),
    ),
}


def _check_options(kind: str, options: dict[str, Any]) -> None:
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(sorted(KINDS))}")
    allowed = KINDS[kind][1]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        takes = ", ".join(allowed) if allowed else "no options"
        raise TypeError(
            f"kind {kind!r} takes {takes} (besides device, statistics and limit), not {', '.join(unknown)}"
        )
    for name, value in options.items():
        if name in ("enable_ipc", "dump_log_on_failure", "shareable"):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, not {value!r}")
        elif name == "tag":
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                raise TypeError(f"tag must be a tag's name or number, not {value!r}")
        elif value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{name} must be an int or None, not {value!r}")
        elif name not in ("min_size_exponent", "max_size_exponent") and value is not None and value < 0:
            raise ValueError(f"{name} must not be negative, not {value}")


def make_resource(
    kind: str = "default",
    *,
    device: Optional[int] = None,
    statistics: bool = False,
    limit: Optional[int] = None,
    **options: Any,
) -> _mr.DeviceMemoryResource:
    """The mempool resource ``kind`` names (see ``KINDS``), made on ``device`` (default: the current device)
    with ``options``; with ``limit``, under a ``LimitingResourceAdaptor`` of that many bytes; with
    ``statistics``, under a ``StatisticsResourceAdaptor`` (outermost). The kind and the options are checked
    before anything touches the GPU: an unknown kind is ValueError, an option the kind does not take or of
    the wrong type TypeError."""
    _check_options(kind, options)
    if not isinstance(statistics, bool):
        raise TypeError(f"statistics must be True or False, not {statistics!r}")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0):
        raise ValueError(f"limit must be a positive number of bytes or None, not {limit!r}")
    if device is not None and (not isinstance(device, int) or isinstance(device, bool) or device < 0):
        raise ValueError(f"device must be a device ordinal or None, not {device!r}")
    o = dict(options)
    if kind == "default":
        r: _mr.DeviceMemoryResource = _mr.default_stack(
            None, o.get("initial_pool_size"), o.get("maximum_pool_size"), device=device
        )
    elif kind == "current":
        r = _mr.get_per_device_resource(device if device is not None else _mr.get_current_device())
    elif kind == "async":
        r = _mr.CudaAsyncMemoryResource(
            o.get("initial_pool_size"), o.get("release_threshold"), bool(o.get("enable_ipc", False)), device=device
        )
    elif kind == "pool":
        r = _mr.PoolMemoryResource(
            _mr.CudaAsyncMemoryResource(device=device), o.get("initial_pool_size"), o.get("maximum_pool_size")
        )
    elif kind == "binning":
        pool = _mr.PoolMemoryResource(
            _mr.CudaAsyncMemoryResource(device=device), o.get("initial_pool_size"), o.get("maximum_pool_size")
        )
        lo, hi = o.get("min_size_exponent"), o.get("max_size_exponent")
        r = _mr.BinningMemoryResource(pool, -1 if lo is None else lo, -1 if hi is None else hi)
    elif kind == "arena":
        r = _mr.ArenaMemoryResource(
            _mr.CudaAsyncMemoryResource(device=device), o.get("arena_size"), bool(o.get("dump_log_on_failure", False))
        )
    elif kind == "cuda":
        r = _mr.CudaMemoryResource(device=device)
    elif kind == "managed":
        r = _mr.ManagedMemoryResource(device=device)
    else:  # service
        service_options = {k: v for k, v in o.items() if k != "tag" and v is not None}
        service = _mr.ServiceMemoryResource(device, **service_options)
        r = service.tagged(o.get("tag", "default"))
    if limit is not None:
        r = _mr.LimitingResourceAdaptor(r, limit)
    if statistics:
        r = _mr.StatisticsResourceAdaptor(r)
    return r


def _resource_and_handle(
    mr: Optional[_mr.DeviceMemoryResource] = None, *, kind: Optional[str] = None, **options: Any
) -> tuple[_mr.DeviceMemoryResource, int]:
    """``MempoolResource``'s constructor: the mempool resource and a new C handle to it (the bridge owns it)."""
    if mr is not None:
        if kind is not None or options:
            raise TypeError("MempoolResource takes a mempool resource or kind= and options, not both")
        if not isinstance(mr, _mr.DeviceMemoryResource):
            raise TypeError(
                f"MempoolResource wraps a mempool.mr resource, not {type(mr).__name__} (an RMM resource is "
                "set current with rmm.mr.set_current_device_resource directly)"
            )
    else:
        mr = make_resource(kind if kind is not None else "default", **options)
    return mr, mr._capi_handle()


def _bridge() -> Any:
    try:
        import mempool_rmm_bridge
    except ImportError as e:
        if getattr(e, "name", None) == "mempool_rmm_bridge":
            raise ImportError(
                "mempool.rmm needs the RMM bridge: build and install it against the installed RMM with "
                "scripts/build-rmm-bridge.sh, or pip install --no-build-isolation crates/mempool-py/rmm-bridge "
                "(docs/rmm.md, 'Python')"
            ) from e
        raise
    return mempool_rmm_bridge


def as_rmm_resource(mr: Optional[_mr.DeviceMemoryResource] = None) -> Any:
    """``mr`` (default: the current device's mempool resource) as an ``rmm.mr.DeviceMemoryResource``."""
    if mr is None:
        mr = make_resource("current")
    return _bridge().MempoolResource(mr)


def __getattr__(name: str) -> Any:
    if name == "MempoolResource":
        return _bridge().MempoolResource
    raise AttributeError(f"module 'mempool.rmm' has no attribute {name!r}")
