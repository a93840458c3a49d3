"""Fixtures of the analysis tests: a synthetic run directory and probe JSON (see synth_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from synth_run import synthetic_probe, write_synthetic_run


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory) -> Path:
    return write_synthetic_run(tmp_path_factory.mktemp("run") / "gspo-none-s0")


@pytest.fixture(scope="module")
def probe_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "drift.json"
    path.write_text(json.dumps(synthetic_probe()))
    return path
