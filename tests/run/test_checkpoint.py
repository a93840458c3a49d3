"""moe_gspo.run.checkpoint without a model (world of one): rotation, `latest`, resume candidates and
fallback, compatibility, a full disk. Issue 12, defects 1-3 and 7 at the unit level."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from moe_gspo.run.checkpoint import (TrainState, checkpoint_candidates, resume, save_checkpoint,
                                     step_dirs)

FP = {"algo.name": "gspo", "algo.routing_replay": "none", "world_size": 1, "parallel.expert_parallel_size": 1,
      "model.expert_layout": "per_expert", "model": {"hidden_size": 64, "num_experts": 8}}


class FakeLearner:
    """Records what `resume` loads into it (the real Learner is exercised by tests/test_train_faults.py)."""

    def __init__(self):
        self.loaded = None

    def load_state_dict(self, state):
        if "w" not in state:
            raise RuntimeError("Error(s) in loading state_dict: missing key w")
        self.loaded = state


def _save(run_dir: Path, step: int, keep: int = 2, value: float = 0.0, fp: dict = FP) -> Path:
    return save_checkpoint(run_dir, TrainState(step=step, prompts_consumed=4 * step), {"w": torch.full((4,), value)},
                           rank=0, keep=keep, fingerprint=fp)


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    """Defect 1: with stale higher-numbered checkpoints (an earlier run), rotation by sorted name
    deleted the checkpoint just written while `latest` pointed at it."""
    _save(tmp_path, 4)
    _save(tmp_path, 6)
    _save(tmp_path, 3)
    assert _latest(tmp_path) == "step_000003" and (tmp_path / "checkpoints" / "step_000003" / "meta.json").is_file()
    assert sorted(step_dirs(tmp_path)) == [3, 4, 6]  # nothing at or below step 3 exceeds keep=2
    _save(tmp_path, 4, value=1.0)  # the same step again: swapped in place
    _save(tmp_path, 5)
    assert _latest(tmp_path) == "step_000005"
    assert sorted(step_dirs(tmp_path)) == [4, 5, 6]  # step 3 rotated out; stale step 6 left alone
    w = torch.load(tmp_path / "checkpoints" / "step_000004" / "rank_00000.pt", weights_only=False)["learner"]["w"]
    assert float(w[0]) == 1.0
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith(".tmp") or p.name.startswith(".")]


def test_candidates_start_at_latest_and_skip_newer_leftovers(tmp_path):
    for s in (2, 4, 6):
        _save(tmp_path, s, keep=5)
    (tmp_path / "checkpoints" / "latest").write_text("step_000004\n")
    assert [p.name for p in checkpoint_candidates(tmp_path)] == ["step_000004", "step_000002"]
    (tmp_path / "checkpoints" / "latest").unlink()
    assert [p.name for p in checkpoint_candidates(tmp_path)] == ["step_000006", "step_000004", "step_000002"]


def _corrupt(ckpt: Path, how: str) -> str:
    f = ckpt / "rank_00000.pt"
    if how == "no_meta":
        (ckpt / "meta.json").unlink()
        return "meta.json is missing"
    if how == "truncated":
        os.truncate(f, f.stat().st_size // 2)
        return "rank_00000.pt is truncated"
    if how == "garbage":
        data = bytearray(f.read_bytes())
        data[: len(data) // 2] = bytes(len(data) // 2)  # same size, zeroed
        f.write_bytes(bytes(data))
        return "rank_00000.pt is unreadable"
    if how == "nan":
        return "NaN/Inf"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["no_meta", "truncated", "garbage", "nan"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, how):
    """Defects 2 and 3: a latest checkpoint without meta.json restarted from step 0 silently; a
    truncated rank file gave a raw traceback; the intact previous checkpoint was never tried."""
    _save(tmp_path, 1, value=1.0)
    _save(tmp_path, 2, value=2.0)
    reason = _corrupt(tmp_path / "checkpoints" / "step_000002", how)
    warnings, learner = [], FakeLearner()
    finite = iter([how != "nan", True])
    state = resume(tmp_path, learner=learner, fingerprint=FP, params_finite=lambda: next(finite),
                   warn=warnings.append)
    assert state.step == 1 and state.prompts_consumed == 4
    assert float(learner.loaded["w"][0]) == 1.0
    assert len(warnings) == 1 and "resuming from step_000001" in warnings[0] and "step_000002" in warnings[0]
    assert reason in warnings[0]


def test_resume_without_an_intact_checkpoint_stops(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    for s in (1, 2):
        _corrupt(tmp_path / "checkpoints" / f"step_{s:06d}", "no_meta")
    with pytest.raises(ValueError, match="no intact checkpoint .*step_000002 is unusable.*step_000001 is unusable"
                                         ".*--overwrite"):
        resume(tmp_path, learner=FakeLearner(), fingerprint=FP, params_finite=lambda: True, warn=print)
    assert sorted(step_dirs(tmp_path)) == [1, 2]  # nothing deleted


def test_resume_never_restarts_silently_when_latest_names_a_deleted_checkpoint(tmp_path):
    """Defect 1's aftermath: `latest` named a checkpoint rotation had deleted, while stale newer ones
    remained; every later --resume restarted from step 0 without a word."""
    _save(tmp_path, 4)
    _save(tmp_path, 6)
    (tmp_path / "checkpoints" / "latest").write_text("step_000003\n")
    with pytest.raises(ValueError, match="names step_000003, which does not exist.*leftovers of an earlier run"):
        resume(tmp_path, learner=FakeLearner(), fingerprint=FP, params_finite=lambda: True, warn=print)


@pytest.mark.parametrize("change,msg", [
    ({"algo.name": "grpo"}, "written with algo.name=gspo, this run has algo.name=grpo; resume with the same value "
                            r"\(--algo\)"),
    ({"parallel.expert_parallel_size": 2}, "parallel.expert_parallel_size=1"),
    ({"model.expert_layout": "grouped"}, "written with model.expert_layout=per_expert, this run has "
                                         r"model.expert_layout=grouped; resume with the same value \(model.expert_layout"),
    ({"model": {"hidden_size": 32, "num_experts": 8}}, r"another model geometry \(hidden_size 64 -> 32\)"),
])
def test_resume_refuses_an_incompatible_run(tmp_path, change, msg):
    _save(tmp_path, 1)
    with pytest.raises(ValueError, match=msg):
        resume(tmp_path, learner=FakeLearner(), fingerprint={**FP, **change}, params_finite=lambda: True, warn=print)


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 512 KiB filesystem (tmpfs); needs root to mount."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]}); needs root")
    yield mnt
    if subprocess.run(["umount", str(mnt)]).returncode:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_checkpoint_on_a_full_disk_is_one_error_and_leaves_nothing_half_written(tiny_fs):
    """Defect 7: a full disk gave `enforce fail ... unexpected pos` and left .tmp/.part files."""
    _save(tiny_fs, 1)
    with pytest.raises(ValueError, match=r"disk full while writing checkpoint file .*rank_00000.pt.*No space left"):
        save_checkpoint(tiny_fs, TrainState(step=2), {"w": torch.zeros(1 << 18)}, rank=0, keep=2, fingerprint=FP)
    left = sorted(str(p.relative_to(tiny_fs)) for p in tiny_fs.rglob("*"))
    assert left == ["checkpoints", "checkpoints/latest", "checkpoints/step_000001", "checkpoints/step_000001/meta.json",
                    "checkpoints/step_000001/rank_00000.pt"], left
    assert _latest(tiny_fs) == "step_000001"
    assert json.loads((tiny_fs / "checkpoints" / "step_000001" / "meta.json").read_text())["train_state"]["step"] == 1


def test_resume_hint_names_the_checkpoint_path_that_exists(tmp_path):
    """Issue 32, defect 4: the hint named `<run_dir>/step_N`; checkpoints live in `<run_dir>/checkpoints/`."""
    from moe_gspo.run.rundir import resume_hint

    _save(tmp_path, 10)
    hint = resume_hint(tmp_path)
    named = [w.rstrip(",.") for w in hint.split() if "step_000010" in w]
    assert named and Path(named[0]).is_dir(), hint
    assert named[0] == str(tmp_path / "checkpoints" / "step_000010")
