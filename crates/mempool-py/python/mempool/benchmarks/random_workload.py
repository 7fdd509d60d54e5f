"""The standard random workload, driven from Python: ns per allocate/free through PyTorch, CuPy, RMM and mempool.

    python -m mempool.benchmarks.random_workload [--points small,mid,large] [--repeats 5]
                                                 [--only NAME[,NAME...]] [--json FILE] [--list]

The workload is the project's standard one (docs/architecture.md, "Performance"; RMM's
``random_allocations`` shape), the same sequence as ``mempool-bench random``: ``n`` draws, each an
allocation of a size uniform in ``[1, max_size]`` with probability 0.73 (dropped when live bytes would
pass ``max_usage``), otherwise the free of a uniformly chosen live allocation (the live list then
swap-removes it); an allocation whenever nothing is live. The generator below is a port of
``crates/mempool-suballoc/src/workload.rs`` (SplitMix64), checked against a fixture the Rust generator
wrote (``crates/mempool-py/tests/test_workload.py``). Point ``i`` of the standard three uses seed
``42 + i``, as ``mempool-bench random`` does.

Each configuration runs in a process of its own, one process per point (PyTorch picks its allocator
once per process, and a fresh process per point is what ``mempool-bench random`` does when it builds a
fresh resource per point). In that process the sequence is generated before anything is timed; then one
warm-up run and ``--repeats`` timed runs, each: every operation in order (an allocation appends the new
object to a list of live objects; a free drops the list's reference to the object, swap-remove, so the
framework frees it at once), then every object left is dropped, then one synchronize of the device's
primary context (``cuCtxSynchronize``, through ctypes, the same call for every configuration, so
stream-ordered frees are paid for the same way everywhere). Reported: wall time of the run over its
operation count (final frees and the synchronize included, not counted as operations), the median of the
timed runs: the method of ``mempool-bench random``. The garbage collector is off while timing.

A configuration whose framework is not installed is reported as skipped, never a crash; one that fails
is reported with its error, and the others still run. This module imports no framework and not mempool's
compiled extension; the processes it starts import what their configuration needs.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

MASK64 = (1 << 64) - 1

#: Seed of the first point; point ``i`` uses ``SEED + i`` (``mempool-bench random --seed``'s default).
SEED = 42


# --------------------------------------------------------------------------------------------------
# The generator: a port of crates/mempool-suballoc/src/workload.rs, bit for bit.
# --------------------------------------------------------------------------------------------------


class SplitMix64:
    """SplitMix64, as ``mempool_suballoc::workload::SplitMix64``: the same outputs for the same seed."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK64

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """Uniform in ``[0, n)`` (``n > 0``), as the Rust ``below``: ``next_u64() % n``."""
        return self.next_u64() % n


def random_workload(n: int, max_size: int, max_usage: int, seed: int) -> list:
    """The operations of the standard random workload, as ``mempool_suballoc::workload::random_workload``.

    Encoded as ints: ``k > 0`` allocates ``k`` bytes; ``k < 0`` frees the live allocation at index ``~k``
    of the live list, which then swap-removes it. :func:`decode` turns one into ``("a", size)`` or
    ``("f", index)``. Fewer than ``n`` operations come out when draws that can never fit are dropped.
    """
    if n < 0 or max_size <= 0 or max_usage < 0:
        raise ValueError(f"random_workload: n={n}, max_size={max_size}, max_usage={max_usage}: "
                         "n and max_usage must be >= 0 and max_size > 0")
    # SplitMix64 inlined: the generator runs before timing, but 200k operations should not take long.
    state = seed & MASK64
    mask = MASK64
    live = []
    live_bytes = 0
    ops = []
    push = ops.append
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        size = 1 + (z ^ (z >> 31)) % max_size
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        alloc = (z ^ (z >> 31)) % 100 < 73
        if (alloc and live_bytes + size <= max_usage) or not live:
            if live_bytes + size > max_usage:
                continue
            live.append(size)
            live_bytes += size
            push(size)
        else:
            state = (state + 0x9E3779B97F4A7C15) & mask
            z = state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
            i = (z ^ (z >> 31)) % len(live)
            last = live.pop()
            if i < len(live):
                live_bytes -= live[i]
                live[i] = last
            else:
                live_bytes -= last
            push(~i)
    return ops


def decode(op: int) -> tuple:
    """``("a", size)`` for an allocation, ``("f", index)`` for a free (see :func:`random_workload`)."""
    return ("a", op) if op > 0 else ("f", ~op)


def peak_live(ops: list) -> tuple:
    """The most allocations and the most bytes live at once over ``ops`` (the final frees excluded)."""
    sizes = []
    live_bytes = peak_n = peak_bytes = 0
    for op in ops:
        if op > 0:
            sizes.append(op)
            live_bytes += op
            peak_n = max(peak_n, len(sizes))
            peak_bytes = max(peak_bytes, live_bytes)
        else:
            i = ~op
            last = sizes.pop()
            if i < len(sizes):
                live_bytes -= sizes[i]
                sizes[i] = last
            else:
                live_bytes -= last
    return peak_n, peak_bytes


class Point:
    """One point of the workload."""

    def __init__(self, name: str, n: int, max_size: int, max_usage: int) -> None:
        self.name, self.n, self.max_size, self.max_usage = name, n, max_size, max_usage

    def label(self) -> str:
        return f"n={self.n}, max_size={_size(self.max_size)}, max_usage={_size(self.max_usage)}"


#: The three standard points of ``mempool-bench random`` (crates/mempool-bench/src/workloads/random.rs).
STANDARD_POINTS = (
    Point("small", 200_000, 64 << 10, 4 << 30),
    Point("mid", 100_000, 1 << 20, 16 << 30),
    Point("large", 20_000, 64 << 20, 16 << 30),
)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------------------------------
# Configurations. Each is set up in its own process by a function returning (alloc expression,
# namespace, versions, notes); the expression, with the size in `n`, is compiled into the timed loop,
# so the loop pays for exactly the call a user writes, and nothing else.
# --------------------------------------------------------------------------------------------------


class Skipped(Exception):
    """The configuration cannot run here because a framework it needs is not installed."""


def _need(module: str):
    """Imports ``module``, or raises :class:`Skipped` naming it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Skipped(f"{module} is not installed ({e})") from e


def _version(mod) -> str:
    return str(getattr(mod, "__version__", "unknown"))


def _mempool_resource(kind: str):
    """A mempool resource for ``kind`` and its label (``None`` for ``default``: left as it is)."""
    _need("mempool")
    mr = _need("mempool.mr")
    if kind == "default":
        current = mr.get_current_device_resource()
        return None, f"the default resource ({type(current).__name__})"
    if kind == "async":
        return mr.CudaAsyncMemoryResource(), "CudaAsyncMemoryResource()"
    if kind == "pool":
        return (mr.PoolMemoryResource(mr.CudaAsyncMemoryResource()),
                "PoolMemoryResource(CudaAsyncMemoryResource())")
    if kind == "binning":
        # Power-of-two bins from 256 B to 1 MiB, larger requests upstream: mempool-bench's binning(async).
        return (mr.BinningMemoryResource(mr.CudaAsyncMemoryResource(), 8, 20),
                "BinningMemoryResource(CudaAsyncMemoryResource(), 8, 20)")
    if kind == "stack":
        # The recommended stack: bins up to 1 MiB over a pool, larger sizes to the pool.
        return (mr.default_stack(),
                "mempool.mr.default_stack() = BinningMemoryResource(PoolMemoryResource(CudaAsyncMemoryResource()), "
                "8, 20)")
    raise ValueError(kind)


def _setup_python_floor():
    class Block:
        __slots__ = ("size",)

        def __init__(self, size):
            self.size = size

    return "Block(n)", {"Block": Block}, {}, "the harness's own cost per operation"


def _setup_torch(kind: str):
    def setup():
        if kind.startswith("mempool-"):
            # torch.cuda.MemPool over mempool (PyTorch's caching allocator carving blocks from segments
            # mempool allocates), entered for the rest of the process.
            mempool = _need("mempool")
            torch_hook = _need("mempool.allocators.torch")
            res, label = _mempool_resource(kind.split("-", 1)[1])
            torch = _need("torch")
            dev = torch.device("cuda", 0)
            torch.empty(1, dtype=torch.uint8, device=dev)  # initialise CUDA outside the timed runs
            pool = torch.cuda.MemPool(torch_hook.mempool_torch_pool_allocator.allocator())
            scope = torch_hook.use(pool, res, device=0)
            scope.__enter__()
            torch.empty(1, dtype=torch.uint8, device=dev)
            return ("torch.empty(n, dtype=u8, device=dev)",
                    {"torch": torch, "u8": torch.uint8, "dev": dev, "_keep": (pool, scope, res)},
                    {"mempool": _version(mempool), "torch": _version(torch)},
                    f"torch.cuda.MemPool(mempool_torch_pool_allocator.allocator()) over {label}, entered with "
                    "mempool.allocators.torch.use")
        if kind == "native-mempool":
            # PyTorch's own private pool, no mempool: what the MemPool path costs inside PyTorch.
            torch = _need("torch")
            dev = torch.device("cuda", 0)
            torch.empty(1, dtype=torch.uint8, device=dev)
            pool = torch.cuda.MemPool()
            scope = torch.cuda.use_mem_pool(pool, device=dev)
            scope.__enter__()
            torch.empty(1, dtype=torch.uint8, device=dev)
            return ("torch.empty(n, dtype=u8, device=dev)",
                    {"torch": torch, "u8": torch.uint8, "dev": dev, "_keep": (pool, scope)},
                    {"torch": _version(torch)},
                    "torch.cuda.MemPool() without an allocator, entered with torch.cuda.use_mem_pool: PyTorch's "
                    "private-pool path, no mempool")
        if kind in ("pool", "binning", "stack"):
            mempool = _need("mempool")
            torch_hook = _need("mempool.allocators.torch")
            res, label = _mempool_resource(kind)
            torch = _need("torch")
            mempool.mr.set_current_device_resource(res)
            # Before anything initialises CUDA in PyTorch, as change_current_allocator requires.
            torch.cuda.memory.change_current_allocator(torch_hook.mempool_torch_allocator)
            note = f"mempool_torch_allocator over {label}"
            versions = {"mempool": _version(mempool)}
        else:
            torch = _need("torch")
            versions = {}
            note = {"caching": "PyTorch's caching allocator (PYTORCH_CUDA_ALLOC_CONF unset)",
                    "async": "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync"}[kind]
        versions["torch"] = _version(torch)
        dev = torch.device("cuda", 0)
        torch.empty(1, dtype=torch.uint8, device=dev)  # initialise CUDA outside the timed runs
        return ("torch.empty(n, dtype=u8, device=dev)", {"torch": torch, "u8": torch.uint8, "dev": dev},
                versions, note)

    return setup


def _setup_cupy(kind: str):
    def setup():
        if kind.startswith("mempool-"):
            # mempool-<resource> (the Python hook) or mempool-c-<resource> (the C allocator).
            mempool = _need("mempool")
            cupy_hook = _need("mempool.allocators.cupy")
            c = kind.startswith("mempool-c-")
            res, label = _mempool_resource(kind.rsplit("-", 1)[1])
            cupy = _need("cupy")
            mempool.mr.set_current_device_resource(res)
            if c:
                cupy.cuda.set_allocator(cupy_hook.mempool_cupy_c_allocator)
                note = f"mempool_cupy_c_allocator (CFunctionAllocator, no Python per allocation) over {label}"
            else:
                cupy.cuda.set_allocator(cupy_hook.mempool_cupy_allocator)
                note = f"mempool_cupy_allocator (a Python function per allocation) over {label}"
            versions = {"mempool": _version(mempool)}
        else:
            cupy = _need("cupy")
            versions = {}
            if kind == "pool":
                cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)
                note = "cupy.cuda.MemoryPool"
            elif kind == "async":
                cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
                note = "cupy.cuda.MemoryAsyncPool (the device's current pool, as CuPy leaves it)"
            else:
                raise ValueError(kind)
        versions["cupy"] = _version(cupy)
        cupy.cuda.alloc(1)  # initialise CUDA outside the timed runs
        return "alloc(n)", {"alloc": cupy.cuda.alloc}, versions, note

    return setup


def _setup_cupy_runtime():
    cupy = _need("cupy")
    rt = cupy.cuda.runtime
    # The device's default pool, made to keep its memory (as mempool-bench's cuMemAllocFromPoolAsync
    # baseline does): without it each run's synchronize would hand the memory back to the system.
    pool = rt.deviceGetDefaultMemPool(0)
    rt.memPoolSetAttribute(pool, getattr(rt, "cudaMemPoolAttrReleaseThreshold", 4), MASK64)

    class Raw:
        __slots__ = ("ptr",)

        def __init__(self, n):
            self.ptr = malloc_async(n, 0)

        def __del__(self):
            free_async(self.ptr, 0)

    malloc_async, free_async = rt.mallocAsync, rt.freeAsync
    Raw(1)
    return ("Raw(n)", {"Raw": Raw}, {"cupy": _version(cupy)},
            "cupy.cuda.runtime.mallocAsync/freeAsync on the legacy stream, default pool keeping its memory: "
            "a floor for a Python object over the driver's pool")


def _setup_buffer(kind: str):
    def setup():
        mempool = _need("mempool")
        res, label = _mempool_resource(kind)
        if res is not None:
            mempool.mr.set_current_device_resource(res)
        mempool.DeviceBuffer(size=1)
        return ("DeviceBuffer(size=n)", {"DeviceBuffer": mempool.DeviceBuffer},
                {"mempool": _version(mempool)}, f"over {label}")

    return setup


def _setup_torch_rmm():
    rmm = _need("rmm")
    rmm_torch = _need("rmm.allocators.torch")
    torch = _need("torch")
    rmm.mr.set_current_device_resource(rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource()))
    torch.cuda.memory.change_current_allocator(rmm_torch.rmm_torch_allocator)
    dev = torch.device("cuda", 0)
    torch.empty(1, dtype=torch.uint8, device=dev)
    return ("torch.empty(n, dtype=u8, device=dev)", {"torch": torch, "u8": torch.uint8, "dev": dev},
            {"torch": _version(torch), "rmm": _version(rmm)},
            "rmm_torch_allocator over rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource())")


def _setup_rmm(kind: str):
    """``rmm.DeviceBuffer`` over RMM's CudaAsyncMemoryResource (``async``), RMM's PoolMemoryResource over
    CudaMemoryResource (``pool``, RMM's usual pool) or, through the RMM bridge (docs/rmm.md), mempool's default
    stack (``mempool-stack``)."""

    def setup():
        rmm = _need("rmm")
        versions = {"rmm": _version(rmm)}
        if kind == "async":
            mr, label = rmm.mr.CudaAsyncMemoryResource(), "rmm.mr.CudaAsyncMemoryResource()"
        elif kind == "pool":
            mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource())
            label = "rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource())"
        else:
            mempool_rmm = _need("mempool.rmm")
            mr = mempool_rmm.MempoolResource()
            label = "mempool.rmm.MempoolResource() (mempool's default stack, through the RMM bridge)"
            versions["mempool"] = _version(_need("mempool"))
        rmm.mr.set_current_device_resource(mr)
        rmm.DeviceBuffer(size=1)
        return ("DeviceBuffer(size=n)", {"DeviceBuffer": rmm.DeviceBuffer}, versions, label)

    return setup


class Config:
    """A configuration: its name, what it allocates with, the modules it needs (checked before the driver
    is touched, so a missing one is reported as skipped), its setup function, whether it needs a GPU
    and the environment its process gets."""

    def __init__(self, name, what, requires, setup, gpu=True, env=None):
        self.name, self.what, self.requires, self.setup = name, what, requires, setup
        self.gpu, self.env = gpu, env or {}


#: Every configuration, in table order.
CONFIGS = (
    Config("python-floor", "a small Python object per allocation, no memory", (), _setup_python_floor,
           gpu=False),
    Config("torch-caching", "`torch.empty`, PyTorch's caching allocator", ("torch",), _setup_torch("caching")),
    Config("torch-async", "`torch.empty`, PyTorch's cudaMallocAsync backend", ("torch",), _setup_torch("async"),
           env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
    Config("torch-mempool-pool", "`torch.empty` through mempool's PoolMemoryResource",
           ("torch", "mempool", "mempool.allocators.torch"), _setup_torch("pool")),
    Config("torch-mempool-binning", "`torch.empty` through mempool's BinningMemoryResource",
           ("torch", "mempool", "mempool.allocators.torch"), _setup_torch("binning")),
    Config("torch-mempool-stack", "`torch.empty` through mempool's default stack",
           ("torch", "mempool", "mempool.allocators.torch"), _setup_torch("stack")),
    Config("torch-mempool-mempool-pool", "`torch.empty` in a `torch.cuda.MemPool` over mempool's PoolMemoryResource",
           ("torch", "mempool", "mempool.allocators.torch"), _setup_torch("mempool-pool")),
    Config("torch-mempool-mempool-async", "`torch.empty` in a `torch.cuda.MemPool` over mempool's "
           "CudaAsyncMemoryResource", ("torch", "mempool", "mempool.allocators.torch"), _setup_torch("mempool-async")),
    Config("torch-native-mempool", "`torch.empty` in a `torch.cuda.MemPool()` of PyTorch's own (no mempool)",
           ("torch",), _setup_torch("native-mempool")),
    Config("torch-rmm-pool", "`torch.empty` through RMM's PoolMemoryResource (baseline)",
           ("torch", "rmm", "rmm.allocators.torch"), _setup_torch_rmm),
    Config("cupy-pool", "`cupy.cuda.alloc`, CuPy's MemoryPool", ("cupy",), _setup_cupy("pool")),
    Config("cupy-async", "`cupy.cuda.alloc`, CuPy's MemoryAsyncPool", ("cupy",), _setup_cupy("async")),
    Config("cupy-mempool-c-pool", "`cupy.cuda.alloc` through mempool's C allocator, PoolMemoryResource",
           ("cupy", "mempool", "mempool.allocators.cupy"), _setup_cupy("mempool-c-pool")),
    Config("cupy-mempool-c-stack", "`cupy.cuda.alloc` through mempool's C allocator, the default stack",
           ("cupy", "mempool", "mempool.allocators.cupy"), _setup_cupy("mempool-c-stack")),
    Config("cupy-mempool-pool", "`cupy.cuda.alloc` through mempool's Python hook, PoolMemoryResource",
           ("cupy", "mempool", "mempool.allocators.cupy"), _setup_cupy("mempool-pool")),
    Config("cupy-mempool-binning", "`cupy.cuda.alloc` through mempool's Python hook, BinningMemoryResource",
           ("cupy", "mempool", "mempool.allocators.cupy"), _setup_cupy("mempool-binning")),
    Config("cupy-runtime-async", "`cupy.cuda.runtime.mallocAsync` / `freeAsync` (baseline)", ("cupy",),
           _setup_cupy_runtime),
    Config("mempool-default", "`mempool.DeviceBuffer`, the default resource", ("mempool",),
           _setup_buffer("default")),
    Config("mempool-async", "`mempool.DeviceBuffer`, CudaAsyncMemoryResource", ("mempool",),
           _setup_buffer("async")),
    Config("mempool-pool", "`mempool.DeviceBuffer`, PoolMemoryResource", ("mempool",), _setup_buffer("pool")),
    Config("mempool-binning", "`mempool.DeviceBuffer`, BinningMemoryResource", ("mempool",),
           _setup_buffer("binning")),
    Config("mempool-stack", "`mempool.DeviceBuffer`, the default stack (`mempool.mr.default_stack()`)", ("mempool",),
           _setup_buffer("stack")),
    Config("rmm-async", "`rmm.DeviceBuffer`, RMM's CudaAsyncMemoryResource", ("rmm",), _setup_rmm("async")),
    Config("rmm-pool", "`rmm.DeviceBuffer`, RMM's PoolMemoryResource over CudaMemoryResource", ("rmm",),
           _setup_rmm("pool")),
    Config("rmm-mempool-stack", "`rmm.DeviceBuffer`, mempool's default stack through the RMM bridge",
           ("rmm", "mempool", "mempool_rmm_bridge"), _setup_rmm("mempool-stack")),
)
CONFIG_NAMES = tuple(c.name for c in CONFIGS)


# --------------------------------------------------------------------------------------------------
# The child: one configuration at one point.
# --------------------------------------------------------------------------------------------------

RESULT_MARK = "MEMPOOL-BENCH-RESULT "

_LOOP = """
def run(ops, sync, clock):
    live = []
    append = live.append
    pop = live.pop
    t0 = clock()
    for op in ops:
        if op > 0:
            n = op
            append({alloc})
        else:
            i = ~op
            if i == len(live) - 1:
                pop()
            else:
                live[i] = pop()
    live.reverse()  # list.clear drops from the end: reversed first, it frees in list order, as Rust drains
    live.clear()
    sync()
    return clock() - t0
"""


def make_runner(alloc: str, namespace: dict):
    """The timed loop with the allocation expression ``alloc`` (the size in ``n``) compiled in, its names
    looked up in ``namespace``: ``run(ops, sync, clock)`` performs every operation of ``ops`` (an
    allocation appends the new object to the live list; a free drops the list's reference to the object
    at its index, swap-remove, so nothing else keeps it alive), drops every object left in list order,
    calls ``sync()``, and returns the elapsed ``clock()`` units."""
    namespace = dict(namespace)
    exec(compile(_LOOP.format(alloc=alloc), f"<random workload: {alloc}>", "exec"), namespace)
    return namespace["run"]


class _Driver:
    """The CUDA driver through ctypes: the primary context of device 0 made current, its synchronize,
    the device's name and the driver's version. Loaded before any framework, so every configuration
    synchronises through the same call."""

    def __init__(self) -> None:
        import ctypes

        try:
            cu = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"no NVIDIA driver: libcuda.so.1 cannot be loaded ({e})") from e

        def check(what, r):
            if r != 0:
                name = ctypes.c_char_p()
                cu.cuGetErrorName(r, ctypes.byref(name))
                raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else r}")

        check("cuInit", cu.cuInit(0))
        dev = ctypes.c_int()
        check("cuDeviceGet(0)", cu.cuDeviceGet(ctypes.byref(dev), 0))
        ctx = ctypes.c_void_p()
        check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
        buf = ctypes.create_string_buffer(256)
        check("cuDeviceGetName", cu.cuDeviceGetName(buf, 256, dev))
        ver = ctypes.c_int()
        check("cuDriverGetVersion", cu.cuDriverGetVersion(ctypes.byref(ver)))
        self.device = buf.value.decode()
        self.driver = f"CUDA {ver.value // 1000}.{ver.value % 1000 // 10}"
        raw_sync = cu.cuCtxSynchronize
        self._ctx = ctx  # retained for the life of the process

        def sync():
            r = raw_sync()
            if r != 0:
                check("cuCtxSynchronize", r)

        self.sync = sync


def _child(config: Config, point: Point, repeats: int, seed: int) -> dict:
    out = {"config": config.name, "point": point.name}
    ops = random_workload(point.n, point.max_size, point.max_usage, seed)
    try:
        for module in config.requires:
            _need(module)
        if config.gpu:
            driver = _Driver()
            out["device"], out["driver"] = driver.device, driver.driver
            sync = driver.sync
        else:
            def sync():
                pass
        alloc, namespace, versions, note = config.setup()
    except Skipped as e:
        out.update(status="skipped", reason=str(e))
        return out
    out.update(versions=versions, note=note)
    run = make_runner(alloc, namespace)
    if "(CudaMemoryResource)" in note:
        repeats = 1  # cuMemAlloc per operation: one timed run, as mempool-bench does for `cuda`
    clock = time.perf_counter_ns
    gc.collect()
    gc.disable()
    try:
        run(ops, sync, clock)  # warm-up
        runs = [run(ops, sync, clock) / len(ops) for _ in range(repeats)]
    finally:
        gc.enable()
    out.update(status="ok", ops=len(ops), alloc=alloc, runs_ns_per_op=runs,
               ns_per_op=statistics.median(runs))
    return out


def _child_main(args) -> int:
    config = _config(args.child)
    point = next(p for p in STANDARD_POINTS if p.name == args.child_point)
    seed = args.seed + [p.name for p in STANDARD_POINTS].index(point.name)
    try:
        result = _child(config, point, args.repeats, seed)
    except BaseException as e:  # reported to the parent, which goes on with the other configurations
        result = {"config": config.name, "point": point.name, "status": "failed",
                  "error": f"{type(e).__name__}: {e}"}
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# The parent: runs the children, prints the table.
# --------------------------------------------------------------------------------------------------


def _config(name: str) -> Config:
    for c in CONFIGS:
        if c.name == name:
            return c
    raise SystemExit(f"random_workload: unknown configuration {name!r}; known: {', '.join(CONFIG_NAMES)}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run_child(config: Config, point: Point, args) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # each configuration says its own
    env.update(config.env)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config.name, "--child-point", point.name,
           "--repeats", str(args.repeats), "--seed", str(args.seed)]
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"config": config.name, "point": point.name, "status": "failed",
                "error": f"timed out after {args.timeout} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
    return {"config": config.name, "point": point.name, "status": "failed",
            "error": f"the process exited with status {p.returncode} without a result: " + " | ".join(tail)}


def _fmt_ns(v: float) -> str:
    return f"{v:,.0f}"


def render(meta: dict, points: list, results: list) -> str:
    """The Markdown report: environment, method, one row per configuration, one column per point."""
    by = {(r["config"], r["point"]): r for r in results}
    lines = [
        "### Random workload from Python: ns per operation (lower is better)",
        "",
        f"- device: {meta['device']}; driver: {meta['driver']}; host CPU: {meta['cpu']}; {meta['date']}",
        f"- command: `{meta['command']}`",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "- points: " + "; ".join(
            f"{p.name} = ({p.label()}, seed {meta['seed'] + i}; {meta['shape'][p.name]})"
            for i, p in enumerate(STANDARD_POINTS) if p in points),
        f"- method: one process per configuration and point; one warm-up run, then the median of "
        f"{meta['repeats']} timed runs; a run is every operation, the final frees and one "
        "`cuCtxSynchronize`, over the operation count (the method of `mempool-bench random`)",
        "",
        "| configuration | allocation | " + " | ".join(f"{p.name} ns/op" for p in points) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in points) + " |",
    ]
    notes = []
    for c in meta["configs"]:
        cells = []
        for p in points:
            r = by.get((c, p.name))
            if r is None:
                cells.append("")
            elif r["status"] == "ok":
                cells.append(_fmt_ns(r["ns_per_op"]))
            elif r["status"] == "skipped":
                cells.append("skipped")
                notes.append(f"`{c}` skipped: {r['reason']}")
            else:
                cells.append("failed")
                notes.append(f"`{c}` at {p.name} failed: {r['error']}")
        what = _config(c).what
        detail = next((by[(c, p.name)].get("note") for p in points
                       if (c, p.name) in by and by[(c, p.name)].get("note")), None)
        if detail:
            what += f" ({detail})"
        lines.append(f"| `{c}` | {what} | " + " | ".join(cells) + " |")
    if notes:
        lines += [""] + [f"- {n}" for n in dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"


def _parse(argv):
    ap = argparse.ArgumentParser(
        prog="python -m mempool.benchmarks.random_workload",
        description="The standard random workload (the sequence of `mempool-bench random`) driven from Python "
                    "through PyTorch, CuPy, RMM and mempool: ns per allocate/free, one process per "
                    "configuration and point, printed as a Markdown table. A configuration whose framework "
                    "is not installed is reported as skipped.",
        epilog="configurations: " + ", ".join(CONFIG_NAMES))
    ap.add_argument("--points", default="small,mid,large",
                    help="comma-separated points among small (200k ops, <= 64 KiB, 4 GiB), mid (100k, "
                         "<= 1 MiB, 16 GiB), large (20k, <= 64 MiB, 16 GiB); default: all three")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per configuration and point, after "
                                                           "one warm-up run; the median is reported (default 5)")
    ap.add_argument("--only", action="append", metavar="NAME",
                    help="run only these configurations (comma-separated or repeated); see --list")
    ap.add_argument("--json", metavar="FILE", help="also write every result, with its timed runs, to FILE")
    ap.add_argument("--seed", type=int, default=SEED, help="seed of the first point; point i uses seed + i "
                                                           "(default 42, as mempool-bench random)")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="seconds one configuration may take at one point before it is reported as failed "
                         "(default 900)")
    ap.add_argument("--list", action="store_true", help="list the configurations and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-point", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, not {args.repeats}")
    if args.seed < 0 or args.seed >= 1 << 64:
        ap.error(f"--seed must be in [0, 2**64), not {args.seed}")
    if args.timeout <= 0:
        ap.error(f"--timeout must be positive, not {args.timeout}")
    names = [p.name for p in STANDARD_POINTS]
    args.point_list = []
    for name in filter(None, (s.strip() for s in args.points.split(","))):
        if name not in names:
            ap.error(f"--points: unknown point {name!r}; known: {', '.join(names)}")
        args.point_list.append(next(p for p in STANDARD_POINTS if p.name == name))
    if not args.point_list:
        ap.error("--points names no point")
    if args.child_point is not None and args.child_point not in names:
        ap.error(f"--child-point: unknown point {args.child_point!r}")
    args.config_list = list(CONFIG_NAMES)
    if args.only:
        wanted = [s.strip() for o in args.only for s in o.split(",") if s.strip()]
        unknown = [w for w in wanted if w not in CONFIG_NAMES]
        if unknown:
            ap.error(f"--only: unknown configuration {', '.join(unknown)}; known: {', '.join(CONFIG_NAMES)}")
        args.config_list = [c for c in CONFIG_NAMES if c in wanted]
    return args


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.child:
        return _child_main(args)
    if args.list:
        width = max(len(c.name) for c in CONFIGS)
        for c in CONFIGS:
            print(f"{c.name:{width}} {c.what}")
        return 0
    shape = {}
    for i, p in enumerate(STANDARD_POINTS):
        if p in args.point_list:
            ops = random_workload(p.n, p.max_size, p.max_usage, args.seed + i)
            peak_n, peak_bytes = peak_live(ops)
            shape[p.name] = f"{len(ops)} ops, at most {peak_n} allocations and {peak_bytes:,} bytes live"
    results = []
    for c in args.config_list:
        for p in args.point_list:
            print(f"random_workload: {c} at {p.name} ...", file=sys.stderr, flush=True)
            r = _run_child(_config(c), p, args)
            results.append(r)
            if r["status"] != "ok":
                print(f"random_workload: {c} at {p.name}: {r['status']}: {r.get('reason') or r.get('error')}",
                      file=sys.stderr, flush=True)
    versions = {"python": platform.python_version()}
    for r in results:
        versions.update(r.get("versions", {}))
    device = next((r["device"] for r in results if r.get("device")), "none (no configuration reached a GPU)")
    driver = next((r["driver"] for r in results if r.get("driver")), "unknown")
    meta = {
        "device": device, "driver": driver, "cpu": _cpu_model(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(shlex.quote(a) for a in
                            ["python", "-m", "mempool.benchmarks.random_workload"] +
                            (sys.argv[1:] if argv is None else list(argv))),
        "versions": versions, "seed": args.seed, "shape": shape, "repeats": args.repeats, "configs": args.config_list,
    }
    table = render(meta, args.point_list, results)
    sys.stdout.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "points": [vars(p) for p in args.point_list], "results": results,
                       "table": table}, f, indent=1)
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
