"""The installed library never imports TRL (a dev-only extra) nor the benchmarks (`benchmarks/`, beside the
package and not installed): every module of `moe_gspo` imports in a fresh interpreter without either."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CODE = """
import importlib, pkgutil, sys
import moe_gspo
for m in pkgutil.walk_packages(moe_gspo.__path__, "moe_gspo."):
    importlib.import_module(m.name)
assert "trl" not in sys.modules, "a moe_gspo module imports trl"
bad = sorted(m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks."))
assert not bad, f"moe_gspo modules import benchmarks: {bad}"
"""


def test_library_imports_neither_trl_nor_benchmarks():
    p = subprocess.run([sys.executable, "-c", _CODE], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]


def test_benchmarks_are_not_installed():
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(pat.startswith("benchmarks") for pat in include)
    assert not (ROOT / "moe_gspo" / "bench").exists()
