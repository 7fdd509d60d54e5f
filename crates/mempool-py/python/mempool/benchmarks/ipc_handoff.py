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

``--trace`` adds a phase of its own after those measurements (they are taken as without it): ``mempool``'s
hand-off at 64 KiB, ``--iterations`` round trips and a sustained run to 4 consumers (``--sustained-buffers``
each), with ``time.perf_counter_ns`` around each step of the producer (``alloc``, ``torch.from_dlpack``,
``fill_``, ``share``, the acknowledgement, ``wait_released``) and of the consumers (``recv``, split at the
moment the producer's ``share`` returned, ``torch.from_dlpack``, the first byte's read and host sync, the
release, the acknowledgement), the consumers' timings sent back once after each run. It prints the median and
90th percentile per step, the steps across processes (perf_counter is CLOCK_MONOTONIC on Linux: one clock for
every process), and the producer's Python work per buffer (alloc to share) with the rate it alone allows.

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
TRACE_SIZE = 64 * KIB
TRACE_CONSUMERS = 4
# What a traced consumer stamps (time.perf_counter_ns) per buffer, in order: before importer.recv, after it,
# after reading the buffer's id, after torch.from_dlpack, after t[0], after .item(), after checking the byte,
# after `del` of the tensor, after `del` of the buffer (the release), after the acknowledgement on the pipe.
CONSUMER_STAMPS = ("call", "recv", "id", "dlpack", "index", "item", "check", "deltensor", "release", "acked")


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
            if cmd.startswith(b"trace:"):  # the --trace phase (mempool only): the same steps, timed
                _, count, mode = cmd.split(b":")
                _consumer_traced(torch, take, conn, int(count), mode != b"end")
                continue
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


def _consumer_traced(torch, take, conn, count: int, each: bool) -> None:
    """The consumer's loop of `_consumer` for ``mempool``, each step timed with ``time.perf_counter_ns``:
    receives `count` buffers (acknowledging each on the pipe if `each`, else once after the last), then sends
    its timings on the pipe once, as ``b"trace:"`` and a JSON list of rows ``[id, *stamps]`` (`CONSUMER_STAMPS`
    names them), collected in a list so that no pipe traffic but the acknowledgements is in the loop."""
    ns = time.perf_counter_ns
    rows = []
    for _ in range(count):
        t0 = ns()
        obj = take()
        t1 = ns()
        bid = obj.id
        t2 = ns()
        t = torch.from_dlpack(obj)
        t3 = ns()
        v = t[0]
        t4 = ns()
        first = int(v.item())  # a read of the first byte on the GPU (and its value back: the host sync)
        t5 = ns()
        if first != 1:
            raise RuntimeError(f"the first byte is {first}, the producer wrote 1")
        t6 = ns()
        del v, t
        t7 = ns()
        del obj  # the last reference: the release
        t8 = ns()
        if each:
            conn.send_bytes(b"a")
        t9 = ns()
        rows.append((bid, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9))
    if not each:
        conn.send_bytes(b"a")
    conn.send_bytes(b"trace:" + json.dumps(rows).encode())


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

    # --------------------------------------------------------------------------------- --trace (mempool)

    def _trace_rows(self, i: int) -> dict:
        """Consumer `i`'s timings after a traced run: its rows by buffer id, as `CONSUMER_STAMPS` name them."""
        if not self.conns[i].poll(TIMEOUT):
            raise RuntimeError(f"{self.framework}: no timings from consumer {i} within {TIMEOUT} s")
        got = self.conns[i].recv_bytes()
        if not got.startswith(b"trace:"):
            raise RuntimeError(f"{self.framework}: consumer {i} said {got.decode(errors='replace')}")
        return {row[0]: dict(zip(CONSUMER_STAMPS, row[1:])) for row in json.loads(got[len(b"trace:"):])}

    def _traced_make_and_send(self, i: int, size: int, ns):
        """`make_and_send` for ``mempool``, each step timed: the buffer and its stamps (`PRODUCER_STAMPS`)."""
        torch = self.torch
        t0 = ns()
        buf = self.exporter.alloc(size)
        t1 = ns()
        view = torch.from_dlpack(buf)
        t2 = ns()
        view.fill_(1)
        t3 = ns()
        del view
        t4 = ns()
        self.exporter.share(buf, to=[self.ids[i]], stream=self.stream)
        t5 = ns()
        return buf, {"start": t0, "alloc": t1, "dlpack": t2, "fill": t3, "deltensor": t4, "share": t5}

    def trace_round_trip(self, size: int, iterations: int) -> dict:
        """`round_trip` with every step of both sides timed (``mempool`` only): the producer's stamps by
        buffer id, the consumer's, and the hand-offs' count."""
        ns = time.perf_counter_ns
        self.conns[0].send_bytes(f"trace:{iterations}:each".encode())
        prod = {}
        for _ in range(iterations):
            buf, st = self._traced_make_and_send(0, size, ns)
            self.ack(0)
            st["ack"] = st["wait"] = ns()
            buf.wait_released(timeout=TIMEOUT)
            st["released"] = ns()
            bid = buf.id
            del buf
            st["freed"] = ns()
            prod[bid] = st
        return {"producer": prod, "consumers": [self._trace_rows(0)], "buffers": iterations}

    def trace_sustained(self, size: int, consumers: int, per_consumer: int) -> dict:
        """`sustained_by_release` with every step of both sides timed (``mempool`` only): the stamps as
        `trace_round_trip` returns them, and the rate of the traced run."""
        ns = time.perf_counter_ns
        for i in range(consumers):
            self.conns[i].send_bytes(f"trace:{per_consumer}:end".encode())
        sent = [0] * consumers
        flight = [[] for _ in range(consumers)]
        prod = {}
        done = 0
        total = per_consumer * consumers
        t0 = time.perf_counter()
        while done < total:
            for i in range(consumers):
                while sent[i] < per_consumer and len(flight[i]) < WINDOW:
                    flight[i].append(self._traced_make_and_send(i, size, ns))
                    sent[i] += 1
                if flight[i]:
                    buf, st = flight[i].pop(0)
                    st["wait"] = ns()
                    buf.wait_released(timeout=TIMEOUT)
                    st["released"] = ns()
                    bid = buf.id
                    del buf
                    st["freed"] = ns()
                    prod[bid] = st
                    done += 1
        for i in range(consumers):
            self.ack(i)  # every buffer was checked
        self.torch.cuda.synchronize()
        rate = total / (time.perf_counter() - t0)
        rows = [self._trace_rows(i) for i in range(consumers)]
        return {"producer": prod, "consumers": rows, "buffers": total, "rate": rate}

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


# ------------------------------------------------------------------------------------------- --trace


def _stat(values) -> tuple[float, float]:
    """The median and the 90th percentile (nearest rank) of nanosecond `values`, in microseconds."""
    s = sorted(values)
    return statistics.median(s) / 1e3, s[min(len(s) - 1, (9 * len(s)) // 10)] / 1e3


def cross_process_clock() -> bool:
    """Whether time.perf_counter_ns reads one clock in every process of this host (CLOCK_MONOTONIC): only then
    are a producer's and a consumer's stamps compared."""
    return "CLOCK_MONOTONIC" in time.get_clock_info("perf_counter").implementation


def summarize_trace(trace: dict, each: bool) -> dict:
    """The steps of a traced run (`Side.trace_round_trip` or `Side.trace_sustained`) as rows ``[side, step,
    median us, p90 us]``, the producer's Python work per buffer (alloc + from_dlpack + fill_ + del + share) and
    the rate it alone allows (1e6 / its median), and, for a sustained run, its rate. `each`: the consumers
    acknowledged each buffer on the pipe (the round trip)."""
    prod = trace["producer"]
    cons = {}
    for rows in trace["consumers"]:
        cons.update(rows)
    if set(cons) != set(prod):
        raise RuntimeError(f"trace: the producer timed {len(prod)} buffers, the consumers {len(cons)}, "
                           f"{len(set(prod) ^ set(cons))} of them not on both sides")
    P = list(prod.values())
    pairs = [(prod[i], cons[i]) for i in prod]
    rows = []

    def add(side, step, values):
        rows.append([side, step, *_stat(values)])

    add("producer", "exporter.alloc", [r["alloc"] - r["start"] for r in P])
    add("producer", "torch.from_dlpack(buf)", [r["dlpack"] - r["alloc"] for r in P])
    add("producer", ".fill_(1) (a launch)", [r["fill"] - r["dlpack"] for r in P])
    add("producer", "del tensor", [r["deltensor"] - r["fill"] for r in P])
    add("producer", "exporter.share", [r["share"] - r["deltensor"] for r in P])
    if each:
        add("producer", "acknowledgement (pipe recv_bytes)", [r["ack"] - r["share"] for r in P])
    add("producer", "wait_released", [r["released"] - r["wait"] for r in P])
    add("producer", "del buffer (back to the pool)", [r["freed"] - r["released"] for r in P])
    if each:
        add("producer", "whole hand-off (alloc to wait_released)", [r["released"] - r["start"] for r in P])
    C = list(cons.values())
    add("consumer", "importer.recv, whole call", [c["recv"] - c["call"] for c in C])
    cross = cross_process_clock()
    if cross:
        add("consumer", "importer.recv, before share() returned",
            [max(0, min(p["share"], c["recv"]) - c["call"]) for p, c in pairs])
        add("consumer", "importer.recv, after share() returned (<0: before)",
            [c["recv"] - max(c["call"], p["share"]) for p, c in pairs])
    add("consumer", "torch.from_dlpack(buf)", [c["dlpack"] - c["id"] for c in C])
    add("consumer", "t[0] (a view, host only)", [c["index"] - c["dlpack"] for c in C])
    add("consumer", ".item() (GPU read + host sync)", [c["item"] - c["index"] for c in C])
    add("consumer", "del tensor", [c["deltensor"] - c["check"] for c in C])
    add("consumer", "del buffer (the release)", [c["release"] - c["deltensor"] for c in C])
    if each:
        add("consumer", "acknowledgement (pipe send_bytes)", [c["acked"] - c["release"] for c in C])
    if cross:
        queued = "" if each else " (with the time it waited its turn)"
        add("across", "share() returned -> consumer's recv returned" + queued,
            [c["recv"] - p["share"] for p, c in pairs])
        add("across", "consumer let go -> wait_released returned" + queued,
            [p["released"] - c["release"] for p, c in pairs])
        if each:
            add("across", "consumer's ack sent -> producer's recv returned",
                [p["ack"] - c["acked"] for p, c in pairs])
    work = _stat([r["share"] - r["start"] for r in P])
    out = {"buffers": trace["buffers"], "steps": rows, "work_us": list(work), "work_rate": 1e6 / work[0],
           "cross_process": cross}
    if "rate" in trace:
        out["rate"] = trace["rate"]
    return out


def run_trace(side: Side, iterations: int, consumers: int, per_consumer: int) -> dict:
    """The --trace phase on `side` (``mempool``): `iterations` traced round trips at `TRACE_SIZE` (after 5
    untimed), then a traced sustained run at `TRACE_SIZE` to `consumers` consumers, `per_consumer` each."""
    side.trace_round_trip(TRACE_SIZE, 5)  # warm-up of the traced loops, not counted
    rt = summarize_trace(side.trace_round_trip(TRACE_SIZE, iterations), each=True)
    st = summarize_trace(side.trace_sustained(TRACE_SIZE, consumers, per_consumer), each=False)
    return {"size": TRACE_SIZE, "consumers": consumers, "round_trip": rt, "sustained": st}


def print_trace(trace: dict) -> None:
    size, k = human(trace["size"]), trace["consumers"]
    print()
    print(f"Trace of mempool's hand-off at {size} (--trace: time.perf_counter_ns around each step, in a phase of "
          "its own after the numbers above)")
    for part, title in (("round_trip", "round trip, 1 consumer"),
                        ("sustained", f"sustained, {k} consumers, {WINDOW} buffers in flight per consumer")):
        t = trace[part]
        head = f"{title}, {t['buffers']} buffers"
        if "rate" in t:
            head += f": {t['rate']:.0f} buffers/s traced, {1e6 / t['rate']:.1f} us of the producer's thread per buffer"
        print()
        print(head)
        print("| side | step | median us | p90 us |")
        print("|---|---|---:|---:|")
        for side, step, med, p90 in t["steps"]:
            print(f"| {side} | {step} | {med:.1f} | {p90:.1f} |")
        med, p90 = t["work_us"]
        work = "Python work per buffer (alloc + from_dlpack + fill_ + del + share)"
        print(f"| producer | {work} | {med:.1f} | {p90:.1f} |")
        print(f"The producer's Python work alone allows at most {t['work_rate']:.0f} buffers/s (1e6 / {med:.1f} us).")
        if not t["cross_process"]:
            print("(perf_counter is not CLOCK_MONOTONIC here: the steps across processes are left out)")


def run(frameworks, consumers: int, iterations: int, sustained_buffers: int, trace: bool = False) -> dict:
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
            if trace and fw == "mempool":
                try:
                    report["trace"] = run_trace(side, iterations, min(TRACE_CONSUMERS, consumers), sustained_buffers)
                except Exception:  # noqa: BLE001 - the numbers above stand
                    report["errors"]["mempool --trace"] = traceback.format_exc(limit=3)
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
    if "trace" in report:
        print_trace(report["trace"])
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
    p.add_argument("--trace", action="store_true",
                   help=f"after the measurements, trace mempool's hand-off at {human(TRACE_SIZE)}: --iterations "
                        f"round trips and a sustained run to {TRACE_CONSUMERS} consumers (--sustained-buffers each) "
                        "with each step of the producer and the consumers timed; prints the median and p90 per "
                        "step and the rate the producer's Python work alone allows (needs mempool in --frameworks)")
    args = p.parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    if unknown:
        p.error(f"unknown framework(s) {', '.join(unknown)}: choose from {', '.join(FRAMEWORKS)}")
    if args.consumers < 1 or args.iterations < 1 or args.sustained_buffers < 1:
        p.error("--consumers, --iterations and --sustained-buffers must be at least 1")
    if args.trace and "mempool" not in frameworks:
        p.error("--trace traces the mempool framework: include mempool in --frameworks")
    try:
        import torch
    except ImportError:
        print("ipc_handoff: needs PyTorch (every framework's consumer views buffers with torch.from_dlpack)",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("ipc_handoff: needs a CUDA GPU", file=sys.stderr)
        return 2
    report = run(frameworks, args.consumers, args.iterations, args.sustained_buffers, args.trace)
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
