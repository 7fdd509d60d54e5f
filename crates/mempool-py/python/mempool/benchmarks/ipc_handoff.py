"""Hand a GPU buffer from a producer process to consumer processes and back, from Python.

``python -m mempool.benchmarks.ipc_handoff`` measures, in one run and on one GPU, the same hand-off through:

- ``mempool``: ``mempool.ipc`` with its shared-memory rings (protocol version 3, the default), buffers
  suballocated from a ``PoolMemoryResource`` over an IPC-enabled ``CudaAsyncMemoryResource`` (kept blocks:
  no import per buffer);
- ``mempool-nospin``: ``mempool`` with the exporter's two spins off (``Exporter.spin`` and
  ``Exporter.wait_spin`` set to 0: the serving thread and ``wait_released`` sleep at once), for comparison
  in the same run;
- ``mempool-socket``: the same over the socket (``rings=False``, protocol version 2: the path before the
  rings, for comparison in the same run);
- ``mempool-acked``: ``mempool`` with the sustained part's per-buffer acknowledgement on the pipe as well (the
  shape this benchmark had before; see below), for comparison in the same run;
- ``torch``: ``torch.multiprocessing`` (a CUDA tensor put in a ``torch.multiprocessing`` queue);
- ``cuda.core``: cuda.core's IPC-enabled ``DeviceMemoryResource`` (the resource passed to the child once,
  then ``Buffer`` objects through a ``multiprocessing`` queue).

Each hand-off has the same shape: a fresh buffer filled on the GPU (PyTorch, through DLPack where the buffer
is not a tensor), handed over, viewed in the consumer with no copy (``torch.from_dlpack``), its first byte
read on the GPU, let go, and acknowledged (one byte on a pipe). The producer's clock runs from the allocation
to the acknowledgement (for ``mempool``, to ``wait_released``). Round trip: one consumer, the median and mean
per size. Sustained: 1, 2 and up to ``--consumers`` consumers, four buffers in flight per consumer, buffers per
second. In the sustained part of ``mempool`` and ``mempool-socket`` the release is the acknowledgement: the
producer waits for the oldest buffer in flight with ``wait_released`` (which returns once the consumer let go of
it, after its first byte was read and checked), and each consumer answers on its pipe once per run, after
checking every buffer (a wrong byte is reported there, and fails the run); ``torch`` and ``cuda.core`` have no
release to wait for and are acknowledged on the pipe per buffer, as is ``mempool-acked``. The output names the device, the host CPU, whether CUDA MPS is in use, every framework's numbers, and
the ratios the targets of issue 25 name (round trip at most 100 us, sustained at least 10x
``torch.multiprocessing``). A framework that is not installed, or that fails, is reported as such and the run
goes on.

Importing this module imports no framework and not mempool's compiled extension.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

FRAMEWORKS = ("mempool", "mempool-nospin", "mempool-socket", "mempool-acked", "torch", "cuda.core")
KIB, MIB = 1 << 10, 1 << 20
ROUND_SIZES = (4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB)
SUSTAINED_SIZES = (64 * KIB, MIB, 16 * MIB)
WINDOW = 4
TIMEOUT = 120.0


def human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def host_cpu() -> str:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} CPUs available"


# ------------------------------------------------------------------------------------------- consumer


def _consumer(framework: str, setup, queue, conn) -> None:
    """One consumer process: connects (or registers) as `framework` says, then for each command
    ``n`` on `conn` receives ``n`` buffers, views each with torch, reads its first byte on the GPU, lets go
    and acknowledges it with one byte; for a command ``n:end``, acknowledges once, after the ``n``-th (the
    producer waits for each release instead); ``b"stop"`` ends it. Reports ``b"ready"`` once set up, or
    ``b"error:..."`` with the traceback."""
    try:
        import torch

        torch.cuda.init()
        if framework.startswith("mempool"):
            from mempool import ipc

            importer = ipc.Importer(setup, timeout=30.0, rings=(framework != "mempool-socket"))

            def take():
                return importer.recv(timeout=TIMEOUT)
        elif framework == "torch":
            def take():
                return queue.get(timeout=TIMEOUT)
        else:
            device, _mr = setup  # passing the resource registers it: buffers of it unpickle here
            device.set_current()

            def take():
                return queue.get(timeout=TIMEOUT)
        conn.send_bytes(b"ready")
        while True:
            cmd = conn.recv_bytes()
            if cmd == b"stop":
                break
            count, _, mode = cmd.partition(b":")
            each = mode != b"end"
            for _ in range(int(count)):
                obj = take()
                t = obj if framework == "torch" else torch.from_dlpack(obj)
                first = int(t[0].item())  # a read of the first byte on the GPU (and its value back)
                if first != 1:
                    raise RuntimeError(f"the first byte is {first}, the producer wrote 1")
                del t
                if framework == "cuda.core":
                    obj.close()
                del obj
                if each:
                    conn.send_bytes(b"a")
            if not each:
                conn.send_bytes(b"a")
    except BaseException:  # noqa: BLE001 - reported to the producer
        try:
            conn.send_bytes(b"error:" + traceback.format_exc().encode())
        except OSError:
            pass


# ------------------------------------------------------------------------------------------- producer


class Side:
    """The producer's side of one framework: its consumers and how it makes and hands over a buffer."""

    def __init__(self, framework: str, consumers: int):
        import torch

        self.torch = torch
        self.framework = framework
        self.ctx = multiprocessing.get_context("spawn")
        self.stream = torch.cuda.current_stream()
        self.children, self.conns, self.queues, self.ids = [], [], [], []
        setup = None
        if framework.startswith("mempool"):
            from mempool import ipc, mr

            upstream = mr.CudaAsyncMemoryResource(enable_ipc=True)
            self.pool = mr.PoolMemoryResource(upstream, initial_pool_size=1 << 30)
            path = os.path.join(tempfile.mkdtemp(prefix="mempool-ipc-bench-"), "handoff.sock")
            self.exporter = ipc.Exporter(path, self.pool)
            if framework == "mempool-nospin":
                self.exporter.spin = 0.0
                self.exporter.wait_spin = 0.0
            setup = path
        elif framework == "cuda.core":
            try:
                from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
            except ImportError:
                from cuda.core.experimental import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
            self.device = Device(torch.cuda.current_device())
            self.device.set_current()
            self.mr = DeviceMemoryResource(self.device, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 << 30))
            setup = (self.device, self.mr)
        for _ in range(consumers):
            queue = (torch.multiprocessing.get_context("spawn").Queue() if framework == "torch" else self.ctx.Queue())
            parent, child = self.ctx.Pipe()
            p = self.ctx.Process(target=_consumer, args=(framework, setup, queue, child), daemon=True)
            p.start()
            self.children.append(p)
            self.conns.append(parent)
            self.queues.append(queue)
        for c in self.conns:
            self._expect(c, b"ready")
        if framework.startswith("mempool"):
            infos = self.exporter.wait_for_importers(consumers, timeout=TIMEOUT)
            by_pid = {i["pid"]: i["id"] for i in infos}
            self.ids = [by_pid[p.pid] for p in self.children]

    def _expect(self, conn, what: bytes) -> None:
        if not conn.poll(TIMEOUT):
            raise RuntimeError(f"{self.framework}: no answer from a consumer within {TIMEOUT} s")
        got = conn.recv_bytes()
        if got != what:
            raise RuntimeError(f"{self.framework}: a consumer said {got.decode(errors='replace')}")

    def make_and_send(self, i: int, size: int):
        """A fresh buffer of `size` bytes filled with 1 on the GPU, handed to consumer `i`; returns what
        the producer keeps until the acknowledgement."""
        torch = self.torch
        if self.framework.startswith("mempool"):
            buf = self.exporter.alloc(size)
            torch.from_dlpack(buf).fill_(1)
            self.exporter.share(buf, to=[self.ids[i]], stream=self.stream)
            return buf
        if self.framework == "torch":
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
            t.fill_(1)
            self.queues[i].put(t)
            return t
        buf = self.mr.allocate(size, stream=self.device.default_stream)  # cuda.core asks for a stream
        torch.from_dlpack(buf).fill_(1)
        self.stream.synchronize()  # nothing orders the consumer after this work: it must be done
        self.queues[i].put(buf)
        return buf

    def finish(self, kept) -> None:
        """After the acknowledgement: the producer lets go of its buffer."""
        if self.framework.startswith("mempool"):
            kept.wait_released(timeout=TIMEOUT)
        elif self.framework == "cuda.core":
            kept.close()

    def ack(self, i: int) -> None:
        got = self.conns[i].recv_bytes()
        if got != b"a":
            raise RuntimeError(f"{self.framework}: consumer {i} said {got.decode(errors='replace')}")

    def round_trip(self, size: int, iterations: int) -> list[float]:
        self.conns[0].send_bytes(str(iterations).encode())
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            kept = self.make_and_send(0, size)
            self.ack(0)
            self.finish(kept)
            times.append((time.perf_counter() - t0) * 1e6)
            del kept
        return times

    def sustained(self, size: int, consumers: int, per_consumer: int) -> float:
        if self.framework in ("mempool", "mempool-nospin", "mempool-socket"):
            return self.sustained_by_release(size, consumers, per_consumer)
        for i in range(consumers):
            self.conns[i].send_bytes(str(per_consumer).encode())
        sent = [0] * consumers
        flight = [[] for _ in range(consumers)]
        done = 0
        total = per_consumer * consumers
        t0 = time.perf_counter()
        while done < total:
            for i in range(consumers):
                while sent[i] < per_consumer and len(flight[i]) < WINDOW:
                    flight[i].append(self.make_and_send(i, size))
                    sent[i] += 1
            ready = wait(self.conns[:consumers], timeout=TIMEOUT)
            if not ready:
                raise RuntimeError(f"{self.framework}: no acknowledgement within {TIMEOUT} s")
            for c in ready:
                i = self.conns.index(c)
                self.ack(i)
                self.finish(flight[i].pop(0))
                done += 1
        self.torch.cuda.synchronize()
        return total / (time.perf_counter() - t0)

    def sustained_by_release(self, size: int, consumers: int, per_consumer: int) -> float:
        """`sustained` with the release as the acknowledgement: the oldest buffer in flight to each consumer is
        waited for with ``wait_released``; each consumer answers on its pipe once, after its last buffer."""
        for i in range(consumers):
            self.conns[i].send_bytes(f"{per_consumer}:end".encode())
        sent = [0] * consumers
        flight = [[] for _ in range(consumers)]
        done = 0
        total = per_consumer * consumers
        t0 = time.perf_counter()
        while done < total:
            for i in range(consumers):
                while sent[i] < per_consumer and len(flight[i]) < WINDOW:
                    flight[i].append(self.make_and_send(i, size))
                    sent[i] += 1
                if flight[i]:
                    self.finish(flight[i].pop(0))
                    done += 1
        for i in range(consumers):
            self.ack(i)  # every buffer was checked
        self.torch.cuda.synchronize()
        return total / (time.perf_counter() - t0)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send_bytes(b"stop")
            except OSError:
                pass
        for p in self.children:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if self.framework.startswith("mempool"):
            self.exporter.shutdown()


def run(frameworks, consumers: int, iterations: int, sustained_buffers: int) -> dict:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    report = {
        "device": f"{props.name} (torch {torch.__version__}, CUDA {torch.version.cuda})",
        "host_cpu": host_cpu(),
        "mps": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        "command": " ".join([sys.executable, "-m", "mempool.benchmarks.ipc_handoff", *sys.argv[1:]]),
        "round_trip": {},
        "sustained": {},
        "errors": {},
    }
    counts = sorted({1, 2, consumers} & set(range(1, consumers + 1)))
    for fw in frameworks:
        side = None
        try:
            side = Side(fw, consumers)
            # mempool-acked differs from mempool in the sustained part only.
            for size in ROUND_SIZES if fw != "mempool-acked" else ():
                n = max(20, min(iterations, (512 * MIB) // size))
                side.round_trip(size, 5)  # warm-up
                times = side.round_trip(size, n)
                report["round_trip"].setdefault(fw, {})[size] = (statistics.median(times), statistics.fmean(times))
            for size in SUSTAINED_SIZES:
                per = max(WINDOW * 4, min(sustained_buffers, (1024 * MIB) // size // consumers))
                for k in counts:
                    rate = side.sustained(size, k, per)
                    report["sustained"].setdefault(fw, {})[(size, k)] = rate
        except Exception:  # noqa: BLE001 - one framework's failure is reported, the others run
            report["errors"][fw] = traceback.format_exc(limit=3)
        finally:
            if side is not None:
                try:
                    side.close()
                except Exception:  # noqa: BLE001
                    pass
    report["counts"] = counts
    return report


def print_report(report: dict, frameworks) -> None:
    print(f"device: {report['device']}")
    print(f"host CPU: {report['host_cpu']}")
    print(f"CUDA MPS: {'CUDA_MPS_PIPE_DIRECTORY=' + report['mps'] if report['mps'] else 'not set'}")
    print(f"command: {report['command']}")
    shown = [fw for fw in frameworks if fw in report["round_trip"]]
    print()
    print("Round trip, 1 consumer (microseconds, median / mean)")
    print("| size | " + " | ".join(shown) + " | torch / mempool (median) |")
    print("|---:|" + "---:|" * (len(shown) + 1))
    rt = report["round_trip"]
    for size in ROUND_SIZES:
        cells = [f"{rt[fw][size][0]:.1f} / {rt[fw][size][1]:.1f}" if size in rt.get(fw, {}) else "-" for fw in shown]
        ratio = "-"
        if size in rt.get("torch", {}) and size in rt.get("mempool", {}):
            ratio = f"{rt['torch'][size][0] / rt['mempool'][size][0]:.1f}x"
        print(f"| {human(size)} | " + " | ".join(cells) + f" | {ratio} |")
    print()
    print(f"Sustained, {WINDOW} buffers in flight per consumer (buffers per second)")
    print("| size | consumers | " + " | ".join(shown) + " | mempool / torch |")
    print("|---:|---:|" + "---:|" * (len(shown) + 1))
    st = report["sustained"]
    for size in SUSTAINED_SIZES:
        for k in report["counts"]:
            cells = [f"{st[fw][(size, k)]:.0f}" if (size, k) in st.get(fw, {}) else "-" for fw in shown]
            ratio = "-"
            if (size, k) in st.get("torch", {}) and (size, k) in st.get("mempool", {}):
                ratio = f"{st['mempool'][(size, k)] / st['torch'][(size, k)]:.1f}x"
            print(f"| {human(size)} | {k} | " + " | ".join(cells) + f" | {ratio} |")
    print()
    print("Targets (issue 25; one run, baselines above):")
    k = max(report["counts"]) if report["counts"] else 0
    for fw in ("mempool", "mempool-nospin"):
        mine = rt.get(fw, {})
        if mine:
            worst = max(v[0] for v in mine.values())
            print(f"- {fw} round trip, worst median over the sizes: {worst:.1f} us (target <= 100 us): "
                  f"{'met' if worst <= 100 else 'MISSED'}")
        for size in SUSTAINED_SIZES:
            a, b = st.get(fw, {}).get((size, k)), st.get("torch", {}).get((size, k))
            if a and b:
                print(f"- {fw} sustained {human(size)} to {k} consumers: {a:.0f}, torch {b:.0f}: {a / b:.1f}x "
                      f"(target >= 10x): {'met' if a >= 10 * b else 'MISSED'}")
    for fw, err in report["errors"].items():
        print(f"\n{fw}: failed or not available:\n{err}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mempool.benchmarks.ipc_handoff", description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                   help=f"comma-separated, from {', '.join(FRAMEWORKS)} (default: all)")
    p.add_argument("--consumers", type=int, default=4, help="the most consumers of the sustained part (default 4)")
    p.add_argument("--iterations", type=int, default=1000, help="round trips per size at most (default 1000)")
    p.add_argument("--sustained-buffers", type=int, default=2000,
                   help="buffers per consumer in the sustained part at most (default 2000)")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = p.parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown:
        p.error(f"unknown framework(s) {', '.join(unknown)}: choose from {', '.join(FRAMEWORKS)}")
    if args.consumers < 1 or args.iterations < 1 or args.sustained_buffers < 1:
        p.error("--consumers, --iterations and --sustained-buffers must be at least 1")
    try:
        import torch
    except ImportError:
        print("ipc_handoff: needs PyTorch (every framework's consumer views buffers with torch.from_dlpack)",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("ipc_handoff: needs a CUDA GPU", file=sys.stderr)
        return 2
    report = run(frameworks, args.consumers, args.iterations, args.sustained_buffers)
    print_report(report, frameworks)
    if args.json:
        def keys(d):
            return {str(k): v for k, v in d.items()}

        out = dict(report)
        out["round_trip"] = {fw: keys(v) for fw, v in report["round_trip"].items()}
        out["sustained"] = {fw: keys(v) for fw, v in report["sustained"].items()}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
