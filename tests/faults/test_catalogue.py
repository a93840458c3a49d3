"""tests/faults/README.md lists every fault trial of issue 49 with the test that holds it: each test it names
exists (a renamed or deleted test would leave a trial unguarded without a word)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_the_catalogue_names_exists():
    page = (Path(__file__).parent / "README.md").read_text(encoding="utf-8")
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", page)
    assert len(named) >= 40, len(named)
    missing = []
    for path, name in named:
        f = ROOT / path
        funcs = ({n.name for n in ast.walk(ast.parse(f.read_text(encoding="utf-8")))
                  if isinstance(n, ast.FunctionDef)} if f.is_file() else set())
        if name not in funcs:
            missing.append(f"{path}::{name}")
    assert not missing, missing
    rows = re.findall(r"^\| ([RNDUFVGPS]\d+) \|", page, flags=re.M)
    assert len(rows) == len(set(rows)) and {f"D{i}" for i in range(1, 13)} <= set(rows)
    assert {f"F{i}" for i in range(1, 51)} <= set(rows) and {f"V{i}" for i in range(1, 15)} <= set(rows)  # issues 58-61
    assert {"P3", "P4", "P5", "S1", "S2"} <= set(rows)  # issues 58 and 62, second session
