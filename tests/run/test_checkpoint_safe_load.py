"""Issue 43.2: `--resume` never runs code from a checkpoint. Rank files load with
`torch.load(weights_only=True)`; one whose pickle names a function is refused with one line (never
skipped for an older checkpoint) and the function never runs."""

from __future__ import annotations

import json
import pathlib
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_gspo.run.checkpoint import TrainState, resume, safe_load, save_checkpoint, set_rng_state


class _Touch:
    """Pickles as a call of `Path.touch(marker)`: what a crafted checkpoint would run on load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


class _Learner:
    def __init__(self):
        self.loaded = None

    def load_state_dict(self, state):
        self.loaded = state


def _fp():
    return {"algo.name": "gspo", "algo.routing_replay": "none", "world_size": 1, "parallel.expert_parallel_size": 1,
            "model": {}}


def test_crafted_rank_file_is_refused_and_never_runs(tmp_path):
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, TrainState(step=1), {"w": torch.ones(2)}, rank=0, keep=3, fingerprint=_fp())
    good = save_checkpoint(run_dir, TrainState(step=2), {"w": torch.ones(2)}, rank=0, keep=3, fingerprint=_fp())
    marker = tmp_path / "pwned"
    f = good / "rank_00000.pt"
    torch.save({"learner": {"w": torch.ones(2)}, "rng": _Touch(marker), "train_state": {"step": 2}}, f)
    meta = json.loads((good / "meta.json").read_text())
    meta["rank_files"]["rank_00000.pt"] = f.stat().st_size
    (good / "meta.json").write_text(json.dumps(meta))
    learner = _Learner()
    with pytest.raises(ValueError) as e:
        resume(run_dir, learner=learner, fingerprint=_fp(), params_finite=lambda: True, warn=lambda m: None)
    msg = str(e.value)
    assert "would run code" in msg and "Unsupported global" in msg and "rank_00000.pt" in msg and "\n" not in msg
    assert not marker.exists()
    assert learner.loaded is None  # not silently resumed from step_000001 either


def test_checkpoints_hold_only_safe_types_and_rng_round_trips(tmp_path):
    np.random.seed(3)
    path = save_checkpoint(tmp_path, TrainState(step=1), {"w": torch.ones(2)}, rank=0, keep=1, fingerprint=_fp())
    expected = np.random.rand(3)
    payload = safe_load(path / "rank_00000.pt")  # weights_only=True: no numpy objects in it
    assert isinstance(payload["rng"]["numpy"][1], torch.Tensor)
    np.random.seed(7)
    set_rng_state(payload["rng"])
    assert np.allclose(np.random.rand(3), expected)


def test_old_checkpoints_with_numpy_rng_state_still_load(tmp_path):
    """Checkpoints written before the RNG state was stored as tensors hold numpy arrays: still loadable."""
    np.random.seed(5)
    f = tmp_path / "old.pt"
    torch.save({"rng": {"numpy": np.random.get_state()}}, f)
    expected = np.random.rand(2)
    np.random.seed(9)
    np.random.set_state(safe_load(f)["rng"]["numpy"])
    assert np.allclose(np.random.rand(2), expected)


def test_no_unsafe_torch_load_in_the_package():
    root = Path(__file__).resolve().parents[2]
    offenders = [str(p.relative_to(root)) for d in ("moe_gspo", "analysis") for p in (root / d).rglob("*.py")
                 if "weights_only=False" in p.read_text()]
    assert offenders == []
