#!/usr/bin/env python3
"""The workspace's rust-version is at least what its locked dependencies need, and README names it.

Usage: .ci/rust-version.py   (from the repository root; `.ci/run` runs it)

Reads `cargo metadata` for this machine's platform (every locked package built here, dev-dependencies
included) and takes the highest `rust-version` among the registry packages. Fails when the workspace's
`rust-version` (Cargo.toml, [workspace.package]) is lower, or when README.md does not say
"Rust toolchain (X or newer" with the workspace's version X. Prints which packages set the minimum.
"""

import json
import re
import subprocess
import sys


def version(text):
    """`1.88` and `1.88.0` alike, as (1, 88, 0)."""
    parts = [int(x) for x in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def main():
    host = subprocess.run(["rustc", "-vV"], capture_output=True, text=True, check=True).stdout
    host = re.search(r"^host: (\S+)", host, re.M).group(1)
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", host],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    resolved = {n["id"] for n in meta["resolve"]["nodes"]}
    deps = [p for p in meta["packages"] if p["id"] in resolved and p["source"] and p.get("rust_version")]
    needed = max(version(p["rust_version"]) for p in deps)
    setters = sorted(f'{p["name"]} {p["version"]}' for p in deps if version(p["rust_version"]) == needed)
    needed_text = ".".join(map(str, needed[:2] if needed[2] == 0 else needed))

    cargo_toml = open("Cargo.toml").read()
    ours = re.search(r'^\[workspace\.package\][^\[]*?^rust-version = "([^"]+)"', cargo_toml, re.M | re.S).group(1)
    readme = open("README.md").read()
    said = re.search(r"Rust toolchain \((\d+\.\d+(?:\.\d+)?) or newer", readme)

    print(f"rust-version: the locked dependencies need {needed_text} ({', '.join(setters)}); the workspace says {ours}")
    ok = True
    if version(ours) < needed:
        print(f"rust-version: Cargo.toml's rust-version {ours} is below {needed_text}: raise it", file=sys.stderr)
        ok = False
    if not said or said.group(1) != ours:
        print(
            f"rust-version: README.md must say 'Rust toolchain ({ours} or newer' "
            f"(it says {said.group(0) if said else 'nothing'})",
            file=sys.stderr,
        )
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
