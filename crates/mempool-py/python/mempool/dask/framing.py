"""The frame a CUDA array travels in between Dask workers of one host: a small binary header naming a
buffer shared through ``mempool.ipc`` (pure Python, no GPU, no Dask).

A handle does not carry the memory's driver handle itself: that (the pool's file descriptor once per
connection, then 64 bytes of ``cuMemPoolExportPointer`` data per buffer) travels over the sender's
``mempool.ipc`` socket, which only processes of the same host and user can connect to. The frame names the
buffer there: the sender's socket path, the buffer's id, the sender's pid and host, and what the receiver
needs to rebuild the array (framework, dtype, shape, strides).

Layout (little-endian), version 1::

    magic "MPDX" | version u16 | flags u16 | kind u8 | ndim u8 | dtype_len u8 | host_len u8
    nbytes u64 | buffer_id u64 | sender_pid u32 | device u32 | path_len u16 | reserved u16 (0)
    shape: ndim x u64 | strides: ndim x i64 (bytes) | dtype | host | path (UTF-8)

``decode`` checks every field before anything uses it and raises ``FrameError`` (a ``ValueError``) naming the
field: a short or long frame, another magic or version, an unknown kind or flag, a dtype outside the list, a
shape whose size disagrees with ``nbytes`` (or overflows), strides that are not C-contiguous, a relative or
over-long socket path. Nothing in a frame is followed before it passed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import struct
from typing import Optional

__all__ = [
    "DTYPES",
    "FLAG_REQUIRES_GRAD",
    "FrameError",
    "Handle",
    "KINDS",
    "MAGIC",
    "MAX_NBYTES",
    "MAX_NDIM",
    "VERSION",
    "c_strides",
    "decode",
    "encode",
    "host_id",
]

MAGIC = b"MPDX"
VERSION = 1
#: Framework of the array: the receiver rebuilds the same type.
KINDS = {1: "cupy", 2: "torch"}
_KIND_CODES = {v: k for k, v in KINDS.items()}
#: ``flags`` bits. Any other bit set is refused.
FLAG_REQUIRES_GRAD = 1
_KNOWN_FLAGS = FLAG_REQUIRES_GRAD
MAX_NDIM = 32
#: No single buffer is larger than this (256 TiB): more is a malformed frame, not a GPU.
MAX_NBYTES = 1 << 48
#: A Unix socket path has at most 107 bytes (``sun_path`` is 108, with its NUL).
MAX_PATH = 107

#: The dtypes a frame may name, with their item sizes: NumPy/CuPy type strings (little-endian or
#: byte-sized) and PyTorch's dtypes that NumPy lacks.
DTYPES = {
    "|b1": 1, "|i1": 1, "|u1": 1,
    "<i2": 2, "<i4": 4, "<i8": 8, "<u2": 2, "<u4": 4, "<u8": 8,
    "<f2": 2, "<f4": 4, "<f8": 8, "<c8": 8, "<c16": 16,
    "torch.bfloat16": 2, "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1,
}

_FIXED = struct.Struct("<4sHHBBBBQQIIHH")


class FrameError(ValueError):
    """A frame that is not a valid handle; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Handle:
    """One array shared through ``mempool.ipc``: what the frame carries."""

    kind: str
    dtype: str
    shape: tuple
    strides: tuple
    nbytes: int
    buffer_id: int
    sender_pid: int
    device: int
    host: str
    path: str
    flags: int = 0

    @property
    def requires_grad(self) -> bool:
        return bool(self.flags & FLAG_REQUIRES_GRAD)


def c_strides(shape: tuple, itemsize: int) -> tuple:
    """The strides (bytes) of a C-contiguous array of ``shape``."""
    strides = []
    step = itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def host_id() -> str:
    """This host's identity in frames: the host name and the kernel's boot id (two machines that share a
    name differ in boot id; processes of one kernel share it). At most 255 bytes."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"[:255]


def _check(handle: Handle) -> None:
    """Every rule ``decode`` enforces, for a ``Handle`` (``encode`` checks what it writes)."""
    if handle.kind not in _KIND_CODES:
        raise FrameError(f"kind: unknown array kind {handle.kind!r} (known: {', '.join(_KIND_CODES)})")
    if handle.dtype not in DTYPES:
        raise FrameError(f"dtype: {handle.dtype!r} is not one a frame may carry")
    if handle.kind == "cupy" and handle.dtype.startswith("torch."):
        raise FrameError(f"dtype: {handle.dtype!r} is PyTorch's, but the kind is cupy")
    if handle.flags & ~_KNOWN_FLAGS:
        raise FrameError(f"flags: unknown bits {handle.flags & ~_KNOWN_FLAGS:#x}")
    if handle.flags & FLAG_REQUIRES_GRAD and handle.kind != "torch":
        raise FrameError("flags: requires_grad is set on a cupy array")
    ndim = len(handle.shape)
    if ndim > MAX_NDIM:
        raise FrameError(f"shape: {ndim} dimensions, more than {MAX_NDIM}")
    if len(handle.strides) != ndim:
        raise FrameError(f"strides: {len(handle.strides)} strides for {ndim} dimensions")
    size = 1
    for n in handle.shape:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise FrameError(f"shape: {handle.shape!r} has an extent that is not a non-negative integer")
        size *= n
        if size * DTYPES[handle.dtype] > MAX_NBYTES:
            raise FrameError(f"shape: {handle.shape!r} of {handle.dtype} is more than {MAX_NBYTES} bytes")
    if not 0 < handle.nbytes <= MAX_NBYTES:
        raise FrameError(f"nbytes: {handle.nbytes} is not in (0, {MAX_NBYTES}]")
    if size * DTYPES[handle.dtype] != handle.nbytes:
        raise FrameError(
            f"nbytes: {handle.nbytes} bytes, but shape {handle.shape!r} of {handle.dtype} is "
            f"{size * DTYPES[handle.dtype]}"
        )
    if tuple(handle.strides) != c_strides(tuple(handle.shape), DTYPES[handle.dtype]):
        raise FrameError(f"strides: {handle.strides!r} are not C-contiguous for shape {handle.shape!r}")
    if not 0 < handle.buffer_id < 1 << 64:
        raise FrameError(f"buffer_id: {handle.buffer_id} is not a buffer id")
    if not 0 < handle.sender_pid < 1 << 32:
        raise FrameError(f"sender_pid: {handle.sender_pid} is not a pid")
    if not 0 <= handle.device < 1 << 16:
        raise FrameError(f"device: {handle.device} is not a device ordinal")
    host = handle.host.encode("utf-8") if isinstance(handle.host, str) else None
    if not host or len(host) > 255:
        raise FrameError(f"host: {handle.host!r} is empty or longer than 255 bytes")
    path = handle.path.encode("utf-8") if isinstance(handle.path, str) else None
    if not path or len(path) > MAX_PATH:
        raise FrameError(f"path: {handle.path!r} is empty or longer than {MAX_PATH} bytes")
    if not handle.path.startswith("/") or "\0" in handle.path or "/../" in handle.path + "/":
        raise FrameError(f"path: {handle.path!r} is not an absolute socket path")


def encode(handle: Handle) -> bytes:
    """The frame of ``handle`` (checked as ``decode`` checks it: a frame this writes always decodes)."""
    _check(handle)
    dtype = handle.dtype.encode("ascii")
    host = handle.host.encode("utf-8")
    path = handle.path.encode("utf-8")
    fixed = _FIXED.pack(
        MAGIC, VERSION, handle.flags, _KIND_CODES[handle.kind], len(handle.shape), len(dtype), len(host),
        handle.nbytes, handle.buffer_id, handle.sender_pid, handle.device, len(path), 0,
    )
    ndim = len(handle.shape)
    dims = struct.pack(f"<{ndim}Q{ndim}q", *handle.shape, *handle.strides)
    return fixed + dims + dtype + host + path


def decode(frame: bytes, *, max_len: int = 4096) -> Handle:
    """The ``Handle`` in ``frame`` (bytes-like); ``FrameError`` naming the field for anything malformed."""
    try:
        data = bytes(memoryview(frame))
    except TypeError:
        raise FrameError(f"frame: expected bytes, got {type(frame).__name__}") from None
    if len(data) > max_len:
        raise FrameError(f"frame: {len(data)} bytes, more than a handle's {max_len}")
    if len(data) < _FIXED.size:
        raise FrameError(f"frame: {len(data)} bytes, shorter than the {_FIXED.size}-byte fixed header")
    (magic, version, flags, kind, ndim, dtype_len, host_len, nbytes, buffer_id, pid, device, path_len,
     reserved) = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise FrameError(f"magic: {magic!r}, not {MAGIC!r}: not a mempool-ipc handle")
    if version != VERSION:
        raise FrameError(f"version: {version}; this mempool reads version {VERSION}")
    if kind not in KINDS:
        raise FrameError(f"kind: unknown array kind {kind}")
    if ndim > MAX_NDIM:
        raise FrameError(f"ndim: {ndim}, more than {MAX_NDIM}")
    if reserved != 0:
        raise FrameError(f"reserved: {reserved}, not 0")
    if path_len > MAX_PATH:
        raise FrameError(f"path_len: {path_len}, more than {MAX_PATH}")
    want = _FIXED.size + 16 * ndim + dtype_len + host_len + path_len
    if len(data) != want:
        raise FrameError(f"frame: {len(data)} bytes, but its lengths add up to {want}")
    off = _FIXED.size
    dims = struct.unpack_from(f"<{ndim}Q{ndim}q", data, off)
    off += 16 * ndim
    try:
        dtype = data[off:off + dtype_len].decode("ascii")
        off += dtype_len
        host = data[off:off + host_len].decode("utf-8")
        off += host_len
        path = data[off:off + path_len].decode("utf-8")
    except UnicodeDecodeError as e:
        raise FrameError(f"frame: a text field is not valid text ({e.reason} at byte {e.start})") from None
    handle = Handle(
        kind=KINDS[kind], dtype=dtype, shape=tuple(dims[:ndim]), strides=tuple(dims[ndim:]), nbytes=nbytes,
        buffer_id=buffer_id, sender_pid=pid, device=device, host=host, path=path, flags=flags,
    )
    _check(handle)
    return handle


_ADVERT_KEYS = {"v": int, "host": str, "pid": int, "path": str}


def check_advert(info: object) -> Optional[dict]:
    """The handle endpoint a peer advertised in its handshake (``{"v", "host", "pid", "path"}``), checked;
    ``None`` for anything else (a peer without the plugin, a malformed or newer advert): such a peer gets
    Dask's default path."""
    if not isinstance(info, dict) or info.get("v") != 1:
        return None
    for k, t in _ADVERT_KEYS.items():
        if not isinstance(info.get(k), t) or isinstance(info.get(k), bool):
            return None
    if not 0 < info["pid"] < 1 << 32 or not info["host"] or len(info["host"]) > 255:
        return None
    p = info["path"]
    if not p.startswith("/") or "\0" in p or len(p.encode("utf-8")) > MAX_PATH or not re.fullmatch(r"[^\n]+", p):
        return None
    return {k: info[k] for k in _ADVERT_KEYS}


def same_host(a: str, b: Optional[str] = None) -> bool:
    """Whether host identity ``a`` is this host's (or ``b``'s)."""
    return a == (b if b is not None else host_id())


def default_socket_dir() -> str:
    """Where endpoints put their sockets: ``$XDG_RUNTIME_DIR`` when set and short enough, else ``/tmp``."""
    d = os.environ.get("XDG_RUNTIME_DIR")
    if d and os.path.isdir(d) and len(d) < 60:
        return d
    return "/tmp"
