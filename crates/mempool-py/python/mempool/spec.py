"""A memory resource described: ``ResourceSpec`` (a kind and its options), the size parser, and ``build``,
which makes the resource on a device. ``mempool.dask`` builds each worker's resource from one, and
``mempool.rmm.MempoolResource(kind=..., **options)`` takes the same kinds and options.

Everything but ``build`` and ``device_total_memory`` is pure Python: a spec is parsed and checked before
anything touches the GPU, and every refusal is a ``ValueError`` (``TypeError`` for a value of the wrong
type) whose message names the field and the value. ``ResourceSpec.resolve(total)`` then turns sizes given
as fractions of the device's memory into bytes and refuses a size larger than the device.

Kinds (the resources of ``mempool.mr``):

=========== ==================================================================================================
``async``   ``CudaAsyncMemoryResource``: the driver's stream-ordered pool (``initial_pool_size``,
            ``release_threshold``, ``enable_ipc``)
``cuda``    ``CudaMemoryResource`` (``cuMemAlloc``), no pool
``managed`` ``ManagedMemoryResource``
``pool``    ``PoolMemoryResource`` over ``upstream`` (``initial_pool_size``, ``maximum_pool_size``)
``binning`` ``BinningMemoryResource`` (``bins``: the power-of-two exponents) over a pool over ``upstream``
``arena``   ``ArenaMemoryResource`` over ``upstream`` (``arena_size``)
``default`` the default stack, ``mempool.mr.default_stack``: bins up to 1 MiB over a pool over ``upstream``
``service`` ``ServiceMemoryResource`` (``chunk_size``, ``max_tags``), one tag ``tag`` (default ``default``)
            allocated from
=========== ==================================================================================================

``upstream`` is ``async`` (the default: a driver pool, with ``release_threshold`` and ``enable_ipc``),
``cuda`` or ``managed``. On top of any kind: ``limit`` (a ``LimitingResourceAdaptor``) and ``statistics``
(a ``StatisticsResourceAdaptor``, on by default: it is how ``worker_statistics`` reads a worker).

Sizes are an ``int`` (bytes), a string with a unit (``"4GiB"``, ``"512MB"``, ``"1.5 GB"``: ``kB``/``MB``/
``GB``/``TB`` are powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024, as ``dask.utils.parse_bytes``
reads them), or a fraction of the device's total memory, as dask-cuda's ``rmm_pool_size`` accepts: a
``float`` in ``(0, 1]``, or a string such as ``"0.8"`` or ``"80%"``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import re
from typing import Any, Mapping, Optional, Union

__all__ = [
    "KINDS",
    "SIZE_FIELDS",
    "UPSTREAMS",
    "ResourceSpec",
    "build",
    "device_total_memory",
    "format_size",
    "parse_size",
]

#: The kinds of resource a spec can ask for.
KINDS = ("async", "cuda", "managed", "pool", "binning", "arena", "default", "service")
#: What ``upstream`` may name.
UPSTREAMS = ("async", "cuda", "managed")
#: The fields that hold sizes.
SIZE_FIELDS = ("initial_pool_size", "maximum_pool_size", "release_threshold", "arena_size", "chunk_size", "limit")

#: Which kind each option applies to (``limit``, ``statistics`` and ``device`` apply to every kind).
_APPLIES = {
    "initial_pool_size": ("async", "pool", "binning", "default"),
    "maximum_pool_size": ("pool", "binning", "default"),
    "release_threshold": ("async", "pool", "binning", "arena", "default"),
    "enable_ipc": ("async", "pool", "binning", "arena", "default"),
    "upstream": ("pool", "binning", "arena", "default"),
    "arena_size": ("arena",),
    "bins": ("binning",),
    "chunk_size": ("service",),
    "max_tags": ("service",),
    "tag": ("service",),
}

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>[A-Za-z%]*)\s*$")

Size = Union[int, float, str]


def parse_size(value: Any, field: str = "size") -> Union[int, float, None]:
    """``value`` as bytes (an ``int``) or a fraction of the device's memory (a ``float`` in ``(0, 1]``);
    ``None`` stays ``None``. ``field`` names the option in errors.

    >>> parse_size("4GiB"), parse_size("512MB"), parse_size(1024), parse_size("80%"), parse_size(0.5)
    (4294967296, 512000000, 1024, 0.8, 0.5)
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{field}: a size must be bytes, a string such as '4GiB' or a fraction, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field}: a size cannot be negative, got {value}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value <= 0 or value > 1:
            raise ValueError(
                f"{field}: a float is a fraction of the device's memory and must be in (0, 1], got {value!r} "
                "(give bytes as an int, or a string with a unit such as '4GiB')"
            )
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"{field}: a size must be an int, a fraction or a string such as '4GiB', got {type(value).__name__}"
        )
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"{field}: {value!r} is not a size (examples: 4294967296, '4GiB', '512MB', '0.8', '80%')")
    num, unit = m["num"], m["unit"].lower()
    if unit == "%":
        frac = float(num) / 100
        return parse_size(frac, field) if frac > 0 else _zero_fraction(field, value)
    if unit == "" and ("." in num or "e" in num.lower()):
        # "0.8": a fraction, as dask-cuda reads it; "1e9" and "2.0" are not fractions in (0, 1].
        frac = float(num)
        if 0 < frac <= 1:
            return frac
        if frac == int(frac) and frac > 1:
            return int(frac)
        raise ValueError(f"{field}: {value!r} is neither a fraction in (0, 1] nor a whole number of bytes")
    if unit not in _UNITS:
        raise ValueError(
            f"{field}: unknown unit {m['unit']!r} in {value!r} (kB, MB, GB, TB are powers of 1000; KiB, MiB, "
            "GiB, TiB powers of 1024)"
        )
    n = float(num) * _UNITS[unit]
    if n != int(n):
        raise ValueError(f"{field}: {value!r} is not a whole number of bytes")
    return int(n)


def _zero_fraction(field: str, value: str):
    raise ValueError(f"{field}: a fraction of the device's memory must be more than 0, got {value!r}")


def format_size(n: int) -> str:
    """``n`` bytes for a message: ``'4.00 GiB (4294967296 bytes)'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def _as_bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{field}: expected true or false, got {value!r}")


def _as_int(value: Any, field: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{field}: expected an integer, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{field}: expected an integer, got {value!r}") from None
    if not low <= n <= high:
        raise ValueError(f"{field}: must be in [{low}, {high}], got {n}")
    return n


@dataclasses.dataclass(frozen=True)
class ResourceSpec:
    """A worker's resource: a kind and its options (see the module's documentation).

    Made from keywords (``ResourceSpec(kind="pool", initial_pool_size="4GiB")``), from a mapping
    (``ResourceSpec.from_dict``) or from text (``ResourceSpec.parse("pool:initial_pool_size=4GiB,limit=0.9")``).
    Construction checks everything that can be checked without a GPU: the kind, which options apply to it,
    sizes, bins, and the order of sizes given in bytes.
    """

    kind: str = "default"
    initial_pool_size: Optional[Size] = None
    maximum_pool_size: Optional[Size] = None
    release_threshold: Optional[Size] = None
    upstream: Optional[str] = None
    arena_size: Optional[Size] = None
    bins: Optional[tuple] = None
    chunk_size: Optional[Size] = None
    max_tags: Optional[int] = None
    tag: Optional[str] = None
    enable_ipc: bool = False
    limit: Optional[Size] = None
    statistics: bool = True
    device: Optional[int] = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.kind, str):
            raise TypeError(f"kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        kind = self.kind.strip().lower().replace("-", "_")
        kind = {"driver_pool": "async", "cuda_async": "async", "stack": "default", "default_stack": "default"}.get(
            kind, kind
        )
        if kind not in KINDS:
            raise ValueError(f"kind: unknown resource kind {self.kind!r}; the kinds are {', '.join(KINDS)}")
        set_(self, "kind", kind)
        for f in SIZE_FIELDS:
            set_(self, f, parse_size(getattr(self, f), f))
        for f in ("enable_ipc", "statistics"):
            set_(self, f, _as_bool(getattr(self, f), f))
        if self.upstream is not None:
            if not isinstance(self.upstream, str) or self.upstream.lower() not in UPSTREAMS:
                raise ValueError(f"upstream: expected one of {', '.join(UPSTREAMS)}, got {self.upstream!r}")
            set_(self, "upstream", self.upstream.lower())
        if self.bins is not None:
            bins = self.bins
            if isinstance(bins, str):
                bins = tuple(p.strip() for p in re.split(r"[-:/ ]+|\.\.", bins.strip()) if p.strip())
            if not isinstance(bins, (tuple, list)) or len(bins) != 2:
                raise ValueError(f"bins: expected two power-of-two exponents (min, max) such as (8, 20), got {self.bins!r}")
            lo, hi = (_as_int(b, "bins", 1, 40) for b in bins)
            if lo > hi:
                raise ValueError(f"bins: the smallest exponent {lo} is larger than the largest {hi}")
            set_(self, "bins", (lo, hi))
        if self.max_tags is not None:
            set_(self, "max_tags", _as_int(self.max_tags, "max_tags", 1, 1024))
        if self.tag is not None and (not isinstance(self.tag, str) or not self.tag):
            raise ValueError(f"tag: expected a non-empty name, got {self.tag!r}")
        if self.device is not None:
            set_(self, "device", _as_int(self.device, "device", 0, 1 << 16))
        for option, kinds in _APPLIES.items():
            value = getattr(self, option)
            if value not in (None, False) and self.kind not in kinds:
                raise ValueError(
                    f"{option}={value!r} does not apply to kind {self.kind!r} (it applies to {', '.join(kinds)})"
                )
        if self.upstream is not None and self.upstream != "async":
            for option in ("release_threshold", "enable_ipc"):
                if getattr(self, option) not in (None, False) and self.kind != "async":
                    raise ValueError(f"{option} needs upstream 'async' (a driver pool), not {self.upstream!r}")
        if self.kind == "arena" and isinstance(self.arena_size, int) and self.arena_size == 0:
            raise ValueError("arena_size: must be more than 0 bytes")
        for f in ("limit", "chunk_size", "maximum_pool_size"):
            if getattr(self, f) == 0:
                raise ValueError(f"{f}: must be more than 0 bytes")
        ini, mx = self.initial_pool_size, self.maximum_pool_size
        if isinstance(ini, int) and isinstance(mx, int) and ini > mx:
            raise ValueError(
                f"initial_pool_size {format_size(ini)} is larger than maximum_pool_size {format_size(mx)}"
            )

    # ---------------------------------------------------------------------------------------------
    # Construction from a mapping or text.
    # ---------------------------------------------------------------------------------------------

    @classmethod
    def fields(cls) -> tuple:
        """The option names a spec takes."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ResourceSpec":
        """A spec from a mapping with ``kind`` and options (dashes in names are read as underscores);
        an unknown name is a ``ValueError`` naming it."""
        if isinstance(d, ResourceSpec):
            return d
        if not isinstance(d, Mapping):
            raise TypeError(f"a resource spec must be a mapping, a string or a ResourceSpec, got {type(d).__name__}")
        known = set(cls.fields())
        kwargs = {}
        for k, v in d.items():
            if not isinstance(k, str):
                raise TypeError(f"a resource spec's option names are strings, got {k!r}")
            name = k.strip().replace("-", "_")
            if name not in known:
                raise ValueError(f"unknown resource option {k!r}; the options are {', '.join(sorted(known))}")
            if name in kwargs:
                raise ValueError(f"option {name!r} is given twice")
            kwargs[name] = v
        return cls(**kwargs)

    @classmethod
    def parse(cls, text: str) -> "ResourceSpec":
        """A spec from text: ``KIND`` or ``KIND:NAME=VALUE,NAME=VALUE``, such as
        ``"pool:initial_pool_size=4GiB,maximum_pool_size=0.9,limit=30GB"``; ``bins`` as ``8-20``."""
        if not isinstance(text, str):
            raise TypeError(f"a resource spec string is a str, got {type(text).__name__}")
        kind, _, rest = text.strip().partition(":")
        if not kind.strip():
            raise ValueError(f"resource spec {text!r}: no kind before ':' (the kinds are {', '.join(KINDS)})")
        d: dict = {"kind": kind.strip()}
        if rest.strip():
            for item in rest.split(","):
                name, eq, value = item.partition("=")
                if not eq or not name.strip():
                    raise ValueError(f"resource spec {text!r}: {item.strip()!r} is not NAME=VALUE")
                key = name.strip()
                if key.replace("-", "_") == "kind":
                    raise ValueError(f"resource spec {text!r}: the kind goes before ':', not as an option")
                if key in d or key.replace("-", "_") in d:
                    raise ValueError(f"resource spec {text!r}: option {key!r} is given twice")
                d[key.replace("-", "_")] = value.strip()
        return cls.from_dict(d)

    @classmethod
    def coerce(cls, spec: Union["ResourceSpec", Mapping[str, Any], str, None] = None, **options: Any) -> "ResourceSpec":
        """A spec from any of: a ``ResourceSpec``, a mapping, text, or keyword options (not both)."""
        if spec is not None and options:
            raise ValueError(
                f"give a resource spec or keyword options, not both (spec={spec!r}, options {sorted(options)})"
            )
        if spec is None:
            return cls.from_dict(options)
        if isinstance(spec, str):
            return cls.parse(spec)
        return cls.from_dict(spec)

    def to_dict(self) -> dict:
        """The options that are set (those that differ from the defaults), with ``kind``."""
        out = {"kind": self.kind}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "kind" and v != f.default:
                out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    # ---------------------------------------------------------------------------------------------
    # Sizes against a device.
    # ---------------------------------------------------------------------------------------------

    def resolve(self, total_memory: int) -> dict:
        """The sizes in bytes for a device of ``total_memory`` bytes: fractions become bytes (rounded down
        to 256 bytes, as pools align); a size larger than the device is a ``ValueError`` naming the field,
        its value and the device's size. Returns ``{field: bytes or None}`` for every size field."""
        if isinstance(total_memory, bool) or not isinstance(total_memory, int) or total_memory <= 0:
            raise ValueError(f"total_memory must be a positive number of bytes, got {total_memory!r}")
        out = {}
        for f in SIZE_FIELDS:
            v = getattr(self, f)
            if isinstance(v, float):
                v = int(v * total_memory) // 256 * 256
                if v == 0:
                    raise ValueError(f"{f}: {getattr(self, f)!r} of {format_size(total_memory)} is less than 256 bytes")
            if v is not None and v > total_memory:
                raise ValueError(
                    f"{f} {format_size(v)} is larger than the device's memory, {format_size(total_memory)}"
                )
            out[f] = v
        ini, mx = out["initial_pool_size"], out["maximum_pool_size"]
        if ini is not None and mx is not None and ini > mx:
            raise ValueError(f"initial_pool_size {format_size(ini)} is larger than maximum_pool_size {format_size(mx)}")
        return out


# -------------------------------------------------------------------------------------------------
# On the GPU.
# -------------------------------------------------------------------------------------------------


def device_total_memory(device: int) -> int:
    """The total memory of ``device`` (an ordinal among the visible devices) in bytes, from the driver
    (``cuDeviceTotalMem``, through ctypes). Raises ``mempool.DriverNotFoundError`` without a driver and
    ``mempool.NoDeviceError`` for a device that does not exist."""
    from ._errors import DriverError, DriverNotFoundError, NoDeviceError

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise DriverNotFoundError(f"no CUDA driver: libcuda.so.1 cannot be loaded ({e})") from None
    rc = cuda.cuInit(0)
    if rc != 0:
        raise DriverError(f"cuInit failed with CUDA error {rc}")
    count = ctypes.c_int()
    rc = cuda.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        raise DriverError(f"cuDeviceGetCount failed with CUDA error {rc}")
    if not 0 <= device < count.value:
        raise NoDeviceError(f"device {device} does not exist: {count.value} device(s) visible")
    dev = ctypes.c_int()
    rc = cuda.cuDeviceGet(ctypes.byref(dev), device)
    if rc != 0:
        raise DriverError(f"cuDeviceGet({device}) failed with CUDA error {rc}")
    total = ctypes.c_size_t()
    rc = cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev)
    if rc != 0:
        raise DriverError(f"cuDeviceTotalMem({device}) failed with CUDA error {rc}")
    return int(total.value)


def build(spec: ResourceSpec, device: int, total_memory: Optional[int] = None):
    """Makes ``spec``'s resource on ``device`` (not made current) and returns it. ``total_memory``
    (default: the device's, from the driver) resolves fractions and bounds every size."""
    from . import mr

    if total_memory is None:
        total_memory = device_total_memory(device)
    sizes = spec.resolve(total_memory)
    kind = spec.kind

    def upstream():
        up = spec.upstream or "async"
        if up == "cuda":
            return mr.CudaMemoryResource(device=device)
        if up == "managed":
            return mr.ManagedMemoryResource(device=device)
        return mr.CudaAsyncMemoryResource(
            release_threshold=sizes["release_threshold"], enable_ipc=spec.enable_ipc, device=device
        )

    if kind == "async":
        res = mr.CudaAsyncMemoryResource(
            initial_pool_size=sizes["initial_pool_size"],
            release_threshold=sizes["release_threshold"],
            enable_ipc=spec.enable_ipc,
            device=device,
        )
    elif kind == "cuda":
        res = mr.CudaMemoryResource(device=device)
    elif kind == "managed":
        res = mr.ManagedMemoryResource(device=device)
    elif kind == "pool":
        res = mr.PoolMemoryResource(upstream(), sizes["initial_pool_size"], sizes["maximum_pool_size"])
    elif kind == "binning":
        pool = mr.PoolMemoryResource(upstream(), sizes["initial_pool_size"], sizes["maximum_pool_size"])
        lo, hi = spec.bins or mr.DEFAULT_STACK_BINS
        res = mr.BinningMemoryResource(pool, lo, hi)
    elif kind == "arena":
        res = mr.ArenaMemoryResource(upstream(), sizes["arena_size"])
    elif kind == "default":
        res = mr.default_stack(upstream(), sizes["initial_pool_size"], sizes["maximum_pool_size"], device=device)
    elif kind == "service":
        kw = {}
        if spec.max_tags is not None:
            kw["max_tags"] = spec.max_tags
        if sizes["chunk_size"] is not None:
            kw["chunk_size"] = sizes["chunk_size"]
        service = mr.ServiceMemoryResource(device, **kw)
        res = service.tagged(service.tag(spec.tag or "default"))
    else:  # __post_init__ refused it
        raise AssertionError(kind)
    if sizes["limit"] is not None:
        res = mr.LimitingResourceAdaptor(res, sizes["limit"])
    if spec.statistics:
        res = mr.StatisticsResourceAdaptor(res)
    return res
