"""The package layout of docs/DESIGN.md holds: no import cycles, the simulator on top of the
core and never under it, and a pure core (no torch, no sockets, no daemon)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.support import REPO

CORE = ("nereusd.plan", "nereusd.backends", "nereusd.models", "nereusd.hf_files", "nereusd.workflow", "nereusd.shards",
        "nereusd.traces", "nereusd.errors", "nereusd.config", "nereusd.cost", "nereusd.planner", "nereusd.control", "nereusd.transition")
"""The pure core: cost and memory model, planner, controller, transition planning, configuration."""


def _modules() -> dict[str, Path]:
    out = {}
    for root in ("nereusd", "emu", "launcher"):
        for path in (REPO / root).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file (function-level imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {x for x in _imports(p) if x in mods and x != m} for m, p in mods.items()}


def _within(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_no_module_imports_one_that_imports_it_back():
    graph = _graph()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_only_the_launcher_imports_the_simulator():
    users = {m for m, deps in _graph().items() if any(_within(d, ["nereusd.sim"]) for d in deps)}
    assert {u for u in users if not _within(u, ["nereusd.sim", "launcher"])} == set()


def test_the_core_is_pure():
    mods = _modules()
    bad = defaultdict(set)
    for m, path in mods.items():
        if not _within(m, CORE) or m == "nereusd.transition.runner":   # the runner is the transition's shell
            continue
        for x in _imports(path):
            top = x.split(".")[0]
            if top in ("torch", "zmq", "emu", "launcher") or _within(x, ["nereusd.daemon", "nereusd.sim", "nereusd.rl"]):
                bad[m].add(x)
    assert dict(bad) == {}
