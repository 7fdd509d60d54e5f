"""GPU test of PyTorch's pluggable allocator path after its per-call work was thinned (the current resource
cached per thread, the live table, the counters with frees derived): tensors land in the resource current
when they are made, go back to it after the current resource changed, and ``memory_stats`` counts
allocations, frees, bytes and peaks exactly. PyTorch's allocator is chosen before CUDA starts, so the test
runs in a fresh interpreter. Marked gpu: it fails, never skips, without a GPU (or without PyTorch)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu


def run_py(code: str, timeout=300) -> str:
    """Runs `code` in a fresh interpreter; fails the test with its output unless it exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


def test_pluggable_allocations_follow_the_current_resource_and_are_counted_exactly():
    out = run_py(
        """
        import torch
        from mempool import mr
        from mempool.allocators import torch as mt

        first = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
        second = mr.StatisticsResourceAdaptor(mr.CudaAsyncMemoryResource())
        mr.set_current_device_resource(first)
        torch.cuda.memory.change_current_allocator(mt.mempool_torch_allocator)
        dev = torch.device("cuda", 0)
        warm = torch.empty(1, dtype=torch.uint8, device=dev)
        assert int(torch.ones(4, dtype=torch.uint8, device=dev).sum()) == 4  # the reduction's first use
        a0 = first.allocation_counts.current_bytes
        s0 = mt.memory_stats(0)

        x = torch.empty(1000, dtype=torch.uint8, device=dev)
        assert first.allocation_counts.current_bytes == a0 + 1000, first.allocation_counts
        mr.set_current_device_resource(second)
        y = torch.empty(3000, dtype=torch.uint8, device=dev)
        assert second.allocation_counts.current_bytes == 3000, second.allocation_counts
        assert first.allocation_counts.current_bytes == a0 + 1000
        x.fill_(5)
        y.fill_(7)
        assert int(x.sum()) == 5000 and int(y.sum()) == 21000
        s1 = mt.memory_stats(0)
        # x.sum() and y.sum() made (and freed) their results: count from the tensors' own two.
        assert s1["allocation.all.current"] - s0["allocation.all.current"] == 2, (s0, s1)
        assert s1["allocated_bytes.all.current"] - s0["allocated_bytes.all.current"] == 4000, (s0, s1)
        assert s1["allocated_bytes.all.peak"] >= s0["allocated_bytes.all.current"] + 4000, (s0, s1)
        made = s1["allocation.all.allocated"] - s0["allocation.all.allocated"]
        assert made >= 2 and s1["allocation.all.freed"] - s0["allocation.all.freed"] == made - 2, (s0, s1)

        del x
        torch.cuda.synchronize()
        assert first.allocation_counts.current_bytes == a0, "x went back to the resource that made it"
        del y
        torch.cuda.synchronize()
        assert second.allocation_counts.current_bytes == 0
        s2 = mt.memory_stats(0)
        assert s2["allocation.all.current"] == s0["allocation.all.current"], (s0, s2)
        assert s2["allocated_bytes.all.current"] == s0["allocated_bytes.all.current"], (s0, s2)
        assert s2["allocation.all.allocated"] - s2["allocation.all.freed"] == s2["allocation.all.current"]
        mt.reset_peak_memory_stats(0)
        assert mt.memory_stats(0)["allocated_bytes.all.peak"] == s2["allocated_bytes.all.current"]
        live, failed = mt.allocator_state()
        assert failed == 0, failed
        print("ok", live)
        """
    )
    assert out.startswith("ok"), out
