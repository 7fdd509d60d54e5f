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

import pathlib
import re
import sys

ROOT = pathlib.Path(".")
ALLOWED = ROOT / "crates" / "mempool-core" / "src" / "raw"
CALL = re.compile(r"(?:\bsys::|\bculib\(\)\s*\.\s*)(cu[A-Z]\w*)\s*\(")


def code_only(text):
    """Blanks out comments and string/char literals, keeping newlines, so only code is searched."""
    out, i, n = [], 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text[i] == '"' or text.startswith('r"', i) or text.startswith('r#"', i):
            m = re.match(r'r(#*)"', text[i:])
            if m:
                end = '"' + m.group(1)
                j = text.find(end, i + len(m.group(0)))
                j = n if j < 0 else j + len(end)
            else:
                j = i + 1
                while j < n and text[j] != '"':
                    j += 2 if text[j] == "\\" else 1
                j = min(n, j + 1)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def sources():
    for top in [ROOT / "crates", ROOT / "src", ROOT / "examples", ROOT / "tests"]:
        for path in sorted(top.rglob("*.rs")):
            if "target" in path.parts or ALLOWED in path.parents:
                continue
            yield path


def main():
    bad = []
    for path in sources():
        code = code_only(path.read_text(encoding="utf-8"))
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
