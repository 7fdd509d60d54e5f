"""Every ```python block of docs/rmm.md, run as it stands in a fresh interpreter on the GPU (the host suite,
crates/mempool-py/tests/test_rmm.py, compiles them). The page is found beside this file (the pack copies it
there) or in the repository's docs/."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def page() -> Path:
    here = Path(__file__).resolve()
    for p in (here.with_name("rmm.md"), here.parents[3] / "docs" / "rmm.md"):
        if p.is_file():
            return p
    raise AssertionError("docs/rmm.md is neither beside this test nor in the repository")


BLOCKS = [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```$", page().read_text(), re.S | re.M)]


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_block_runs(code, tmp_path):
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
