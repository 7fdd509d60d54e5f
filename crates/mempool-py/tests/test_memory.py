"""mempool.memory (issue 26): snapshots of a resource stack, the viewer page, the out-of-memory report and
retry. The host tests need no GPU; the ``gpu`` ones snapshot a real pool stack and, with PyTorch allocating
through mempool, a small training step (skipped where PyTorch is not installed)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import mempool
from mempool import memory, mr

MARKER = "/*MEMPOOL_SNAPSHOT*/"


def _embedded(page: str) -> str:
    start = page.index('<script id="mempool-snapshot" type="application/json">')
    body = page[start:]
    return body[body.index(">") + 1 : body.index("</script>")]


def test_write_html_embeds_the_snapshot_escaped(tmp_path):
    snap = {
        "schema": "mempool.snapshot",
        "version": 1,
        "source": "python",
        "tags": ["default", "</script><script>alert(1)</script>"],
        "resources": [],
        "live": [],
        "history": {"t_ns": []},
    }
    path = tmp_path / "page.html"
    memory.write_html(snap, path)
    page = path.read_text(encoding="utf-8")
    assert MARKER not in page
    assert "</script><script>alert" not in page
    assert page.count('id="mempool-snapshot"') == 1
    embedded = _embedded(page)
    assert "\\u003c/script>" in embedded
    assert json.loads(embedded) == snap
    # JSON text is embedded as it is (escaped).
    memory.write_html(json.dumps(snap), path)
    assert json.loads(_embedded(path.read_text(encoding="utf-8"))) == snap


def test_the_module_is_exported():
    assert mempool.memory is memory
    for name in ["snapshot", "snapshot_json", "dump_snapshot", "write_html", "record", "oom_retry"]:
        assert callable(getattr(memory, name)), name


def _check_pool_snapshot(s, pool_name="PoolResource"):
    """The numbers of a snapshot of record(PoolMemoryResource(...)) agree with each other."""
    assert s["schema"] == "mempool.snapshot" and s["version"] == 1, s.keys()
    names = [r["name"] for r in s["resources"]]
    assert names[0] == "HistoryResource" and pool_name in names, names
    pool = s["resources"][names.index(pool_name)]
    chunks = pool["chunks"]
    assert chunks, pool
    held = sum(c["size"] for c in chunks)
    used = sum(r["size"] for c in chunks for r in c["ranges"] if r["used"])
    used_n = sum(1 for c in chunks for r in c["ranges"] if r["used"])
    assert pool["stats"]["held_bytes"] == held, (pool["stats"], held)
    assert pool["stats"]["live_bytes"] == used, (pool["stats"], used)
    assert pool["stats"]["live_count"] == used_n, (pool["stats"], used_n)
    for c in chunks:
        at = 0
        for r in c["ranges"]:
            assert r["offset"] == at, c
            at += r["size"]
        assert at == c["size"], c
    h = s["history"]
    n = len(h["t_ns"])
    for col in ["op", "resource", "address", "size", "stream", "tag", "thread"]:
        assert len(h[col]) == n, col
    assert h["dropped"] == 0 and h["recorded"] == n, (h["recorded"], h["dropped"], n)
    # What the history saw made and not freed is live, inside a used range of the pool.
    made = {}
    for i in range(n):
        if h["op"][i] == 0:
            made[h["address"][i]] = h["size"][i]
        elif h["op"][i] == 1:
            made.pop(h["address"][i], None)
    top_live = {l["address"]: l["size"] for l in s["live"] if l["resource"] == 0}
    assert top_live == made, (top_live, made)
    used_ranges = [(c["address"] + r["offset"], r["size"]) for c in chunks for r in c["ranges"] if r["used"]]
    for addr, size in made.items():
        assert any(a <= addr and addr + size <= a + n_ for a, n_ in used_ranges), hex(addr)
    return pool, made


@pytest.mark.gpu
def test_a_pool_stack_snapshot_matches_its_stats(tmp_path):
    pool = mr.PoolMemoryResource(mr.CudaAsyncMemoryResource(), initial_pool_size=64 << 20)
    rec = memory.record(pool)
    bufs = [mempool.DeviceBuffer(size=n, mr=rec) for n in (1000, 1 << 20, 5 << 20, 12345)]
    del bufs[1]
    s = memory.snapshot(rec)
    p, made = _check_pool_snapshot(s)
    assert sorted(made.values()) == [1000, 12345, 5 << 20], made
    st = pool.stats()
    assert (st["reserved_bytes"], st["used_bytes"]) == (p["stats"]["held_bytes"], p["stats"]["live_bytes"]), st
    assert s["devices"] and s["devices"][0]["total_bytes"] > 0, s["devices"]
    memory.dump_snapshot(tmp_path / "s.json", rec)
    assert json.loads((tmp_path / "s.json").read_text())["history"]["op"][:4] == [0, 0, 0, 0]
    memory.write_html(s, tmp_path / "s.html")
    assert json.loads(_embedded((tmp_path / "s.html").read_text(encoding="utf-8"))) == s
    del bufs


@pytest.mark.gpu
def test_out_of_memory_explains_itself_and_retry_retries():
    pool = mr.PoolMemoryResource(mr.CudaAsyncMemoryResource(), initial_pool_size=32 << 20, maximum_pool_size=32 << 20)
    rec = memory.record(pool)
    small = mempool.DeviceBuffer(size=1024, mr=rec)  # the pool reserves its 32 MiB now
    with pytest.raises(mempool.OutOfMemoryError) as e:
        mempool.DeviceBuffer(size=64 << 20, mr=rec)
    msg = str(e.value)
    held = pool.stats()["reserved_bytes"]
    assert held >= 32 << 20
    for part in ["out of memory: HistoryResource > PoolResource > AsyncResource could not allocate 67108864 bytes",
                 f"PoolResource holds {held} bytes, 1024 bytes live", f"its largest free block is {held - 1024} bytes"]:
        assert part in msg, msg
    retry = memory.oom_retry(rec)
    with pytest.raises(mempool.OutOfMemoryError) as e:
        mempool.DeviceBuffer(size=64 << 20, mr=retry)
    assert "failed again after trimming, synchronizing and retrying once" in str(e.value), str(e.value)
    assert str(e.value).startswith("out of memory: OomRetryAdaptor > HistoryResource > PoolResource"), str(e.value)
    del small


TORCH_STEP = """
import json, sys
import torch
from mempool import memory, mr
from mempool.allocators.torch import mempool_torch_allocator

out = sys.argv[1]
rec = memory.record(mr.PoolMemoryResource(mr.CudaAsyncMemoryResource(), initial_pool_size=2**27))
mr.set_current_device_resource(rec)
# Every PyTorch allocation of the process, the autograd threads' too, goes through `rec`.
torch.cuda.memory.change_current_allocator(mempool_torch_allocator)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 1024, device="cuda")
y = torch.randint(0, 10, (256,), device="cuda")
loss = torch.nn.functional.cross_entropy(model(x), y)
loss.backward()
torch.cuda.synchronize()
snap = memory.snapshot()  # the current resource, `rec`, in the middle of the step: gradients live
opt.step()
torch.cuda.synchronize()
memory.write_html(snap, out + ".html")
with open(out + ".json", "w") as f:
    json.dump(snap, f)
ptrs = [p.data_ptr() for p in model.parameters()] + [p.grad.data_ptr() for p in model.parameters()]
print(json.dumps({"ptrs": ptrs, "x": x.data_ptr()}))
"""


@pytest.mark.gpu
def test_a_snapshot_taken_during_a_torch_training_step_opens_in_the_page(tmp_path):
    pytest.importorskip("torch")
    out = str(tmp_path / "step")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(TORCH_STEP), out], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    ptrs = seen["ptrs"] + [seen["x"]]
    with open(out + ".json") as f:
        s = json.load(f)
    pool, made = _check_pool_snapshot(s)
    assert s["source"] == "python"
    # Every parameter, gradient and the input lie in a live allocation the history saw.
    for ptr in ptrs:
        assert any(a <= ptr < a + n for a, n in made.items()), (hex(ptr), {hex(a): n for a, n in made.items()})
    # The weights and gradients (2 x (1024*2048 + 2048 + 2048*10 + 10) floats) are live.
    params = 1024 * 2048 + 2048 + 2048 * 10 + 10
    assert sum(made.values()) >= 2 * 4 * params, sum(made.values())
    page = (tmp_path / "step.html").read_text(encoding="utf-8")
    assert MARKER not in page
    assert json.loads(_embedded(page)) == s


@pytest.mark.gpu
def test_the_observe_training_example_writes_its_snapshot_and_page(tmp_path):
    pytest.importorskip("torch")
    example = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "observe_training.py")
    p = subprocess.run([sys.executable, example, str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ))
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    with open(tmp_path / "training.json") as f:
        s = json.load(f)
    assert s["schema"] == "mempool.snapshot" and s["version"] == 1
    assert summary["events"] == s["history"]["recorded"] > 0
    assert summary["pool_chunks"] >= 1 and summary["live"] == len(s["live"]) > 0
    page = (tmp_path / "training.html").read_text(encoding="utf-8")
    assert json.loads(_embedded(page)) == s
