"""Host tests of ``mempool.benchmarks.random_workload`` as a program: it imports without PyTorch, CuPy, RMM,
Numba or a GPU (and does not import mempool itself), ``--help`` and ``--list`` work, bad arguments are
refused with the reason, and a whole run of the configuration that needs no GPU goes through the same
child processes, table and JSON as a GPU run, with a framework that is not installed reported as skipped.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "python" / "mempool" / "benchmarks" / "random_workload.py"
FRAMEWORKS = ("torch", "cupy", "numba", "rmm", "mempool")


def script() -> list:
    """How to run the benchmark: ``-m mempool.benchmarks.random_workload`` when ``mempool`` is installed
    (what a user types), else the source file (a checkout where the extension is not built)."""
    probe = subprocess.run([sys.executable, "-c", "import mempool.benchmarks.random_workload"],
                           capture_output=True, cwd="/")
    if probe.returncode == 0:
        return [sys.executable, "-m", "mempool.benchmarks.random_workload"]
    return [sys.executable, str(SOURCE)]


def run(*args, timeout=120):
    return subprocess.run(script() + list(args), capture_output=True, text=True, timeout=timeout, cwd="/")


def test_the_module_imports_no_framework_and_not_mempool():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('_rw', {str(SOURCE)!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r}))\n"
        "print(len(mod.CONFIGS))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert p.returncode == 0, p.stderr
    imported, n = p.stdout.split("\n")[:2]
    assert imported == "[]", f"importing the benchmark imported {imported}"
    assert int(n) >= 14


def test_help():
    p = run("--help")
    assert p.returncode == 0, p.stderr
    for opt in ("--points", "--repeats", "--only", "--json", "--list"):
        assert opt in p.stdout, f"--help does not mention {opt}:\n{p.stdout}"
    assert "torch-caching" in p.stdout and "--child" not in p.stdout


def test_list_names_every_configuration():
    p = run("--list")
    assert p.returncode == 0, p.stderr
    names = [ln.split()[0] for ln in p.stdout.splitlines()]
    for want in ("python-floor", "torch-caching", "torch-async", "torch-mempool-pool", "torch-mempool-binning",
                 "cupy-pool", "cupy-async", "cupy-mempool-pool", "mempool-default", "mempool-pool", "rmm-async",
                 "rmm-pool", "rmm-mempool-stack"):
        assert want in names, f"--list lacks {want}: {names}"


@pytest.mark.parametrize("args, says", [
    (["--points", "huge"], "unknown point 'huge'"),
    (["--points", ","], "names no point"),
    (["--only", "torch-caching,nope"], "unknown configuration nope"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--seed", "-1"], "--seed must be in"),
    (["--timeout", "0"], "--timeout must be positive"),
])
def test_bad_arguments_are_refused_with_the_reason(args, says):
    p = run(*args)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert says in p.stderr, p.stderr


def test_a_run_without_a_gpu(tmp_path):
    # The large point is the shortest (20k operations). python-floor needs no GPU; a configuration whose
    # framework is not installed here must come out as skipped, naming it.
    absent = [c for c, m in (("torch-caching", "torch"), ("cupy-pool", "cupy"), ("rmm-async", "rmm"))
              if importlib.util.find_spec(m) is None]
    out = tmp_path / "result.json"
    p = run("--only", ",".join(["python-floor"] + absent), "--points", "large", "--repeats", "2",
            "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(out.read_text())
    by = {r["config"]: r for r in report["results"]}
    floor = by["python-floor"]
    assert floor["status"] == "ok", floor
    assert floor["ops"] == 20_000 and len(floor["runs_ns_per_op"]) == 2 and floor["ns_per_op"] > 0
    for c in absent:
        assert by[c]["status"] == "skipped" and "is not installed" in by[c]["reason"], by[c]
    table = p.stdout
    assert report["table"] == table
    assert "| `python-floor` |" in table and "large ns/op" in table
    assert "host CPU:" in table and "python " in table and "--only" in table
    assert "20000 ops, at most" in table
    for c in absent:
        assert f"| `{c}` |" in table and "skipped" in table
