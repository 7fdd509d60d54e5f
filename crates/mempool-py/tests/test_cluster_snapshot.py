"""mempool.memory's cluster documents (docs/observe.md, "Cluster snapshots"): ``cluster_snapshot`` over
snapshots made here without a GPU (what an RMM-format log gives, as ``mempool-bench replay --snapshot`` writes
it), ``write_cluster_snapshot`` as JSON and as the page, the errors for every bad input, and the Python block of
docs/observe.md's section, run as it stands. Host tests: no GPU, no driver."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mempool import memory

MIB = 1 << 20


def log_snapshot(events, source="replay:worker.csv", device=None):
    """A version-1 snapshot of one resource (``log``) from ``events``: (t_ns, op, address, size, stream) with op
    0 allocate, 1 free, 2 failed; its statistics and live list computed from them."""
    cols = {c: [] for c in ("t_ns", "op", "resource", "address", "size", "stream", "tag", "thread")}
    live, peak, allocs, frees, sizes = 0, 0, 0, 0, {}
    for t, op, addr, size, stream in events:
        for c, v in zip(cols, (t, op, 0, addr, size, stream, 0, 1)):
            cols[c].append(v)
        if op == 0:
            allocs += 1
            sizes[addr] = (size, stream, t)
            live += size
            peak = max(peak, live)
        elif op == 1 and addr in sizes:
            frees += 1
            live -= sizes.pop(addr)[0]
    n = len(events)
    return {
        "schema": "mempool.snapshot", "version": 1, "created_unix_ns": 1764212345000000000, "source": source,
        "devices": [] if device is None else [{"ordinal": device[0], "name": device[1], "total_bytes": 80 << 30,
                                               "free_bytes": 60 << 30}],
        "tags": ["default"], "streams": [{"id": 0, "handle": "0x0", "label": "default"}],
        "resources": [{"id": 0, "parent": None, "name": "log", "kind": "RmmLog", "device": None,
                       "stats": {"live_bytes": live, "peak_live_bytes": peak, "held_bytes": None,
                                 "peak_held_bytes": None, "allocations": allocs, "frees": frees,
                                 "live_count": len(sizes)},
                       "per_stream": [{"stream": 0, "live_bytes": live, "free_bytes": 0}], "chunks": []}],
        "live": [{"resource": 0, "address": a, "size": s, "stream": st, "tag": 0, "t_ns": t}
                 for a, (s, st, t) in sizes.items()],
        "history": dict(cols, capacity=n, recorded=n, dropped=0),
    }


def three():
    a = log_snapshot([(0, 0, 0x1000, 4 * MIB, 0), (10, 0, 0x9000, 1024, 0), (20, 1, 0x9000, 1024, 0)],
                     device=(0, "Simulated GPU"))
    b = log_snapshot([(0, 0, 0x2000, 2 * MIB, 0), (5, 2, 0, 1 << 34, 0)])
    c = log_snapshot([(0, 0, 0x3000, 512, 0)], device=(3, "Simulated GPU"))
    return a, b, c


def embedded(page):
    start = page.index('<script id="mempool-snapshot" type="application/json">')
    body = page[start:]
    return body[body.index(">") + 1: body.index("</script>")]


def test_a_cluster_holds_every_worker_unchanged_with_its_identity(tmp_path):
    a, b, c = three()
    before = json.dumps([a, b, c], sort_keys=True)
    doc = memory.cluster_snapshot(
        {"tcp://10.0.0.5:40123": a, "worker-b": json.dumps(b), "worker-c": json.dumps(c).encode()},
        identities={"tcp://10.0.0.5:40123": {"address": "tcp://10.0.0.5:40123", "host": "node-a", "pid": 4242},
                    "worker-b": {"host": "node-b", "device": 1}},
    )
    assert (doc["schema"], doc["version"], doc["source"]) == ("mempool.cluster-snapshot", 1, "python")
    assert [w["name"] for w in doc["workers"]] == ["tcp://10.0.0.5:40123", "worker-b", "worker-c"]
    wa, wb, wc = doc["workers"]
    # the snapshots, whatever form they came in, are the same documents, unchanged
    assert [wa["snapshot"], wb["snapshot"], wc["snapshot"]] == [a, b, c]
    assert json.dumps([a, b, c], sort_keys=True) == before
    assert (wa["host"], wa["pid"], wa["address"]) == ("node-a", 4242, "tcp://10.0.0.5:40123")
    # no device given: the snapshot's one device; given: as given; a snapshot of no device leaves it unknown
    assert (wa["device"], wa["device_name"]) == (0, "Simulated GPU")
    assert (wb["device"], wb["device_name"], wb["address"]) == (1, None, None)
    assert (wc["device"], wc["device_name"], wc["host"], wc["pid"]) == (3, "Simulated GPU", None, None)
    assert set(wa) == {"name", "address", "host", "pid", "device", "device_name", "snapshot"}

    memory.write_cluster_snapshot(doc, tmp_path / "cluster.json")
    assert json.loads((tmp_path / "cluster.json").read_text()) == doc
    memory.write_cluster_snapshot(doc, str(tmp_path / "cluster.HTML"))
    page = (tmp_path / "cluster.HTML").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "/*MEMPOOL_SNAPSHOT*/" not in page
    assert json.loads(embedded(page)) == doc
    # write_html takes a cluster document as well, and writes the same page
    memory.write_html(doc, tmp_path / "same.html")
    assert (tmp_path / "same.html").read_text(encoding="utf-8") == page
    # (name, snapshot) pairs keep their order
    pairs = memory.cluster_snapshot([("z", c), ("a", a)], source="test")
    assert [w["name"] for w in pairs["workers"]] == ["z", "a"] and pairs["source"] == "test"


def test_markup_in_a_worker_name_stays_inside_the_page(tmp_path):
    a, _, _ = three()
    doc = memory.cluster_snapshot({"</script><b>w</b>": a})
    memory.write_cluster_snapshot(doc, tmp_path / "c.html")
    page = (tmp_path / "c.html").read_text(encoding="utf-8")
    assert "</script><b>w" not in page
    assert json.loads(embedded(page))["workers"][0]["name"] == "</script><b>w</b>"


def ragged():
    s = three()[0]
    s["history"]["size"] = s["history"]["size"][:1]
    return s


@pytest.mark.parametrize("args,kwargs,error,expected", [
    (({},), {}, ValueError, "a cluster snapshot needs at least one worker"),
    (([("w", three()[0]), ("w", three()[1])],), {}, ValueError, "two workers are named 'w'"),
    (({"": three()[0]},), {}, ValueError, "a worker's name is a non-empty string, not ''"),
    (({"w": "{not json"},), {}, ValueError, "worker 'w': its snapshot is not JSON"),
    (({"w": "[1, 2]"},), {}, ValueError, "worker 'w': its snapshot is JSON but not an object (a list)"),
    (({"w": 42},), {}, TypeError, "worker 'w': a snapshot is a dict (memory.snapshot()) or its JSON text"),
    (([three()[0]],), {}, TypeError, "(name, snapshot) pairs; item 0 is"),
    (({"a": three()[0], "b": dict(three()[1], version=2)},), {}, ValueError,
     "worker `b` (workers[1]): schema `mempool.snapshot` version Some(2) is not `mempool.snapshot` version 1"),
    (({"a": three()[0], "b": dict(three()[1], schema="torch.memory")},), {}, ValueError,
     "worker `b` (workers[1]): schema `torch.memory` version Some(1)"),
    (({"a": ragged()},), {}, ValueError,
     "worker `a` (workers[0]): history columns differ in length: `size` has 1 entries, `t_ns` has 3"),
    (({"a": dict(three()[0], resources="none")},), {}, ValueError, "worker `a` (workers[0]): not a snapshot: "),
    (({"a": three()[0]},), {"identities": {"a": {"rank": 0}}}, ValueError,
     "identities['a'] has 'rank'; a worker's identity has address, host, pid, device, device_name"),
    (({"a": three()[0]},), {"identities": {"b": {"host": "x"}}}, ValueError,
     "identities name workers with no snapshot: 'b'"),
    (({"a": three()[0]},), {"identities": {"a": {"pid": "4242"}}}, ValueError,
     "worker `a` (workers[0]): invalid type: string \"4242\", expected u32"),
    (({"a": three()[0]},), {"identities": {"a": ["host"]}}, TypeError, "identities['a']: a mapping of address"),
])
def test_bad_input_says_why(args, kwargs, error, expected):
    with pytest.raises(error) as e:
        memory.cluster_snapshot(*args, **kwargs)
    assert expected in str(e.value), str(e.value)


def test_writing_refuses_what_is_not_a_cluster(tmp_path):
    a, b, _ = three()
    with pytest.raises(ValueError, match=r"this is a single snapshot \(schema `mempool.snapshot`\), not a cluster"):
        memory.write_cluster_snapshot(a, tmp_path / "x.html")
    doc = memory.cluster_snapshot({"a": a, "b": b})
    doc["workers"][1]["name"] = "a"
    with pytest.raises(ValueError, match=r"workers\[0\] and workers\[1\] are both named `a`"):
        memory.write_cluster_snapshot(doc, tmp_path / "x.json")
    with pytest.raises(ValueError, match=r"workers\[0\] and workers\[1\] are both named `a`"):
        memory.write_html(doc, tmp_path / "x.html")
    with pytest.raises(ValueError, match="version Some\\(2\\) is not `mempool.cluster-snapshot` version 1"):
        memory.write_cluster_snapshot(json.dumps(dict(doc, version=2)), tmp_path / "x.json")
    with pytest.raises(ValueError, match="not JSON"):
        memory.write_cluster_snapshot("{", tmp_path / "x.json")
    assert not list(tmp_path.iterdir()), "nothing is written for a document that is refused"
    # a single snapshot's page is written as before, unchecked (the page says what it cannot read)
    memory.write_html(dict(a, version=2), tmp_path / "single.html")
    assert json.loads(embedded((tmp_path / "single.html").read_text(encoding="utf-8")))["version"] == 2


def test_the_module_exports_the_cluster_functions():
    for name in ("cluster_snapshot", "write_cluster_snapshot"):
        assert name in memory.__all__ and callable(getattr(memory, name))


# -------------------------------------------------------------------------------------------------
# docs/observe.md's Python blocks: every one compiles; the "Cluster snapshots" section's run as they stand.
# -------------------------------------------------------------------------------------------------

def observe_md():
    env = os.environ.get("MEMPOOL_DOCS")
    path = Path(env).with_name("observe.md") if env else Path(__file__).resolve().parents[3] / "docs" / "observe.md"
    assert path.is_file(), f"docs/observe.md is not at {path} (set MEMPOOL_DOCS to docs/python.md's path)"
    return path


def python_blocks(text):
    """(section, code) of every ```python block, section being the ## heading above it."""
    out, section, lines, i = [], "", text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^## (.+)$", lines[i])
        if m:
            section = m.group(1).strip()
        if lines[i].strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            out.append((section, textwrap.dedent("\n".join(lines[i + 1: j])) + "\n"))
            i = j
        i += 1
    return out


def test_every_python_block_of_observe_md_compiles():
    blocks = python_blocks(observe_md().read_text(encoding="utf-8"))
    assert len(blocks) >= 2
    for section, code in blocks:
        compile(code, f"docs/observe.md ({section})", "exec")


def test_the_cluster_section_runs(tmp_path):
    blocks = [code for section, code in python_blocks(observe_md().read_text(encoding="utf-8"))
              if section == "Cluster snapshots"]
    assert blocks, "docs/observe.md has no ```python block under ## Cluster snapshots"
    a, b, _ = three()
    # the snapshot files the block reads, as memory.dump_snapshot or mempool-bench replay --snapshot write them
    (tmp_path / "worker-0.json").write_text(json.dumps(a))
    (tmp_path / "worker-1.json").write_text(json.dumps(b))
    for code in blocks:
        p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, f"exit {p.returncode}\n{code}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    doc = json.loads((tmp_path / "cluster.json").read_text())
    assert [w["snapshot"] for w in doc["workers"]] == [a, b]
    page = (tmp_path / "cluster.html").read_text(encoding="utf-8")
    assert json.loads(embedded(page))["workers"][0]["name"] == "worker-0"
