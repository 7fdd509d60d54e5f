"""mempool for Dask: each worker's memory resource, and CUDA arrays between workers by handle.

- ``MempoolSetup``: the worker plugin (dask-cuda's ``RMMSetup``'s counterpart). It builds each worker's
  resource from a ``ResourceSpec`` or keyword options (``kind="pool", initial_pool_size="0.5"``, ...),
  makes it current, and points CuPy, PyTorch and Numba at it; ``ipc=True`` sends CuPy arrays and PyTorch
  tensors between workers of one host as ``mempool.ipc`` handles (``mempool.dask.transfer``).
- ``register(client, ...)``: registers it on every worker, now and later; ``worker_statistics(client)``:
  every worker's resource, hooks and statistics; ``cluster_snapshot(client, path)``: every worker's snapshot
  in one document and one page (docs/observe.md, "Cluster snapshots").
- ``mempool.dask.preload``: the same as a preload module, ``--preload mempool.dask.preload`` with
  ``--preload-argv "--mempool-kind pool ..."``.
- ``ResourceSpec``, ``parse_size``: the spec and the sizes, checked without a GPU.
- ``mempool.dask.framing``: the handle's frame (pure functions).

Needs ``distributed`` (``dask-cuda`` for ``LocalCUDACluster``). See docs/dask.md.
"""

from __future__ import annotations

from mempool.dask.plugin import (
    FRAMEWORKS,
    PLUGIN_NAME,
    MempoolSetup,
    cluster_snapshot,
    current_setup,
    parse_frameworks,
    register,
    setup_worker,
    worker_statistics,
)
from mempool.spec import KINDS, ResourceSpec, build, device_total_memory, format_size, parse_size

__all__ = [
    "FRAMEWORKS",
    "KINDS",
    "PLUGIN_NAME",
    "MempoolSetup",
    "ResourceSpec",
    "build",
    "cluster_snapshot",
    "current_setup",
    "device_total_memory",
    "format_size",
    "parse_frameworks",
    "parse_size",
    "register",
    "setup_worker",
    "worker_statistics",
]
