"""Synthetic snapshots (schema: docs/observe.md, "Schema", version 1) for the viewer's browser test, and the
page writer, which follows the embedding rule the Rust and Python producers follow: the viewer's marker
`/*MEMPOOL_SNAPSHOT*/` is replaced by the snapshot's JSON with every `<` written as `\\u003c`.

`small()` has hand-checked numbers; `fragmented()` is a first-fit pool simulated over a few thousand
operations until it fails an allocation with free space left; `big(n)` has `n` history events from a longer
run (the ring dropped the older ones) and a pool of many chunks. `cluster(...)` makes a cluster document of
several snapshots; `three_workers()` is the one the cluster page's test opens.

Run as a program to write the fragmented page (for the docs' screenshot): `python3 snapshots.py OUT.html`.
"""

import json
import random
import sys
from pathlib import Path

MARKER = "/*MEMPOOL_SNAPSHOT*/"
VIEWER = Path(__file__).resolve().parents[2] / "src" / "observe" / "viewer.html"
COLUMNS = ("t_ns", "op", "resource", "address", "size", "stream", "tag", "thread")
ALLOC, FREE, FAILED = 0, 1, 2
MIB = 1 << 20


def page(snapshot, viewer_html=None):
    """The viewer with `snapshot` embedded (a dict, or a string written as is, for malformed input)."""
    html = VIEWER.read_text(encoding="utf-8") if viewer_html is None else viewer_html
    if html.count(MARKER) != 1:
        raise ValueError(f"the viewer holds the marker {MARKER} {html.count(MARKER)} times, not once")
    text = snapshot if isinstance(snapshot, str) else json.dumps(snapshot, separators=(",", ":"))
    return html.replace(MARKER, text.replace("<", "\\u003c"))


class History:
    def __init__(self):
        self.cols = {c: [] for c in COLUMNS}

    def add(self, t, op, resource, address, size, stream, tag, thread=1):
        for c, v in zip(COLUMNS, (t, op, resource, address, size, stream, tag, thread)):
            self.cols[c].append(v)

    def json(self, capacity, recorded=None, keep=None):
        n = len(self.cols["t_ns"])
        start = 0 if keep is None else max(0, n - keep)
        out = {"capacity": capacity, "recorded": n if recorded is None else recorded,
               "dropped": start if recorded is None else recorded - (n - start)}
        for c in COLUMNS:
            out[c] = self.cols[c][start:]
        return out


def base(resources, live, history, tags, streams, source="test"):
    return {
        "schema": "mempool.snapshot", "version": 1, "created_unix_ns": 1764212345000000000, "source": source,
        "devices": [{"ordinal": 0, "name": "Simulated GPU", "total_bytes": 80 * 1024 * MIB,
                     "free_bytes": 60 * 1024 * MIB}],
        "tags": tags, "streams": streams, "resources": resources, "live": live, "history": history,
    }


def small():
    """Two resources, a pool (id 0) over an upstream (id 1), four allocations, one free, one failure."""
    a = 140000000000
    h = History()
    h.add(0, ALLOC, 1, a, 2 * MIB, 0, 0)
    h.add(100, ALLOC, 0, a, 1024, 0, 1)
    h.add(200, ALLOC, 0, a + 1024, 2048, 1, 2)
    h.add(300, ALLOC, 0, a + 3072, 4096, 0, 0)
    h.add(400, FREE, 0, a + 1024, 2048, 1, 2)
    h.add(500, FAILED, 0, 0, 8 * MIB, 0, 0)
    resources = [
        {"id": 0, "parent": 1, "name": "pool", "kind": "PoolResource", "device": 0,
         "stats": {"live_bytes": 5120, "peak_live_bytes": 7168, "held_bytes": 2 * MIB, "peak_held_bytes": 2 * MIB,
                   "allocations": 3, "frees": 1, "live_count": 2},
         "per_stream": [{"stream": 0, "live_bytes": 5120, "free_bytes": 2 * MIB - 7168},
                        {"stream": 1, "live_bytes": 0, "free_bytes": 2048}],
         "chunks": [{"address": a, "size": 2 * MIB, "ranges": [
             {"offset": 0, "size": 1024, "used": True, "stream": 0},
             {"offset": 1024, "size": 2048, "used": False, "stream": 1},
             {"offset": 3072, "size": 4096, "used": True, "stream": 0},
             {"offset": 7168, "size": 2 * MIB - 7168, "used": False, "stream": 0}]}]},
        {"id": 1, "parent": None, "name": "device", "kind": "CudaAsyncResource", "device": 0,
         "stats": {"live_bytes": 2 * MIB, "peak_live_bytes": 2 * MIB, "held_bytes": 2 * MIB,
                   "peak_held_bytes": 2 * MIB, "allocations": 1, "frees": 0, "live_count": 1},
         "per_stream": [{"stream": 0, "live_bytes": 2 * MIB, "free_bytes": 0}], "chunks": []},
    ]
    live = [{"resource": 0, "address": a, "size": 1024, "stream": 0, "tag": 1, "t_ns": 100},
            {"resource": 0, "address": a + 3072, "size": 4096, "stream": 0, "tag": 0, "t_ns": 300}]
    streams = [{"id": 0, "handle": "0x0", "label": "default"}, {"id": 1, "handle": "0x55d0c0", "label": "copy"}]
    # a tag with markup in it: the page must show it as text, and the embedding must not end the script early
    tags = ["default", "weights", "kv</script><b>cache</b>"]
    return base(resources, live, h.json(capacity=65536), tags, streams)


def cross_stream():
    """One resource; stream 1 ("copy") allocates three blocks, stream 0 frees two of them (the frees RMM's
    log of 26.10 shows on another stream than their allocation's), stream 0 allocates and frees one of its
    own, and a block allocated before the window is freed on stream 1."""
    a = 0x7F0000000000
    h = History()
    h.add(100, ALLOC, 0, a, 1 * MIB, 1, 0)
    h.add(200, ALLOC, 0, a + MIB, 2 * MIB, 1, 0)
    h.add(300, ALLOC, 0, a + 3 * MIB, 4 * MIB, 1, 0)
    h.add(400, FREE, 0, a, 1 * MIB, 0, 0)
    h.add(500, FREE, 0, a + MIB, 2 * MIB, 0, 0)
    h.add(600, ALLOC, 0, a + 8 * MIB, 512, 0, 0)
    h.add(700, FREE, 0, a + 8 * MIB, 512, 0, 0)
    h.add(800, FREE, 0, a - 64 * MIB, 8 * MIB, 1, 0)
    resources = [
        {"id": 0, "parent": None, "name": "pool", "kind": "PoolResource", "device": 0,
         "stats": {"live_bytes": 4 * MIB, "peak_live_bytes": 15 * MIB, "held_bytes": 64 * MIB,
                   "peak_held_bytes": 64 * MIB, "allocations": 4, "frees": 4, "live_count": 1},
         "per_stream": [{"stream": 0, "live_bytes": 0, "free_bytes": 0},
                        {"stream": 1, "live_bytes": 4 * MIB, "free_bytes": 0}],
         "chunks": []},
    ]
    live = [{"resource": 0, "address": a + 3 * MIB, "size": 4 * MIB, "stream": 1, "tag": 0, "t_ns": 300}]
    streams = [{"id": 0, "handle": "0x0", "label": "default"}, {"id": 1, "handle": "0x55d0c0", "label": "copy"}]
    return base(resources, live, h.json(capacity=65536, recorded=9), ["default"], streams)


class FirstFitPool:
    """A first-fit pool over 2 MiB chunks (larger requests get a chunk of their own, rounded to 2 MiB), with
    a limit on what it holds; frees merge with free neighbours. Records every event in `history`."""

    def __init__(self, limit, rng, chunk=2 * MIB):
        self.limit, self.rng, self.chunk = limit, rng, chunk
        self.chunks = []  # [address, size, ranges]; a range is [offset, size, used, stream]
        self.live = {}  # address -> (size, stream, tag, t)
        self.h = History()
        self.t = 0
        self.next_addr = 0x7F0000000000
        self.stats = dict(live_bytes=0, peak_live_bytes=0, held_bytes=0, peak_held_bytes=0, allocations=0, frees=0)
        self.up = dict(live_bytes=0, peak_live_bytes=0, held_bytes=0, peak_held_bytes=0, allocations=0, frees=0)

    def tick(self):
        self.t += self.rng.randint(200, 4000)

    def alloc(self, size, stream, tag):
        self.tick()
        for c in self.chunks:
            for i, r in enumerate(c[2]):
                if not r[2] and r[1] >= size:
                    return self._take(c, i, size, stream, tag)
        grow = -(-size // self.chunk) * self.chunk
        if self.stats["held_bytes"] + grow > self.limit:
            self.h.add(self.t, FAILED, 0, 0, size, stream, tag)
            return None
        addr = self.next_addr
        self.next_addr += grow + 64 * MIB
        self.h.add(self.t, ALLOC, 1, addr, grow, stream, 0)
        for s in (self.up,):
            s["live_bytes"] += grow; s["held_bytes"] += grow; s["allocations"] += 1
            s["peak_live_bytes"] = max(s["peak_live_bytes"], s["live_bytes"])
            s["peak_held_bytes"] = max(s["peak_held_bytes"], s["held_bytes"])
        self.stats["held_bytes"] += grow
        self.stats["peak_held_bytes"] = max(self.stats["peak_held_bytes"], self.stats["held_bytes"])
        c = [addr, grow, [[0, grow, False, stream]]]
        self.chunks.append(c)
        self.tick()
        return self._take(c, 0, size, stream, tag)

    def _take(self, c, i, size, stream, tag):
        r = c[2][i]
        addr = c[0] + r[0]
        if r[1] > size:
            c[2].insert(i + 1, [r[0] + size, r[1] - size, False, r[3]])
        r[1], r[2], r[3] = size, True, stream
        self.live[addr] = (size, stream, tag, self.t)
        self.h.add(self.t, ALLOC, 0, addr, size, stream, tag)
        self.stats["live_bytes"] += size
        self.stats["allocations"] += 1
        self.stats["peak_live_bytes"] = max(self.stats["peak_live_bytes"], self.stats["live_bytes"])
        return addr

    def free(self, addr):
        self.tick()
        size, stream, tag, _ = self.live.pop(addr)
        c = next(c for c in self.chunks if c[0] <= addr < c[0] + c[1])
        i = next(i for i, r in enumerate(c[2]) if c[0] + r[0] == addr)
        c[2][i][2] = False
        if i + 1 < len(c[2]) and not c[2][i + 1][2]:
            c[2][i][1] += c[2].pop(i + 1)[1]
        if i > 0 and not c[2][i - 1][2]:
            c[2][i - 1][1] += c[2].pop(i)[1]
        self.h.add(self.t, FREE, 0, addr, size, stream, tag)
        self.stats["live_bytes"] -= size
        self.stats["frees"] += 1

    def snapshot(self, tags, streams, source):
        per_stream = {}
        for size, stream, _, _ in self.live.values():
            per_stream.setdefault(stream, [0, 0])[0] += size
        for c in self.chunks:
            for r in c[2]:
                if not r[2]:
                    per_stream.setdefault(r[3], [0, 0])[1] += r[1]
        pool = {"id": 0, "parent": 1, "name": "pool", "kind": "PoolResource", "device": 0,
                "stats": dict(self.stats, live_count=len(self.live)),
                "per_stream": [{"stream": s, "live_bytes": v[0], "free_bytes": v[1]} for s, v in sorted(per_stream.items())],
                "chunks": [{"address": c[0], "size": c[1],
                            "ranges": [{"offset": r[0], "size": r[1], "used": r[2], "stream": r[3]} for r in c[2]]}
                           for c in self.chunks]}
        up = {"id": 1, "parent": None, "name": "device", "kind": "CudaAsyncResource", "device": 0,
              "stats": dict(self.up, live_count=len(self.chunks)),
              "per_stream": [], "chunks": []}
        live = [{"resource": 0, "address": a, "size": s, "stream": st, "tag": tg, "t_ns": t}
                for a, (s, st, tg, t) in sorted(self.live.items())]
        return base([pool, up], live, None, tags, streams, source)


def fragmented(seed=7):
    """A pool that fills with small and medium blocks, frees most of the small ones (leaving holes between
    the survivors), then asks for blocks the holes cannot hold until it fails at its 48 MiB limit."""
    rng = random.Random(seed)
    p = FirstFitPool(limit=48 * MIB, rng=rng)
    small_sizes = [256 * (1 << rng.randint(0, 6)) for _ in range(4000)]
    kept = []
    for i, size in enumerate(small_sizes):
        a = p.alloc(size, stream=i % 2, tag=1 + i % 3)
        if a is not None:
            kept.append(a)
        if i % 5 == 4 and kept:
            p.free(kept.pop(rng.randrange(len(kept))))
    for _ in range(60):
        p.alloc(256 * 1024 * rng.randint(1, 4), stream=0, tag=rng.choice((0, 1, 3)))
    rng.shuffle(kept)
    for a in kept[: int(len(kept) * 0.7)]:
        p.free(a)
    for _ in range(40):
        if p.alloc(768 * 1024, stream=1, tag=2) is None:
            break
    s = p.snapshot(["activations", "weights", "kv-cache", "optimizer"],
                   [{"id": 0, "handle": "0x0", "label": "default"}, {"id": 1, "handle": "0x55d0c0", "label": "side"}],
                   "test:fragmented")
    s["history"] = p.h.json(capacity=65536)
    return s


def big(n=1_000_000, seed=11):
    """`n` history events (a ring of 2^20 that saw 1.25 n, so the older quarter was dropped) over two
    resources and four streams, and a pool of 64 chunks with about 1000 ranges each."""
    rng = random.Random(seed)
    recorded = n + n // 4
    h = History()
    T, OP, RES, ADDR, SIZE, STREAM, TAG, THREAD = (h.cols[c].append for c in COLUMNS)
    live = [[], []]  # per resource: [address, size, stream, tag, t]
    addr = [0x7F0000000000, 0x7E0000000000]
    stats = [dict(live_bytes=0, peak_live_bytes=0, allocations=0, frees=0) for _ in range(2)]
    per_stream = [[0] * 4, [0] * 4]
    t = 0
    rnd, randrange = rng.random, rng.randrange
    sizes = [256 << k for k in range(12)]
    for _ in range(recorded):
        t += 50 + int(rnd() * 400)
        r = 0 if rnd() < 0.8 else 1
        lv, st = live[r], stats[r]
        u = rnd()
        if lv and (len(lv) > (3000 if r == 0 else 500) or u < 0.45):
            j = int(rnd() * len(lv))
            e = lv[j]
            lv[j] = lv[-1]
            lv.pop()
            op, a, size, stream, tag = FREE, e[0], e[1], e[2], e[3]
            st["live_bytes"] -= size
            st["frees"] += 1
            per_stream[r][stream] -= size
        elif u > 0.999:
            op, a, size, stream, tag = FAILED, 0, 1 << 34, 0, 0
        else:
            size = sizes[int(u * 1e6) % 12] + 256 * (int(u * 1e8) % 4)
            stream, tag = int(rnd() * 4), int(u * 1e4) % 3
            op, a = ALLOC, addr[r]
            lv.append([a, size, stream, tag, t])
            addr[r] += size
            st["live_bytes"] += size
            st["allocations"] += 1
            if st["live_bytes"] > st["peak_live_bytes"]:
                st["peak_live_bytes"] = st["live_bytes"]
            per_stream[r][stream] += size
        T(t); OP(op); RES(r); ADDR(a); SIZE(size); STREAM(stream); TAG(tag); THREAD(1 + r)
    history = h.json(capacity=1 << 20, recorded=recorded, keep=n)
    chunks = []
    for c in range(64):
        off, ranges = 0, []
        size = 64 * MIB
        while off < size:
            s = min(size - off, 256 * rng.randint(1, 256))
            ranges.append({"offset": off, "size": s, "used": rng.random() < 0.6, "stream": rng.randrange(4)})
            off += s
        chunks.append({"address": 0x7D0000000000 + c * 128 * MIB, "size": size, "ranges": ranges})
    resources = []
    for r, (name, kind) in enumerate((("pool", "PoolResource"), ("binning", "BinningResource"))):
        resources.append({"id": r, "parent": None, "name": name, "kind": kind, "device": 0,
                          "stats": dict(stats[r], held_bytes=64 * 64 * MIB if r == 0 else 0,
                                        peak_held_bytes=64 * 64 * MIB if r == 0 else 0, live_count=len(live[r])),
                          "per_stream": [{"stream": s, "live_bytes": per_stream[r][s], "free_bytes": 0}
                                         for s in range(4)],
                          "chunks": chunks if r == 0 else []})
    live_json = [{"resource": r, "address": e[0], "size": e[1], "stream": e[2], "tag": e[3], "t_ns": e[4]}
                 for r in range(2) for e in live[r]]
    streams = [{"id": s, "handle": hex(0x55D0C0 + 16 * s), "label": f"s{s}"} for s in range(4)]
    return base(resources, live_json, history, ["default", "weights", "kv-cache"], streams, "test:big")


def cluster(workers, source="test"):
    """A cluster document (docs/observe.md, "Cluster snapshots") of `workers`: (name, snapshot, identity) triples,
    identity a dict of the fields beside the name (address, host, pid, device, device_name; missing ones null)."""
    out = []
    for name, snap, ident in workers:
        w = {"name": name, "address": None, "host": None, "pid": None, "device": None, "device_name": None}
        w.update(ident)
        w["snapshot"] = snap
        out.append(w)
    return {"schema": "mempool.cluster-snapshot", "version": 1, "created_unix_ns": 1764212399000000000,
            "source": source, "workers": out}


def three_workers():
    """Three workers on two hosts: the small snapshot, the fragmented pool (which failed an allocation) and the
    frees on another stream; the first named by its address, as Dask names workers. The first one's driver pool
    (its lowest resource) holds 8 MiB, more than its pool's 2 MiB chunk, as a driver pool that reserved ahead does:
    the worker's held bytes are the lowest resource's."""
    first = small()
    first["resources"][1]["stats"].update(held_bytes=8 * MIB, peak_held_bytes=8 * MIB)
    return cluster([
        ("tcp://10.0.0.5:40123", first, {"address": "tcp://10.0.0.5:40123", "host": "node-a", "pid": 4242,
                                          "device": 0, "device_name": "Simulated GPU"}),
        ("worker-b", fragmented(), {"host": "node-a", "pid": 4243, "device": 1}),
        ("worker-c", cross_stream(), {"host": "node-b"}),
    ])


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(page(fragmented()), encoding="utf-8")
