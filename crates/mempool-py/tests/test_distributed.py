"""torch.distributed over mempool memory: two processes, one GPU each, NCCL backend (markers ``gpu`` and
``two_gpu``; on a machine with fewer than two GPUs they fail, saying so, and never skip).

Each test starts the two ranks of ``_dist_child.py`` as processes of their own (a fresh interpreter each:
PyTorch's allocator can only be swapped before CUDA starts), with ``NCCL_NVLS_ENABLE=0`` in their
environment, rendezvous through a FileStore in the test's temporary directory, and NCCL's log written to
files there. A rank that fails makes the test kill the other and report both ranks' exit status, stdout
and stderr (with the traceback); a rank still running after ``TIMEOUT_S`` is killed and reported the same
way. NCCL's registration lines (``NCCL_DEBUG_SUBSYS=INIT,REG``) are printed for the record: which
transports use a registered buffer is NCCL's choice, so the tests assert what PyTorch guarantees
(``register_mem_pool`` raises if NCCL refuses a segment) and the results, not the log.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mempool import mr

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpu]

CHILD = Path(__file__).with_name("_dist_child.py")
WORLD = 2
#: Seconds a job of two ranks may take, start to end (each rank also gives up on its own after 90 s).
TIMEOUT_S = 150


def require_two_gpus() -> None:
    n = mr.device_count()
    assert n >= WORLD, (
        f"this two_gpu test needs {WORLD} GPUs, one per process; this machine has {n}. Run it on the two-GPU "
        f"machine (pytest -m two_gpu); on one GPU run -m 'gpu and not two_gpu'"
    )


def nccl_log_lines(tmp: Path, pattern: str = r"regist|NCCL version|NVLS") -> list:
    lines = []
    for f in sorted(tmp.glob("nccl.*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if re.search(pattern, line, re.I):
                lines.append(f"{f.name}: {line.strip()}")
    return lines


def run_job(scenario: str, tmp: Path) -> list:
    """Runs both ranks of `scenario`; returns their JSON results, rank 0 first, or fails the test with
    everything both ranks printed."""
    require_two_gpus()
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,REG",
        "NCCL_DEBUG_FILE": str(tmp / "nccl.%h.%p.log"),
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    store = tmp / "store"
    procs = []
    for rank in range(WORLD):
        out = open(tmp / f"rank{rank}.out", "w")
        err = open(tmp / f"rank{rank}.err", "w")
        p = subprocess.Popen(
            [sys.executable, str(CHILD), scenario, str(rank), str(WORLD), str(store), str(tmp / f"rank{rank}.json")],
            stdout=out,
            stderr=err,
            env=env,
            cwd=tmp,
        )
        procs.append((p, out, err))
    deadline = time.monotonic() + TIMEOUT_S
    why = None
    while any(p.poll() is None for p, _, _ in procs):
        if any(p.poll() not in (None, 0) for p, _, _ in procs):
            why = "a rank failed; the other was stopped"
            time.sleep(2)  # let the other one report its own error, if it has one
            break
        if time.monotonic() > deadline:
            why = f"the job did not finish in {TIMEOUT_S} s; both ranks were killed"
            break
        time.sleep(0.2)
    for p, out, err in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        out.close()
        err.close()
    codes = [p.returncode for p, _, _ in procs]
    if why or any(codes):
        report = [f"{scenario}: {why or 'a rank failed'}; exit statuses {codes}"]
        for rank in range(WORLD):
            report.append(f"--- rank {rank} stdout\n{(tmp / f'rank{rank}.out').read_text(errors='replace')}")
            report.append(f"--- rank {rank} stderr\n{(tmp / f'rank{rank}.err').read_text(errors='replace')}")
        report.append("--- NCCL log (registration lines)\n" + "\n".join(nccl_log_lines(tmp)[-60:]))
        pytest.fail("\n".join(report), pytrace=False)
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_all_reduce_and_all_gather_over_registered_vmm_memory(tmp_path):
    results = run_job("collectives", tmp_path / "collectives")
    for r in results:
        print(f"rank {r['rank']}: torch {r['torch_version']}, NCCL {r['nccl_version']}, NCCL_NVLS_ENABLE={r['nvls_enable']}")
        print(f"rank {r['rank']}: provenance {r['provenance']}")
    print("NCCL registration log:\n" + "\n".join(nccl_log_lines(tmp_path / "collectives")))
    for r in results:
        assert r["nvls_enable"] == "0", r
        assert r["all_gather_exact"], r
        assert r["all_reduce_exact"], (r["x_head"], r["want_head"])
        assert r["all_reduce_int_exact"], r
        p = r["provenance"]
        assert p["segments"] and all(p["tensors_inside"]), p
        assert p["segment_bytes"] == p["mempool_current_bytes"], p
        # Every VMM allocation is a whole number of granules.
        assert p["vmm_allocated"][0] % p["granularity"] == 0, p


def test_ddp_losses_match_the_native_allocator_bitwise(tmp_path):
    """Five steps of DDP over a tiny MLP with PyTorch's allocator, with the model, data and gradient
    buckets in a registered MemPool over mempool, and with every allocation through mempool: the losses
    and the final parameters are bitwise equal. Bitwise, not within a tolerance: the computation on each
    rank is deterministic (fixed seeds and data, deterministic algorithms, TF32 off, a fixed cuBLAS
    workspace), and with two ranks each reduced element is the sum of two numbers, which IEEE-754
    addition gives exactly the same whichever order or algorithm NCCL picks (it is commutative and
    correctly rounded)."""
    runs = {mode: run_job(f"train-{mode}", tmp_path / mode) for mode in ("native", "region", "all")}
    for mode, results in runs.items():
        for r in results:
            print(f"{mode} rank {r['rank']}: losses {r['losses']} params {r['params_sha256'][:16]} "
                  f"mempool {r.get('mempool')} torch_allocator_state {r.get('torch_allocator_state')}")
    print("NCCL registration log (region):\n" + "\n".join(nccl_log_lines(tmp_path / "region")))
    native = runs["native"]
    # DDP keeps the replicas equal.
    assert native[0]["params_sha256"] == native[1]["params_sha256"], native
    for mode in ("region", "all"):
        for rank in range(WORLD):
            got, want = runs[mode][rank], native[rank]
            assert got["losses_hex"] == want["losses_hex"], (
                f"{mode} rank {rank}: losses {got['losses']} != native {want['losses']}")
            assert got["params_sha256"] == want["params_sha256"], f"{mode} rank {rank}: parameters differ"
            assert got["mempool"]["total_count"] > 0, got
    for r in runs["region"]:
        assert all(r["params_inside"]) and all(r["grads_inside"]), r
