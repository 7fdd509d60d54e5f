"""mempool.ipc: share device buffers between processes over a Unix socket (the ``mempool-ipc`` crate).

- ``Exporter(path, mr=None, ...)``: serves an exportable CUDA pool at ``path`` (a pool of its own, or the
  pool of a ``mempool.mr.CudaAsyncMemoryResource(enable_ipc=True)``, or a resource over one, whose
  suballocations travel as a block plus an offset). ``alloc(size)`` makes an ``ExportedBuffer``; fill it,
  then ``share(buffer, to=None)`` sends it to importers; ``share_many(buffers, to=None)`` sends several at once.
  ``rings=False`` keeps every connection on the socket (protocol version 2).
- ``Importer(path)``: connects and imports the pool; ``recv(timeout=None)`` (the Rust crate's verb) returns an
  ``ImportedBuffer`` with ``ptr``, ``size``, ``__cuda_array_interface__`` and DLPack, so that
  ``torch.from_dlpack`` and ``cupy.from_dlpack`` view it without a copy. The lease is released when the
  object and every view of it are garbage-collected. ``recv_many(max=64, timeout=None)`` waits for one buffer and
  takes every one already there behind it. By default buffers and releases travel through a shared-memory ring
  per connection (protocol version 3; ``Importer.rings`` says whether the exporter offered it, ``rings=False``
  asks for the socket); a release goes out as soon as the buffer is let go.
- Sharing a service resource's memory: ``Exporter.share_range(mr, buffer, to=None)`` shares a buffer
  allocated from a ``mempool.mr.ServiceMemoryResource`` (or a ``TaggedMemoryResource`` of one) with
  importers made with ``Importer(path, accept_ranges=True)``; their ``recv`` returns an ``ImportedRange``
  (the owner's physical chunks mapped back to back at the importer's own addresses; ``ptr``, ``size``,
  ``__cuda_array_interface__`` and DLPack, so ``torch.from_dlpack`` views it). While an importer holds it,
  the owner keeps the buffer alive and its tag cannot sleep; an importer that dies lets go of it.

The exporter frees a buffer only when it and every importer holding it have let go; an importer that dies
counts as having let go once its process is gone. None of these objects can be pickled: send the socket
path to the other process (for example as a ``multiprocessing`` argument, in spawn mode) and connect there.
"""

from ._errors import IpcError, IpcProtocolError, IpcTimeoutError, PeerGoneError, RefusedError
from ._lib import ExportedBuffer, Exporter, ImportedBuffer, ImportedRange, Importer

__all__ = [
    "ExportedBuffer",
    "Exporter",
    "ImportedBuffer",
    "ImportedRange",
    "Importer",
    "IpcError",
    "IpcProtocolError",
    "IpcTimeoutError",
    "PeerGoneError",
    "RefusedError",
]
