"""The Python port of the standard random workload against the Rust generator.

``crates/mempool-suballoc/tests/data/random_workload.txt`` was written by the Rust generator
(``MEMPOOL_BLESS=1 cargo test -p mempool-suballoc --test workload_fixture``), and that Rust test checks
it on every ``cargo test``; this test checks ``mempool.benchmarks.random_workload`` against the same
file: SplitMix64's outputs, small workloads op for op, and the three standard points of
``mempool-bench random`` by length, hash, first 100 and last 20 operations.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FIXTURE = HERE.parents[1] / "mempool-suballoc" / "tests" / "data" / "random_workload.txt"
SOURCE = HERE.parent / "python" / "mempool" / "benchmarks" / "random_workload.py"


def load_module():
    """The installed ``mempool.benchmarks.random_workload`` (what the wheel ships) when ``mempool``
    imports, else the source file (a checkout where the extension is not built)."""
    try:
        from mempool.benchmarks import random_workload

        return random_workload
    except ImportError:
        spec = importlib.util.spec_from_file_location("_mempool_random_workload", SOURCE)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


rw = load_module()


def fnv(ops) -> int:
    h = 0xCBF29CE484222325
    for op in ops:
        kind, v = (1, op) if op > 0 else (2, ~op)
        for x in (kind, v):
            h = ((h ^ x) * 0x100000001B3) & ((1 << 64) - 1)
    return h


def parse_ops(s: str) -> list:
    out = []
    for tok in s.split(","):
        kind, v = tok[0], int(tok[1:])
        assert kind in "af", tok
        out.append(v if kind == "a" else ~v)
    return out


def fixture_lines(kind: str) -> list:
    assert FIXTURE.is_file(), f"the fixture is not at {FIXTURE}"
    lines = [ln.split() for ln in FIXTURE.read_text().splitlines() if ln and not ln.startswith("#")]
    found = [ln[1:] for ln in lines if ln[0] == kind]
    assert found, f"{FIXTURE}: no '{kind}' lines"
    return found


def test_splitmix64_matches_rust():
    for seed, *outs in fixture_lines("splitmix64"):
        r = rw.SplitMix64(int(seed))
        assert [f"{r.next_u64():016x}" for _ in outs] == outs, f"seed {seed}"


@pytest.mark.parametrize("line", fixture_lines("full"), ids=lambda ln: f"n{ln[0]}-seed{ln[3]}")
def test_small_workloads_match_rust_op_for_op(line):
    n, max_size, max_usage, seed, length, h, ops = line
    got = rw.random_workload(int(n), int(max_size), int(max_usage), int(seed))
    assert got == parse_ops(ops)
    assert len(got) == int(length) and fnv(got) == int(h, 16)


@pytest.mark.parametrize("line", fixture_lines("point"), ids=lambda ln: f"n{ln[0]}-seed{ln[3]}")
def test_standard_points_match_rust(line):
    n, max_size, max_usage, seed, length, h, first, last = line
    got = rw.random_workload(int(n), int(max_size), int(max_usage), int(seed))
    assert len(got) == int(length)
    assert got[:100] == parse_ops(first)
    assert got[-20:] == parse_ops(last)
    assert fnv(got) == int(h, 16)


def test_the_benchmark_runs_the_points_mempool_bench_runs():
    # crates/mempool-bench/src/workloads/random.rs: STANDARD_POINTS, seed 42 + point index.
    got = [(p.n, p.max_size, p.max_usage) for p in rw.STANDARD_POINTS]
    assert got == [(int(ln[0]), int(ln[1]), int(ln[2])) for ln in fixture_lines("point")]
    assert [rw.SEED + i for i in range(3)] == [int(ln[3]) for ln in fixture_lines("point")]


def test_decode_and_peak_live():
    ops = rw.random_workload(12, 4096, 10_000, 42)
    assert [rw.decode(op) for op in ops[:4]] == [("a", 3734), ("a", 3923), ("a", 1011), ("f", 1)]
    # a3734 a3923 a1011 f1 (live 3734 1011) a1967 f1 (live 3734 1967) a3805 (live 3734 1967 3805) f0 ...:
    # at most 3 live, the most bytes 3734 + 1967 + 3805.
    assert rw.peak_live(ops) == (3, 3734 + 1967 + 3805)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="max_size"):
        rw.random_workload(10, 0, 100, 1)


def test_the_timed_loop_frees_exactly_what_the_workload_says_when_it_says_it():
    # Each object records its allocation and its destruction: a free must destroy the object at the
    # named index of the live list (swap-remove) at once, the final frees go in list order, then sync.
    events = []
    counter = iter(range(1 << 30))

    class Obj:
        def __init__(self, n):
            self.id = next(counter)
            events.append(("a", self.id, n))

        def __del__(self):
            events.append(("f", self.id))

    ops = rw.random_workload(3000, 100, 4000, 3)
    assert any(op < 0 for op in ops) and any(~op > 0 for op in ops if op < 0)
    run = rw.make_runner("Obj(n)", {"Obj": Obj})
    elapsed = run(ops, lambda: events.append(("sync",)), iter(range(0, 1 << 30, 7)).__next__)
    assert elapsed == 7

    want, live, next_id = [], [], 0
    for op in ops:
        if op > 0:
            want.append(("a", next_id, op))
            live.append(next_id)
            next_id += 1
        else:
            i = ~op
            last = live.pop()
            if i < len(live):
                victim, live[i] = live[i], last
            else:
                victim = last
            want.append(("f", victim))
    want += [("f", x) for x in live] + [("sync",)]
    assert events == want
