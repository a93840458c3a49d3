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


@pytest.fixture(scope="module")
def one_thread():
    """The tiny mechanism passes on one thread (two spinning threads on a shared 2-core box take ~50x as long);
    modules that need it say `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
