"""Dask on GPUs with mempool: the shuffle of CuPy partitions between two workers (Dask's default comm
against mempool-ipc handles) and the bdb workload under RMM's pool and mempool's resources. Needs
dask-cuda, CuPy and two GPUs (``--gpus``); nothing here was run on the machine that wrote it.

    python -m mempool.benchmarks.dask_gpu shuffle --partitions 64 --mib 256 [--repeats 3] [--json FILE]
    python -m mempool.benchmarks.bdb --xp cupy --gpus 2 --scale 10 --partitions 64 \
        --allocators rmm-pool,mempool-default --json FILE

Shuffle: a ``LocalCUDACluster`` of two workers (one GPU each); ``--partitions`` CuPy arrays of ``--mib``
MiB, half made on each worker, each then consumed by a task on the other worker (the array moves there
through Dask's comm; the task returns its checksum, which must equal the one computed where it was made).
Timed: from submitting the consuming tasks to their last result, per repeat (fresh arrays each repeat).
Two modes, each in a cluster of its own: ``default`` (``MempoolSetup(ipc=False)``: distributed's CuPy
serializer, device to host, TCP, host to device) and ``handle`` (``MempoolSetup(ipc=True)``; one warm-up
transfer each way first, so that each worker's importer is connected before the timed runs). The report
includes each worker's handle counters (``worker_statistics``): in ``handle`` mode every timed transfer
must have gone by handle, or the run says so and fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional


def _make(i: int, nbytes: int, seed: int) -> Any:
    import cupy

    rng = cupy.random.default_rng(seed * 100_003 + i)
    return rng.integers(0, 1 << 31, nbytes // 4, dtype=cupy.int32)


def _checksum(x: Any) -> int:
    import cupy

    return int(cupy.sum(x.astype(cupy.int64)))


def _consume(x: Any) -> tuple:
    import cupy

    return _checksum(x), int(x.data.ptr), int(cupy.cuda.runtime.getDevice())


def _cluster(n_workers: int = 2, **kw: Any) -> Any:
    from dask_cuda import LocalCUDACluster

    return LocalCUDACluster(n_workers=n_workers, threads_per_worker=1, dashboard_address=":0", **kw)


def _wait_connected(client: Any, workers: list, timeout: float = 30.0) -> None:
    from mempool.dask import worker_statistics

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = worker_statistics(client)
        if all(st[w].get("ipc_stats", {}).get("peers_imported", 0) >= 1 for w in workers):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the workers' importers did not connect within {timeout} s: {worker_statistics(client)}")


def shuffle_run(mode: str, partitions: int, mib: int, repeats: int, kind: str = "default") -> dict:
    from distributed import Client, wait

    from mempool.dask import MempoolSetup, worker_statistics

    if mode not in ("default", "handle"):
        raise ValueError(f"mode: default or handle, got {mode!r}")
    nbytes = mib << 20
    with _cluster() as cluster, Client(cluster) as client:
        client.register_plugin(MempoolSetup(kind=kind, frameworks="cupy", ipc=mode == "handle"))
        workers = sorted(client.scheduler_info()["workers"])
        if len(workers) != 2:
            raise RuntimeError(f"the shuffle needs two workers (two GPUs), the cluster has {len(workers)}")
        if mode == "handle":
            for src, dst in ((0, 1), (1, 0)):
                w = client.submit(_make, 0, 1 << 20, 999 + src, workers=[workers[src]], pure=False)
                client.submit(_consume, w, workers=[workers[dst]], pure=False).result()
            _wait_connected(client, workers)
        before = worker_statistics(client)
        seconds = []
        for r in range(repeats):
            src = [workers[i % 2] for i in range(partitions)]
            made = [client.submit(_make, i, nbytes, r, workers=[src[i]], pure=False) for i in range(partitions)]
            sums = client.gather([client.submit(_checksum, m, workers=[src[i]], pure=False)
                                  for i, m in enumerate(made)])
            wait(made)
            t0 = time.perf_counter()
            out = [client.submit(_consume, m, workers=[workers[(i + 1) % 2]], pure=False)
                   for i, m in enumerate(made)]
            got = client.gather(out)
            seconds.append(time.perf_counter() - t0)
            bad = [i for i, (g, s) in enumerate(zip(got, sums)) if g[0] != s]
            if bad:
                raise AssertionError(f"{mode}: partitions {bad[:8]} arrived with another checksum")
            del made, out
        after = worker_statistics(client)
    moved = partitions * nbytes
    report = {
        "mode": mode, "partitions": partitions, "mib": mib, "kind": kind, "seconds": seconds,
        "best_gib_per_s": moved / min(seconds) / 2**30,
        "ipc_before": {w: before[w].get("ipc_stats") for w in before},
        "ipc_after": {w: after[w].get("ipc_stats") for w in after},
    }
    if mode == "handle":
        sent = sum((after[w].get("ipc_stats") or {}).get("sent_handles", 0) -
                   (before[w].get("ipc_stats") or {}).get("sent_handles", 0) for w in after)
        report["handles_sent"] = sent
        if sent < partitions * repeats:
            raise AssertionError(f"handle mode: only {sent} of {partitions * repeats} transfers went by handle: {report}")
    return report


# -------------------------------------------------------------------------------------------------
# bdb under RMM and mempool (called by python -m mempool.benchmarks.bdb --gpus 2).
# -------------------------------------------------------------------------------------------------


def _rmm_wrap_statistics() -> str:
    import rmm

    mr = rmm.mr.StatisticsResourceAdaptor(rmm.mr.get_current_device_resource())
    rmm.mr.set_current_device_resource(mr)
    import cupy
    from rmm.allocators.cupy import rmm_cupy_allocator

    cupy.cuda.set_allocator(rmm_cupy_allocator)
    return type(mr.get_upstream()).__name__


def _rmm_peak() -> int:
    import rmm

    counts = rmm.mr.get_current_device_resource().allocation_counts
    # A Statistics object in recent RMM releases, a dict in older ones.
    return int(counts["peak_bytes"] if isinstance(counts, dict) else counts.peak_bytes)


def bdb_cluster_runs(a: Any, queries: list) -> dict:
    from distributed import Client

    from mempool.benchmarks.bdb import run_dask  # the importable module's, not __main__'s
    from mempool.dask import MempoolSetup, worker_statistics

    runs = {}
    pool = float(a.pool_size) if "." in a.pool_size else a.pool_size
    for name in [n for n in a.allocators.split(",") if n]:
        if name == "rmm-pool":
            with _cluster(a.gpus, rmm_pool_size=pool) as cluster, Client(cluster) as client:
                client.run(_rmm_wrap_statistics)
                run = run_dask(client, a.scale, a.partitions, "cupy", queries, repeats=a.repeats)
                run["peak_bytes"] = client.run(_rmm_peak)
        elif name in ("mempool-default", "mempool-pool"):
            kind = "default" if name == "mempool-default" else "pool"
            with _cluster(a.gpus) as cluster, Client(cluster) as client:
                client.register_plugin(MempoolSetup(kind=kind, initial_pool_size=pool, frameworks="cupy"))
                run = run_dask(client, a.scale, a.partitions, "cupy", queries, repeats=a.repeats)
                st = worker_statistics(client)
                run["peak_bytes"] = {w: s["statistics"]["peak_bytes"] for w, s in st.items()}
        else:
            raise ValueError(f"--allocators: unknown run {name!r} (rmm-pool, mempool-default, mempool-pool)")
        runs[name] = run
    return runs


# -------------------------------------------------------------------------------------------------
# Task functions that tests/test_dask_gpu.py submits (here, in an importable module, because a worker loads
# a task's function by reference: it could not import the test file).
# -------------------------------------------------------------------------------------------------

def task_gpu_identity():
    import cupy

    return cupy.cuda.Device(0).pci_bus_id


def task_cupy_alloc(n):
    import cupy

    a = cupy.ones(n // 4, dtype=cupy.float32)
    return float(a.sum())


def task_torch_alloc(n):
    import torch

    t = torch.ones(n // 4, dtype=torch.float32, device="cuda")
    return float(t.sum().item())


def task_rmm_alloc(n):
    """``n`` bytes through RMM's current device resource (``rmm.DeviceBuffer``), written and read back:
    with the plugin's ``"rmm"`` hook, from the worker's mempool resource through the RMM bridge."""
    import rmm

    data = bytes(range(256)) * (n // 256)
    buf = rmm.DeviceBuffer.to_device(data)
    ok = buf.tobytes() == data
    return {"size": buf.size, "same": ok, "rmm_resource": type(rmm.mr.get_current_device_resource()).__name__}


def task_sleep(s):
    time.sleep(s)
    return s


def task_make_cupy(i, n, dtype):
    import cupy

    return cupy.arange(n, dtype=dtype).reshape(-1, 4) * (i + 1)


def task_make_torch(i, n, dtype_name, grad):
    import torch

    t = (torch.arange(n, device="cuda", dtype=torch.float32).reshape(-1, 8) * (i + 1)).to(getattr(torch, dtype_name))
    return t.requires_grad_(grad) if grad else t


def task_describe(x):
    """(type, dtype, shape, checksum, device ordinal, requires_grad) of what arrived."""
    mod = type(x).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return ("cupy", x.dtype.str, tuple(x.shape), float(x.astype(cupy.float64).sum()), x.device.id, False)
    import torch

    return ("torch", str(x.dtype), tuple(x.shape), float(x.detach().double().sum().item()), x.device.index,
            x.requires_grad)


def task_orphan_share(peer_pid):
    """Shares a buffer with the peer's importer without a Dask message naming it (a lost message)."""
    from mempool.dask.plugin import _STATE

    ep = _STATE.ipc
    import cupy

    x = cupy.ones(1 << 20, dtype=cupy.uint8)
    ep.send("cupy", x, ep.importer_id(peer_pid))
    return ep.exporter.stats()["live_buffers"]


def task_set_stash_ttl(seconds):
    from mempool.dask import transfer

    transfer.STASH_TTL = seconds


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mempool.benchmarks.dask_gpu")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sh = sub.add_parser("shuffle", help="CuPy partitions between two workers: default comm against handles")
    sh.add_argument("--partitions", type=int, default=64)
    sh.add_argument("--mib", type=int, default=256)
    sh.add_argument("--repeats", type=int, default=3)
    sh.add_argument("--kind", default="default", help="the workers' resource kind")
    sh.add_argument("--modes", default="default,handle")
    sh.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.partitions < 2 or a.mib < 1 or a.repeats < 1:
        ap.error("--partitions at least 2, --mib and --repeats at least 1")
    from mempool.benchmarks import dask_gpu as this  # tasks name the importable module's functions

    reports = [this.shuffle_run(m, a.partitions, a.mib, a.repeats, a.kind) for m in a.modes.split(",") if m]
    print("| mode | partitions x MiB | seconds per repeat | best GiB/s |")
    print("|---|---|---|---|")
    for r in reports:
        secs = ", ".join(f"{s:.3f}" for s in r["seconds"])
        print(f"| {r['mode']} | {r['partitions']} x {r['mib']} | {secs} | {r['best_gib_per_s']:.2f} |")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(reports, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
