"""A preload module for Dask workers: ``dask-cuda-worker ... --preload mempool.dask.preload`` (or
``dask worker``), with options through ``--preload-argv``:

.. code-block:: sh

    dask-cuda-worker tcp://scheduler:8786 --preload mempool.dask.preload \
        --preload-argv "--mempool-kind pool --mempool-initial-pool-size 0.5 --mempool-ipc"

``dask_setup(worker, ...)`` (a click command, as distributed's preload protocol asks) registers a
``MempoolSetup`` made from the options on the worker as it starts: a bad option, a size larger than the
GPU or a framework asked for and missing fails the worker's start with the message. Options
(``--help`` through ``python -m mempool.dask.preload --help``):

- ``--mempool-spec TEXT``: a whole spec, ``KIND[:NAME=VALUE,...]`` (``ResourceSpec.parse``); or the parts:
- ``--mempool-kind``, ``--mempool-initial-pool-size``, ``--mempool-maximum-pool-size``,
  ``--mempool-release-threshold``, ``--mempool-upstream``, ``--mempool-arena-size``, ``--mempool-bins``,
  ``--mempool-limit``, ``--mempool-enable-ipc-pool``, ``--mempool-no-statistics``;
- ``--mempool-frameworks auto|none|cupy,torch,numba``, ``--mempool-device N``,
  ``--mempool-cupy-allocator c|python``, ``--mempool-ipc`` (CUDA arrays between workers of one host by
  handle).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import click

from mempool.dask.plugin import PLUGIN_NAME, MempoolSetup

__all__ = ["SetupFailed", "dask_setup", "plugin_from_options"]

logger = logging.getLogger("mempool.dask")

_PARTS = (
    "kind", "initial_pool_size", "maximum_pool_size", "release_threshold", "upstream", "arena_size", "bins",
    "limit",
)


def plugin_from_options(
    spec: Optional[str] = None,
    frameworks: str = "auto",
    device: Optional[int] = None,
    cupy_allocator: str = "c",
    ipc: bool = False,
    no_statistics: bool = False,
    enable_ipc_pool: bool = False,
    **parts: Any,
) -> MempoolSetup:
    """The plugin the command line asks for (``dask_setup``'s options without the ``mempool_`` prefix);
    ``--mempool-spec`` and the part options together are refused, naming both."""
    unknown = set(parts) - set(_PARTS)
    if unknown:
        raise click.UsageError(f"unknown mempool options: {sorted(unknown)}")
    given = {k: v for k, v in parts.items() if v is not None}
    if spec is not None and (given or no_statistics or enable_ipc_pool):
        named = sorted(given) + (["no_statistics"] if no_statistics else []) + (["enable_ipc_pool"] if enable_ipc_pool else [])
        raise click.UsageError(
            "--mempool-spec and --mempool-" + ", --mempool-".join(n.replace("_", "-") for n in named)
            + " both set the resource: give the whole spec, or its parts"
        )
    try:
        if spec is not None:
            return MempoolSetup(spec, frameworks=frameworks, device=device, cupy_allocator=cupy_allocator, ipc=ipc)
        options = dict(given)
        if no_statistics:
            options["statistics"] = False
        if enable_ipc_pool:
            options["enable_ipc"] = True
        return MempoolSetup(frameworks=frameworks, device=device, cupy_allocator=cupy_allocator, ipc=ipc, **options)
    except (TypeError, ValueError) as e:
        raise click.BadParameter(str(e)) from None


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--mempool-spec", "spec", default=None, help="the whole resource spec, KIND[:NAME=VALUE,...]")
@click.option("--mempool-kind", "kind", default=None, help="async, cuda, managed, pool, binning, arena, default, service")
@click.option("--mempool-initial-pool-size", "initial_pool_size", default=None, help="bytes, '4GiB' or a fraction such as 0.5")
@click.option("--mempool-maximum-pool-size", "maximum_pool_size", default=None)
@click.option("--mempool-release-threshold", "release_threshold", default=None)
@click.option("--mempool-upstream", "upstream", default=None, help="async (default), cuda or managed")
@click.option("--mempool-arena-size", "arena_size", default=None)
@click.option("--mempool-bins", "bins", default=None, help="binning: smallest-largest power-of-two exponent, e.g. 8-20")
@click.option("--mempool-limit", "limit", default=None, help="a LimitingResourceAdaptor's limit")
@click.option("--mempool-enable-ipc-pool", "enable_ipc_pool", is_flag=True, help="an exportable driver pool")
@click.option("--mempool-no-statistics", "no_statistics", is_flag=True, help="no StatisticsResourceAdaptor on top")
@click.option("--mempool-frameworks", "frameworks", default="auto", show_default=True)
@click.option("--mempool-device", "device", default=None, type=int, help="default 0: the worker's GPU under dask-cuda")
@click.option("--mempool-cupy-allocator", "cupy_allocator", default="c", type=click.Choice(["c", "python"]))
@click.option("--mempool-ipc", "ipc", is_flag=True, help="CUDA arrays between workers of one host by mempool-ipc handle")
async def dask_setup(worker: Any, **options: Any) -> None:
    """Sets the worker's mempool resource up as it starts (distributed's preload protocol). A failure
    raises ``SetupFailed`` (a ``SystemExit``): distributed only logs a preload's ordinary exceptions and
    starts the worker anyway, which would leave it on the wrong resource."""
    from distributed import Worker

    try:
        if not isinstance(worker, Worker):
            raise RuntimeError(
                f"mempool.dask.preload sets up workers; it was preloaded into a {type(worker).__name__} (pass it "
                "to dask worker or dask-cuda-worker, not the scheduler or the nanny)"
            )
        plugin = plugin_from_options(**options)
        await worker.plugin_add(plugin=plugin, name=PLUGIN_NAME, catch_errors=False)
    except Exception as e:
        where = getattr(worker, "address", None) or type(worker).__name__
        logger.error("mempool.dask.preload: %s cannot start: %s: %s", where, type(e).__name__, e)
        raise SetupFailed(f"mempool.dask.preload: {where} cannot start: {type(e).__name__}: {e}") from e


class SetupFailed(SystemExit):
    """The preload could not set the worker up; the message says why. A ``SystemExit``, so that it stops the
    worker's start (distributed logs and ignores a preload's ``Exception``\\ s) and its process."""


if __name__ == "__main__":  # python -m mempool.dask.preload --help
    dask_setup.main(args=None, prog_name="mempool.dask.preload")
