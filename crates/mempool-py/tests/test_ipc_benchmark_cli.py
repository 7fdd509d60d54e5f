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
    for option in ("--frameworks", "--consumers", "--iterations", "--sustained-buffers", "--json", "--trace"):
        assert option in out.stdout, out.stdout
    assert "trace mempool's hand-off" in out.stdout, out.stdout


def test_bad_arguments_are_refused_with_the_reason():
    out = run("--frameworks", "mempool,nccl")
    assert out.returncode == 2
    assert "unknown framework(s) nccl" in out.stderr, out.stderr
    out = run("--consumers", "0")
    assert out.returncode == 2
    assert "must be at least 1" in out.stderr, out.stderr


def test_trace_parses_and_needs_mempool():
    # --trace is a flag; without mempool among the frameworks it is refused with the reason, before anything
    # is imported (so this runs without PyTorch or a GPU).
    out = run("--frameworks", "torch", "--trace")
    assert out.returncode == 2
    assert "--trace traces the mempool framework" in out.stderr, out.stderr
    out = run("--trace=1")
    assert out.returncode == 2
    assert "--trace: ignored explicit argument" in out.stderr, out.stderr
    # With mempool, the arguments parse and reach `run` as trace=True (and trace=False without the flag): main
    # runs here with `run` and `print_report` replaced and a stand-in torch that says a GPU is there.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('_ih', {str(SOURCE)!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "seen = {}\n"
        "def fake_run(frameworks, consumers, iterations, sustained_buffers, trace=False):\n"
        "    seen.update(frameworks=frameworks, trace=trace)\n"
        "    return None\n"
        "mod.run = fake_run\n"
        "mod.print_report = lambda report, frameworks: None\n"
        "sys.modules['torch'] = type(sys)('torch')\n"
        "sys.modules['torch'].cuda = type('C', (), {'is_available': staticmethod(lambda: True)})\n"
        "assert mod.main(['--frameworks', 'mempool,torch', '--trace']) == 0\n"
        "assert seen == {'frameworks': ['mempool', 'torch'], 'trace': True}, seen\n"
        "assert mod.main(['--frameworks', 'mempool']) == 0\n"
        "assert seen['trace'] is False, seen\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
