"""No import circles in `moe_gspo` and `analysis` (issue 33): the import graph, built from the source with
`ast`, counting module-level and function-level (lazy) imports alike, has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("moe_gspo", "analysis")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The module of ours that `name` (a module or a name inside one) refers to, longest match."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its source). `from pkg import sub` is an
    arrow to pkg.sub when that is a module, else to pkg; `import a.b.c` also runs a and a.b, but a
    package's own __init__ is not counted as an arrow to its parents (Python runs it anyway), to keep the
    graph about what the code asks for."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    targets.append(sub if sub in mods else src)
            for t in targets:
                r = _resolve(t, mods)
                if r is not None and r != mod:
                    graph[mod].add(r)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    import sys
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _edges_within(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    s = set(comp)
    return [f"{a} -> {b}" for a in comp for b in sorted(graph[a]) if b in s]


def test_graph_sees_lazy_imports():
    g = import_graph()
    assert "moe_gspo.config" in g and "analysis.report" in g
    assert any(g.values())


def test_no_import_cycles():
    g = import_graph()
    cycles = find_cycles(g)
    assert not cycles, "import cycles:\n" + "\n".join(
        "  " + ", ".join(c) + "\n    " + "\n    ".join(_edges_within(g, c)) for c in cycles)


if __name__ == "__main__":
    g = import_graph()
    for c in find_cycles(g):
        print(c)
        print("   ", "\n    ".join(_edges_within(g, c)))
