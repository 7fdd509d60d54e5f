"""The worker plugin: ``MempoolSetup``, what it does on a worker (``setup_worker``), the framework hooks, and
``worker_statistics`` / ``register``.

One resource per worker process: ``setup_worker`` builds the spec's resource on the worker's device (device
0 by default: dask-cuda puts each worker's GPU first in its ``CUDA_VISIBLE_DEVICES``), makes it the
device's current resource, and points the frameworks asked for at it. The state is the process's (a
process has one current resource per device), so a second ``setup_worker`` with the same spec and device
changes nothing, and one with another spec replaces the resource (memory allocated before keeps its own
resource alive until it is freed; hooks already made stay).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from typing import Any, Iterable, Mapping, Optional, Union

try:
    from distributed import WorkerPlugin

    _NO_DISTRIBUTED = None
except ImportError as _e:  # Ray or plain processes: setup_worker and the spec need no Dask
    _NO_DISTRIBUTED = _e

    class WorkerPlugin:  # type: ignore[no-redef]
        """Stands in for distributed's, which is not installed: ``MempoolSetup`` refuses to be made."""


from mempool.spec import ResourceSpec, build, device_total_memory, format_size

logger = logging.getLogger("mempool.dask")

__all__ = [
    "FRAMEWORKS",
    "MempoolSetup",
    "cluster_snapshot",
    "current_setup",
    "parse_frameworks",
    "register",
    "setup_worker",
    "worker_statistics",
]

#: The frameworks a worker can point at its resource. ``rmm`` is RMM's current device resource, through the
#: RMM bridge (``mempool.rmm.MempoolResource``, docs/rmm.md): cudf, RMM's CuPy and PyTorch hooks and anything
#: else that allocates through RMM then allocate from the worker's mempool resource.
FRAMEWORKS = ("cupy", "torch", "numba", "rmm")
#: The modules each framework needs (all importable for it to count as installed).
_MODULES = {"cupy": ("cupy",), "torch": ("torch",), "numba": ("numba",), "rmm": ("rmm", "mempool_rmm_bridge")}
#: What "auto" tries, in order.
_AUTO = ("cupy", "torch", "numba", "rmm")

#: The plugin's name on the workers: registering a second ``MempoolSetup`` replaces the first (Dask calls
#: the old one's ``teardown``, then the new one's ``setup``), never adds a second.
PLUGIN_NAME = "mempool-setup"


def parse_frameworks(value: Union[str, Iterable[str], None]) -> Union[str, tuple]:
    """``"auto"`` (hook what is importable on the worker), or a tuple of framework names to hook (each
    must be installed on every worker: one that is missing fails the worker's start). Accepts ``"auto"``,
    ``"none"``/``""``/``None``/``[]`` (hook nothing), a comma-separated string or an iterable of names."""
    if value is None:
        return ()
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text in ("", "none"):
            return ()
        names = [p.strip() for p in text.split(",")]
    else:
        try:
            names = [str(p).strip().lower() for p in value]
        except TypeError:
            raise TypeError(f"frameworks: expected 'auto', a name or a list of names, got {value!r}") from None
    out = []
    for n in names:
        if n not in FRAMEWORKS:
            raise ValueError(f"frameworks: unknown framework {n!r}; the frameworks are {', '.join(FRAMEWORKS)} or 'auto'")
        if n in out:
            raise ValueError(f"frameworks: {n!r} is listed twice")
        out.append(n)
    return tuple(out)


def _importable(modules: tuple) -> bool:
    try:
        return all(importlib.util.find_spec(m.split(".")[0]) is not None for m in modules)
    except (ImportError, ValueError):
        return False


class _State:
    """The process's setup: the spec and device applied, the resource, the hooks made, the IPC endpoint."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spec: Optional[ResourceSpec] = None
        self.device: Optional[int] = None
        self.resource: Any = None
        self.hooked: dict = {}  # framework -> what was set ("c", "python", "pluggable", "emm", "bridge")
        self.hooked_resource: dict = {}  # framework -> the resource it was pointed at
        self.not_hooked: dict = {}  # framework -> why "auto" left it alone
        self.ipc: Any = None  # mempool.dask.transfer.Endpoint when handles are on
        self.setups = 0


_STATE = _State()


def current_setup() -> dict:
    """What ``setup_worker`` made in this process: ``spec`` (a dict), ``device``, ``hooked`` (framework ->
    allocator), ``not_hooked`` (framework -> why ``"auto"`` left it alone), ``ipc`` (the endpoint's socket path, or None), ``setups`` (how many setups ran) and
    ``resource_id`` (which resource object). ``spec`` is ``None`` when none ran."""
    s = _STATE
    return {
        "spec": s.spec.to_dict() if s.spec else None,
        "device": s.device,
        "hooked": dict(s.hooked),
        "not_hooked": dict(s.not_hooked),
        "ipc": s.ipc.path if s.ipc is not None else None,
        "setups": s.setups,
        # Which resource object: equal across calls while the same resource is current.
        "resource_id": id(s.resource) if s.resource is not None else None,
    }


def _hook(framework: str, cupy_allocator: str, device: int, resource: Any) -> str:
    """Points ``framework`` at ``resource``, ``device``'s current resource; returns how."""
    if framework == "cupy":
        import cupy

        from mempool.allocators import cupy as hook

        if cupy_allocator == "c":
            cupy.cuda.set_allocator(hook.c_allocator().malloc)
        else:
            cupy.cuda.set_allocator(hook.mempool_cupy_allocator)
        return cupy_allocator
    if framework == "torch":
        import torch

        from mempool.allocators import torch as hook

        if torch.cuda.is_initialized():
            raise RuntimeError(
                "mempool.dask: PyTorch has already started CUDA in this worker, so its allocator can no longer be "
                "changed; set the plugin up before any task uses PyTorch on the GPU (register it right after the "
                "cluster starts, or preload mempool.dask.preload)"
            )
        torch.cuda.memory.change_current_allocator(hook.mempool_torch_allocator)
        return "pluggable"
    if framework == "numba":
        from numba import cuda

        from mempool.allocators.numba import MempoolNumbaManager

        cuda.set_memory_manager(MempoolNumbaManager)
        return "emm"
    if framework == "rmm":
        import rmm

        from mempool.rmm import MempoolResource

        rmm.mr.set_per_device_resource(device, MempoolResource(resource))
        return "bridge"
    raise AssertionError(framework)


def setup_worker(
    spec: ResourceSpec,
    *,
    device: Optional[int] = None,
    frameworks: Union[str, tuple] = "auto",
    cupy_allocator: str = "c",
    ipc: bool = False,
    ipc_dir: Optional[str] = None,
    worker: Any = None,
) -> dict:
    """Builds ``spec``'s resource on ``device`` (default: the spec's, else 0), makes it current, hooks
    ``frameworks``; with ``ipc``, starts
    the process's handle endpoint (``mempool.dask.transfer``) and, given the ``worker``, advertises it in
    the worker's handshakes. Returns ``current_setup()``.

    A framework asked for by name that is not installed raises ``ImportError`` naming it, before the
    resource is built; a size larger than the device raises ``ValueError`` naming the field. Repeated with
    the same spec and device, it changes nothing (hooks are made once per process: a hook cannot be
    undone, and PyTorch's can be set only once).
    """
    if not isinstance(spec, ResourceSpec):
        raise TypeError(f"setup_worker needs a ResourceSpec, got {type(spec).__name__}")
    if cupy_allocator not in ("c", "python"):
        raise ValueError(f"cupy_allocator: expected 'c' or 'python', got {cupy_allocator!r}")
    if device is not None and spec.device is not None and device != spec.device:
        raise ValueError(f"device: the spec names device {spec.device} and device={device}")
    device = device if device is not None else (spec.device if spec.device is not None else 0)
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"device: expected a non-negative ordinal, got {device!r}")
    frameworks = parse_frameworks(frameworks) if not isinstance(frameworks, tuple) else frameworks
    if frameworks == "auto":
        wanted = tuple(f for f in _AUTO if _importable(_MODULES[f]))
    else:
        wanted = frameworks
        missing = [f for f in wanted if not _importable(_MODULES[f])]
        if missing:
            where = f" on worker {getattr(worker, 'address', '')}" if worker is not None else ""
            raise ImportError(
                f"mempool.dask: framework(s) {', '.join(missing)} asked for but not installed{where} "
                f"(python {sys.executable}); install them on every worker or leave them out of frameworks"
            )
    from mempool import mr

    s = _STATE
    with s.lock:
        if s.spec == spec and s.device == device and s.resource is not None:
            logger.info("mempool.dask: the resource of %s on device %d is already set up", spec.kind, device)
        else:
            total = device_total_memory(device)
            try:
                resource = build(spec, device, total)
            except ValueError as e:
                raise ValueError(f"mempool.dask: device {device} ({format_size(total)}): {e}") from None
            mr.set_per_device_resource(device, resource)
            s.spec, s.device, s.resource = spec, device, resource
            logger.info("mempool.dask: device %d now allocates from %s (%s)", device, resource.name, spec.to_dict())
        for f in wanted:
            # RMM's resource follows the worker's: a new spec's resource is made RMM's current one again.
            if f in s.hooked and not (f == "rmm" and s.hooked_resource.get(f) is not s.resource):
                continue
            try:
                s.hooked[f] = _hook(f, cupy_allocator, device, s.resource)
                s.hooked_resource[f] = s.resource
                s.not_hooked.pop(f, None)
            except Exception as e:
                if frameworks != "auto":
                    raise RuntimeError(f"mempool.dask: pointing {f} at the resource failed: {e}") from e
                # "auto": a framework that imports but cannot be hooked is left alone, and said so.
                s.not_hooked[f] = f"{type(e).__name__}: {e}"
                logger.warning("mempool.dask: %s is installed but was not hooked: %s", f, e)
        if ipc and s.ipc is None:
            from mempool.dask.transfer import Endpoint

            s.ipc = Endpoint.start(device=device, directory=ipc_dir)
        if ipc and worker is not None:
            from mempool.dask.transfer import advertise, install

            install()
            advertise(worker, s.ipc)
        s.setups += 1
    return current_setup()


class MempoolSetup(WorkerPlugin):
    """The worker plugin (the counterpart of dask-cuda's ``RMMSetup``): on every worker, builds the resource
    of ``spec`` (a ``ResourceSpec``, a mapping, a string such as ``"pool:initial_pool_size=0.5"``, or the
    keyword ``options``: ``kind=``, ``initial_pool_size=``, ...), makes it the current resource of
    ``device`` and points ``frameworks`` at it (``"auto"``: CuPy, PyTorch and Numba where importable; a
    list: each, failing the worker's start if one is missing). ``ipc=True`` turns on the handle path for
    CuPy arrays and PyTorch tensors between workers of one host (``mempool.dask.transfer``).

    The spec is checked when the plugin is made (in the client), the sizes against the device when a worker
    starts: a misconfiguration fails the worker's start (or ``Client.register_plugin``), not the first task.
    The plugin's name is fixed (``mempool-setup``), so registering it twice is harmless: the second replaces
    the first, and a worker whose resource already matches changes nothing.
    """

    idempotent = False
    name = PLUGIN_NAME

    def __init__(
        self,
        spec: Union[ResourceSpec, Mapping[str, Any], str, None] = None,
        *,
        frameworks: Union[str, Iterable[str], None] = "auto",
        device: Optional[int] = None,
        cupy_allocator: str = "c",
        ipc: bool = False,
        ipc_dir: Optional[str] = None,
        **options: Any,
    ) -> None:
        if _NO_DISTRIBUTED is not None:
            raise ImportError(
                f"MempoolSetup is a Dask worker plugin and needs distributed, which is not installed "
                f"({_NO_DISTRIBUTED}); without Dask, call mempool.dask.setup_worker in each process"
            )
        self.spec = ResourceSpec.coerce(spec, **options)
        self.frameworks = parse_frameworks(frameworks)
        if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
            raise ValueError(f"device: expected a non-negative ordinal, got {device!r}")
        if self.spec.device is not None and device is not None and self.spec.device != device:
            raise ValueError(f"device: the spec names device {self.spec.device} and device={device}")
        # dask-cuda puts each worker's GPU first in its CUDA_VISIBLE_DEVICES: device 0 is the worker's.
        self.device = self.spec.device if self.spec.device is not None else (device or 0)
        if cupy_allocator not in ("c", "python"):
            raise ValueError(f"cupy_allocator: expected 'c' or 'python', got {cupy_allocator!r}")
        self.cupy_allocator = cupy_allocator
        self.ipc = bool(ipc)
        self.ipc_dir = ipc_dir

    def __repr__(self) -> str:
        return (
            f"MempoolSetup({self.spec.to_dict()!r}, frameworks={self.frameworks!r}, device={self.device}, "
            f"ipc={self.ipc})"
        )

    def setup(self, worker: Any) -> None:
        setup_worker(
            self.spec,
            device=self.device,
            frameworks=self.frameworks,
            cupy_allocator=self.cupy_allocator,
            ipc=self.ipc,
            ipc_dir=self.ipc_dir,
            worker=worker,
        )

    def teardown(self, worker: Any) -> None:
        # The resource and the hooks stay: allocations made from them may outlive the plugin, and a hook
        # cannot be undone. A worker that closes stops its handle endpoint (importers get their leases'
        # memory until they let go: mempool.ipc's exporter shutdown).
        status = str(getattr(worker, "status", ""))
        if "clos" in status and _STATE.ipc is not None:
            with _STATE.lock:
                endpoint, _STATE.ipc = _STATE.ipc, None
            endpoint.close()


def _statistics() -> dict:
    """This process's statistics (runs on a worker)."""
    from mempool import mr

    s = _STATE
    out: dict = {"pid": os.getpid(), **current_setup()}
    res = s.resource
    if res is None:
        return out
    out["resource"] = res.name
    current = mr.get_per_device_resource(s.device)
    out["is_current"] = current is res  # the registry hands back the object that was set
    if isinstance(res, mr.StatisticsResourceAdaptor):
        c = res.allocation_counts
        out["statistics"] = {
            "current_bytes": c.current_bytes,
            "current_count": c.current_count,
            "peak_bytes": c.peak_bytes,
            "peak_count": c.peak_count,
            "total_bytes": c.total_bytes,
            "total_count": c.total_count,
        }
    if s.ipc is not None:
        out["ipc_stats"] = s.ipc.stats()
    return out


def worker_statistics(client: Any, workers: Optional[list] = None) -> dict:
    """Every worker's (or those of ``workers``') mempool state: ``{worker address: dict}`` with the pid,
    the spec, the device, the hooks, the resource's name, whether it is still the device's current
    resource, its statistics (bytes and counts: current, peak, total; when the spec keeps ``statistics``
    on) and the handle endpoint's counters (``ipc_stats``, with its exporter's)."""
    return client.run(_statistics, workers=workers)


def _snapshot() -> dict:
    """This process's snapshot of its device's current resource, with who took it (runs on a worker)."""
    import socket

    from mempool import memory, mr

    s = _STATE
    device = s.device if s.device is not None else 0
    snap = memory.snapshot(device=device)
    name = None
    for d in snap.get("devices") or []:
        if d.get("ordinal") == device:
            name = d.get("name")
    return {"snapshot": snap, "host": socket.gethostname(), "pid": os.getpid(), "device": device,
            "device_name": name, "resource": mr.get_per_device_resource(device).name}


def cluster_snapshot(client: Any, path: Any = None, workers: Optional[list] = None) -> dict:
    """Every worker's (or those of ``workers``') snapshot of its device's current resource, gathered into
    one cluster document (``mempool.memory.cluster_snapshot``: the schema ``mempool.cluster-snapshot`` of
    docs/observe.md, one entry per worker address, with its host, pid and device); with ``path``, also
    written there (the viewer's page showing every worker when it ends in ``.html``, else JSON). A worker
    whose snapshot fails makes this raise with that worker's error."""
    from mempool import memory

    replies = client.run(_snapshot, workers=workers)
    if not replies:
        raise ValueError("cluster_snapshot: the client has no workers to take snapshots of")
    snaps = {addr: r["snapshot"] for addr, r in replies.items()}
    ids = {
        addr: {"address": addr, "host": r["host"], "pid": r["pid"], "device": r["device"],
               "device_name": r["device_name"]}
        for addr, r in replies.items()
    }
    doc = memory.cluster_snapshot(snaps, identities=ids, source="dask")
    if path is not None:
        memory.write_cluster_snapshot(doc, path)
    return doc


def register(client: Any, plugin: Optional[MempoolSetup] = None, **kwargs: Any) -> dict:
    """Registers ``plugin`` (or ``MempoolSetup(**kwargs)``) on every worker of ``client``, now and on every
    worker that joins later (a restarted one included), and returns ``worker_statistics(client)``. A worker
    whose setup fails makes this raise with that worker's error."""
    if plugin is None:
        plugin = MempoolSetup(**kwargs)
    elif kwargs:
        raise ValueError(f"give a plugin or its options, not both ({sorted(kwargs)})")
    client.register_plugin(plugin, name=PLUGIN_NAME)
    return worker_statistics(client)
