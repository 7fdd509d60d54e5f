"""A gpu-bdb-style workload for Dask: synthetic retail tables sized by a scale factor, four queries written
over an array module ``xp`` (NumPy on the host, CuPy on the GPU), and a runner over a Dask client.

    python -m mempool.benchmarks.bdb --scale 1 --partitions 16 --xp numpy            # on the host
    python -m mempool.benchmarks.bdb --scale 10 --partitions 64 --xp cupy --gpus 2 \
        --allocators rmm-pool,mempool-default --json out.json                       # LocalCUDACluster runs

Tables (``make_partition``, ``dimension_tables``): ``store_sales`` (item, customer, quantity, price in
cents, partitioned: ``ROWS_PER_SCALE`` rows per unit of scale, split into ``partitions``), ``item`` (item
key, category, brand) and ``customer`` (customer key, region), whole on every task. Every value is an
integer and every aggregate an integer sum, count or maximum, so a run on NumPy, a run on CuPy and runs
under different allocators give equal results, bit for bit; ``check_equal`` compares two runs. The data
of partition ``p`` is drawn from NumPy's ``default_rng((seed, p))``, on the host, then moved to ``xp``:
the same tables on every run.

Queries (``QUERIES``), each a map over the partitions and a reduction of their partial results:

- ``q1_sort_merge_join``: revenue per item category: ``store_sales`` joined with ``item`` on the item key
  by sort-merge (the item keys sorted, each sale found by binary search), then a group-by sum.
- ``q2_hash_join``: sales count, units and revenue per customer region: ``store_sales`` joined with
  ``customer`` through a hash table (open addressing, linear probing, built and probed with whole-array
  operations), then a group-by.
- ``q3_filter_topk``: the ``TOPK`` sales of largest revenue among those with quantity at least
  ``Q3_MIN_QUANTITY`` and price in ``Q3_PRICE``, ties broken by the sale's global row number.
- ``q4_groupby_agg``: per customer: sales count, revenue, largest quantity; the result is the number of
  customers with revenue above ``Q4_REVENUE`` and the ``TOPK`` customers by revenue.

``reference_*`` are the naive versions (Python dicts and loops over rows) the host tests check the queries
against. This module imports neither Dask nor a GPU framework until a runner asks for them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

SEED = 20261128
ROWS_PER_SCALE = 1_000_000
ITEMS_PER_SCALE = 20_000
CUSTOMERS_PER_SCALE = 100_000
CATEGORIES = 16
REGIONS = 12
TOPK = 10
Q3_MIN_QUANTITY = 60
Q3_PRICE = (20_00, 400_00)  # cents, inclusive
Q4_REVENUE = 50_000_00  # cents
_EMPTY = -1


# -------------------------------------------------------------------------------------------------
# Data.
# -------------------------------------------------------------------------------------------------


def sizes(scale: float) -> dict:
    """Rows of each table at ``scale``."""
    if not scale > 0:
        raise ValueError(f"scale: must be more than 0, got {scale!r}")
    return {
        "store_sales": max(1, int(ROWS_PER_SCALE * scale)),
        "item": max(1, int(ITEMS_PER_SCALE * scale)),
        "customer": max(1, int(CUSTOMERS_PER_SCALE * scale)),
    }


def partition_bounds(rows: int, partitions: int) -> list:
    """``[(start, stop)]`` of each partition's rows (as even as can be)."""
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ValueError(f"partitions: must be a positive integer, got {partitions!r}")
    if partitions > rows:
        raise ValueError(f"partitions: {partitions} partitions for {rows} rows")
    base, extra = divmod(rows, partitions)
    out, start = [], 0
    for p in range(partitions):
        stop = start + base + (1 if p < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def dimension_tables(scale: float, xp: Any = np, seed: int = SEED) -> dict:
    """``item`` and ``customer``, as dicts of ``xp`` arrays. Keys are a permutation of ``0..n`` (stored out
    of order, so a join has work to do) offset by a gap every 7 keys (some keys match no sale)."""
    n = sizes(scale)
    rng = np.random.default_rng((seed, 1 << 20))
    item_sk = rng.permutation(n["item"]).astype(np.int64) * 7 // 6
    item = {
        "i_item_sk": item_sk,
        "i_category": rng.integers(0, CATEGORIES, n["item"], dtype=np.int64),
        "i_brand": rng.integers(0, 1000, n["item"], dtype=np.int64),
    }
    cust_sk = rng.permutation(n["customer"]).astype(np.int64) * 7 // 6
    customer = {"c_customer_sk": cust_sk, "c_region": rng.integers(0, REGIONS, n["customer"], dtype=np.int64)}
    return {
        "item": {k: xp.asarray(v) for k, v in item.items()},
        "customer": {k: xp.asarray(v) for k, v in customer.items()},
    }


def make_partition(scale: float, partitions: int, p: int, xp: Any = np, seed: int = SEED) -> dict:
    """Partition ``p`` of ``store_sales``: ``ss_row`` (the global row number), ``ss_item_sk``,
    ``ss_customer_sk``, ``ss_quantity`` (1..100), ``ss_price`` (cents, 1..500_00). About 1 in 50 sales names
    an item key and 1 in 50 a customer key that does not exist."""
    n = sizes(scale)
    start, stop = partition_bounds(n["store_sales"], partitions)[p]
    rows = stop - start
    rng = np.random.default_rng((seed, p, partitions))
    max_item = n["item"] * 7 // 6 + 2
    max_cust = n["customer"] * 7 // 6 + 2
    part = {
        "ss_row": np.arange(start, stop, dtype=np.int64),
        "ss_item_sk": rng.integers(0, max_item, rows, dtype=np.int64),
        "ss_customer_sk": rng.integers(0, max_cust, rows, dtype=np.int64),
        "ss_quantity": rng.integers(1, 101, rows, dtype=np.int64),
        "ss_price": rng.integers(1, 500_01, rows, dtype=np.int64),
    }
    return {k: xp.asarray(v) for k, v in part.items()}


# -------------------------------------------------------------------------------------------------
# Building blocks over xp.
# -------------------------------------------------------------------------------------------------


def group_sum(keys: Any, values: Any, groups: int, xp: Any) -> Any:
    """Exact integer sums of ``values`` per key in ``0..groups`` (sort, cumulative sum, boundaries)."""
    if keys.size == 0:
        return xp.zeros(groups, dtype=np.int64)
    order = xp.argsort(keys)
    k = keys[order]
    cs = xp.concatenate([xp.zeros(1, dtype=np.int64), xp.cumsum(values[order].astype(np.int64))])
    ends = xp.searchsorted(k, xp.arange(groups, dtype=k.dtype), side="right")
    upto = cs[ends]
    return xp.diff(xp.concatenate([xp.zeros(1, dtype=np.int64), upto]))


def sort_merge_lookup(build_keys: Any, probe_keys: Any, xp: Any) -> tuple:
    """For each probe key, the row of ``build_keys`` (unique) with that key: ``(rows, matched)``."""
    order = xp.argsort(build_keys)
    sorted_keys = build_keys[order]
    pos = xp.searchsorted(sorted_keys, probe_keys)
    pos = xp.minimum(pos, sorted_keys.size - 1)
    matched = sorted_keys[pos] == probe_keys
    return order[pos], matched


def _hash(keys: Any, bits: int, xp: Any) -> Any:
    # Fibonacci hashing on the low 32 bits, in int64 without overflow.
    k = (keys & 0xFFFFFFFF) * 2654435761 & 0xFFFFFFFF
    return (k >> (32 - bits)) if bits <= 32 else k


class HashTable:
    """An open-addressing hash table (linear probing) over unique int64 keys, built and probed with
    whole-array operations: each round scatters the keys still to place into their slots, keeps those that
    won their slot, and moves the others one slot on."""

    def __init__(self, keys: Any, xp: Any) -> None:
        self.xp = xp
        n = int(keys.size)
        if int(xp.unique(keys).size) != n:
            raise ValueError(f"hash table: the {n} build keys have duplicates; a join's build side has unique keys")
        self.bits = max(4, int(n * 2 - 1).bit_length())
        self.size = 1 << self.bits
        self.keys = keys
        self.slots = xp.full(self.size, _EMPTY, dtype=np.int64)
        pending = xp.arange(n, dtype=np.int64)
        slot = _hash(keys, self.bits, xp)
        rounds = 0
        while pending.size:
            rounds += 1
            if rounds > self.size:
                raise RuntimeError("hash table: could not place every key")
            free = self.slots[slot] == _EMPTY
            cand, cslot = pending[free], slot[free]
            self.slots[cslot] = cand  # one of the keys aiming at a slot wins it
            won = self.slots[cslot] == cand
            placed = xp.zeros(pending.size, dtype=bool)
            placed[xp.nonzero(free)[0][won]] = True
            pending, slot = pending[~placed], (slot[~placed] + 1) & (self.size - 1)
        self.rounds = rounds

    def lookup(self, probe: Any) -> tuple:
        """``(rows, matched)`` for each probe key."""
        xp = self.xp
        rows = xp.full(probe.size, _EMPTY, dtype=np.int64)
        active = xp.arange(probe.size, dtype=np.int64)
        slot = _hash(probe, self.bits, xp)
        for _ in range(self.size):
            if active.size == 0:
                break
            s = self.slots[slot]
            empty = s == _EMPTY
            hit = ~empty & (self.keys[xp.maximum(s, 0)] == probe[active])
            rows[active[hit]] = s[hit]
            go = ~empty & ~hit
            active, slot = active[go], (slot[go] + 1) & (self.size - 1)
        return rows, rows != _EMPTY


# -------------------------------------------------------------------------------------------------
# Queries: map (one partition) and reduce (partials).
# -------------------------------------------------------------------------------------------------


def _to_host(a: Any) -> np.ndarray:
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) else a)


def q1_map(part: dict, dims: dict, xp: Any) -> Any:
    rows, ok = sort_merge_lookup(dims["item"]["i_item_sk"], part["ss_item_sk"], xp)
    cat = dims["item"]["i_category"][rows[ok]]
    rev = (part["ss_quantity"] * part["ss_price"])[ok]
    return group_sum(cat, rev, CATEGORIES, xp)


def q1_reduce(partials: list, xp: Any) -> dict:
    total = partials[0]
    for p in partials[1:]:
        total = total + p
    return {"revenue_by_category": _to_host(total).tolist()}


def q2_map(part: dict, dims: dict, xp: Any, table: Optional[HashTable] = None) -> Any:
    table = table or HashTable(dims["customer"]["c_customer_sk"], xp)
    rows, ok = table.lookup(part["ss_customer_sk"])
    region = dims["customer"]["c_region"][rows[ok]]
    q = part["ss_quantity"][ok]
    rev = (part["ss_quantity"] * part["ss_price"])[ok]
    ones = xp.ones(region.size, dtype=np.int64)
    return xp.stack([group_sum(region, ones, REGIONS, xp), group_sum(region, q, REGIONS, xp),
                     group_sum(region, rev, REGIONS, xp)])


def q2_reduce(partials: list, xp: Any) -> dict:
    total = partials[0]
    for p in partials[1:]:
        total = total + p
    t = _to_host(total)
    return {"count_by_region": t[0].tolist(), "units_by_region": t[1].tolist(), "revenue_by_region": t[2].tolist()}


def _topk_rows(rev: Any, row: Any, k: int, xp: Any) -> tuple:
    # Largest revenue first, then the smaller row number (or key): one int64 key, exact while revenue < 2**31
    # and row < 2**32 (a customer's revenue stays far below at any scale this runs at).
    key = -rev * (1 << 32) + row
    order = xp.argsort(key)[:k]
    return rev[order], row[order]


def q3_map(part: dict, dims: dict, xp: Any) -> Any:
    lo, hi = Q3_PRICE
    keep = (part["ss_quantity"] >= Q3_MIN_QUANTITY) & (part["ss_price"] >= lo) & (part["ss_price"] <= hi)
    rev = (part["ss_quantity"] * part["ss_price"])[keep]
    rev, row = _topk_rows(rev, part["ss_row"][keep], TOPK, xp)
    return xp.stack([rev, row])


def q3_reduce(partials: list, xp: Any) -> dict:
    both = xp.concatenate(partials, axis=1)
    rev, row = _topk_rows(both[0], both[1], TOPK, xp)
    return {"top_revenue": _to_host(rev).tolist(), "top_rows": _to_host(row).tolist()}


def q4_map(part: dict, dims: dict, xp: Any) -> Any:
    """Per customer key present in the partition: ``[key, count, revenue, max quantity]`` rows."""
    cust = part["ss_customer_sk"]
    rev = part["ss_quantity"] * part["ss_price"]
    order = xp.argsort(cust)
    c, r, q = cust[order], rev[order], part["ss_quantity"][order]
    if c.size == 0:
        return xp.zeros((4, 0), dtype=np.int64)
    starts = xp.concatenate([xp.zeros(1, dtype=bool), c[1:] != c[:-1]])
    first = xp.nonzero(xp.concatenate([xp.ones(1, dtype=bool), starts[1:]]))[0]
    bounds = xp.concatenate([first, xp.asarray([c.size], dtype=first.dtype)])
    cs = xp.concatenate([xp.zeros(1, dtype=np.int64), xp.cumsum(r)])
    revenue = cs[bounds[1:]] - cs[bounds[:-1]]
    count = (bounds[1:] - bounds[:-1]).astype(np.int64)
    # Max quantity per group: sort by (customer, quantity) and take each group's last.
    order2 = xp.argsort(c * 128 + q)
    q2 = q[order2]
    maxq = q2[bounds[1:] - 1]
    return xp.stack([c[first], count, revenue, maxq])


def q4_reduce(partials: list, xp: Any) -> dict:
    allp = xp.concatenate(partials, axis=1)
    keys = allp[0]
    uniq_order = xp.argsort(keys)
    k = keys[uniq_order]
    rows = allp[:, uniq_order]
    if k.size == 0:
        return {"customers_above": 0, "top_customers": [], "top_revenue": []}
    first = xp.nonzero(xp.concatenate([xp.ones(1, dtype=bool), k[1:] != k[:-1]]))[0]
    bounds = xp.concatenate([first, xp.asarray([k.size], dtype=first.dtype)])
    cs_rev = xp.concatenate([xp.zeros(1, dtype=np.int64), xp.cumsum(rows[2])])
    revenue = cs_rev[bounds[1:]] - cs_rev[bounds[:-1]]
    cust = k[first]
    above = int(_to_host((revenue > Q4_REVENUE).sum()))
    top_rev, top_cust = _topk_rows(revenue, cust, TOPK, xp)
    return {"customers_above": above, "top_customers": _to_host(top_cust).tolist(),
            "top_revenue": _to_host(top_rev).tolist()}


QUERIES = {
    "q1_sort_merge_join": (q1_map, q1_reduce),
    "q2_hash_join": (q2_map, q2_reduce),
    "q3_filter_topk": (q3_map, q3_reduce),
    "q4_groupby_agg": (q4_map, q4_reduce),
}


def run_local(scale: float, partitions: int, xp: Any = np, queries: Optional[list] = None, seed: int = SEED) -> dict:
    """Every query in this process, partition by partition (no Dask): ``{query: result}``."""
    dims = dimension_tables(scale, xp, seed)
    parts = [make_partition(scale, partitions, p, xp, seed) for p in range(partitions)]
    out = {}
    for name in queries or list(QUERIES):
        fmap, fred = QUERIES[name]
        out[name] = fred([fmap(p, dims, xp) for p in parts], xp)
    return out


# -------------------------------------------------------------------------------------------------
# Naive references (host, Python loops): what the tests check the queries against.
# -------------------------------------------------------------------------------------------------


def _rows(scale: float, partitions: int, seed: int):
    dims = dimension_tables(scale, np, seed)
    item = dict(zip(dims["item"]["i_item_sk"].tolist(), dims["item"]["i_category"].tolist()))
    cust = dict(zip(dims["customer"]["c_customer_sk"].tolist(), dims["customer"]["c_region"].tolist()))
    sales = []
    for p in range(partitions):
        part = make_partition(scale, partitions, p, np, seed)
        sales.extend(zip(*(part[k].tolist() for k in ("ss_row", "ss_item_sk", "ss_customer_sk", "ss_quantity", "ss_price"))))
    return item, cust, sales


def reference(scale: float, partitions: int, seed: int = SEED) -> dict:
    """Every query's result, computed row by row with dicts."""
    item, cust, sales = _rows(scale, partitions, seed)
    q1 = [0] * CATEGORIES
    cnt, units, rrev = [0] * REGIONS, [0] * REGIONS, [0] * REGIONS
    q3 = []
    per_cust: dict = {}
    lo, hi = Q3_PRICE
    for row, isk, csk, q, price in sales:
        rev = q * price
        if isk in item:
            q1[item[isk]] += rev
        if csk in cust:
            g = cust[csk]
            cnt[g] += 1
            units[g] += q
            rrev[g] += rev
        if q >= Q3_MIN_QUANTITY and lo <= price <= hi:
            q3.append((-rev, row))
        c = per_cust.setdefault(csk, [0, 0, 0])
        c[0] += 1
        c[1] += rev
        c[2] = max(c[2], q)
    q3.sort()
    top = sorted(((-v[1], k) for k, v in per_cust.items()))[:TOPK]
    return {
        "q1_sort_merge_join": {"revenue_by_category": q1},
        "q2_hash_join": {"count_by_region": cnt, "units_by_region": units, "revenue_by_region": rrev},
        "q3_filter_topk": {"top_revenue": [-r for r, _ in q3[:TOPK]], "top_rows": [r for _, r in q3[:TOPK]]},
        "q4_groupby_agg": {
            "customers_above": sum(1 for v in per_cust.values() if v[1] > Q4_REVENUE),
            "top_customers": [k for _, k in top],
            "top_revenue": [-r for r, _ in top],
        },
    }


def check_equal(a: dict, b: dict, what: str = "runs") -> None:
    """Raises ``AssertionError`` naming the first query and field where two results differ."""
    if set(a) != set(b):
        raise AssertionError(f"{what}: different queries: {sorted(a)} and {sorted(b)}")
    for q in a:
        for field in sorted(set(a[q]) | set(b[q])):
            if a[q].get(field) != b[q].get(field):
                raise AssertionError(f"{what}: {q}.{field} differs: {a[q].get(field)!r} and {b[q].get(field)!r}")


# -------------------------------------------------------------------------------------------------
# Over Dask.
# -------------------------------------------------------------------------------------------------


def _xp(name: str) -> Any:
    if name == "numpy":
        return np
    if name == "cupy":
        import cupy

        return cupy
    raise ValueError(f"xp: expected numpy or cupy, got {name!r}")


def _task_partition(scale: float, partitions: int, p: int, xp_name: str, seed: int) -> dict:
    return make_partition(scale, partitions, p, _xp(xp_name), seed)


def _task_dims(scale: float, xp_name: str, seed: int) -> dict:
    return dimension_tables(scale, _xp(xp_name), seed)


def _task_map(name: str, part: dict, dims: dict, xp_name: str) -> Any:
    return QUERIES[name][0](part, dims, _xp(xp_name))


def _task_reduce(name: str, xp_name: str, *partials: Any) -> Any:
    # Partials of other workers arrive through Dask's comm (and, with mempool.dask's ipc, by handle).
    return QUERIES[name][1](list(partials), _xp(xp_name))


def run_dask(client: Any, scale: float, partitions: int, xp_name: str = "numpy", queries: Optional[list] = None,
             seed: int = SEED, repeats: int = 1) -> dict:
    """Every query over ``client``'s workers: the partitions made on the workers (and kept there), each
    query a map task per partition and one reduce task. Returns ``{"results": {query: result}, "seconds":
    {query: [seconds per repeat]}}``; each repeat's time runs from submitting the query's tasks to its
    result."""
    from distributed import wait

    workers = sorted(client.scheduler_info()["workers"])
    parts = [client.submit(_task_partition, scale, partitions, p, xp_name, seed, workers=[workers[p % len(workers)]],
                           pure=False, key=f"bdb-part-{p}-{time.monotonic_ns()}") for p in range(partitions)]
    dims = [client.submit(_task_dims, scale, xp_name, seed, workers=[w], pure=False,
                          key=f"bdb-dims-{w}-{time.monotonic_ns()}") for w in workers]
    wait(parts + dims)
    results: dict = {}
    seconds: dict = {}
    for name in queries or list(QUERIES):
        if name not in QUERIES:
            raise ValueError(f"unknown query {name!r}; the queries are {', '.join(QUERIES)}")
        seconds[name] = []
        for r in range(repeats):
            t0 = time.perf_counter()
            maps = [client.submit(_task_map, name, part, dims[i % len(workers)], xp_name, pure=False,
                                  workers=[workers[i % len(workers)]]) for i, part in enumerate(parts)]
            red = client.submit(_task_reduce, name, xp_name, *maps, pure=False)
            res = red.result()
            seconds[name].append(time.perf_counter() - t0)
            if r == 0:
                results[name] = res
            elif res != results[name]:
                raise AssertionError(f"{name}: repeat {r} gave another result")
            del maps, red
    del parts, dims
    return {"results": results, "seconds": seconds}


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mempool.benchmarks.bdb", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--xp", choices=("numpy", "cupy"), default="numpy")
    ap.add_argument("--queries", default=",".join(QUERIES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=0, help="with --xp cupy: a LocalCUDACluster of this many GPUs")
    ap.add_argument("--allocators", default="mempool-default",
                    help="with --gpus: comma-separated runs among rmm-pool, mempool-default, mempool-pool")
    ap.add_argument("--pool-size", default="0.8", help="the pool size of the rmm-pool and mempool runs")
    ap.add_argument("--json", default=None, help="write the report here as well")
    ap.add_argument("--check-reference", action="store_true", help="also compute the naive reference (slow)")
    a = ap.parse_args(argv)
    queries = [q for q in a.queries.split(",") if q]
    for q in queries:
        if q not in QUERIES:
            ap.error(f"unknown query {q!r}; the queries are {', '.join(QUERIES)}")
    # The tasks must name functions of the importable module, not of __main__ (python -m runs this file as
    # __main__: its functions would travel by value to the workers).
    from mempool.benchmarks import bdb as this

    report: dict = {"scale": a.scale, "partitions": a.partitions, "xp": a.xp, "runs": {}}
    if a.gpus:
        if a.xp != "cupy":
            ap.error("--gpus needs --xp cupy")
        from mempool.benchmarks.dask_gpu import bdb_cluster_runs

        report["runs"] = bdb_cluster_runs(a, queries)
    else:
        from distributed import Client, LocalCluster

        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
                Client(cluster) as client:
            report["runs"]["local"] = this.run_dask(client, a.scale, a.partitions, a.xp, queries, repeats=a.repeats)
    runs = list(report["runs"].values())
    for other in runs[1:]:
        check_equal(runs[0]["results"], other["results"], "two runs")
    if a.check_reference:
        ref = reference(a.scale, a.partitions)
        check_equal(runs[0]["results"], {q: ref[q] for q in queries}, "reference")
        print("results equal to the naive reference")
    print(f"| run | {' | '.join(queries)} | peak bytes per worker |")
    print("|---|" + "---|" * (len(queries) + 1))
    for name, run in report["runs"].items():
        cells = [f"{min(run['seconds'][q]) * 1000:.1f} ms" for q in queries]
        peaks = run.get("peak_bytes", {})
        print(f"| {name} | {' | '.join(cells)} | {', '.join(str(v) for v in peaks.values()) or 'n/a'} |")
    print("results equal across runs" if len(runs) > 1 else "one run")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
