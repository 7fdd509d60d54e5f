"""Every ```python block of docs/python.md (the user guide) and docs/distributed.md, run as it stands in
a fresh interpreter.

The GPU tests (marked ``gpu``) run each block in a process of its own, in an empty working directory, one
test per block, named after the heading the block sits under: the guide's with ``sys.executable -c``,
distributed.md's written to a script and run as one (so that ``torch.multiprocessing.spawn`` can import its
functions). A block fenced ```` ```python two_gpu ```` is marked ``two_gpu`` as well: it needs two GPUs and
fails on fewer. The host tests check the extraction itself: every main section of the guide has a block
(the sections that are prose by design are listed), no block is empty, every block compiles, the guide
uses ``mempool``, not ``rmm``, and every block that starts NCCL turns NVLink multicast off first.

The documents are found relative to this file (``../../../docs/``) or, when the tests run from an
installed wheel elsewhere, at the path in the environment variable ``MEMPOOL_DOCS`` (the guide;
distributed.md is its sibling).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: ``##`` sections that are prose by design (no runnable block): the benchmark table, and the note on how
#: the guide is tested.
PROSE_SECTIONS = {"Performance", "Testing this guide"}

#: Environment variables that would make one block depend on the environment the tests run in.
CLEARED_ENV = ("NUMBA_CUDA_MEMORY_MANAGER", "PYTORCH_CUDA_ALLOC_CONF", "RMM_LOG_FILE")

#: Seconds one block may take (the pool and PyTorch blocks start CUDA, a few seconds each).
TIMEOUT = 300

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,}|~{3,})\s*(?P<info>[^`\s]*)(?P<attrs>[^`]*)$")
_HEADING = re.compile(r"^(?P<level>#{1,6})\s+(?P<text>.+?)\s*#*\s*$")


def docs_path() -> Path:
    env = os.environ.get("MEMPOOL_DOCS")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "docs" / "python.md"


def distributed_path() -> Path:
    return docs_path().with_name("distributed.md")


class Block:
    """One fenced block: its language, code (dedented), first line number, and the headings above it."""

    def __init__(self, info: str, code: str, line: int, section: str, heading: str, attrs: tuple = ()) -> None:
        self.info, self.code, self.line, self.section, self.heading = info, code, line, section, heading
        self.attrs = attrs  # the words after the language: ```python two_gpu
        self.id = ""


def parse(text: str) -> tuple:
    """Every fenced block of ``text`` and every ``##`` section, in order. Headings inside blocks are
    not headings; a block's fence may be indented (inside a list item), and its code is dedented."""
    blocks, sections = [], []
    section = heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _FENCE.match(line)
        if m:
            ticks, info, start = m["ticks"], m["info"].lower(), i + 1
            attrs = tuple(m["attrs"].lower().split())
            body = []
            i += 1
            while i < len(lines) and not re.match(r"^\s*" + re.escape(ticks[0]) + "{%d,}\\s*$" % len(ticks),
                                                 lines[i]):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"line {start}: a ``` block that is never closed")
            blocks.append(Block(info, textwrap.dedent("\n".join(body)).strip("\n") + "\n", start + 1, section,
                                heading, attrs))
            i += 1
            continue
        h = _HEADING.match(line)
        if h:
            heading = h["text"]
            if len(h["level"]) == 2:
                section = heading
                sections.append(section)
        i += 1
    return blocks, sections


def python_blocks(path: Path | None = None) -> list:
    """The ``python`` blocks of the guide (or of `path`), each with a unique id made from its heading."""
    path = path or docs_path()
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} is not at {path} (set MEMPOOL_DOCS to the user guide's path)")
    blocks = [b for b in parse(path.read_text(encoding="utf-8"))[0] if b.info == "python"]
    seen: dict = {}
    for b in blocks:
        base = re.sub(r"[^A-Za-z0-9]+", "-", b.heading).strip("-").lower() or "top"
        seen[base] = seen.get(base, 0) + 1
        b.id = base if seen[base] == 1 else f"{base}-{seen[base]}"
    return blocks


def _blocks_or_error():
    try:
        return python_blocks()
    except (OSError, ValueError) as e:  # reported by test_the_guide_is_found, not a collection crash
        return [pytest.param(None, id="guide-not-found", marks=pytest.mark.skip(reason=str(e)))]


def _distributed_blocks_or_error():
    try:
        blocks = python_blocks(distributed_path())
    except (OSError, ValueError) as e:  # reported by test_distributed_md_is_found
        return [pytest.param(None, id="distributed-not-found", marks=pytest.mark.skip(reason=str(e)))]
    return [pytest.param(b, id=b.id, marks=[pytest.mark.gpu] + ([pytest.mark.two_gpu] if "two_gpu" in b.attrs else []))
            for b in blocks]


# -------------------------------------------------------------------------------------------------
# Host tests: the extraction.
# -------------------------------------------------------------------------------------------------


def test_the_guide_is_found():
    path = docs_path()
    assert path.is_file(), f"the user guide is not at {path} (set MEMPOOL_DOCS to its path)"


def test_distributed_md_is_found():
    path = distributed_path()
    assert path.is_file(), f"distributed.md is not at {path} (the guide's sibling)"


def test_parse_finds_blocks_headings_and_indented_fences():
    text = textwrap.dedent("""\
        # Title
        ## One
        ```python two_gpu
        x = 1
        ```
        ### Sub
        1. a list item:

           ```python
           if True:
               y = 2
           ```
        ```sh
        # not a heading
        ```
        ## Two
        ```text
        out
        ```
        """)
    blocks, sections = parse(text)
    assert sections == ["One", "Two"]
    assert [(b.info, b.section, b.heading) for b in blocks] == [
        ("python", "One", "One"), ("python", "One", "Sub"), ("sh", "One", "Sub"), ("text", "Two", "Two")]
    assert blocks[1].code == "if True:\n    y = 2\n"
    assert blocks[0].line == 4
    assert blocks[0].attrs == ("two_gpu",) and blocks[1].attrs == ()
    with pytest.raises(ValueError, match="never closed"):
        parse("## A\n```python\nx = 1\n")


def test_every_main_section_has_a_block():
    path = docs_path()
    blocks, sections = parse(path.read_text(encoding="utf-8"))
    runnable = {b.section for b in blocks if b.info == "python"}
    missing = [s for s in sections if s not in PROSE_SECTIONS and s not in runnable]
    assert not missing, f"{path}: sections without a ```python block: {missing}"
    unknown = PROSE_SECTIONS - set(sections)
    assert not unknown, f"PROSE_SECTIONS names sections the guide does not have: {sorted(unknown)}"
    assert len(sections) >= 8, sections


def test_every_block_is_nonempty_compiles_and_uses_mempool():
    blocks = python_blocks()
    assert len(blocks) >= 20, f"only {len(blocks)} python blocks"
    assert len({b.id for b in blocks}) == len(blocks)
    for b in blocks:
        where = f"{docs_path()}:{b.line} ({b.id})"
        assert b.code.strip(), f"{where}: empty block"
        assert not re.search(r"^\s*(>>>|\.\.\.)\s", b.code, re.M), f"{where}: interactive prompts do not run"
        compile(b.code, where, "exec")
        assert not re.search(r"\brmm\b", b.code), f"{where}: the guide's code must use mempool, not rmm"
        assert "mempool" in b.code, f"{where}: a block that does not use mempool"


def test_distributed_blocks_compile_use_mempool_and_turn_multicast_off():
    blocks = python_blocks(distributed_path())
    assert len(blocks) >= 2 and any("two_gpu" in b.attrs for b in blocks), [(b.id, b.attrs) for b in blocks]
    for b in blocks:
        where = f"{distributed_path()}:{b.line} ({b.id})"
        compile(b.code, where, "exec")
        assert "mempool" in b.code and not re.search(r"\brmm\b", b.code), where
        assert set(b.attrs) <= {"two_gpu"}, f"{where}: unknown block attributes {b.attrs}"
        if "torch.distributed" in b.code:
            # NVLink multicast stays off: set before torch (and so NCCL) is imported.
            nvls = b.code.find('os.environ["NCCL_NVLS_ENABLE"] = "0"')
            assert 0 <= nvls < b.code.find("import torch"), f"{where}: NCCL_NVLS_ENABLE=0 must come before torch"
    _, sections = parse(distributed_path().read_text(encoding="utf-8"))
    assert "What was tested here" in sections, sections


def test_blocks_of_other_languages_are_not_python():
    # Shell and output blocks are fenced as such, so nothing runnable hides in an unlabelled block.
    for path in (docs_path(), distributed_path()):
        blocks, _ = parse(path.read_text(encoding="utf-8"))
        unlabelled = [b.line for b in blocks if not b.info]
        assert not unlabelled, f"{path}: blocks without a language at lines {unlabelled}: label them python, sh or text"


# -------------------------------------------------------------------------------------------------
# GPU test: every block, in a fresh interpreter.
# -------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("block", _blocks_or_error(), ids=lambda b: getattr(b, "id", None))
def test_guide_block_runs(block, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    try:
        p = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"docs/python.md:{block.line} ({block.id}) did not finish in {TIMEOUT} s\n"
                    f"--- stdout\n{e.stdout}\n--- stderr\n{e.stderr}\n--- code\n{block.code}")
    assert p.returncode == 0, (
        f"docs/python.md:{block.line} ({block.id}) exited with status {p.returncode}\n"
        f"--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}\n--- code\n{block.code}")


@pytest.mark.parametrize("block", _distributed_blocks_or_error(), ids=lambda b: getattr(b, "id", None))
def test_distributed_block_runs(block, tmp_path):
    if "two_gpu" in block.attrs:
        from mempool import mr

        n = mr.device_count()
        assert n >= 2, f"docs/distributed.md:{block.line} ({block.id}) needs two GPUs; this machine has {n}"
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    try:
        p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"docs/distributed.md:{block.line} ({block.id}) did not finish in {TIMEOUT} s\n"
                    f"--- stdout\n{e.stdout}\n--- stderr\n{e.stderr}\n--- code\n{block.code}")
    assert p.returncode == 0, (
        f"docs/distributed.md:{block.line} ({block.id}) exited with status {p.returncode}\n"
        f"--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}\n--- code\n{block.code}")
