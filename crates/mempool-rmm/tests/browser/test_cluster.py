"""The viewer on a cluster document (docs/observe.md, "Cluster snapshots"): the overview of every worker (the
summary row, the per-worker timeline, the largest allocations of the cluster) against numbers computed here from
the documents, switching to a worker's own panels (the selector, the worker's link, a `#worker=NAME` link), and
the error box for cluster documents the viewer cannot read. Pages, and a screenshot of the three-worker page,
land in target/browser/ as in test_viewer.py, whose helpers these tests use.
"""

import json

import pytest

import snapshots as S
from test_viewer import OUT, Dom, assert_error_page, assert_ready, browser, expected_pool, html_attrs, open_page


def summary(snap):
    """What the overview's row says of a worker, computed from its snapshot by the rule of docs/observe.md."""
    res = snap["resources"]
    live_res = next((r for r in res if isinstance(r["stats"].get("live_bytes"), int)), None)
    held_res = next((r for r in reversed(res) if isinstance(r["stats"].get("held_bytes"), int)), None)
    free = largest_free = 0
    chunked = False
    for r in res:
        if r["chunks"]:
            chunked = True
            f, l = expected_pool(r)
            free += f
            largest_free = max(largest_free, l)
    h = snap["history"]
    return {
        "live-bytes": live_res["stats"]["live_bytes"] if live_res else sum(a["size"] for a in snap["live"]),
        "peak-live-bytes": live_res["stats"]["peak_live_bytes"] if live_res else None,
        "held-bytes": held_res["stats"]["held_bytes"] if held_res else None,
        "peak-held-bytes": held_res["stats"]["peak_held_bytes"] if held_res else None,
        "live-count": live_res["stats"]["live_count"] if live_res else len(snap["live"]),
        "free-bytes": free if chunked else None,
        "largest-free": largest_free if chunked else None,
        "frag": (1 - largest_free / free if free else 0) if chunked else None,
        "largest-live": max((a["size"] for a in snap["live"]), default=None),
        "events": len(h["t_ns"]),
        "failed": sum(1 for o in h["op"] if o == S.FAILED),
    }


def worker_line(snap):
    """The worker's line: the topmost resource its history names; (resource id, end, highest)."""
    h, res = snap["history"], snap["resources"]
    index = {r["id"]: i for i, r in enumerate(res)}
    rid = res[min(index[r] for r in h["resource"])]["id"]
    r = res[index[rid]]
    end = r["stats"]["live_bytes"]
    if not isinstance(end, int):
        end = sum(a["size"] for a in snap["live"] if a["resource"] == rid)
    deltas = [s if o == S.ALLOC else -s if o == S.FREE else 0 for o, rr, s in zip(h["op"], h["resource"], h["size"])
              if rr == rid]
    v = end - sum(deltas)
    peak = v
    for x in deltas:
        v += x
        peak = max(peak, v)
    assert v == end
    return rid, end, peak


def cell_value(row, cls):
    c = row.one("td", cls)
    return (None if c.attrs.get("data-value", "") == "" else int(float(c.attrs["data-value"]))), c.text()


def test_a_cluster_of_three_workers(tmp_path):
    doc = S.three_workers()
    dom = open_page(tmp_path, "cluster", S.page(doc), screenshot="1400,2600")
    assert_ready(dom)
    assert "shown" in dom.by_id("cluster").classes
    assert dom.one("h1").text() == "mempool cluster snapshot"
    assert dom.by_id("cluster-meta").one(cls="workers").text() == "cluster of 3 workers"
    rows = [r for r in dom.by_id("workers").find_all("tr") if "data-worker" in r.attrs]
    assert [r.attrs["data-worker"] for r in rows] == [w["name"] for w in doc["workers"]]
    for w, row in zip(doc["workers"], rows):
        want = summary(w["snapshot"])
        for cls in ("live-bytes", "peak-live-bytes", "held-bytes", "peak-held-bytes", "live-count", "free-bytes",
                    "largest-free", "largest-live", "events", "failed"):
            assert cell_value(row, cls)[0] == want[cls], (w["name"], cls)
        frag = row.one("td", "fragmentation")
        if want["frag"] is None:
            assert frag.text() == "—"
        else:
            assert float(frag.attrs["data-value"]) == pytest.approx(want["frag"], abs=1e-4)
            assert frag.text() == f"{want['frag'] * 100:.1f} %"
        assert row.one("td", "name").text() == w["name"]
    # the numbers that tell the workers apart, by hand: the small snapshot's pool, the fragmented pool's failures
    a, b, c = rows
    assert a.value("live-bytes") == (5120, "5.00 KiB") and a.value("held-bytes") == (8 * S.MIB, "8.00 MiB")
    assert a.value("peak-live-bytes")[0] == 7168 and a.value("peak-held-bytes")[0] == 8 * S.MIB
    assert a.one("td", "host").text() == "node-a" and a.one("td", "pid").text() == "4242"
    assert a.one("td", "device").text() == "0: Simulated GPU"
    assert b.one("td", "device").text() == "1", "the identity's ordinal, with no name given"
    assert c.one("td", "device").text() == "0: Simulated GPU", "no identity: the snapshot's one device"
    assert b.value("failed")[0] > 0 and a.value("failed")[0] == 1 and c.value("failed")[0] == 0
    assert c.one("td", "free-bytes").text() == "—"

    # one plot per worker, each line ending at its worker's live bytes
    plots = dom.by_id("worker-plots").find_all("div", "worker-plot")
    assert [p.attrs["data-worker"] for p in plots] == [w["name"] for w in doc["workers"]]
    for w, p in zip(doc["workers"], plots):
        rid, end, peak = worker_line(w["snapshot"])
        assert p.attrs["data-resource"] == str(rid), w["name"]
        assert int(float(p.one(cls="end-live").attrs["data-value"])) == end, w["name"]
        assert int(float(p.one(cls="peak-shown").attrs["data-value"])) == peak, w["name"]
        assert len(p.find_all("canvas")) == 1

    # the largest live allocations of the cluster, each with its worker
    every = sorted(((a["size"], i) for i, w in enumerate(doc["workers"]) for a in w["snapshot"]["live"]),
                   key=lambda x: (-x[0], x[1]))
    largest = [r for r in dom.by_id("cluster-largest").find_all("tr") if "data-rank" in r.attrs]
    assert len(largest) == min(10, len(every))
    for (size, i), r in zip(every, largest):
        assert r.value("size")[0] == size
        assert r.one("td", "worker").text() == doc["workers"][i]["name"]
    assert dom.by_id("cluster-largest-note").text().startswith(f"The 10 largest of {len(every):,} live allocations")

    # the first worker's own panels are shown below
    assert html_attrs(dom)["data-worker"] == "tcp://10.0.0.5:40123"
    assert "selected" in a.classes and "selected" not in b.classes
    assert dom.by_id("summary").one("tr", data_resource=0).value("live-bytes") == (5120, "5.00 KiB")
    assert dom.by_id("timeline").attrs["data-events"] == "6"
    assert dom.by_id("worker-identity").text() == "host node-a, pid 4242, device 0: Simulated GPU"


SWITCH = {
    "select": "const s = document.getElementById('worker-select'); s.value = '%d'; s.dispatchEvent(new Event('change'));",
    "link": "document.querySelectorAll('#workers tbody tr')[%d].querySelector('button.worker-link').click();",
}


@pytest.mark.parametrize("how", ["select", "link", "hash"])
def test_switching_workers_shows_that_workers_panels(tmp_path, how):
    doc = S.three_workers()
    k = 1  # worker-b, the fragmented pool
    snap = doc["workers"][k]["snapshot"]
    html = S.page(doc)
    if how == "hash":
        OUT.mkdir(parents=True, exist_ok=True)
        path = OUT / "cluster-hash.html"
        path.write_text(html, encoding="utf-8")
        dom = Dom(browser(tmp_path, "--dump-dom", path.as_uri() + "#worker=worker-b")).root
    else:
        script = "<script>(function () {" + SWITCH[how] % k + "})();</script>"
        dom = open_page(tmp_path, f"cluster-{how}", html.replace("</body>", script + "</body>"))
    assert_ready(dom)
    assert html_attrs(dom)["data-worker"] == "worker-b"
    assert dom.by_id("cluster").attrs["data-selected"] == "worker-b"
    row = dom.by_id("workers").one("tr", data_worker="worker-b")
    assert "selected" in row.classes
    assert "selected" not in dom.by_id("workers").one("tr", data_worker="worker-c").classes
    # the worker's own panels: its resources, timeline, streams, sizes, largest allocations, chunks
    assert dom.by_id("meta").one(cls="source").text() == "source: test:fragmented"
    res = snap["resources"][0]
    free, largest = expected_pool(res)
    srow = dom.by_id("summary").one("tr", data_resource=0)
    assert srow.value("live-bytes")[0] == res["stats"]["live_bytes"]
    assert srow.value("free-bytes")[0] == free and srow.value("largest-free")[0] == largest
    assert dom.by_id("timeline").attrs["data-events"] == str(len(snap["history"]["t_ns"]))
    tl = dom.by_id("timeline").one("tr", data_resource=0)
    assert tl.value("end-live")[0] == res["stats"]["live_bytes"]
    assert tl.value("failed")[0] == summary(snap)["failed"]
    assert len([r for r in dom.by_id("pools").one("div", "pool", data_resource=0).find_all("tr")
                if "data-chunk" in r.attrs]) == len(res["chunks"])
    assert dom.by_id("largest").one("tr", data_rank=1).value("size")[0] == max(a["size"] for a in snap["live"])
    # the overview stays as it was
    assert dom.by_id("workers").one("tr", data_worker="tcp://10.0.0.5:40123").value("live-bytes")[0] == 5120


def test_a_single_snapshot_shows_no_cluster_parts(tmp_path):
    dom = open_page(tmp_path, "single-not-cluster", S.page(S.small()))
    assert_ready(dom)
    assert "shown" not in dom.by_id("cluster").classes
    assert all("shown" not in e.classes for e in dom.find_all(cls="cluster-only"))
    assert "data-worker" not in html_attrs(dom)
    assert dom.one("h1").text() == "mempool snapshot"


def bad(mutate):
    doc = S.three_workers()
    mutate(doc)
    return json.dumps(doc)


@pytest.mark.parametrize("name,text,expected", [
    ("cluster-bad-json", '{"schema": "mempool.cluster-snapshot", "workers": [', "not valid JSON"),
    ("cluster-version-2", bad(lambda d: d.update(version=2)),
     "This cluster snapshot has version 2; this viewer reads cluster version 1 only."),
    ("cluster-no-workers", bad(lambda d: d.pop("workers")), "This cluster snapshot has no \"workers\" array."),
    ("cluster-empty", bad(lambda d: d.update(workers=[])), "has no workers (its \"workers\" array is empty)"),
    ("cluster-duplicate", bad(lambda d: d["workers"][2].update(name="worker-b")),
     "workers[1] and workers[2] are both named \"worker-b\": worker names must be unique."),
    ("cluster-nameless", bad(lambda d: d["workers"][0].pop("name")), "workers[0] has no name (a non-empty string)."),
    ("cluster-no-snapshot", bad(lambda d: d["workers"][1].pop("snapshot")),
     "Worker \"worker-b\" (workers[1]) has no \"snapshot\"."),
    ("cluster-worker-version", bad(lambda d: d["workers"][2]["snapshot"].update(version=2)),
     "Worker \"worker-c\" (workers[2]): This snapshot has version 2; this viewer reads version 1 only."),
    ("cluster-worker-ragged", bad(lambda d: d["workers"][1]["snapshot"]["history"].update(size=[1])),
     "Worker \"worker-b\" (workers[1]): history columns differ in length: \"size\" has 1 entries"),
    ("cluster-worker-schema", bad(lambda d: d["workers"][0]["snapshot"].update(schema="torch.memory")),
     "Worker \"tcp://10.0.0.5:40123\" (workers[0]): This JSON is not a mempool snapshot"),
])
def test_unreadable_cluster_says_why(tmp_path, name, text, expected):
    dom = open_page(tmp_path, name, S.page(text))
    assert_error_page(dom, expected)
    assert "shown" not in dom.by_id("cluster-meta").classes


def test_bare_viewer_opens_a_cluster_file(tmp_path):
    doc = S.three_workers()
    text = json.dumps(json.dumps(doc)).replace("<", "\\u003c")
    script = ("<script>(function () { const dt = new DataTransfer();"
              f" dt.items.add(new File([{text}], 'cluster.json', {{type: 'application/json'}}));"
              " const input = document.getElementById('file-input'); input.files = dt.files;"
              " input.dispatchEvent(new Event('change')); })();</script>")
    bare = S.VIEWER.read_text(encoding="utf-8")
    dom = open_page(tmp_path, "bare-cluster", bare.replace("</body>", script + "</body>"))
    assert_ready(dom)
    assert "shown" in dom.by_id("cluster").classes
    row = dom.by_id("workers").one("tr", data_worker="worker-c")
    assert row.value("live-bytes")[0] == summary(doc["workers"][2]["snapshot"])["live-bytes"]


def test_a_worker_with_no_history_and_no_counters(tmp_path):
    """A worker whose snapshot has no history, no device and a stack that counts nothing: its row falls back to
    the sum of its live allocations and shows what it does not know as "—", its plot says it has no events, and
    the other workers draw as usual."""
    bare = {"schema": "mempool.snapshot", "version": 1, "created_unix_ns": 0, "source": "replay:empty.csv",
            "resources": [{"id": 7, "parent": None, "name": "hist", "kind": "HistoryResource", "device": None,
                           "stats": {"live_bytes": None, "peak_live_bytes": None, "held_bytes": None,
                                     "peak_held_bytes": None, "allocations": None, "frees": None, "live_count": None},
                           "per_stream": [], "chunks": []}],
            "live": [{"resource": 7, "address": 4096, "size": 3000, "stream": None, "tag": 0, "t_ns": None},
                     {"resource": 7, "address": 8192, "size": 96, "stream": None, "tag": 0, "t_ns": None}],
            "history": {"t_ns": []}}
    doc = S.cluster([("empty", bare, {}), ("small", S.small(), {})])
    dom = open_page(tmp_path, "cluster-bare-worker", S.page(doc))
    assert_ready(dom)
    row = dom.by_id("workers").one("tr", data_worker="empty")
    assert row.value("live-bytes") == (3096, "3.02 KiB")
    assert row.value("live-count")[0] == 2 and row.value("largest-live")[0] == 3000
    for cls in ("peak-live-bytes", "held-bytes", "peak-held-bytes", "free-bytes", "fragmentation"):
        assert row.one("td", cls).text() == "—", cls
    assert row.one("td", "device").text() == "—" and row.value("events")[0] == 0
    plot = dom.by_id("worker-plots").one("div", "worker-plot", data_worker="empty")
    assert plot.one("p", "note").text() == "No history events." and not plot.find_all("canvas")
    other = dom.by_id("worker-plots").one("div", "worker-plot", data_worker="small")
    assert int(float(other.one(cls="end-live").attrs["data-value"])) == 5120
    assert html_attrs(dom)["data-worker"] == "empty"
    assert dom.by_id("timeline-note").text() == "The snapshot has no history events."
