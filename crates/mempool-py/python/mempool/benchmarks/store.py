"""Time to first forward pass of a restarted PyTorch process: weights attached from the memory store against
weights loaded from a file in host memory, in the same run.

    python -m mempool.benchmarks.store [--gib 4] [--hidden 8192] [--batch 16] [--repeats 3] [--dir DIR]

The model is a stack of ``Linear(hidden, hidden, bias=False)`` layers with ReLU between them, in float16,
with as many layers as make ``--gib`` GiB of weights. The run:

1. This process starts a memory server (``mempool.ipc.serve``) on GPU 0, on a temporary socket.
2. A producer process creates one named buffer per layer (``bench/layer.N``), initialises the weights in
   place (through ``torch.from_dlpack``, seeded), publishes them, writes the same weights to a file in
   host memory (``torch.save`` into ``--dir``: ``/dev/shm`` when it has room, else the temporary
   directory, whose file was just written and so sits in the page cache) and the output of a forward pass
   over a seeded input (the reference), and exits.
3. Then, ``--repeats`` times, alternating: a fresh process that attaches every layer by name, builds the
   model over the attached memory (``torch.from_dlpack``: each weight's address is the buffer's, checked)
   and runs a forward pass; and a fresh process that loads the file (``torch.load(mmap=True)``), copies
   the weights to the GPU, builds the same model and runs the forward pass. Each compares its output
   with the reference (``torch.equal``).

Reported, per path, the median over the repeats of the time to first forward pass measured in the
process: from after ``import torch`` and CUDA's start (a context and one tiny kernel) to the forward pass's
output on the host side of a ``torch.cuda.synchronize`` (process start, Python and PyTorch imports
excluded); and the whole process's wall time as this process sees it (start included). The outputs must
be equal. The device, host CPU, PyTorch version and command are printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

LAYER_PREFIX = "bench/layer."


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ------------------------------------------------------------------------------------------ child processes


def _start_cuda():
    import torch

    torch.cuda.init()
    torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    return torch


def _forward(torch, weights, x):
    """The model over ``weights`` (tensors, used as they are) applied to ``x``."""
    model = torch.nn.Sequential()
    for i, w in enumerate(weights):
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        model.append(layer)
        if i + 1 < len(weights):
            model.append(torch.nn.ReLU())
    with torch.inference_mode():
        return model(x)


def _input(torch, cfg):
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    return torch.randn(cfg["batch"], cfg["hidden"], device="cuda", dtype=torch.float16, generator=g)


def _producer(cfg):
    import math

    from mempool import ipc

    torch = _start_cuda()
    client = ipc.Client(cfg["socket"])
    stream = torch.cuda.Stream()
    h = cfg["hidden"]
    nbytes = h * h * 2
    torch.manual_seed(0)
    published, weights = [], []
    with torch.cuda.stream(stream):
        for i in range(cfg["layers"]):
            buf = client.create(f"{LAYER_PREFIX}{i}", nbytes, device=0, tag="store benchmark")
            w = torch.from_dlpack(buf)[:nbytes].view(torch.float16).view(h, h)
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            weights.append(w)
            published.append(buf.publish(stream))
        y = _forward(torch, weights, _input(torch, cfg))
    stream.synchronize()
    torch.save({f"layer.{i}": w.cpu() for i, w in enumerate(weights)}, cfg["file"])
    torch.save(y.cpu(), cfg["reference"])
    print(json.dumps({"ok": True}), flush=True)


def _attach(cfg):
    from mempool import ipc

    torch = _start_cuda()
    t0 = time.perf_counter()
    client = ipc.Client(cfg["socket"])
    h = cfg["hidden"]
    stream = torch.cuda.current_stream()
    weights, buffers = [], []
    for i in range(cfg["layers"]):
        buf = client.attach(f"{LAYER_PREFIX}{i}", stream=stream)
        w = torch.from_dlpack(buf)[: h * h * 2].view(torch.float16).view(h, h)
        if w.data_ptr() != buf.ptr:
            raise SystemExit(f"layer {i}: the tensor is not the attached memory (a copy)")
        weights.append(w)
        buffers.append(buf)
    y = _forward(torch, weights, _input(torch, cfg))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    _report(torch, cfg, y, t1 - t0)


def _file(cfg):
    torch = _start_cuda()
    t0 = time.perf_counter()
    state = torch.load(cfg["file"], map_location="cpu", mmap=True, weights_only=True)
    weights = [state[f"layer.{i}"].to("cuda") for i in range(cfg["layers"])]
    y = _forward(torch, weights, _input(torch, cfg))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    _report(torch, cfg, y, t1 - t0)


def _report(torch, cfg, y, seconds):
    ref = torch.load(cfg["reference"], weights_only=True)
    got = y.cpu()
    equal = bool(torch.equal(got, ref))
    diff = float((got.float() - ref.float()).abs().max())
    print(json.dumps({"ok": True, "seconds": seconds, "equal": equal, "max_abs_diff": diff}), flush=True)


# ------------------------------------------------------------------------------------------ the driver


def _run_child(role, cfg):
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "mempool.benchmarks.store", "--child", role, "--config", json.dumps(cfg)],
        capture_output=True, text=True, env=env,
    )
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the {role} process failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    result = json.loads(lines[-1])
    result["wall"] = wall
    return result


def _pick_dir(need: int) -> str:
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need * 1.2:
        return "/dev/shm"
    return tempfile.gettempdir()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mempool.benchmarks.store", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=4.0, help="GiB of weights (default 4)")
    p.add_argument("--hidden", type=int, default=8192, help="the layers' width (default 8192)")
    p.add_argument("--batch", type=int, default=16, help="rows of the input (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per path (default 3)")
    p.add_argument("--dir", default=None, help="where the weights file goes (default /dev/shm if it has room)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        cfg = json.loads(args.config)
        {"producer": _producer, "attach": _attach, "file": _file}[args.child](cfg)
        return 0
    if args.hidden < 1 or args.batch < 1 or args.repeats < 1 or args.gib <= 0:
        p.error("--hidden, --batch and --repeats must be at least 1, --gib positive")
    layer_bytes = args.hidden * args.hidden * 2
    layers = max(1, round(args.gib * (1 << 30) / layer_bytes))
    total = layers * layer_bytes

    import mempool
    from mempool import ipc

    work = tempfile.mkdtemp(prefix="mempool-store-bench-")
    data_dir = args.dir or _pick_dir(total)
    files = tempfile.mkdtemp(prefix="mempool-store-bench-", dir=data_dir)
    cfg = {
        "socket": os.path.join(work, "svc.sock"),
        "hidden": args.hidden,
        "layers": layers,
        "batch": args.batch,
        "file": os.path.join(files, "weights.pt"),
        "reference": os.path.join(files, "reference.pt"),
    }
    results = {"attach": [], "file": []}
    try:
        try:
            server = ipc.serve(cfg["socket"], devices=[0])
        except (mempool.MempoolError, OSError) as e:
            print(f"store benchmark: cannot start the memory server: {e}", file=sys.stderr)
            return 2
        with server:
            _run_child("producer", cfg)
            for _ in range(args.repeats):
                for role in ("attach", "file"):
                    results[role].append(_run_child(role, cfg))
            stats = server.stats()
    finally:
        shutil.rmtree(files, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    info = json.loads(
        subprocess.run(
            [sys.executable, "-c", "import json, torch; print(json.dumps([torch.cuda.get_device_name(0), "
             "torch.__version__, torch.version.cuda]))"],
            capture_output=True, text=True, check=True,
        ).stdout
    )
    print(f"## memory store: time to first forward pass ({layers} x Linear({args.hidden}, {args.hidden}) "
          f"float16, {total / (1 << 30):.2f} GiB of weights, batch {args.batch})")
    print()
    print(f"- device: {info[0]}; PyTorch {info[1]} (CUDA {info[2]}); host CPU: {_cpu_model()}")
    print(f"- command: {' '.join(shlex.quote(a) for a in [sys.executable, '-m', 'mempool.benchmarks.store', *(argv if argv is not None else sys.argv[1:])])}")
    print(f"- weights file: {data_dir} (torch.save, loaded with torch.load(mmap=True) then .to('cuda'))")
    print(f"- server after the run: {stats['named']} named buffers, {stats['bytes']} bytes")
    print()
    print("| path | first forward, in process (ms, median) | each (ms) | process wall incl. start (ms, median) | outputs equal |")
    print("|---|---|---|---|---|")
    ok = True
    for role, label in (("attach", "attach by name (mempool.ipc.Client)"), ("file", "load file from host memory")):
        rs = results[role]
        ms = [r["seconds"] * 1e3 for r in rs]
        wall = [r["wall"] * 1e3 for r in rs]
        equal = all(r["equal"] for r in rs)
        ok &= equal
        worst = max(r["max_abs_diff"] for r in rs)
        print(f"| {label} | {statistics.median(ms):.1f} | {', '.join(f'{m:.1f}' for m in ms)} | "
              f"{statistics.median(wall):.0f} | {'yes' if equal else f'NO (max abs diff {worst})'} |")
    a = statistics.median(r["seconds"] for r in results["attach"])
    f = statistics.median(r["seconds"] for r in results["file"])
    print()
    print(f"attach is {f / a:.1f}x faster to the first forward pass (in process)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
