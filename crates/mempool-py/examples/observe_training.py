"""A few PyTorch training steps allocating through mempool, then a snapshot and its page.

    python crates/mempool-py/examples/observe_training.py OUT_DIR

Every PyTorch allocation goes through a pool with a history (`mempool.memory.record`); the batch size
changes from step to step, so the pool's chunks end up with free ranges between live ones. The snapshot
is taken in the middle of the last step (after backward, before the optimizer step: activations freed,
gradients live) and written as OUT_DIR/training.json and OUT_DIR/training.html (open it in a browser).
docs/observe.md's screenshot is this page from a run on an H200. Needs a GPU and PyTorch.
"""
import json
import os
import sys

import torch

from mempool import memory, mr
from mempool.allocators.torch import mempool_torch_allocator


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    rec = memory.record(mr.PoolMemoryResource(mr.CudaAsyncMemoryResource(), initial_pool_size=2**28))
    mr.set_current_device_resource(rec)
    torch.cuda.memory.change_current_allocator(mempool_torch_allocator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
        torch.nn.Linear(4096, 10),
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    snap = None
    batches = [64, 512, 96, 1024, 128, 768, 32, 640]
    for i, b in enumerate(batches):
        x = torch.randn(b, 1024, device="cuda")
        y = torch.randint(0, 10, (b,), device="cuda")
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if i == len(batches) - 1:
            torch.cuda.synchronize()
            snap = memory.snapshot()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    memory.write_html(snap, os.path.join(out_dir, "training.html"))
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump(snap, f)
    pool = next(r for r in snap["resources"] if r["name"] == "PoolResource")
    print(json.dumps({"events": snap["history"]["recorded"], "live": len(snap["live"]),
                      "pool_chunks": len(pool["chunks"]), "pool_stats": pool["stats"]}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
