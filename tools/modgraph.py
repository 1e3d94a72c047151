#!/usr/bin/env python3
"""Lists the import graph between the modules of one Rust crate and fails on any import circle.

Usage: python3 tools/modgraph.py CRATE_SRC_DIR [--depth N] [--edges]

A module is named by its path under the crate root cut to N segments (default 1: the crate's
top-level modules, `exec`, `kernels`, ...). An edge A -> B is any `crate::B...` path written in a
file of A (in a `use` item, brace groups included, or inline), and any `super::` path that leaves
A. Test-only code counts too: a circle through a `#[cfg(test)]` module is still a circle for a
reader. Exit status 1 and the circle on stderr when one exists, 0 otherwise.
"""
import argparse
import os
import re
import sys


def module_of(root, path):
    rel = os.path.relpath(path, root)[: -len(".rs")].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return rel


def expand_use(text):
    """Yields every crate-relative path (a list of segments) that `text` names."""
    # Flatten `use crate::{a::{b, c}, d}` one level at a time into `crate::a::b` etc.
    for m in re.finditer(r"\bcrate::((?:[A-Za-z_0-9]+::)*)\{", text):
        start = m.end()
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        prefix = m.group(1)
        for part in split_top(text[start : i - 1]):
            part = part.strip()
            if part and part != "self":
                yield from expand_use("crate::" + prefix + part)
            elif part == "self":
                yield [s for s in prefix.split("::") if s]
    for m in re.finditer(r"\bcrate((?:::[A-Za-z_0-9]+)+)", text):
        yield [s for s in m.group(1).split("::") if s]


def split_top(inner):
    depth, cur = 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            yield cur
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    yield cur


def super_paths(text, module):
    for m in re.finditer(r"\b((?:super::)+)((?:[A-Za-z_0-9]+::)*[A-Za-z_0-9]+)", text):
        ups = m.group(1).count("super::")
        base = module[: len(module) - ups] if ups <= len(module) else []
        yield base + m.group(2).split("::")


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def graph(root, depth):
    edges = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(dirpath, f)
            module = module_of(root, path)
            if not module:
                continue
            text = strip_comments(open(path, encoding="utf-8").read())
            src = tuple(module[:depth])
            refs = list(expand_use(text)) + list(super_paths(text, module))
            for ref in refs:
                dst = tuple(ref[: min(depth, len(ref))])
                if dst and dst != src and is_module(root, dst):
                    edges.setdefault(src, set()).add(dst)
            edges.setdefault(src, set())
    return edges


def is_module(root, segs):
    base = os.path.join(root, *segs)
    return os.path.isfile(base + ".rs") or os.path.isfile(os.path.join(base, "mod.rs"))


def find_cycle(edges):
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                c = visit(m)
                if c:
                    return c
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(edges):
        if n not in state:
            c = visit(n)
            if c:
                return c
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--edges", action="store_true", help="print every edge")
    a = ap.parse_args()
    edges = graph(a.src, a.depth)
    name = lambda n: "::".join(n)
    if a.edges:
        for n in sorted(edges):
            print(f"{name(n)} -> {', '.join(name(m) for m in sorted(edges[n])) or '(nothing)'}")
    cycle = find_cycle(edges)
    if cycle:
        print("import circle: " + " -> ".join(name(n) for n in cycle), file=sys.stderr)
        sys.exit(1)
    print(f"{len(edges)} modules, no import circle")


if __name__ == "__main__":
    main()
