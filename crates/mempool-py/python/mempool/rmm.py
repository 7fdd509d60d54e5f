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
describe (``mempool.spec``, as ``mempool.dask`` does for each worker), checking them first.
"""

from __future__ import annotations

from typing import Any, Optional

from . import mr as _mr
from .spec import KINDS as SPEC_KINDS
from .spec import ResourceSpec, build

__all__ = ["KINDS", "MempoolResource", "as_rmm_resource", "make_resource"]

#: What ``kind`` may name: the kinds of ``mempool.spec.ResourceSpec``, and ``"current"``, the device's current
#: mempool resource as it is.
KINDS = SPEC_KINDS + ("current",)


def make_resource(kind: str = "default", *, device: Optional[int] = None, statistics: bool = False, **options: Any):
    """The mempool resource ``kind`` and ``options`` describe, made on ``device`` (default: the current
    device): the kinds and options of ``mempool.spec.ResourceSpec`` (docs/rmm.md has the table; sizes in
    bytes, as ``"4GiB"``, or as a fraction of the device's memory, ``"0.5"``), except that ``statistics``
    (a ``StatisticsResourceAdaptor`` on top) is off unless asked for; or ``"current"``, the device's current
    mempool resource, which takes no options. Everything that can be checked without the GPU is checked
    first: an unknown kind or option, or a value it cannot take, raises ``ValueError`` (``TypeError`` for a
    wrong type) naming it."""
    if kind == "current":
        if options or statistics:
            raise ValueError(f"kind 'current' takes no options (given: {', '.join(sorted(options)) or 'statistics'})")
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise ValueError(f"device: expected a non-negative ordinal, got {device!r}")
        return _mr.get_per_device_resource(device if device is not None else _mr.get_current_device())
    spec = ResourceSpec.coerce(kind=kind, device=device, statistics=statistics, **options)
    return build(spec, spec.device if spec.device is not None else _mr.get_current_device())


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
