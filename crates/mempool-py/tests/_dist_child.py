"""One rank of test_distributed.py's two-process jobs, run as a script:

    python _dist_child.py SCENARIO RANK WORLD_SIZE STORE_FILE RESULT_FILE

It uses GPU RANK, joins a ``torch.distributed`` NCCL process group through a FileStore at STORE_FILE,
runs SCENARIO and writes what it saw as JSON to RESULT_FILE. A failure prints its traceback to stderr
and exits 1; a hang dumps every thread's stack to stderr and exits 1 after ``HANG_S`` seconds (the
parent kills it later still), so a broken collective costs seconds, not the job's time limit.

Scenarios:

- ``collectives``: the device's current mempool resource is a ``StatisticsResourceAdaptor`` over a
  ``VmmMemoryResource`` (one ``cuMemCreate`` mapping per request, POSIX-exportable, peers granted
  access: what ``ncclMemAlloc`` makes). Tensors come from a ``torch.cuda.MemPool`` over mempool's
  pluggable allocator, the pool is registered with the process group (``register_mem_pool``), and an
  all-gather and all-reduces run over them.
- ``train-native``, ``train-region``, ``train-all``: five steps of a tiny DDP model. ``native``: PyTorch's
  own allocator. ``region``: model, data, DDP's gradient buckets and the optimizer's state in a
  ``MemPool`` over mempool (a ``PoolMemoryResource`` over a ``VmmMemoryResource``), registered with the
  process group (backward's temporaries come from PyTorch's allocator: ``use_mem_pool`` routes the
  calling thread only, and autograd runs CUDA work on a thread of its own). ``all``: every CUDA
  allocation of the process through mempool (``change_current_allocator``), no registration.
"""

from __future__ import annotations

import os

# Before torch, and so before NCCL reads its environment: never NVLink multicast (NVLS) on the shared
# machines; deterministic cuBLAS.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import datetime  # noqa: E402
import faulthandler  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

#: Seconds after which a child that has not finished dumps its threads' stacks and exits.
HANG_S = 90
#: The process group's own timeout for a collective or the rendezvous.
PG_TIMEOUT = datetime.timedelta(seconds=60)
STEPS = 5


def segments_of(pool) -> list:
    """The pool's segments as (address, size) pairs, sorted."""
    return sorted((int(s["address"]), int(s["total_size"])) for s in pool.snapshot())


def inside(ptr: int, segments: list) -> bool:
    return any(a <= ptr < a + n for a, n in segments)


def init_group(rank: int, world: int, store_file: str):
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", rank)
    # device_id makes PyTorch create the NCCL communicator now (eager init): register_mem_pool needs it.
    dist.init_process_group(
        "nccl",
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world,
        timeout=PG_TIMEOUT,
        device_id=dev,
    )
    return dev


def collectives(rank: int, world: int, store_file: str) -> dict:
    import torch
    import torch.distributed as dist

    from mempool import mr
    from mempool.allocators.torch import allocator_state, mempool_torch_pool_allocator

    torch.cuda.set_device(rank)
    vmm = mr.VmmMemoryResource(device=rank, peers="all")
    stats = mr.StatisticsResourceAdaptor(vmm)
    mr.set_per_device_resource(rank, stats)
    dev = init_group(rank, world, store_file)
    backend = dist.group.WORLD._get_backend(dev)

    pool = torch.cuda.MemPool(mempool_torch_pool_allocator.allocator())
    n = 1 << 20  # 4 MiB of float32: a large message, the kind registration is for
    with torch.cuda.use_mem_pool(pool):
        # Every value and every sum is an integer below 2**24: exact in float32.
        x = (torch.arange(n, device=dev, dtype=torch.float32) % 1021) + 4096 * rank
        gathered = torch.empty(world * n, device=dev, dtype=torch.float32)
        small = torch.full((1000,), rank + 1, device=dev, dtype=torch.int32)
    segments = segments_of(pool)
    counts = stats.allocation_counts
    # The pool's segments are exactly what mempool handed out: PyTorch's caching allocator asked the
    # pluggable allocator for each one, and nothing else in this process allocates through it.
    provenance = {
        "segments": segments,
        "segment_bytes": sum(n for _, n in segments),
        "mempool_current_bytes": counts.current_bytes,
        "mempool_current_count": counts.current_count,
        "vmm_allocated": list(vmm.allocated()),
        "granularity": vmm.granularity,
        "tensors_inside": [inside(t.data_ptr(), segments) for t in (x, gathered, small)],
        "torch_allocator_state": list(allocator_state()),
    }
    assert all(provenance["tensors_inside"]), provenance
    assert provenance["segment_bytes"] == counts.current_bytes and len(segments) == counts.current_count, provenance
    # Each VMM allocation is rounded up to the granularity: at least the bytes asked for.
    assert vmm.allocated()[1] == counts.current_count and vmm.allocated()[0] >= counts.current_bytes, provenance

    # ncclCommRegister on every segment; PyTorch raises if NCCL refuses one.
    backend.register_mem_pool(pool)

    dist.all_gather_into_tensor(gathered, x)
    dist.all_reduce(x)
    dist.all_reduce(small)
    torch.cuda.synchronize(dev)

    base = torch.arange(n, device=dev, dtype=torch.float32) % 1021
    want_gather = torch.cat([base + 4096 * r for r in range(world)])
    want_sum = world * base + 4096 * sum(range(world))
    result = {
        "provenance": provenance,
        "all_gather_exact": bool(torch.equal(gathered, want_gather)),
        "all_reduce_exact": bool(torch.equal(x, want_sum)),
        "all_reduce_int_exact": bool((small == sum(range(1, world + 1))).all().item()),
        "x_head": x[:4].tolist(),
        "want_head": want_sum[:4].tolist(),
        "nccl_version": list(torch.cuda.nccl.version()),
        "torch_version": torch.__version__,
    }
    backend.deregister_mem_pool(pool)
    del x, gathered, small, base, want_gather, want_sum
    dist.destroy_process_group()
    return result


def train(mode: str, rank: int, world: int, store_file: str) -> dict:
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mempool import mr

    stats = None
    if mode in ("region", "all"):
        vmm = mr.VmmMemoryResource(device=rank, peers="all")
        stats = mr.StatisticsResourceAdaptor(mr.PoolMemoryResource(vmm, initial_pool_size=64 << 20))
        mr.set_per_device_resource(rank, stats)
    if mode == "all":
        from mempool.allocators.torch import mempool_torch_allocator

        # Before anything initialises CUDA in PyTorch (set_device does).
        torch.cuda.memory.change_current_allocator(mempool_torch_allocator)

    torch.cuda.set_device(rank)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = init_group(rank, world, store_file)

    pool = None
    region = contextlib.nullcontext()
    if mode == "region":
        from mempool.allocators.torch import mempool_torch_pool_allocator

        pool = torch.cuda.MemPool(mempool_torch_pool_allocator.allocator())
        region = torch.cuda.use_mem_pool(pool)

    # The same model on every rank (DDP broadcasts rank 0's anyway); data of each rank its own.
    torch.manual_seed(1234)
    gen = torch.Generator().manual_seed(99 + rank)
    xs = [torch.randn(16, 32, generator=gen) for _ in range(STEPS)]
    ys = [torch.randn(16, 8, generator=gen) for _ in range(STEPS)]
    losses = []
    with region:
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(dev)
        # Gradients as views of DDP's buckets: the buckets NCCL all-reduces are the gradients.
        ddp = DDP(model, device_ids=[rank], gradient_as_bucket_view=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        if pool is not None:
            dist.group.WORLD._get_backend(dev).register_mem_pool(pool)
        for x, y in zip(xs, ys):
            x, y = x.to(dev), y.to(dev)
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        torch.cuda.synchronize(dev)
        params = [p.detach().cpu() for p in model.parameters()]
        digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()
        grads_ptrs = [p.grad.data_ptr() for p in model.parameters()]
        param_ptrs = [p.data_ptr() for p in model.parameters()]

    result = {
        "mode": mode,
        "losses_hex": [float(v).hex() for v in losses],
        "losses": losses,
        "params_sha256": digest,
    }
    if stats is not None:
        c = stats.allocation_counts
        result["mempool"] = {"total_count": c.total_count, "peak_bytes": c.peak_bytes, "current_bytes": c.current_bytes}
        assert c.total_count > 0, f"{mode}: nothing was allocated through mempool: {c}"
    if pool is not None:
        segments = segments_of(pool)
        result["params_inside"] = [inside(p, segments) for p in param_ptrs]
        result["grads_inside"] = [inside(p, segments) for p in grads_ptrs]
        assert all(result["params_inside"]) and all(result["grads_inside"]), result
        dist.group.WORLD._get_backend(dev).deregister_mem_pool(pool)
    if mode == "all":
        from mempool.allocators.torch import allocator_state

        result["torch_allocator_state"] = list(allocator_state())
        assert allocator_state()[0] > 0, "change_current_allocator: PyTorch holds nothing from mempool"
    del ddp, opt, model
    dist.destroy_process_group()
    return result


def main(argv: list) -> int:
    scenario, rank, world, store_file, result_file = argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5]
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        if scenario == "collectives":
            result = collectives(rank, world, store_file)
        elif scenario.startswith("train-"):
            result = train(scenario.removeprefix("train-"), rank, world, store_file)
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
        result["rank"] = rank
        result["nvls_enable"] = os.environ.get("NCCL_NVLS_ENABLE")
        with open(result_file, "w", encoding="utf-8") as f:
            json.dump(result, f)
    except BaseException:  # noqa: BLE001 - everything goes to the parent through stderr and the status
        sys.stderr.write(f"rank {rank} (pid {os.getpid()}), scenario {scenario}:\n{traceback.format_exc()}")
        sys.stderr.flush()
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
