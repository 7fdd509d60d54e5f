"""See the memory: snapshots of a resource stack, the viewer page, and two stack settings.

- ``snapshot(mr=None, device=None)``: the snapshot (a dict in the schema of docs/observe.md, version 1) of
  ``mr``'s resource stack, or of the current device resource: its resources with their statistics, each
  suballocator's chunks with their used and free ranges, the live allocations and the recent history.
  The registry's default resource records a history; ``record(mr)`` makes any stack record one.
- ``dump_snapshot(path, mr=None, device=None)``: writes that snapshot as JSON.
- ``write_html(snapshot, path)``: writes the self-contained viewer page showing ``snapshot`` (a dict from
  ``snapshot()``, or JSON text).
- ``record(mr, capacity=65536)``: a resource over ``mr`` that records its allocations and frees.
- ``oom_retry(mr)``: a resource over ``mr`` that, on out of memory, trims the stack, synchronizes the
  stream and retries once.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Union

from . import _lib
from ._lib import DeviceMemoryResource

__all__ = ["snapshot", "snapshot_json", "dump_snapshot", "write_html", "record", "oom_retry"]

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


def write_html(snapshot: Union[dict[str, Any], str], path: PathLike) -> None:
    """Writes the viewer page showing ``snapshot`` (a dict or JSON text) to ``path``: one self-contained
    HTML file, no network."""
    text = snapshot if isinstance(snapshot, str) else json.dumps(snapshot, separators=(",", ":"))
    page = _lib._memory_page(text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


def record(mr: DeviceMemoryResource, capacity: int = 65536) -> DeviceMemoryResource:
    """A resource over ``mr`` that records its last ``capacity`` allocations and frees (the history a
    snapshot shows)."""
    return _lib._memory_record(mr, capacity)


def oom_retry(mr: DeviceMemoryResource) -> DeviceMemoryResource:
    """A resource over ``mr`` that, on out of memory, trims the stack under it, synchronizes the stream
    and retries the allocation once."""
    return _lib._memory_oom_retry(mr)
