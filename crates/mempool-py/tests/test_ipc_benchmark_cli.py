"""Host tests of ``mempool.benchmarks.ipc_handoff`` as a program: it imports without PyTorch, cuda.core or a GPU
(and does not import mempool itself), ``--help`` works, and bad arguments are refused with the reason before
anything is imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "python" / "mempool" / "benchmarks" / "ipc_handoff.py"


def run(*args):
    return subprocess.run([sys.executable, str(SOURCE), *args], capture_output=True, text=True, timeout=60, cwd="/")


def test_the_module_imports_no_framework_and_not_mempool():
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('_ih', {str(SOURCE)!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "bad = [m for m in ('torch', 'cuda', 'mempool', 'mempool._lib') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert mod.FRAMEWORKS == ('mempool', 'mempool-nospin', 'mempool-socket', 'mempool-acked', 'torch', 'cuda.core')\n"
        "assert mod.human(64 << 10) == '64 KiB' and mod.human(16 << 20) == '16 MiB'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr


def test_help_lists_the_options():
    out = run("--help")
    assert out.returncode == 0, out.stderr
    for option in ("--frameworks", "--consumers", "--iterations", "--sustained-buffers", "--json"):
        assert option in out.stdout, out.stdout


def test_bad_arguments_are_refused_with_the_reason():
    out = run("--frameworks", "mempool,nccl")
    assert out.returncode == 2
    assert "unknown framework(s) nccl" in out.stderr, out.stderr
    out = run("--consumers", "0")
    assert out.returncode == 2
    assert "must be at least 1" in out.stderr, out.stderr
