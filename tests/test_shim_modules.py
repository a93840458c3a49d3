"""Every patch of a third-party module lives in its dependency's shim module (issue 42; docs/architecture.md,
"Shims"): outside `SHIM_MODULES`, no module of `moe_gspo` assigns to (or deletes, or `setattr`s) an attribute
of a name it imported from outside the package (`torch.x = ...`, `RouterReplay.list[:] = ...`,
`parallel_state._WORLD = ...`), nor sets a `forward` on an object (an instance-level override of a module's
method). Found with `ast`; a patch through a name the file did not import (an object handed in) is the
reviewer's to see."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHIM_MODULES = {
    "moe_gspo/mcore/shims.py": "megatron-core (and torch / Transformer Engine on its behalf)",
    "moe_gspo/rollout/vllm_shims.py": "vLLM (and Triton / torch on its behalf)",
    "moe_gspo/rollout/hf_shims.py": "transformers (the transformers engine's model)",
    "moe_gspo/run/wandb_shims.py": "W&B (the metrics sink's start-up)",
}
INSTANCE_METHODS = ("forward",)
"""Attributes whose assignment on any object is a method override, whatever the object's name."""
NOT_PATCHES = ("os.environ[", "sys.modules[")
"""Process configuration, not a patch: environment variables (read by a dependency, e.g. vLLM's), and
`sys.modules` entries for a user's plug-in file loaded by path (`tasks/plugin.py`, `algos/registry.py`)."""


def _third_party_names(tree: ast.Module) -> set[str]:
    """Local names bound by an import of a module outside `moe_gspo` (anywhere in the file)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if not a.name.startswith("moe_gspo"):
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and not (node.module or "").startswith("moe_gspo"):
            names.update(a.asname or a.name for a in node.names if a.name != "*")
    return names - {"annotations"}


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def patches_in(path: Path) -> list[str]:
    """"file:line: what" for each patch-like statement in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    third = _third_party_names(tree)
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args and _root(node.args[0]) in third):
            found.append(f"{rel}:{node.lineno}: {node.func.id}({ast.unparse(node.args[0])}, ...)")
        for t in targets:
            for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if not isinstance(leaf, (ast.Attribute, ast.Subscript)):
                    continue
                text = ast.unparse(leaf)
                if text.startswith(NOT_PATCHES):
                    continue
                if _root(leaf) in third or (isinstance(leaf, ast.Attribute) and leaf.attr in INSTANCE_METHODS):
                    found.append(f"{rel}:{node.lineno}: {text}")
    return found


def test_no_patch_outside_the_shim_modules():
    found = [p for path in sorted((ROOT / "moe_gspo").rglob("*.py"))
             if path.relative_to(ROOT).as_posix() not in SHIM_MODULES for p in patches_in(path)]
    assert not found, ("patches of a third-party module outside its shim module (move each into "
                       f"{', '.join(SHIM_MODULES)}, named and documented):\n  " + "\n  ".join(found))


def test_the_scan_sees_the_shims_and_each_is_named_on_the_architecture_page():
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    for shim in SHIM_MODULES:
        assert patches_in(ROOT / shim), f"{shim} holds no patch the scan sees"
        assert f"`{shim.removeprefix('moe_gspo/')}`" in page, f"docs/architecture.md does not name {shim}"
