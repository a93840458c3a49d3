"""Issue 43.13: console scripts in pyproject.toml's [project.scripts] name existing entry points whose
`main(argv)` returns an exit code (`python -m ...` unchanged)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def test_every_console_script_names_a_main_taking_argv():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"moe-gspo-train", "moe-gspo-ablate", "moe-gspo-probe", "moe-gspo-report", "moe-gspo-plan",
            "moe-gspo-launch"} <= set(scripts)
    for name, target in scripts.items():
        module, _, func = target.partition(":")
        fn = getattr(importlib.import_module(module), func)
        params = inspect.signature(fn).parameters
        assert "argv" in params and params["argv"].default is None, name  # reads sys.argv when run as a script
