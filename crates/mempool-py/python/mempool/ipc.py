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

The memory store (``mempool_store``; docs/memory-store.md): named GPU buffers held by a server
process (the ``mempool-store-server`` binary, or ``serve(path, ...)`` in this process), which outlive the processes
that made them.

- ``Client(path, timeout=None, trust_uids=())``: ``create(name, size, device=None, tag=None, ttl=None,
  attach_uids=None)`` returns a ``CreatedBuffer`` mapped for writing; ``publish(stream=None)`` makes it
  attachable by name (by this uid, and the uids of ``attach_uids``) and returns an ``AttachedBuffer``
  (``discard()`` drops it unpublished); ``attach(name, stream=None)`` maps a published buffer with no copy,
  ordered after its creator's writes; ``attach_many(names, stream=None)`` attaches many in few requests (a
  list, all or nothing); ``create_many(names, sizes, device=None, tag=None, ttl=None, attach_uids=None)``
  creates a group (one allocation, at most 128 members, all or nothing: a member is
  attachable once every member is published, and whoever may attach one maps the whole group's memory;
  attaching members of a group maps its memory once); ``delete(name)``; ``list()``
  (``BufferInfo``s); ``stats()``; ``protocol_version``. The buffers have ``ptr``, ``size``, ``name``, the CUDA array interface and
  DLPack (``torch.from_dlpack(buf)``, ``cupy.from_dlpack(buf)``: no copy); a buffer's mapping goes when the
  object and every view of it are gone, and the server keeps the buffer until it is deleted or expires.
- ``serve(path, devices=None, per_uid_bytes=None, per_uid_buffers=None, total_bytes=None,
  total_buffers=None, allow_uids=(), default_ttl=None, max_buffer_bytes=None, socket_mode=None)``: a
  ``MemoryStoreServer`` in this process (``path``, ``stats()``, ``shutdown()``, a context manager).
- Errors: the ``MemoryStoreError`` classes below; ``ValueError`` for a bad size, tag or argument.

The exporter frees a buffer only when it and every importer holding it have let go; an importer that dies
counts as having let go once its process is gone. None of these objects can be pickled: send the socket
path to the other process (for example as a ``multiprocessing`` argument, in spawn mode) and connect there.
"""

from ._errors import IpcError, IpcProtocolError, IpcTimeoutError, PeerGoneError, RefusedError
from ._lib import ExportedBuffer, Exporter, ImportedBuffer, ImportedRange, Importer
from ._lib import AttachedBuffer, BufferInfo, Client, CreatedBuffer, MemoryStoreServer, serve, validate_name


class MemoryStoreError(IpcError):
    """The memory store (``Client``, ``serve``) refused or failed a call; the base of the classes below, and
    the class of the rest (the server's own GPU failure, a device it does not serve, a socket path it cannot
    use)."""


class NameTakenError(MemoryStoreError, FileExistsError):
    """``create`` named a buffer that exists (published, or being created by someone)."""


class UnknownNameError(MemoryStoreError, LookupError):
    """No buffer has the name: never created, deleted, expired, or its creator died before publishing it."""


class InvalidNameError(MemoryStoreError, ValueError):
    """The name breaks the naming rule (the message names the rule; ``validate_name`` checks it)."""


class QuotaExceededError(MemoryStoreError):
    """Creating the buffer would pass a quota (the message says whose, of what, the limit and the use)."""


class NotPermittedError(MemoryStoreError, PermissionError):
    """The access rules refuse the call: a uid the server does not allow, a server uid this client does not
    trust, or deleting another user's buffer."""


class WrongStateError(MemoryStoreError):
    """The buffer's state does not allow the call: attaching one still being created, publishing twice or
    after a discard."""


class ServerGoneError(MemoryStoreError, PeerGoneError, ConnectionError):
    """The server is gone (nobody listens on the path, it closed the connection or died); every later call of
    the same ``Client`` raises it too. Buffers already mapped stay valid until dropped."""


__all__ = [
    "AttachedBuffer",
    "BufferInfo",
    "Client",
    "CreatedBuffer",
    "InvalidNameError",
    "MemoryStoreServer",
    "MemoryStoreError",
    "NameTakenError",
    "NotPermittedError",
    "QuotaExceededError",
    "ServerGoneError",
    "UnknownNameError",
    "WrongStateError",
    "serve",
    "validate_name",
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
