"""The package's import graph, read from the source with ``ast`` (function-local imports included): no import
circle, and nothing below the job driver imports it (``pipeline.run``: ``plan`` at the bottom, ``local`` and
``ray`` on it, ``control`` on top; only the CLI and the benchmarks stand above it)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "pipeline"


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``; ``from X import name`` counts as ``X.name`` when that is
    a module. A module's own ancestor packages are left out (Python initializes them first anyway)."""
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (f, parts[-1] == "__init__")
    graph = {m: set() for m in mods}
    for m, (f, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = m.split(".")[:len(m.split(".")) - (node.level - is_pkg)] if node.level else []
                base = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m and not m.startswith(t + "."):
                    graph[m].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_graph_sees_function_local_and_relative_imports():
    graph = import_graph()
    assert "pipeline.run.control" in graph["pipeline.run"]  # from .control import ... in a package __init__
    assert "pipeline.run.plan" in graph["pipeline.run.local"]  # from .plan import ...
    assert "pipeline.run" in graph["pipeline.cli"]  # from .run import ... inside a function


def test_nothing_below_the_driver_imports_it():
    graph = import_graph()
    above = {"pipeline.cli"} | {m for m in graph if m.startswith(("pipeline.bench", "pipeline.run"))}
    for m, deps in graph.items():
        if m in above:
            continue
        allowed = {"pipeline.run.plan"} if m == "pipeline.status" else set()
        assert not {d for d in deps if d.startswith("pipeline.run")} - allowed, m
    run = {m: {d for d in deps if d.startswith("pipeline.run.")} for m, deps in graph.items()
           if m.startswith("pipeline.run.")}
    assert run["pipeline.run.plan"] == set()
    assert run["pipeline.run.cluster"] == set()
    assert run["pipeline.run.local"] == {"pipeline.run.plan"}
    assert "pipeline.run.control" not in run["pipeline.run.ray"]
