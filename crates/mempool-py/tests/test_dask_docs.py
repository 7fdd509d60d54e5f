"""docs/dask.md's snippets: every ```python block runs as it stands, each in a fresh interpreter, on the GPU
machine (marked ``gpu``; blocks fenced ```` ```python two_gpu ```` are marked ``two_gpu`` as well). The host
tests compile every block, check that each name a block imports or uses from ``mempool.dask`` exists, that
the page starts with the three-line ``LocalCUDACluster`` example, and that every ``--mempool-*`` option and
every ``python -m mempool...`` command of its shell blocks is one the command takes.

The page is found next to the user guide (``../../../docs/`` from here, or the directory of
``MEMPOOL_DOCS``), as test_guide.py finds it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("distributed", reason="docs/dask.md's host tests need distributed (scripts/python-tests.sh "
                    "installs it on Python 3.11 or newer)")

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_mempool_test_guide", HERE / "test_guide.py")
guide = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(guide)

TIMEOUT = 360  # inside dask-gpu-tests.sh's --timeout 420


def dask_doc() -> Path:
    return guide.docs_path().with_name("dask.md")


def blocks():
    return guide.parse(dask_doc().read_text(encoding="utf-8"))[0]


def python_blocks():
    return guide.python_blocks(dask_doc())


def _params():
    try:
        bs = python_blocks()
    except (OSError, ValueError) as e:
        return [pytest.param(None, id="dask-md-not-found", marks=pytest.mark.skip(reason=str(e)))]
    return [pytest.param(b, id=b.id, marks=[pytest.mark.gpu] + ([pytest.mark.two_gpu] if "two_gpu" in b.attrs else []))
            for b in bs]


def test_the_page_is_found_and_linked_from_the_readme():
    assert dask_doc().is_file(), f"docs/dask.md is not at {dask_doc()}"
    readme = dask_doc().parents[1] / "README.md"
    if readme.is_file():  # a source tree (an installed wheel's tests may run without one)
        assert "docs/dask.md" in readme.read_text(encoding="utf-8")


def test_the_page_starts_with_a_three_line_local_cuda_cluster_example():
    first = blocks()[0]
    assert first.info == "python", first.info
    lines = [ln for ln in first.code.splitlines() if ln.strip()]
    assert len(lines) == 3 and "LocalCUDACluster" in first.code, first.code
    text = dask_doc().read_text(encoding="utf-8")
    assert text.index("```python") < text.index("\n## "), "the example comes before the first section"


def test_every_block_compiles_and_uses_what_mempool_dask_has():
    import mempool.dask as md

    bs = python_blocks()
    assert len(bs) >= 4
    for b in bs:
        where = f"{dask_doc()}:{b.line} ({b.id})"
        tree = ast.parse(b.code, where)
        assert set(b.attrs) <= {"two_gpu"}, f"{where}: unknown block attributes {b.attrs}"
        assert "mempool" in b.code and not re.search(r"\brmm\b", b.code), where
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "mempool.dask":
                for alias in node.names:
                    assert hasattr(md, alias.name), f"{where}: mempool.dask has no {alias.name}"
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "mempool"
                    and node.value.attr == "dask"):
                assert hasattr(md, node.attr), f"{where}: mempool.dask has no {node.attr}"
        if "LocalCUDACluster(" in b.code and b is not bs[0]:
            # Run as `python -c`; the guard keeps the blocks runnable as scripts too (spawned workers).
            assert '__name__ == "__main__"' in b.code, f"{where}: a cluster block needs a __main__ guard"


def test_the_host_only_block_runs_here():
    """The spec block needs no GPU: it runs on the host too."""
    b = [b for b in python_blocks() if "ResourceSpec.parse" in b.code]
    assert len(b) == 1
    p = subprocess.run([sys.executable, "-c", b[0].code], capture_output=True, text=True, timeout=120, cwd="/")
    assert p.returncode == 0, p.stderr


def _shell_commands():
    out = []
    for b in blocks():
        if b.info != "sh":
            continue
        text = re.sub(r"\\\n\s*", " ", b.code)
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(shlex.split(line))
    return out


def test_every_shell_option_is_one_the_command_takes():
    from mempool.dask.preload import dask_setup
    from mempool.benchmarks import bdb, dask_gpu

    preload_opts = {opt for p in dask_setup.params for opt in p.opts}
    cmds = _shell_commands()
    assert cmds
    checked = 0
    for argv in cmds:
        for i, a in enumerate(argv):
            if a == "--preload-argv":
                for opt in shlex.split(argv[i + 1]):
                    if opt.startswith("--"):
                        assert opt in preload_opts, f"docs/dask.md passes {opt}, which the preload does not take"
                        checked += 1
            if a == "--preload":
                assert argv[i + 1] == "mempool.dask.preload"
        if argv[:2] == ["python", "-m"]:
            module = argv[2]
            assert module in ("mempool.dask.preload", "mempool.benchmarks.bdb", "mempool.benchmarks.dask_gpu"), module
            args = [x for x in argv[3:]]
            if module == "mempool.benchmarks.bdb":
                parser_help = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                                             timeout=120, cwd="/")
                assert parser_help.returncode == 0, parser_help.stderr
                for opt in (x for x in args if x.startswith("--")):
                    assert opt in parser_help.stdout, f"bdb has no {opt}"
                    checked += 1
            elif module == "mempool.benchmarks.dask_gpu":
                parser_help = subprocess.run([sys.executable, "-m", module] + args[:1] + ["--help"],
                                             capture_output=True, text=True, timeout=120, cwd="/")
                assert parser_help.returncode == 0, parser_help.stderr
                for opt in (x for x in args[1:] if x.startswith("--")):
                    assert opt in parser_help.stdout, f"dask_gpu {args[0]} has no {opt}"
                    checked += 1
            else:
                p = subprocess.run([sys.executable, "-m", module] + args, capture_output=True, text=True, timeout=120,
                                   cwd="/")
                assert p.returncode == 0 and "--mempool-kind" in p.stdout, (p.stdout, p.stderr)
    assert checked >= 10
    assert bdb.QUERIES and dask_gpu.shuffle_run


def test_the_host_workload_command_runs():
    """The first workload command of the page (NumPy, a LocalCluster) at its size, with the reference."""
    argv = next(a for a in _shell_commands() if a[:3] == ["python", "-m", "mempool.benchmarks.bdb"] and "numpy" in a)
    p = subprocess.run([sys.executable] + argv[1:] + ["--repeats", "1"], capture_output=True, text=True, timeout=300,
                       cwd="/")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| local |" in p.stdout, p.stdout


@pytest.mark.parametrize("block", _params(), ids=lambda b: getattr(b, "id", None))
def test_dask_block_runs(block, tmp_path):
    if "two_gpu" in block.attrs:
        from mempool import mr

        n = mr.device_count()
        assert n >= 2, f"docs/dask.md:{block.line} ({block.id}) needs two GPUs; this machine has {n}"
    env = {k: v for k, v in os.environ.items() if k not in guide.CLEARED_ENV}
    try:
        p = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"docs/dask.md:{block.line} ({block.id}) did not finish in {TIMEOUT} s\n"
                    f"--- stdout\n{e.stdout}\n--- stderr\n{e.stderr}")
    assert p.returncode == 0, (f"docs/dask.md:{block.line} ({block.id}) exited with status {p.returncode}\n"
                               f"--- stdout\n{p.stdout}\n--- stderr\n{p.stderr[-6000:]}")
