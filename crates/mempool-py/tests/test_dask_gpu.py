"""GPU tests of ``mempool.dask`` on a two-GPU ``LocalCUDACluster`` (markers ``gpu`` and ``two_gpu``: they fail,
never skip, without dask-cuda, CuPy, PyTorch or two GPUs). Written on a machine without a GPU: none of
them has run yet (docs/dask.md, "What was tested").

- every worker's current resource is the one asked for, on its own GPU, with CuPy and PyTorch hooked;
- CuPy and PyTorch tasks allocate from it (its statistics count their bytes);
- a worker killed mid-task is replaced, and the replacement is set up again;
- the plugin registered twice is harmless (same resource object), and another spec replaces the resource;
- a size larger than the GPU fails the registration, and a preloaded worker's start, naming the field;
- the preload module sets workers up;
- CuPy arrays and PyTorch tensors between the two workers by handle (the handle counters prove the path;
  values checked), the sender's shared buffers all released afterwards; a buffer whose message never
  arrives is released after the stash's time limit; without ``ipc`` the default path still works.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpu]

# The functions the tests submit live in an importable module: the workers cannot import this file (pytest
# imports it by path), and distributed pickles a task's function by reference.
from mempool.benchmarks.dask_gpu import (  # noqa: E402
    task_cupy_alloc as _cupy_alloc,
    task_describe as _describe,
    task_gpu_identity as _gpu_identity,
    task_make_cupy as _make_cupy,
    task_make_torch as _make_torch,
    task_orphan_share as _orphan_share,
    task_rmm_alloc as _rmm_alloc,
    task_set_stash_ttl as _set_ttl,
    task_sleep as _sleep,
    task_torch_alloc as _torch_alloc,
)


MiB = 1 << 20


def _need_two_gpus():
    from mempool import mr

    n = mr.device_count()
    assert n >= 2, f"these tests need two GPUs; this machine has {n}"


@pytest.fixture
def cluster():
    _need_two_gpus()
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    with LocalCUDACluster(n_workers=2, CUDA_VISIBLE_DEVICES="0,1", threads_per_worker=1,
                          dashboard_address=":0") as c, Client(c) as client:
        yield client


def _workers(client):
    return sorted(client.scheduler_info()["workers"])








def test_every_worker_runs_on_the_resource_asked_for(cluster):
    from mempool.dask import MempoolSetup, worker_statistics

    cluster.register_plugin(MempoolSetup(kind="pool", initial_pool_size="256MiB", frameworks=["cupy", "torch"]))
    stats = worker_statistics(cluster)
    assert len(stats) == 2
    for w, s in stats.items():
        assert s["spec"] == {"kind": "pool", "initial_pool_size": 256 * MiB}, (w, s)
        assert s["device"] == 0 and s["is_current"], (w, s)
        assert s["hooked"] == {"cupy": "c", "torch": "pluggable"}, (w, s)
        assert s["resource"] == "StatisticsResourceAdaptor" or "Statistics" in s["resource"], s["resource"]
    ids = cluster.run(_gpu_identity)
    assert len(set(ids.values())) == 2, f"both workers on one GPU: {ids}"


def test_cupy_and_torch_tasks_allocate_from_it(cluster):
    from mempool.dask import MempoolSetup, worker_statistics

    cluster.register_plugin(MempoolSetup(kind="default", initial_pool_size="512MiB", frameworks=["cupy", "torch"]))
    before = worker_statistics(cluster)
    for w in _workers(cluster):
        assert cluster.submit(_cupy_alloc, 64 * MiB, workers=[w], pure=False).result() == 16 * MiB
        assert cluster.submit(_torch_alloc, 32 * MiB, workers=[w], pure=False).result() == 8 * MiB
    after = worker_statistics(cluster)
    for w in _workers(cluster):
        grew = after[w]["statistics"]["total_bytes"] - before[w]["statistics"]["total_bytes"]
        assert grew >= 96 * MiB, (w, before[w]["statistics"], after[w]["statistics"])
        assert after[w]["statistics"]["peak_bytes"] >= 64 * MiB




def test_rmm_through_the_bridge_allocates_from_the_workers_resource(cluster):
    """frameworks=["rmm"]: RMM's current device resource on each worker is the worker's mempool resource
    through the RMM bridge (docs/rmm.md), so what allocates through RMM (cudf, rmm.DeviceBuffer) counts in
    mempool's statistics. Needs RMM and mempool-rmm-bridge on the workers (scripts/dask-gpu-tests.sh
    install takes them from target/rmm-gpu); fails without them."""
    from mempool.dask import MempoolSetup, worker_statistics

    cluster.register_plugin(MempoolSetup(kind="pool", initial_pool_size="256MiB", frameworks=["rmm", "cupy"]))
    before = worker_statistics(cluster)
    for w in _workers(cluster):
        assert before[w]["hooked"]["rmm"] == "bridge", before[w]
        got = cluster.submit(_rmm_alloc, 48 * MiB, workers=[w], pure=False).result()
        assert got == {"size": 48 * MiB, "same": True, "rmm_resource": "MempoolResource"}, (w, got)
    after = worker_statistics(cluster)
    for w in _workers(cluster):
        grew = after[w]["statistics"]["total_bytes"] - before[w]["statistics"]["total_bytes"]
        assert grew >= 48 * MiB, (w, before[w]["statistics"], after[w]["statistics"])


def test_one_snapshot_of_the_cluster(cluster, tmp_path):
    """mempool.dask.cluster_snapshot: both workers' snapshots in one checked document and one page."""
    from mempool.dask import MempoolSetup, cluster_snapshot

    cluster.register_plugin(MempoolSetup(kind="pool", initial_pool_size="128MiB", frameworks=["cupy"]))
    page = tmp_path / "cluster.html"
    doc = cluster_snapshot(cluster, page)
    assert sorted(w["name"] for w in doc["workers"]) == _workers(cluster)
    assert len({w["pid"] for w in doc["workers"]}) == 2
    for w in doc["workers"]:
        assert w["device"] == 0 and w["device_name"], w
        names = {r["name"] for r in w["snapshot"]["resources"]}
        assert any("Pool" in n for n in names), names
    assert page.stat().st_size > 10_000


def test_a_worker_killed_mid_task_is_replaced_and_set_up_again(cluster):
    from mempool.dask import MempoolSetup, worker_statistics

    cluster.register_plugin(MempoolSetup(kind="pool", initial_pool_size="128MiB", frameworks=["cupy"]))
    pids = cluster.run(os.getpid)
    victim = _workers(cluster)[0]
    fut = cluster.submit(_sleep, 120, workers=[victim], pure=False)
    deadline = time.monotonic() + 30
    while victim not in {w for w, ts in cluster.processing().items() if ts} and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(pids[victim], signal.SIGKILL)
    deadline = time.monotonic() + 120
    now: dict = {}
    while time.monotonic() < deadline:
        try:
            now = cluster.run(os.getpid)
        except OSError:  # the dead worker is still listed: ask again
            now = {}
        if len(now) == 2 and pids[victim] not in now.values():
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"no replacement worker within 120 s: before {pids}, last seen {now}")
    fut.cancel()
    stats = worker_statistics(cluster)
    for w, s in stats.items():
        assert s["spec"] == {"kind": "pool", "initial_pool_size": 128 * MiB} and s["is_current"], (w, s)
    new = [w for w, s in stats.items() if s["pid"] not in pids.values()]
    assert len(new) == 1 and stats[new[0]]["setups"] == 1, stats
    assert cluster.submit(_cupy_alloc, 8 * MiB, workers=new, pure=False).result() == 2 * MiB


def test_the_plugin_registered_twice_is_harmless(cluster):
    from mempool.dask import MempoolSetup, worker_statistics

    plugin = MempoolSetup(kind="pool", initial_pool_size="128MiB", frameworks=["cupy"])
    cluster.register_plugin(plugin)
    first = worker_statistics(cluster)
    cluster.register_plugin(MempoolSetup(kind="pool", initial_pool_size="128MiB", frameworks=["cupy"]))
    second = worker_statistics(cluster)
    for w in first:
        assert second[w]["resource_id"] == first[w]["resource_id"], "the same spec made a new resource"
        assert second[w]["setups"] == first[w]["setups"] + 1 and second[w]["is_current"]
    assert cluster.submit(_cupy_alloc, 8 * MiB, pure=False).result() == 2 * MiB
    cluster.register_plugin(MempoolSetup(kind="arena", arena_size="256MiB", frameworks=["cupy"]))
    third = worker_statistics(cluster)
    for w in first:
        assert third[w]["spec"]["kind"] == "arena" and third[w]["is_current"]
        assert third[w]["resource_id"] != first[w]["resource_id"]
    assert cluster.submit(_cupy_alloc, 8 * MiB, pure=False).result() == 2 * MiB


def test_a_size_larger_than_the_gpu_fails_the_registration(cluster):
    from mempool.dask import MempoolSetup

    with pytest.raises(ValueError, match=r"initial_pool_size 1.00 TiB .* is larger than the device's memory"):
        cluster.register_plugin(MempoolSetup(kind="pool", initial_pool_size="1TiB", frameworks="none"))


PRELOAD_FAILS = """
import sys
from dask_cuda import LocalCUDACluster
try:
    with LocalCUDACluster(n_workers=1, CUDA_VISIBLE_DEVICES="0", dashboard_address=":0",
                          preload=["mempool.dask.preload"],
                          preload_argv=["--mempool-kind", "pool", "--mempool-initial-pool-size", "1TiB"]):
        print("STARTED")
except BaseException as e:
    print("START FAILED:", type(e).__name__, e)
    sys.exit(3)
"""


def test_a_preloaded_worker_with_a_size_larger_than_the_gpu_does_not_start(tmp_path):
    """In a process of its own, with a time limit: the worker's process exits at start (SetupFailed), the
    message naming the field is in its output, and the cluster's start fails."""
    import subprocess
    import sys

    _need_two_gpus()
    p = subprocess.run([sys.executable, "-c", PRELOAD_FAILS], cwd=tmp_path, capture_output=True, text=True,
                       timeout=240)
    out = p.stdout + p.stderr
    assert "STARTED" not in p.stdout, out[-4000:]
    assert "initial_pool_size 1.00 TiB" in out and "larger than the device's memory" in out, out[-4000:]


def test_the_preload_module_sets_workers_up():
    _need_two_gpus()
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    from mempool.dask import worker_statistics

    argv = ["--mempool-kind", "default", "--mempool-initial-pool-size", "0.05", "--mempool-frameworks", "cupy"]
    with LocalCUDACluster(n_workers=2, CUDA_VISIBLE_DEVICES="0,1", dashboard_address=":0",
                          preload=["mempool.dask.preload"], preload_argv=argv) as c, Client(c) as client:
        stats = worker_statistics(client)
        assert len(stats) == 2
        for w, s in stats.items():
            assert s["spec"] == {"kind": "default", "initial_pool_size": 0.05} and s["is_current"], (w, s)
            assert s["hooked"] == {"cupy": "c"}
        assert client.submit(_cupy_alloc, 8 * MiB, pure=False).result() == 2 * MiB


# -------------------------------------------------------------------------------------------------
# Between workers by handle.
# -------------------------------------------------------------------------------------------------








def _wait_connected(client, timeout=30.0):
    from mempool.dask import worker_statistics

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = worker_statistics(client)
        if all(s.get("ipc_stats", {}).get("peers_imported", 0) >= 1 for s in st.values()):
            return st
        time.sleep(0.2)
    raise AssertionError(f"importers not connected within {timeout} s: {worker_statistics(client)}")


def _warm_up(client):
    a, b = _workers(client)
    for src, dst in ((a, b), (b, a)):
        x = client.submit(_make_cupy, 0, 1024, "float32", workers=[src], pure=False)
        client.submit(_describe, x, workers=[dst], pure=False).result()
    return _wait_connected(client)


def _ipc(st, w, key):
    return st[w]["ipc_stats"][key]


def test_cupy_arrays_and_torch_tensors_between_workers_by_handle(cluster):
    from mempool.dask import MempoolSetup, worker_statistics

    cluster.register_plugin(MempoolSetup(kind="default", initial_pool_size="1GiB", frameworks=["cupy", "torch"],
                                         ipc=True))
    a, b = _workers(cluster)
    before = _warm_up(cluster)
    cases = []
    for i, dtype in enumerate(("float32", "int64", "int32", "uint8")):
        for src, dst in ((a, b), (b, a)):
            x = cluster.submit(_make_cupy, i, 4 * MiB, dtype, workers=[src], pure=False)
            local = cluster.submit(_describe, x, workers=[src], pure=False)
            remote = cluster.submit(_describe, x, workers=[dst], pure=False)
            cases.append((local, remote))
    for i, (dtype, grad) in enumerate((("float32", False), ("bfloat16", False), ("float32", True))):
        x = cluster.submit(_make_torch, i, 1 * MiB, dtype, grad, workers=[a], pure=False)
        cases.append((cluster.submit(_describe, x, workers=[a], pure=False),
                      cluster.submit(_describe, x, workers=[b], pure=False)))
    for local, remote in cases:
        lo, re_ = local.result(), remote.result()
        assert lo[:4] == re_[:4] and lo[5] == re_[5], (lo, re_)
        assert re_[4] == 0  # on the receiver's own GPU (its device 0)
    after = worker_statistics(cluster)
    sent = sum(_ipc(after, w, "sent_handles") - _ipc(before, w, "sent_handles") for w in (a, b))
    received = sum(_ipc(after, w, "received_handles") - _ipc(before, w, "received_handles") for w in (a, b))
    assert sent == received == len(cases), (sent, received, after)
    # Every shared buffer is released once the receivers copied it: the senders' exporters hold none.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = worker_statistics(cluster)
        if all(s["ipc_stats"]["exporter"]["live_buffers"] == 0 for s in st.values()):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"shared buffers still live: {[s['ipc_stats'] for s in st.values()]}")






def test_a_buffer_whose_message_is_lost_is_released_after_the_time_limit(cluster):
    from mempool.dask import MempoolSetup, worker_statistics

    cluster.register_plugin(MempoolSetup(kind="pool", initial_pool_size="256MiB", frameworks=["cupy"], ipc=True))
    a, b = _workers(cluster)
    _warm_up(cluster)
    pids = cluster.run(os.getpid)
    cluster.run(_set_ttl, 1.0, workers=[b])
    live = cluster.submit(_orphan_share, pids[b], workers=[a], pure=False).result()
    assert live >= 1
    time.sleep(2.0)
    # The next transfer to b finds the orphan first, stashes it; the one after that (past the limit)
    # releases it.
    for _ in range(2):
        x = cluster.submit(_make_cupy, 1, 1024, "float32", workers=[a], pure=False)
        cluster.submit(_describe, x, workers=[b], pure=False).result()
        time.sleep(1.5)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = worker_statistics(cluster)
        if st[a]["ipc_stats"]["exporter"]["live_buffers"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the orphan is still live: {st[a]['ipc_stats']}, receiver {st[b]['ipc_stats']}")
    assert st[b]["ipc_stats"]["stash_expired"] >= 1


def test_a_receiver_killed_lets_the_sender_free_what_it_held(cluster):
    from mempool.dask import MempoolSetup, worker_statistics

    cluster.register_plugin(MempoolSetup(kind="pool", initial_pool_size="256MiB", frameworks=["cupy"], ipc=True))
    a, b = _workers(cluster)
    _warm_up(cluster)
    pids = cluster.run(os.getpid)
    live = cluster.submit(_orphan_share, pids[b], workers=[a], pure=False).result()
    assert live >= 1
    os.kill(pids[b], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = worker_statistics(cluster, workers=[a])
        if st[a]["ipc_stats"]["exporter"]["live_buffers"] == 0:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the dead receiver's lease was not reclaimed: {st[a]['ipc_stats']}")


def test_without_ipc_cupy_arrays_take_the_default_path(cluster):
    from mempool.dask import MempoolSetup, worker_statistics

    cluster.register_plugin(MempoolSetup(kind="pool", initial_pool_size="256MiB", frameworks=["cupy"]))
    a, b = _workers(cluster)
    x = cluster.submit(_make_cupy, 3, 1 * MiB, "float32", workers=[a], pure=False)
    lo = cluster.submit(_describe, x, workers=[a], pure=False).result()
    re_ = cluster.submit(_describe, x, workers=[b], pure=False).result()
    assert lo[:4] == re_[:4]
    assert all(s.get("ipc") is None for s in worker_statistics(cluster).values())
