#!/usr/bin/env python3
"""Every CUDA driver call of the workspace goes through mempool-core's `raw/` (docs/architecture.md,
"Where unsafe lives").

Usage: .ci/driver-calls.py   (from the repository root; `.ci/run` runs it)

Scans the Rust sources of every crate, the facade, its examples and tests, comments and string literals
blanked out, for a call of a driver entry point through cudarc's bindings (`sys::cuXxx(`,
`cudarc::driver::sys::cuXxx(`, or `culib().cuXxx(`) outside `crates/mempool-core/src/raw/`. Handle types
and constants (`sys::CUstream`, `sys::CUresult::...`) are not calls and pass. Prints each offender and
fails when there is one.
"""

import importlib.util
import pathlib
import re
import sys

ROOT = pathlib.Path(".")
ALLOWED = ROOT / "crates" / "mempool-core" / "src" / "raw"
CALL = re.compile(r"(?:\bsys::|\bculib\(\)\s*\.\s*)(cu[A-Z]\w*)\s*\(")


def load_strip():
    """module-cycles.py's `strip`: the one comment and literal blanker of the CI scripts."""
    here = pathlib.Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("module_cycles", here / "module-cycles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.strip


def sources():
    for top in [ROOT / "crates", ROOT / "src", ROOT / "examples", ROOT / "tests"]:
        for path in sorted(top.rglob("*.rs")):
            if "target" in path.parts or ALLOWED in path.parents:
                continue
            yield path


def main():
    strip = load_strip()
    bad = []
    for path in sources():
        code = strip(path.read_text(encoding="utf-8"))
        for m in CALL.finditer(code):
            line = code.count("\n", 0, m.start()) + 1
            bad.append(f"{path}:{line}: {m.group(1)} called outside crates/mempool-core/src/raw/")
    for b in bad:
        print(b)
    if bad:
        print(f"driver-calls: {len(bad)} driver call(s) outside mempool-core's raw/: add a function there")
        return 1
    print("driver-calls: every driver call goes through crates/mempool-core/src/raw/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
