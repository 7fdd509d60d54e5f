"""See the memory: snapshots of a resource stack, the viewer page, and two stack settings.

- ``snapshot(mr=None, device=None)``: the snapshot (a dict in the schema of docs/observe.md, version 1) of
  ``mr``'s resource stack, or of the current device resource: its resources with their statistics, each
  suballocator's chunks with their used and free ranges, the live allocations and the recent history.
  The registry's default resource records a history; ``record(mr)`` makes any stack record one.
- ``dump_snapshot(path, mr=None, device=None)``: writes that snapshot as JSON.
- ``write_html(snapshot, path)``: writes the self-contained viewer page showing ``snapshot`` (a dict from
  ``snapshot()``, or JSON text; a cluster document too).
- ``cluster_snapshot(snapshots, identities=None)``: one document (schema ``mempool.cluster-snapshot``, version
  1) holding the snapshots of several workers, each unchanged beside the worker's identity.
- ``write_cluster_snapshot(cluster, path)``: writes a cluster document as JSON, or as the viewer page when
  ``path`` ends in ``.html``.
- ``record(mr, capacity=65536)``: a resource over ``mr`` that records its allocations and frees.
- ``oom_retry(mr)``: a resource over ``mr`` that, on out of memory, trims the stack, synchronizes the
  stream and retries once.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

from . import _lib
from ._lib import DeviceMemoryResource

__all__ = [
    "snapshot",
    "snapshot_json",
    "dump_snapshot",
    "write_html",
    "cluster_snapshot",
    "write_cluster_snapshot",
    "record",
    "oom_retry",
]

#: The ``schema`` of a cluster document, and the version this module writes.
CLUSTER_SCHEMA = "mempool.cluster-snapshot"
CLUSTER_VERSION = 1

#: A worker's identity: the fields beside its name and snapshot (each may be unknown, ``None``).
IDENTITY_FIELDS = ("address", "host", "pid", "device", "device_name")

Snapshot = Union[dict[str, Any], str, bytes]

PathLike = Union[str, "os.PathLike[str]"]


def _device(device: Optional[int]) -> int:
    return _lib.get_current_device() if device is None else device


def snapshot_json(mr: Optional[DeviceMemoryResource] = None, device: Optional[int] = None) -> str:
    """The snapshot of ``mr``'s stack (default: the current resource of ``device``) as JSON text."""
    return _lib._memory_snapshot_json(mr, _device(device))


def snapshot(mr: Optional[DeviceMemoryResource] = None, device: Optional[int] = None) -> dict[str, Any]:
    """The snapshot of ``mr``'s stack (default: the current resource of ``device``, default the current
    device) as a dict in the schema of docs/observe.md."""
    return json.loads(snapshot_json(mr, device))


def dump_snapshot(path: PathLike, mr: Optional[DeviceMemoryResource] = None, device: Optional[int] = None) -> None:
    """Writes the snapshot of ``mr``'s stack (default: the current device resource) to ``path`` as JSON."""
    text = snapshot_json(mr, device)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _is_cluster(doc: Union[dict[str, Any], str]) -> bool:
    if isinstance(doc, dict):
        return doc.get("schema") == CLUSTER_SCHEMA
    if CLUSTER_SCHEMA not in doc:
        return False
    try:
        v = json.loads(doc)
    except ValueError:
        return False
    return isinstance(v, dict) and v.get("schema") == CLUSTER_SCHEMA


def write_html(snapshot: Union[dict[str, Any], str], path: PathLike) -> None:
    """Writes the viewer page showing ``snapshot`` (a dict or JSON text) to ``path``: one self-contained
    HTML file, no network. A cluster document (``cluster_snapshot``) is checked first and refused with a
    ``ValueError`` that says why; a single snapshot is written as it is (the page says what it cannot read)."""
    text = snapshot if isinstance(snapshot, str) else json.dumps(snapshot, separators=(",", ":"))
    if _is_cluster(snapshot):
        _lib._memory_cluster_check(text)
    page = _lib._memory_page(text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def _as_dict(name: str, snap: Any) -> dict[str, Any]:
    """Worker ``name``'s snapshot as a dict: a dict as it is, JSON text (str or bytes) parsed."""
    if isinstance(snap, dict):
        return snap
    if isinstance(snap, (bytes, bytearray)):
        snap = bytes(snap).decode("utf-8")
    if isinstance(snap, str):
        try:
            v = json.loads(snap)
        except ValueError as e:
            raise ValueError(f"worker {name!r}: its snapshot is not JSON: {e}") from None
        if not isinstance(v, dict):
            raise ValueError(f"worker {name!r}: its snapshot is JSON but not an object (a {type(v).__name__})")
        return v
    raise TypeError(
        f"worker {name!r}: a snapshot is a dict (memory.snapshot()) or its JSON text (memory.snapshot_json()), "
        f"not {type(snap).__name__}"
    )


def cluster_snapshot(
    snapshots: Union[Mapping[str, Snapshot], Iterable[tuple[str, Snapshot]]],
    identities: Optional[Mapping[str, Mapping[str, Any]]] = None,
    *,
    source: str = "python",
) -> dict[str, Any]:
    """One document holding the snapshots of several workers (docs/observe.md, "Cluster snapshots").

    ``snapshots`` maps each worker's name (unique; a Dask worker's address, a rank) to its snapshot: the dict
    ``snapshot()`` returns, or its JSON text (str or bytes). ``(name, snapshot)`` pairs work as well. The
    workers keep the order given. ``identities`` maps worker names to what is known of them, among
    ``address``, ``host``, ``pid``, ``device`` (the ordinal) and ``device_name``; what is not given is
    ``None``, except that a worker given neither ``device`` nor ``device_name`` gets those of its snapshot's
    device when the snapshot lists exactly one.

    Returns the cluster document as a dict (schema ``mempool.cluster-snapshot``, version 1), each snapshot in
    it unchanged. Raises ``ValueError`` (``TypeError`` for a value of the wrong type) that says why: no
    snapshot, a name that is empty or given twice, an identity of a worker with no snapshot or with a field
    not listed above, and a worker whose snapshot is not a mempool snapshot of version 1 (its schema,
    version or history columns; the message names the worker)."""
    items = list(snapshots.items()) if isinstance(snapshots, Mapping) else list(snapshots)
    ids = dict(identities or {})
    workers = []
    names = set()
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                f"snapshots: a mapping of worker name to snapshot, or (name, snapshot) pairs; item {i} is {item!r:.80}"
            )
        name, snap = item
        if not isinstance(name, str) or not name:
            raise ValueError(f"worker {i}: a worker's name is a non-empty string, not {name!r}")
        if name in names:
            raise ValueError(f"two workers are named {name!r}: worker names must be unique")
        names.add(name)
        snap = _as_dict(name, snap)
        ident = ids.get(name) or {}
        if not isinstance(ident, Mapping):
            raise TypeError(f"identities[{name!r}]: a mapping of {', '.join(IDENTITY_FIELDS)}, not {type(ident).__name__}")
        unknown = sorted(set(ident) - set(IDENTITY_FIELDS))
        if unknown:
            raise ValueError(
                f"identities[{name!r}] has {', '.join(map(repr, unknown))}; a worker's identity has "
                f"{', '.join(IDENTITY_FIELDS)}"
            )
        w: dict[str, Any] = {"name": name}
        w.update({f: ident.get(f) for f in IDENTITY_FIELDS})
        devices = snap.get("devices")
        if w["device"] is None and w["device_name"] is None and isinstance(devices, list) and len(devices) == 1:
            d = devices[0] if isinstance(devices[0], dict) else {}
            w["device"], w["device_name"] = d.get("ordinal"), d.get("name") or None
        w["snapshot"] = snap
        workers.append(w)
    stray = sorted(set(ids) - names)
    if stray:
        raise ValueError(f"identities name workers with no snapshot: {', '.join(map(repr, stray))}")
    doc = {
        "schema": CLUSTER_SCHEMA,
        "version": CLUSTER_VERSION,
        "created_unix_ns": time.time_ns(),
        "source": source,
        "workers": workers,
    }
    _lib._memory_cluster_check(json.dumps(doc, separators=(",", ":")))
    return doc


def write_cluster_snapshot(cluster: Union[dict[str, Any], str], path: PathLike) -> None:
    """Writes the cluster document ``cluster`` (from ``cluster_snapshot``, or its JSON text) to ``path``: the
    viewer page showing every worker when ``path`` ends in ``.html`` or ``.htm``, else the document's JSON.
    Checks it first, as ``cluster_snapshot`` does, and raises ``ValueError`` saying why it is not one."""
    text = cluster if isinstance(cluster, str) else json.dumps(cluster, separators=(",", ":"))
    _lib._memory_cluster_check(text)
    if os.fspath(path).lower().endswith((".html", ".htm")):
        text = _lib._memory_page(text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def record(mr: DeviceMemoryResource, capacity: int = 65536) -> DeviceMemoryResource:
    """A resource over ``mr`` that records its last ``capacity`` allocations and frees (the history a
    snapshot shows)."""
    return _lib._memory_record(mr, capacity)


def oom_retry(mr: DeviceMemoryResource) -> DeviceMemoryResource:
    """A resource over ``mr`` that, on out of memory, trims the stack under it, synchronizes the stream
    and retries the allocation once."""
    return _lib._memory_oom_retry(mr)
