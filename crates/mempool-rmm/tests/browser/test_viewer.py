"""The snapshot viewer (crates/mempool-rmm/src/observe/viewer.html) in a real browser: headless Chromium opens
pages written by the embedding rule, and the test reads what the page shows (`--dump-dom`) and compares it
with the snapshot. Screenshots and the 1,000,000-event page's draw time go to target/browser/.

Run by scripts/browser-tests.sh, which installs Chromium from the distribution's packages when it is missing;
MEMPOOL_CHROMIUM names another binary. Needs no GPU and no mempool wheel.
"""

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

import snapshots as S

ROOT = Path(__file__).resolve().parents[4]
OUT = ROOT / "target" / "browser"


def chromium():
    for name in (os.environ.get("MEMPOOL_CHROMIUM"), "chromium-headless-shell", "chromium"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise RuntimeError("no Chromium found (chromium-headless-shell or chromium on PATH, or MEMPOOL_CHROMIUM): "
                       "scripts/browser-tests.sh installs it from the distribution's packages")


def browser(tmp_path, *args):
    exe = chromium()
    headless = "--headless" if "headless-shell" in Path(exe).name else "--headless=new"
    cmd = [exe, headless, "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {r.returncode}:\n{r.stderr[-4000:]}")
    return r.stdout


class Node:
    def __init__(self, tag, attrs, parent):
        self.tag, self.attrs, self.parent, self.children = tag, dict(attrs), parent, []

    @property
    def classes(self):
        return (self.attrs.get("class") or "").split()

    def text(self):
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def walk(self):
        for c in self.children:
            if isinstance(c, Node):
                yield c
                yield from c.walk()

    def find_all(self, tag=None, cls=None, **data):
        out = []
        for n in self.walk():
            if tag and n.tag != tag:
                continue
            if cls and cls not in n.classes:
                continue
            if any(n.attrs.get(k.replace("_", "-")) != str(v) for k, v in data.items()):
                continue
            out.append(n)
        return out

    def one(self, tag=None, cls=None, **data):
        found = self.find_all(tag, cls, **data)
        assert len(found) == 1, f"expected one <{tag or '*'} class={cls} {data}>, found {len(found)}"
        return found[0]

    def by_id(self, ident):
        return self.one(id=ident)

    def value(self, cls):
        """The exact number a cell carries (data-value) and the text it shows."""
        c = self.one("td", cls)
        return int(float(c.attrs["data-value"])), c.text()


VOID = {"meta", "input", "br", "img", "link", "hr", "col", "source", "wbr"}


class Dom(HTMLParser):
    def __init__(self, html):
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", [], None)
        self.cur = self.root
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        n = Node(tag, attrs, self.cur)
        self.cur.children.append(n)
        if tag not in VOID:
            self.cur = n

    def handle_endtag(self, tag):
        n = self.cur
        while n is not self.root and n.tag != tag:
            n = n.parent
        if n is not self.root:
            self.cur = n.parent

    def handle_data(self, data):
        self.cur.children.append(data)


def open_page(tmp_path, name, html, screenshot=None):
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.html"
    path.write_text(html, encoding="utf-8")
    dom = Dom(browser(tmp_path, "--dump-dom", path.as_uri())).root
    if screenshot:
        png = OUT / f"{name}.png"
        png.unlink(missing_ok=True)
        browser(tmp_path, f"--screenshot={png}", f"--window-size={screenshot}", path.as_uri())
        assert png.stat().st_size > 10_000, f"{png} is nearly empty"
    return dom


def html_attrs(dom):
    return dom.one("html").attrs


def assert_ready(dom):
    attrs = html_attrs(dom)
    err = dom.by_id("error")
    assert attrs.get("data-state") == "ready", f"page state {attrs.get('data-state')!r}, error: {err.text()!r}"
    assert "shown" not in err.classes and err.text() == ""
    assert float(attrs["data-render-ms"]) >= 0


def test_viewer_is_self_contained():
    html = S.VIEWER.read_text(encoding="utf-8")
    assert html.count(S.MARKER) == 1
    assert html.count('<script id="mempool-snapshot" type="application/json">/*MEMPOOL_SNAPSHOT*/</script>') == 1
    for pattern in (r"\bsrc\s*=", r"<link\b", r"@import", r"url\(", r"https?://", r"\bfetch\(", r"XMLHttpRequest",
                    r"WebSocket"):
        assert not re.search(pattern, html), f"the viewer must not load anything: found {pattern}"


def test_small_snapshot_numbers(tmp_path):
    snap = S.small()
    dom = open_page(tmp_path, "small", S.page(snap), screenshot="1400,1800")
    assert_ready(dom)

    meta = dom.by_id("meta")
    assert meta.attrs["data-events"] == "6"
    assert meta.one(cls="source").text() == "source: test"
    assert meta.one(cls="history-events").text() == "6 events shown"

    pool = dom.by_id("summary").one("tr", data_resource=0)
    assert pool.one("td", "name").text() == "pool"
    assert pool.one("td", "kind").text() == "PoolResource"
    assert pool.value("live-bytes") == (5120, "5.00 KiB")
    assert pool.value("peak-live-bytes") == (7168, "7.00 KiB")
    assert pool.value("held-bytes") == (2097152, "2.00 MiB")
    assert pool.value("live-count") == (2, "2")
    assert pool.value("allocations") == (3, "3")
    assert pool.value("frees") == (1, "1")
    assert pool.value("chunks") == (1, "1")
    assert pool.value("free-bytes") == (2048 + 2097152 - 7168, "2.00 MiB")
    assert pool.value("largest-free") == (2097152 - 7168, "1.99 MiB")
    frag = 1 - (2097152 - 7168) / (2048 + 2097152 - 7168)
    assert pool.one("td", "fragmentation").text() == f"{frag * 100:.1f} %"
    device = dom.by_id("summary").one("tr", data_resource=1)
    assert device.value("live-bytes") == (2097152, "2.00 MiB")
    assert device.one("td", "free-bytes").text() == "—"

    # the timeline's series end at the live bytes and peak where the history does
    tl = dom.by_id("timeline")
    assert tl.attrs["data-events"] == "6"
    r0 = tl.one("tr", data_resource=0)
    assert r0.value("end-live") == (5120, "5.00 KiB")
    assert r0.value("peak-shown") == (7168, "7.00 KiB")
    assert r0.value("allocations")[0] == 3 and r0.value("frees")[0] == 1 and r0.value("failed")[0] == 1
    assert tl.one("tr", data_resource=1).value("end-live")[0] == 2097152

    streams = dom.by_id("streams")
    assert streams.attrs["data-resource"] == "0"
    s0, s1 = streams.one("tr", data_stream=0), streams.one("tr", data_stream=1)
    assert s0.one("td", "name").text() == "default" and s1.one("td", "name").text() == "copy"
    assert s1.one("td", "handle").text() == "0x55d0c0"
    assert s0.value("end-live")[0] == 5120 and s1.value("end-live")[0] == 0
    assert s1.value("peak-shown")[0] == 2048
    assert s1.value("free-bytes")[0] == 2048

    # log2 buckets: 1024 -> 10, 2048 -> 11, 4096 -> 12, 2 MiB -> 21
    hist = dom.by_id("histogram")
    rows = {int(r.attrs["data-bucket"]): r for r in hist.find_all("tr") if "data-bucket" in r.attrs}
    assert sorted(rows) == [10, 11, 12, 21]
    assert rows[10].value("history-count")[0] == 1 and rows[10].value("live-count")[0] == 1
    assert rows[10].value("live-bytes")[0] == 1024
    assert rows[11].value("live-count")[0] == 0
    assert rows[12].value("live-bytes") == (4096, "4.00 KiB")
    assert rows[21].value("history-count")[0] == 1
    assert rows[10].one("td", "range").text() == "1.00 KiB – 2.00 KiB"

    largest = dom.by_id("largest")
    first, second = largest.one("tr", data_rank=1), largest.one("tr", data_rank=2)
    assert first.value("size") == (4096, "4.00 KiB")
    assert first.one("td", "tag").text() == "default"
    assert first.one("td", "address").text() == hex(140000000000 + 3072)
    assert second.value("size")[0] == 1024 and second.one("td", "tag").text() == "weights"
    assert second.one("td", "stream").text() == "default"

    pool_map = dom.by_id("pools").one("div", "pool", data_resource=0)
    chunk = pool_map.one("tr", data_chunk=0)
    assert chunk.value("size") == (2097152, "2.00 MiB")
    assert chunk.value("used")[0] == 5120
    assert chunk.value("free-ranges")[0] == 2
    assert len(pool_map.find_all("canvas", "chunk-map")) == 1
    assert not dom.by_id("pools").find_all("div", "pool", data_resource=1)


def test_a_free_on_another_stream_counts_against_the_allocations_stream(tmp_path):
    """Live bytes belong to the stream an allocation was made on: frees on another stream lower that stream's
    line, never the freeing stream's below zero, and the legend counts them as frees on another stream."""
    dom = open_page(tmp_path, "cross_stream", S.page(S.cross_stream()))
    assert_ready(dom)
    streams = dom.by_id("streams")
    assert streams.attrs["data-cross-frees"] == "2"
    default, copy = streams.one("tr", data_stream=0), streams.one("tr", data_stream=1)
    assert default.value("end-live")[0] == 0, "stream 0 freed copy's blocks: its own line stays at zero"
    assert default.value("peak-shown")[0] == 512
    assert copy.value("end-live")[0] == 4 * S.MIB
    # copy's line starts where the live bytes now put it (the block freed at 800 was allocated before the
    # window, on a stream the history does not tell) and peaks with all three blocks live
    assert copy.value("peak-shown")[0] == 7 * S.MIB
    assert copy.value("cross-frees") == (2, "2 (3.00 MiB)")
    assert default.value("cross-frees") == (0, "0")


def test_markup_in_a_tag_is_text(tmp_path):
    snap = S.small()
    snap["live"][0]["tag"] = 2  # "kv</script><b>cache</b>"
    dom = open_page(tmp_path, "markup", S.page(snap))
    assert_ready(dom)
    row = dom.by_id("largest").one("tr", data_rank=2)
    assert row.one("td", "tag").text() == "kv</script><b>cache</b>"
    assert not row.find_all("b")


def expected_pool(resource):
    free = largest = 0
    for c in resource["chunks"]:
        for r in c["ranges"]:
            if not r["used"]:
                free += r["size"]
                largest = max(largest, r["size"])
    return free, largest


def test_fragmented_pool(tmp_path):
    snap = S.fragmented()
    dom = open_page(tmp_path, "fragmented", S.page(snap), screenshot="1400,2200")
    assert_ready(dom)
    res = snap["resources"][0]
    free, largest = expected_pool(res)
    # the simulated pool failed an allocation although it held free space: no free block was large enough
    failed = [s for o, s in zip(snap["history"]["op"], snap["history"]["size"]) if o == S.FAILED]
    assert failed and largest < min(failed) < free

    row = dom.by_id("summary").one("tr", data_resource=0)
    assert row.value("free-bytes")[0] == free
    assert row.value("largest-free")[0] == largest
    assert row.value("live-bytes")[0] == res["stats"]["live_bytes"]
    assert float(row.one("td", "fragmentation").attrs["data-value"]) == pytest.approx(1 - largest / free, abs=1e-4)
    tl = dom.by_id("timeline").one("tr", data_resource=0)
    assert tl.value("failed")[0] == len(failed)
    assert tl.value("end-live")[0] == res["stats"]["live_bytes"]
    assert tl.value("peak-shown")[0] == res["stats"]["peak_live_bytes"]

    pool = dom.by_id("pools").one("div", "pool", data_resource=0)
    rows = [r for r in pool.find_all("tr") if "data-chunk" in r.attrs]
    assert len(rows) == len(res["chunks"])
    for r, c in zip(rows, res["chunks"]):
        cf = [g["size"] for g in c["ranges"] if not g["used"]]
        assert r.value("address")[0] == c["address"]
        assert r.value("free-bytes")[0] == sum(cf)
        assert r.value("largest-free")[0] == max(cf, default=0)
        assert r.value("free-ranges")[0] == len(cf)
    assert f"largest free block {row.value('largest-free')[1]}" in pool.one("h3").text()


def running_peak(snap, rid, key=None):
    h = snap["history"]
    net = peak = 0
    for o, r, s, st in zip(h["op"], h["resource"], h["size"], h["stream"]):
        if r != rid or (key is not None and st != key):
            continue
        net += s if o == S.ALLOC else -s if o == S.FREE else 0
        peak = max(peak, net)
    return net, peak


def test_million_events(tmp_path):
    snap = S.big(1_000_000)
    html = S.page(snap)
    dom = open_page(tmp_path, "million", html, screenshot="1400,1000")
    assert_ready(dom)
    h = snap["history"]
    assert len(h["t_ns"]) == 1_000_000 and h["dropped"] > 0
    assert dom.by_id("meta").attrs["data-events"] == "1000000"
    assert dom.by_id("meta").one(cls="history-dropped").text() == f"{h['dropped']:,} dropped"
    # the ring dropped the older events: each series starts at (live now - net change of what it shows)
    for res in snap["resources"]:
        live = res["stats"]["live_bytes"]
        net, peak = running_peak(snap, res["id"])
        start = live - net
        row = dom.by_id("timeline").one("tr", data_resource=res["id"])
        assert row.value("end-live")[0] == live
        assert row.value("peak-shown")[0] == max(start, start + peak)
        assert dom.by_id("summary").one("tr", data_resource=res["id"]).value("live-count")[0] == res["stats"]["live_count"]
    for ps in snap["resources"][0]["per_stream"]:
        net, peak = running_peak(snap, 0, ps["stream"])
        start = ps["live_bytes"] - net
        row = dom.by_id("streams").one("tr", data_stream=ps["stream"])
        assert row.value("end-live")[0] == ps["live_bytes"]
        assert row.value("peak-shown")[0] == max(start, start + peak)
    biggest = max(a["size"] for a in snap["live"])
    assert dom.by_id("largest").one("tr", data_rank=1).value("size")[0] == biggest
    free, largest = expected_pool(snap["resources"][0])
    row = dom.by_id("summary").one("tr", data_resource=0)
    assert row.value("free-bytes")[0] == free and row.value("largest-free")[0] == largest

    attrs = html_attrs(dom)
    line = (f"viewer, 1,000,000 history events ({len(html) / 1e6:.1f} MB page): drawn "
            f"{float(attrs['data-render-ms']):.0f} ms after its script started (JSON.parse and checks: "
            f"{float(attrs['data-parse-ms']):.0f} ms), "
            f"{float(attrs['data-since-navigation-ms']):.0f} ms after navigation ({chromium_version()})")
    print("\n" + line)
    (OUT / "million-render.txt").write_text(line + "\n")


def chromium_version():
    r = subprocess.run([chromium(), "--version"], capture_output=True, text=True, timeout=60)
    return r.stdout.strip()


def assert_error_page(dom, expected):
    """The page refused its document: the error box is shown and says ``expected``, the content is hidden."""
    assert html_attrs(dom).get("data-state") == "error"
    err = dom.by_id("error")
    assert "shown" in err.classes
    assert expected in err.text(), err.text()
    assert "shown" not in dom.by_id("content").classes


@pytest.mark.parametrize("name,text,expected", [
    ("bad-json", '{"schema": "mempool.snapshot", "version": 1, "resources": [', "not valid JSON"),
    ("version-2", json.dumps(dict(S.small(), version=2)), "version 2; this viewer reads version 1 only"),
    ("not-a-snapshot", json.dumps({"schema": "torch.memory", "version": 1}), "not a mempool snapshot"),
    ("ragged-history", json.dumps(dict(S.small(), history=dict(S.small()["history"], size=[1]))),
     "history columns differ in length: \"size\" has 1 entries"),
    ("no-thread-column", json.dumps(dict(S.small(), history={k: v for k, v in S.small()["history"].items()
                                                           if k != "thread"})),
     "history has 6 events but no \"thread\" column"),
])
def test_unreadable_snapshot_says_why(tmp_path, name, text, expected):
    dom = open_page(tmp_path, name, S.page(text))
    assert_error_page(dom, expected)


def test_bare_viewer_offers_a_file(tmp_path):
    dom = open_page(tmp_path, "bare", S.VIEWER.read_text(encoding="utf-8"))
    assert html_attrs(dom).get("data-state") == "empty"
    assert "shown" in dom.by_id("open").classes
    assert dom.by_id("file-input").attrs.get("type") == "file"
    assert dom.by_id("error").text() == ""


def test_minimal_snapshot(tmp_path):
    """What the schema lets a producer leave out or empty: devices, tags, streams, per_stream, chunks, live,
    history's events (and then its columns); `stats` keys the viewer does not know, and the nulls the Rust
    producer writes for what a resource does not count or an allocation's unknown stream."""
    snap = {"schema": "mempool.snapshot", "version": 1, "created_unix_ns": 0, "source": "replay:empty.csv",
            "devices": [], "tags": [], "streams": [],
            "resources": [{"id": 3, "parent": None, "name": "cuda", "kind": "CudaResource", "device": 0,
                           "stats": {"live_bytes": 0, "peak_live_bytes": 0, "held_bytes": 0, "peak_held_bytes": 0,
                                     "allocations": 0, "frees": 0, "live_count": 0, "new_counter": 5},
                           "per_stream": [], "chunks": []}],
            "live": [],
            "history": {"capacity": 16, "recorded": 0, "dropped": 0, "t_ns": []}}
    snap["resources"].append({"id": 4, "parent": 3, "name": "stats", "kind": "StatisticsAdaptor", "device": None,
                              "stats": {"live_bytes": 256, "peak_live_bytes": None, "held_bytes": None,
                                        "peak_held_bytes": None, "allocations": 1, "frees": 0, "live_count": 1},
                              "per_stream": [], "chunks": []})
    snap["live"].append({"resource": 4, "address": 4096, "size": 256, "stream": None, "tag": 0, "t_ns": None})
    dom = open_page(tmp_path, "minimal", S.page(snap))
    assert_ready(dom)
    assert dom.by_id("meta").one(cls="source").text() == "source: replay:empty.csv"
    assert dom.by_id("summary").one("tr", data_resource=3).value("live-bytes") == (0, "0 B")
    assert dom.by_id("timeline-note").text() == "The snapshot has no history events."
    assert dom.by_id("timeline").one("tr", data_resource=3).value("end-live")[0] == 0
    row = dom.by_id("summary").one("tr", data_resource=4)
    assert row.one("td", "held-bytes").text() == "—" and row.value("live-bytes") == (256, "256 B")
    largest = dom.by_id("largest").one("tr", data_rank=1)
    assert largest.one("td", "stream").text() == "—" and largest.one("td", "t").text() == "—"
    assert largest.one("td", "tag").text() == "tag 0"
    assert dom.by_id("no-chunks").text().startswith("No resource in this snapshot reports chunks")
    buckets = [r for r in dom.by_id("histogram").find_all("tr") if "data-bucket" in r.attrs]
    assert [r.attrs["data-bucket"] for r in buckets] == ["8"]
    assert buckets[0].value("history-count")[0] == 0 and buckets[0].value("live-count")[0] == 1


@pytest.mark.parametrize("how", ["input", "drop"])
def test_bare_viewer_opens_a_file(tmp_path, how):
    """The bare viewer reads a snapshot file given to its file input or dropped on the page: the test appends
    a script that hands it one, as the browser does after the user picks or drops a file."""
    snap = S.small()
    text = json.dumps(json.dumps(snap)).replace("<", "\\u003c")
    hand = ("input.files = dt.files; input.dispatchEvent(new Event('change'));" if how == "input" else
            "document.dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));")
    script = ("<script>(function () { const dt = new DataTransfer();"
              f" dt.items.add(new File([{text}], 'snapshot.json', {{type: 'application/json'}}));"
              f" const input = document.getElementById('file-input'); {hand} }})();</script>")
    bare = S.VIEWER.read_text(encoding="utf-8")
    assert bare.count("</body>") == 1
    dom = open_page(tmp_path, f"bare-{how}", bare.replace("</body>", script + "</body>"))
    assert_ready(dom)
    assert "shown" not in dom.by_id("open").classes
    assert dom.by_id("summary").one("tr", data_resource=0).value("live-bytes") == (5120, "5.00 KiB")
    assert dom.by_id("largest").one("tr", data_rank=2).one("td", "tag").text() == "weights"


def window_values(snap, rid, a, b):
    """A resource's line over the events a <= t_ns <= b: (value at a, highest, value at b, events in the window)."""
    h = snap["history"]
    live = next(r for r in snap["resources"] if r["id"] == rid)["stats"]["live_bytes"]
    delta = [(t, s if o == S.ALLOC else -s if o == S.FREE else 0)
             for t, o, r, s in zip(h["t_ns"], h["op"], h["resource"], h["size"]) if r == rid]
    v = live - sum(x for _, x in delta) + sum(x for t, x in delta if t < a)
    at_a, peak = v, v
    for t, x in delta:
        if a <= t <= b:
            v += x
            peak = max(peak, v)
    return at_a, peak, v


@pytest.mark.parametrize("then", ["", "dblclick"])
def test_zoom_by_dragging(tmp_path, then):
    """Dragging across the timeline shows only the events inside the dragged time range; a double-click
    shows them all again."""
    snap = S.fragmented()
    drag = """<script>(function () {
      const cv = document.getElementById('timeline-canvas'), r = cv.getBoundingClientRect();
      const W = Number(document.getElementById('timeline').dataset.columns), y = r.top + 50;
      const at = (f) => ({clientX: r.left + 72 + f * W, clientY: y, bubbles: true, button: 0});
      cv.dispatchEvent(new MouseEvent('mousedown', at(0.2)));
      window.dispatchEvent(new MouseEvent('mousemove', at(0.45)));
      window.dispatchEvent(new MouseEvent('mouseup', at(0.7)));
      %s
    })();</script>""" % ("cv.dispatchEvent(new MouseEvent('dblclick', at(0.5)));" if then else "")
    html = S.page(snap)
    dom = open_page(tmp_path, f"zoom{then}", html.replace("</body>", drag + "</body>"))
    assert_ready(dom)
    tl = dom.by_id("timeline")
    ts = snap["history"]["t_ns"]
    if then:
        assert "data-view-start" not in tl.attrs and tl.attrs["data-shown"] == str(len(ts))
        assert "hidden" in dom.by_id("zoom-reset").attrs
        return
    a, b = float(tl.attrs["data-view-start"]), float(tl.attrs["data-view-end"])
    assert ts[0] < a < b < ts[-1]
    assert int(tl.attrs["data-shown"]) == sum(1 for t in ts if a <= t <= b)
    assert "hidden" not in dom.by_id("zoom-reset").attrs
    assert dom.by_id("timeline-note").text().startswith(f"Zoomed: {int(tl.attrs['data-shown']):,} of {len(ts):,} events")
    for rid in (0, 1):
        at_a, peak, at_b = window_values(snap, rid, a, b)
        row = tl.one("tr", data_resource=rid)
        assert row.value("end-live")[0] == at_b
        assert row.value("peak-shown")[0] == peak
    # the whole-history numbers elsewhere do not change
    assert dom.by_id("summary").one("tr", data_resource=0).value("live-bytes")[0] == snap["resources"][0]["stats"]["live_bytes"]
