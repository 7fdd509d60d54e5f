#!/usr/bin/env python3
"""Module import graph of a crate's src/ and a check that it has no cycle.

Usage: .ci/module-cycles.py [crates/mempool-core/src]

A module is a file (lib.rs is the crate root, `crate`; foo/mod.rs is `foo`). Its edges are the crate paths
its code names, comments and string literals stripped: `crate::a::b` (and `$crate::` in macros), `use`
groups `crate::{a, b::c}`, `super::` / `self::` resolved from the file (and any inline `mod` it sits in),
and bare paths to its own child modules (`raw::init()` in lib.rs). A path to a child module counts as an
edge to that child; a path to an item of the root (a re-export or a function of lib.rs) counts as an edge
to the root. Declaring a module (`mod foo;`) is not an edge. A second pass adds the edges no path shows:
calls of inherent methods that another module's `impl Type` block defines (see `method_edges`).
Prints the graphs and every cycle (strongly connected component); exits 1 if there is one.
`.ci/run` runs it on every crate's src/ (and the facade's).
"""

import os
import re
import sys


def strip(text):
    """Blanks out comments, string and char literals (keeping newlines), so only code is searched."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + len(m.group(0)))
            end = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", text[i:]):
            m = re.match(r"'(\\[^']*|[^\\'])'", text[i:])
            out.append("' '")
            i += len(m.group(0))
        else:
            out.append(c)
            i += 1
    return "".join(out)


def modules(src):
    """Maps module path (tuple) -> file, for every .rs file under src."""
    mods = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)
            parts = rel[:-3].split(os.sep)
            if parts == ["lib"] or parts == ["main"]:
                path = ()
            elif parts[-1] == "mod":
                path = tuple(parts[:-1])
            else:
                path = tuple(parts)
            mods[path] = os.path.join(src, rel)
    return mods


def expand(body):
    """Expands a use-tree body (`a::b`, `{a, b::{c, d}}`, `a::{self, b}`) into paths (lists of segments)."""
    body = body.strip()
    if not body:
        return [[]]
    if body.startswith("{"):
        depth, items, cur = 0, [], ""
        for ch in body[1:-1] if body.endswith("}") else body[1:]:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                items.append(cur)
                cur = ""
            else:
                cur += ch
        items.append(cur)
        return [p for it in items if it.strip() for p in expand(it)]
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*|\*)\s*(::\s*(.*))?$", body, re.S)
    if not m:
        return [[]]
    head, rest = m.group(1), m.group(3)
    if rest is None:
        return [[head]]
    return [[head] + p if p != ["self"] else [head] for p in expand(rest)]


def inline_mods(code):
    """(start, end, name) of every inline `mod name { ... }` in stripped code."""
    spans = []
    for m in re.finditer(r"\bmod\s+([A-Za-z_][A-Za-z0-9_]*)\s*\{", code):
        depth, j = 1, m.end()
        while j < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[j], 0)
            j += 1
        spans.append((m.start(), j, m.group(1)))
    return spans


def resolve(segments, mods):
    """The longest module prefix of an absolute path; the root if the path names a root item."""
    best = ()
    for k in range(1, len(segments) + 1):
        if tuple(segments[:k]) in mods:
            best = tuple(segments[:k])
        else:
            break
    return best


PATH = r"(?<![A-Za-z0-9_$])(\$crate|crate|super|self)\s*::\s*((?:super\s*::\s*)*)(\{[^;]*?\}(?=\s*;)|[A-Za-z_][A-Za-z0-9_]*(?:\s*::\s*(?:[A-Za-z_][A-Za-z0-9_]*|\{[^;]*?\}(?=\s*;)|\*))*)"


def graph(src):
    mods = modules(src)
    edges = {m: set() for m in mods}
    for mod, path in mods.items():
        with open(path) as f:
            code = strip(f.read())
        spans = inline_mods(code)
        for m in re.finditer(PATH, code):
            anchor, supers, body = m.group(1), m.group(2), m.group(3)
            # The module the path is written in: the file's module plus any inline mods around it.
            here = list(mod) + [name for (s, e, name) in spans if s < m.start() < e]
            if anchor in ("crate", "$crate"):
                base = []
            else:
                base = here if anchor == "self" else here[:-1]
                base = base[: len(base) - supers.count("super")]
            for tail in expand(body):
                target = resolve(base + tail, mods)
                # Paths into this file (or an inline mod of it) are not edges.
                if target != mod:
                    edges[mod].add(target)
        # Bare paths to a child module (`raw::init()` in lib.rs, `pub use buffer::X`).
        for m in re.finditer(r"(?<![A-Za-z0-9_$:])\s*([a-z_][a-z0-9_]*)\s*::", code):
            here = list(mod) + [name for (s, e, name) in spans if s < m.start() < e]
            child = tuple(here + [m.group(1)])
            if child in mods and child != mod:
                edges[mod].add(child)
    return mods, edges


def method_edges(mods):
    """Edges a `use` does not show: module N calls a method of an inherent `impl Type` block that another
    module M defines (Rust lets any module of the crate add one). Counted when N names `Type` and calls
    `.name(` or `Type::name(` for a method name that only M's impls of `Type` define; conservative (a
    same-named method of another type can add an edge that is not real, never hide one)."""
    codes = {m: strip(open(p).read()) for m, p in mods.items()}
    defs = {}  # method name -> set of (module, type)
    for m, code in codes.items():
        for im in re.finditer(r"\bimpl\b(?:\s*<[^{]*?>)?\s+([A-Z][A-Za-z0-9_]*)(?:\s*<[^{]*?>)?\s*(?:where[^{]*)?\{", code):
            depth, j = 1, im.end()
            while j < len(code) and depth:
                depth += {"{": 1, "}": -1}.get(code[j], 0)
                j += 1
            body = code[im.end() : j]
            for fm in re.finditer(r"\bfn\s+([a-z_][a-z0-9_]*)", body):
                defs.setdefault(fm.group(1), set()).add((m, im.group(1)))
    edges = {m: set() for m in mods}
    for n, code in codes.items():
        for name, owners in defs.items():
            if len({o for o, _ in owners}) != 1:
                continue
            (m, ty), *_ = owners
            if m == n or not re.search(r"\b%s\b" % ty, code):
                continue
            if re.search(r"(\.|\b%s\s*::\s*)%s\s*(::\s*<[^>]*>\s*)?\(" % (ty, name), code):
                edges[n].add(m)
    return edges


def sccs(edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def name(m):
    return "::".join(m) if m else "crate"


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "crates/mempool-core/src"
    mods, edges = graph(src)
    print("imports (use and paths):")
    for m in sorted(edges):
        print(f"  {name(m):16} -> {', '.join(name(t) for t in sorted(edges[m])) or '(nothing)'}")
    extra = method_edges(mods)
    print("plus calls of inherent methods defined in another module:")
    for m in sorted(extra):
        more = extra[m] - edges[m]
        if more:
            print(f"  {name(m):16} -> {', '.join(name(t) for t in sorted(more))}")
    failed = False
    for what, graph_ in (("imports", edges), ("imports and method calls", {m: edges[m] | extra[m] for m in mods})):
        cycles = [c for c in sccs(graph_) if len(c) > 1]
        for c in cycles:
            print(f"CYCLE ({what}):", " <-> ".join(sorted(name(m) for m in c)))
        if not cycles:
            print(f"no cycles among {len(mods)} modules ({what})")
        failed |= bool(cycles)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
