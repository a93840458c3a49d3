"""The import graph of `moe_gspo` and `analysis`, built from the source with `ast`, counting module-level and
function-level (lazy) imports alike:

- no import circles (issue 33);
- no arrow runs up the house (issue 42): no module imports one from a layer above its own, with the layers
  of docs/architecture.md (`LAYERS`). Type-only imports (`if TYPE_CHECKING:`) run nothing and are not
  counted there.
"""

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


def _is_type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` / `if typing.TYPE_CHECKING:`."""
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def _walk(tree: ast.AST, *, runtime_only: bool):
    """`ast.walk`, leaving out the body of `if TYPE_CHECKING:` blocks when `runtime_only` (their `else`
    runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if runtime_only and _is_type_checking(node):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def import_graph(*, runtime_only: bool = False) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its source; with `runtime_only`, not the
    type-only imports under `if TYPE_CHECKING:`). `from pkg import sub` is an arrow to pkg.sub when that is
    a module, else to pkg; `import a.b.c` also runs a and a.b, but a package's own __init__ is not counted
    as an arrow to its parents (Python runs it anyway), to keep the graph about what the code asks for."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _walk(tree, runtime_only=runtime_only):
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


LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground floor", ("moe_gspo.files", "moe_gspo.plugins", "moe_gspo.tensor_cache", "moe_gspo.tokenizer", "moe_gspo.tiny",
                      "moe_gspo.yaml_limits")),
    ("pure maths", ("moe_gspo.algos", "moe_gspo.routing")),
    ("inputs", ("moe_gspo.tasks", "moe_gspo.config", "moe_gspo.config_algo", "moe_gspo.rollout.engine_spec")),
    ("model", ("moe_gspo.mcore",)),
    ("engines", ("moe_gspo.rollout",)),
    ("learner", ("moe_gspo.learner",)),
    ("checks and plan", ("moe_gspo.config_checks", "moe_gspo.config_load", "moe_gspo.config_sizes", "moe_gspo.plan")),
    ("orchestration", ("moe_gspo.run",)),
    ("entry points and tools", ("moe_gspo.train", "moe_gspo.probe", "moe_gspo.ablate", "moe_gspo.launch",
                                "moe_gspo.launch_rendezvous", "moe_gspo.plan.__main__", "moe_gspo.probe_localize", "analysis")),
)
"""docs/architecture.md's layers, lowest first: a module may import its own layer and those below. A module
belongs to the layer of its longest listed prefix; the package's own `__init__` is the ground floor. The
probe's divergence localiser, which hooks into both models (`moe_gspo.probe_localize`), is a tool beside the
probe, not the pure maths of `routing/` (issue 49 moved it out of `routing/`)."""


def layer_of(mod: str) -> int | None:
    """Index in `LAYERS` of `mod`'s layer; None when no prefix covers it."""
    if mod == "moe_gspo":
        return 0
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), i)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """"a (layer) -> b (higher layer)" for every arrow that runs up the house."""
    out = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            la, lb = layer_of(a), layer_of(b)
            if la is not None and lb is not None and lb > la:
                out.append(f"{a} ({LAYERS[la][0]}) -> {b} ({LAYERS[lb][0]})")
    return out


def test_graph_sees_lazy_imports():
    g = import_graph()
    assert "moe_gspo.config" in g and "analysis.report" in g
    assert any(g.values())


def test_no_import_cycles():
    g = import_graph()
    cycles = find_cycles(g)
    assert not cycles, "import cycles:\n" + "\n".join(
        "  " + ", ".join(c) + "\n    " + "\n    ".join(_edges_within(g, c)) for c in cycles)


def test_every_module_has_a_layer():
    missing = [m for m in import_graph() if layer_of(m) is None]
    assert not missing, f"modules in no layer of LAYERS (place them, and say so in docs/architecture.md): {missing}"


def test_no_module_imports_a_layer_above_its_own():
    up = upward_imports(import_graph(runtime_only=True))
    assert not up, "imports that run up the layers of docs/architecture.md:\n  " + "\n  ".join(up)


def test_the_layering_test_sees_an_upward_import():
    g = {"moe_gspo.mcore.checkpoint": {"moe_gspo.run.errors"}, "moe_gspo.run.errors": {"moe_gspo.files"}}
    assert upward_imports(g) == ["moe_gspo.mcore.checkpoint (model) -> moe_gspo.run.errors (orchestration)"]
    assert layer_of("moe_gspo.probe_localize") == len(LAYERS) - 1 and layer_of("moe_gspo") == 0
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                     "def f():\n    import c\n")
    seen = {n.names[0].name for n in _walk(tree, runtime_only=True) if isinstance(n, ast.Import)}
    assert seen == {"b", "c"}


def routing_imports_of_rollout_or_analysis(graph: dict[str, set[str]]) -> list[str]:
    """"a -> b" for every import of `routing/` that names `rollout/` or `analysis/`."""
    return [f"{a} -> {b}" for a in sorted(graph) if a == "moe_gspo.routing" or a.startswith("moe_gspo.routing.")
            for b in sorted(graph[a]) if b.startswith(("analysis", "moe_gspo.rollout"))]


def test_routing_imports_neither_analysis_nor_rollout():
    """Issues 49 and 60: `routing/` is pure maths; its localiser's capture (hooks into the engines' models, figures
    of `analysis/`) lives beside the probe, and rollout samples become traces on the rollout side
    (`moe_gspo.rollout.traces`). Type-only imports (`if TYPE_CHECKING:`) count too: routing/ names nothing of
    rollout/ or analysis/, not even for types."""
    up = routing_imports_of_rollout_or_analysis(import_graph())
    assert not up, up


def test_the_routing_check_sees_a_type_only_import(tmp_path):
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from moe_gspo.rollout.base import X\n")
    names = {n.module for n in _walk(tree, runtime_only=False) if isinstance(n, ast.ImportFrom)}
    assert "moe_gspo.rollout.base" in names  # the full graph (not runtime_only) walks TYPE_CHECKING blocks
    g = {"moe_gspo.routing.trace": {"moe_gspo.rollout.base", "moe_gspo.files"}, "moe_gspo.routing": {"analysis.load"},
         "moe_gspo.routing_x": {"moe_gspo.rollout.base"}}
    assert routing_imports_of_rollout_or_analysis(g) == ["moe_gspo.routing -> analysis.load",
                                                         "moe_gspo.routing.trace -> moe_gspo.rollout.base"]


def test_the_architecture_page_states_these_layers():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for name, prefixes in LAYERS:
        assert f"**{name}**" in page, f"docs/architecture.md does not name the layer {name!r}"
        for p in prefixes:
            path = p.replace(".", "/")
            assert f"`{path.removeprefix('moe_gspo/')}" in page, f"docs/architecture.md does not place {path}"


if __name__ == "__main__":
    g = import_graph()
    for c in find_cycles(g):
        print(c)
        print("   ", "\n    ".join(_edges_within(g, c)))
    print("\n".join(upward_imports(import_graph(runtime_only=True))))
