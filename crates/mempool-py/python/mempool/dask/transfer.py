"""CuPy arrays and PyTorch tensors between Dask workers of one host by ``mempool.ipc`` handle instead of
device-to-host-to-device bytes.

How it goes (``MempoolSetup(ipc=True)`` sets it up on every worker):

1. Each worker runs an ``Endpoint``: a ``mempool.ipc.Exporter`` with a pool of its own on the worker's
   device, at a socket path in ``$XDG_RUNTIME_DIR`` (or ``/tmp``). The worker advertises it (host identity,
   pid, socket path) in the handshake of every connection it opens (its ``rpc`` pool's
   ``handshake_overrides``), so a worker that sends data to it finds the advert in the comm's context.
2. The sender's serializer (the ``dask`` family's function for ``cupy.ndarray`` and ``torch.Tensor``,
   wrapped; also the family ``mempool-ipc`` for explicit serializer lists) sees the recipient's advert. Same
   host, and the recipient's importer connected to this worker's exporter: the array is copied into a
   buffer of the exporter's pool (on the array's stream) and shared with that importer alone; the Dask
   message carries only the frame of ``mempool.dask.framing``. Same host, recipient not yet connected: the
   default path this time, with an offer in the header; the recipient connects in the background, and the
   next transfers take the handle path. Another host, no advert, an empty array, or any failure to share:
   Dask's default path (distributed's own serializer: bytes through host memory).
3. The recipient's deserializer takes the buffer with that id from its importer (buffers that arrive for
   other messages wait, for ``STASH_TTL`` seconds at most), copies it into memory of its own current
   resource, waits for the copy, and lets go of the lease.

Leases: the sender's memory is freed only when the recipient released it, or its process is gone (the
exporter watches it); a recipient whose sender died keeps what it received (the driver keeps imported
memory alive) and gets an error for what it had not received; a buffer shared for a message that never
arrived (a comm that broke) is released after ``STASH_TTL`` seconds.

Costs, as built: one device-to-device copy on the sender (into the exporter's pool: a Python process
cannot hand an arbitrary CuPy allocation to the exporter) and one device-to-device (peer) copy on the
receiver, against a device-to-host copy, the bytes through the comm and a host-to-device copy.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any, Optional

from mempool.dask import framing

logger = logging.getLogger("mempool.dask")

__all__ = ["ADVERT_KEY", "Endpoint", "FAMILY", "STASH_TTL", "advertise", "install"]

#: The key of the advert in a handshake, and of the offer in a fallback header.
ADVERT_KEY = "mempool-ipc"
#: The serialization family's name.
FAMILY = "mempool-ipc"
#: Seconds a received buffer waits for the message that names it before it is released.
STASH_TTL = 60.0
#: Seconds a receiver waits for a buffer its message names.
RECV_TIMEOUT = 30.0
#: Seconds before a receiver tries again to connect to an endpoint it could not connect to.
RETRY_AFTER = 60.0


class Endpoint:
    """One process's exporter (to send) and importers (one per sending peer, to receive)."""

    def __init__(self, exporter: Any, device: int, path: str) -> None:
        self.exporter = exporter
        self.device = device
        self.path = path
        self.host = framing.host_id()
        self.pid = os.getpid()
        self._importers: dict = {}  # peer socket path -> mempool.ipc.Importer
        self._connecting: set = set()
        self._failed: dict = {}  # peer socket path -> when a connection to it last failed
        self._recv_locks: dict = {}
        self._stash: dict = {}  # (path, id) -> (ImportedBuffer, time received)
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(
            ("sent_handles", "sent_bytes", "fallbacks", "offers_sent", "received_handles", "received_bytes",
             "connects", "connect_failures", "stash_expired", "share_failures"), 0)

    @classmethod
    def start(cls, device: int, directory: Optional[str] = None) -> "Endpoint":
        from mempool import ipc

        directory = directory or framing.default_socket_dir()
        path = os.path.join(directory, f"mempool-dask-{os.getpid()}-{secrets.token_hex(4)}.sock")
        if len(path.encode()) > framing.MAX_PATH:
            raise ValueError(f"ipc_dir: the socket path {path!r} is longer than {framing.MAX_PATH} bytes")
        return cls(ipc.Exporter(path, device=device), device, path)

    def advert(self) -> dict:
        return {"v": 1, "host": self.host, "pid": self.pid, "path": self.path}

    def stats(self) -> dict:
        out = dict(self.counters)
        out["importers_connected"] = len(self.exporter.importers())
        out["peers_imported"] = len(self._importers)
        out["stashed"] = len(self._stash)
        out["exporter"] = dict(self.exporter.stats())
        return out

    def close(self) -> None:
        for imp in list(self._importers.values()):
            imp.close()
        self._importers.clear()
        self._stash.clear()
        self.exporter.shutdown()

    # ---------------------------------------------------------------------------------------------
    # Sender.
    # ---------------------------------------------------------------------------------------------

    def importer_id(self, pid: int) -> Optional[int]:
        ids = [i["id"] for i in self.exporter.importers() if i["pid"] == pid]
        return max(ids) if ids else None

    def send(self, kind: str, x: Any, importer: int) -> bytes:
        """Copies ``x`` into a buffer of the exporter's pool, shares it with ``importer`` and returns the
        frame naming it."""
        if kind == "cupy":
            import cupy

            if x.dtype.str not in framing.DTYPES:
                raise TypeError(f"dtype {x.dtype.str} does not travel by handle")
            if not x.flags.c_contiguous:
                x = cupy.ascontiguousarray(x)
            nbytes, dtype, device, flags = x.nbytes, x.dtype.str, x.device.id, 0
            stream = cupy.cuda.get_current_stream()
            buf = self.exporter.alloc(nbytes)
            _after(stream, buf.stream, buf.device)  # the buffer was allocated on the exporter's stream
            cupy.cuda.runtime.memcpyAsync(buf.ptr, x.data.ptr, nbytes, 4, stream.ptr)  # cudaMemcpyDefault
        else:
            import torch

            t = x.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            nbytes = t.numel() * t.element_size()
            dtype = _torch_dtype_str(t.dtype)
            if dtype not in framing.DTYPES:
                raise TypeError(f"dtype {t.dtype} does not travel by handle")
            device, flags = t.device.index or 0, framing.FLAG_REQUIRES_GRAD if x.requires_grad else 0
            stream = torch.cuda.current_stream(t.device)
            buf = self.exporter.alloc(nbytes)
            with torch.cuda.stream(stream):
                dst = torch.from_dlpack(buf)
                dst.copy_(t.reshape(-1).view(torch.uint8))
            del dst
        handle = framing.Handle(
            kind=kind, dtype=dtype, shape=tuple(int(n) for n in x.shape),
            strides=framing.c_strides(tuple(int(n) for n in x.shape), framing.DTYPES[dtype]), nbytes=nbytes,
            buffer_id=buf.id, sender_pid=self.pid, device=device, host=self.host, path=self.path, flags=flags,
        )
        frame = framing.encode(handle)  # before sharing: a frame that cannot be written shares nothing
        self.exporter.share(buf, to=[importer], stream=stream)
        self.counters["sent_handles"] += 1
        self.counters["sent_bytes"] += nbytes
        return frame

    # ---------------------------------------------------------------------------------------------
    # Receiver.
    # ---------------------------------------------------------------------------------------------

    def offer(self, advert: Any) -> None:
        """A sender offered its endpoint: connect to it in the background (once)."""
        a = framing.check_advert(advert)
        if a is None or a["host"] != self.host or a["path"] == self.path:
            return
        with self._lock:
            if a["path"] in self._connecting:
                return
            failed = self._failed.get(a["path"])
            if failed is not None and time.monotonic() - failed < RETRY_AFTER:
                return  # it failed a moment ago: the default path meanwhile
            imp = self._importers.get(a["path"])
            if imp is not None and not imp.closed:
                return  # connected: the sender sees it by the next transfer
            self._importers.pop(a["path"], None)  # closed (the connection dropped): connect again
            self._connecting.add(a["path"])
        threading.Thread(target=self._connect, args=(a["path"],), name="mempool-dask-connect", daemon=True).start()

    def _connect(self, path: str) -> None:
        from mempool import ipc

        try:
            imp = ipc.Importer(path, timeout=5.0)
        except Exception as e:  # the sender keeps using the default path
            self.counters["connect_failures"] += 1
            logger.warning("mempool.dask: cannot connect to the endpoint at %s: %s", path, e)
            with self._lock:
                self._connecting.discard(path)
                self._failed[path] = time.monotonic()
            return
        with self._lock:
            self._importers[path] = imp
            self._recv_locks[path] = threading.Lock()
            self._connecting.discard(path)
        self.counters["connects"] += 1

    def take(self, handle: framing.Handle, timeout: float = RECV_TIMEOUT) -> Any:
        """The ``ImportedBuffer`` ``handle`` names, from the importer of its sender."""
        from mempool import ipc

        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                imp = self._importers.get(handle.path)
                lock = self._recv_locks.get(handle.path)
                connecting = handle.path in self._connecting
            # The sender may see this importer connected a moment before its constructor returned here.
            if imp is not None or not connecting or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        if imp is None:
            raise ipc.IpcError(
                f"a handle from {handle.path} (pid {handle.sender_pid}) arrived, but this worker has no "
                "connection to that endpoint"
            )
        with lock:
            self._expire()
            got = self._stash.pop((handle.path, handle.buffer_id), None)
            if got is not None:
                return got[0]
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ipc.IpcTimeoutError(
                        f"buffer {handle.buffer_id} from {handle.path} did not arrive within {timeout} s"
                    )
                try:
                    buf = imp.recv(timeout=left)
                except ipc.IpcTimeoutError:
                    raise ipc.IpcTimeoutError(
                        f"buffer {handle.buffer_id} from {handle.path} did not arrive within {timeout} s"
                    ) from None
                except ipc.PeerGoneError:
                    with self._lock:
                        self._importers.pop(handle.path, None)
                    raise
                if buf.id == handle.buffer_id:
                    return buf
                self._stash[(handle.path, buf.id)] = (buf, time.monotonic())

    def _expire(self) -> None:
        now = time.monotonic()
        for key, (_, t) in list(self._stash.items()):
            if now - t > STASH_TTL:
                del self._stash[key]  # the lease goes with the object
                self.counters["stash_expired"] += 1

    def receive(self, handle: framing.Handle) -> Any:
        """The array ``handle`` names, copied into this process's current resource; the lease released."""
        if handle.host != self.host:
            raise ValueError(f"a handle from host {handle.host!r} reached host {self.host!r}")
        buf = self.take(handle)
        try:
            if buf.size < handle.nbytes:
                raise ValueError(f"buffer {handle.buffer_id} has {buf.size} bytes; the frame names {handle.nbytes}")
            if handle.kind == "cupy":
                import cupy

                out = cupy.empty(handle.shape, dtype=handle.dtype)
                stream = cupy.cuda.get_current_stream()
                _after(stream, buf.stream, buf.device)  # recv ordered the sender's writes before the importer's stream
                cupy.cuda.runtime.memcpyAsync(out.data.ptr, buf.ptr, handle.nbytes, 4, stream.ptr)
                stream.synchronize()  # the copy is done before the lease goes
            else:
                import torch

                dev = torch.device("cuda", torch.cuda.current_device())
                flat = torch.empty(handle.nbytes, dtype=torch.uint8, device=dev)
                src = torch.from_dlpack(buf)  # on the sender's GPU, ordered after the importer's stream
                flat.copy_(src)
                # The copy is done on both devices' streams before the lease goes.
                torch.cuda.current_stream(dev).synchronize()
                torch.cuda.current_stream(src.device).synchronize()
                del src
                out = flat.view(_torch_dtype(handle.dtype)).reshape(handle.shape)
                if handle.requires_grad:
                    out.requires_grad_(True)
        finally:
            del buf
        self.counters["received_handles"] += 1
        self.counters["received_bytes"] += handle.nbytes
        return out


def _after(stream: Any, other: int, other_device: int) -> None:
    """Makes CuPy ``stream`` wait for the work queued so far on the raw stream handle ``other`` of device
    ``other_device`` (the event is made and recorded on that device, as the driver requires)."""
    import cupy

    if other == stream.ptr:
        return
    with cupy.cuda.Device(other_device):
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(cupy.cuda.ExternalStream(other, other_device))
    stream.wait_event(ev)


def _torch_dtype_str(dtype: Any) -> str:
    import torch

    special = {torch.bfloat16: "torch.bfloat16"}
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            special[getattr(torch, name)] = "torch." + name
    if dtype in special:
        return special[dtype]
    if dtype == torch.bool:
        return "|b1"
    import numpy

    return numpy.dtype(str(dtype).replace("torch.", "")).str


def _torch_dtype(s: str) -> Any:
    import torch

    if s.startswith("torch."):
        return getattr(torch, s[len("torch."):])
    import numpy

    return torch.from_numpy(numpy.empty(0, dtype=numpy.dtype(s))).dtype


# -------------------------------------------------------------------------------------------------
# Dask's side: the serializers, and where they are installed.
# -------------------------------------------------------------------------------------------------


def _endpoint() -> Optional[Endpoint]:
    from mempool.dask.plugin import _STATE

    return _STATE.ipc


def _kind(x: Any) -> Optional[str]:
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return "cupy" if isinstance(x, cupy.ndarray) else None
    if mod == "torch":
        import torch

        return "torch" if isinstance(x, torch.Tensor) and x.is_cuda and x.grad is None else None
    return None


def _recipient(context: Any) -> Optional[dict]:
    if not isinstance(context, dict):
        return None
    rec = context.get("recipient")
    return framing.check_advert(rec.get(ADVERT_KEY)) if isinstance(rec, dict) else None


def try_handle(x: Any, context: Any) -> tuple:
    """``(frame, None)`` when ``x`` went by handle; ``(None, offer)`` otherwise, with the advert to offer the
    recipient (or None)."""
    ep = _endpoint()
    kind = _kind(x)
    rec = _recipient(context)
    if ep is None or kind is None or rec is None or rec["host"] != ep.host or rec["pid"] == ep.pid:
        return None, None
    importer = ep.importer_id(rec["pid"])
    if importer is None:
        ep.counters["offers_sent"] += 1
        return None, ep.advert()
    nbytes = x.nbytes if kind == "cupy" else x.numel() * x.element_size()
    if nbytes == 0:
        return None, None
    try:
        return ep.send(kind, x, importer), None
    except Exception as e:  # the default path still works
        ep.counters["share_failures"] += 1
        logger.warning("mempool.dask: sharing a %s of %d bytes failed, sending it by value: %s", kind, nbytes, e)
        return None, None


def receive_frame(frame: Any) -> Any:
    handle = framing.decode(frame)
    ep = _endpoint()
    if ep is None:
        raise RuntimeError("a mempool-ipc handle reached a process without mempool.dask's endpoint (ipc=True)")
    return ep.receive(handle)


def family_dumps(x: Any, context: Any = None) -> tuple:
    """The ``mempool-ipc`` family: a handle, or ``NotImplementedError`` (the next family in the list)."""
    frame, offer = try_handle(x, context)
    if frame is None:
        raise NotImplementedError("mempool-ipc: not sent by handle")
    return {ADVERT_KEY: 1}, [frame]


def family_loads(header: dict, frames: list) -> Any:
    if header.get(ADVERT_KEY) != 1 or len(frames) != 1:
        raise ValueError(f"mempool-ipc: a header {sorted(header)} with {len(frames)} frames is not a handle")
    return receive_frame(frames[0])


_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Registers the ``mempool-ipc`` family, and wraps the ``dask`` family's serializers of ``cupy.ndarray``
    and ``torch.Tensor`` (for the frameworks installed) so that Dask's default comm path takes handles. Once
    per process."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from distributed.protocol.serialize import (
            dask_deserialize,
            dask_serialize,
            register_serialization_family,
        )

        register_serialization_family(FAMILY, family_dumps, family_loads)
        try:
            import cupy
            import distributed.protocol.cupy  # noqa: F401  distributed's own, registered first

            _wrap(dask_serialize, dask_deserialize, cupy.ndarray, None)
        except ImportError:
            pass
        try:
            import torch
            import distributed.protocol.torch  # noqa: F401

            _wrap(dask_serialize, dask_deserialize, torch.Tensor, _torch_by_value)
        except ImportError:
            pass
        _installed = True


def _torch_by_value(original: Any) -> Any:
    """distributed's ``torch.Tensor`` serializer goes through ``Tensor.numpy()``, which a CUDA tensor
    refuses: copy it to the host first; its deserializer puts it back on ``header["device"]``."""

    def dumps(t: Any) -> tuple:
        # A CUDA tensor's .grad does not travel this way (distributed's path never carried one either).
        if getattr(t, "is_cuda", False):
            header, frames = original(t.detach().cpu().requires_grad_(t.requires_grad))
            header["device"] = "cuda"
            return header, frames
        return original(t)

    return dumps


def _wrap(ser: Any, deser: Any, typ: type, by_value: Any) -> None:
    original_dumps = ser.dispatch(typ)
    original_loads = deser.dispatch(typ)
    fallback = by_value(original_dumps) if by_value else original_dumps

    def dumps(x: Any, context: Any = None) -> tuple:
        frame, offer = try_handle(x, context)
        if frame is not None:
            return {ADVERT_KEY: 1}, [frame]
        header, frames = fallback(x)
        if offer is not None:
            header[ADVERT_KEY + "-offer"] = offer
        ep = _endpoint()
        if ep is not None:
            ep.counters["fallbacks"] += 1
        return header, frames

    def loads(header: dict, frames: list) -> Any:
        if header.get(ADVERT_KEY) == 1:
            return family_loads(header, frames)
        offer = header.get(ADVERT_KEY + "-offer")
        ep = _endpoint()
        if offer is not None and ep is not None:
            ep.offer(offer)
        return original_loads(header, frames)

    # Not __wrapped__: inspect.signature would follow it, and distributed would find no `context` keyword.
    dumps._mempool_original = original_dumps  # type: ignore[attr-defined]
    loads._mempool_original = original_loads  # type: ignore[attr-defined]
    ser.register(typ, dumps)
    deser.register(typ, loads)


def advertise(worker: Any, endpoint: Endpoint) -> None:
    """Adds ``endpoint``'s advert to the handshake of every connection ``worker`` opens from now on."""
    pool = worker.rpc
    args = dict(pool.connection_args or {})
    overrides = dict(args.get("handshake_overrides") or {})
    overrides[ADVERT_KEY] = endpoint.advert()
    args["handshake_overrides"] = overrides
    pool.connection_args = args
