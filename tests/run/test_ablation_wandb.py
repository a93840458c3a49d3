"""W&B grouping of an ablation's runs (issue 50): every run carries group = the ablation's name, job type =
its arm, tags algo / replay / variant / seed. The runner puts W&B's own variables into the run's environment
(the command line stays the local one); the offline run file W&B writes is read back here."""

from __future__ import annotations

import struct
import sys
import time
from pathlib import Path

from moe_gspo.ablate import expand_arms, parse_spec, wandb_env
from moe_gspo.run.arm_runner import SubprocessArmRunner
from moe_gspo.run.sinks import MetricsSink, wandb_run_id

_BLOCK, _HEADER = 32768, 7


def offline_run_record(run_dir: Path, wait_s: float = 30.0):
    """`_offline_run_record`, read again for up to `wait_s` seconds while the run record is missing: W&B's service
    process writes the record log, and under load it can still be flushing when `wandb.finish()` has returned
    (seen twice on a loaded 2-core box: 'no run record'); an idle box reads it at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _offline_run_record(run_dir)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _offline_run_record(run_dir: Path):
    """The `RunRecord` (run_group, job_type, tags, ...) of the offline W&B run under `run_dir/wandb/`: its
    `run-*.wandb` file is W&B's record log (a 7-byte ':W&B' header, then LevelDB-log blocks of 32 KiB holding
    length-prefixed protobuf `Record`s; wandb 0.31 ships no Python reader of it)."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {run_dir / 'wandb'}"
    data = files[-1].read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, chunk = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's zero-filled tail
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pos += _HEADER
        if kind == 0:
            pos += left - _HEADER
            continue
        chunk += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # a FULL record or the LAST piece of one
            rec = pb.Record()
            rec.ParseFromString(chunk)
            chunk = b""
            if rec.WhichOneof("record_type") == "run":
                return rec.run
    raise AssertionError(f"no run record in {files[-1]}")


def _spec(tmp_path: Path, **changes):
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  steps: 3\n")
    raw = {"base_config": str(base), "algos": ["gspo", "grpo"], "routing_replay": ["none", "r3"], "seeds": [0, 3],
           "out_dir": str(tmp_path / "my_ablation"), **changes}
    return parse_spec(raw)


def test_wandb_env_names_the_ablation_the_arm_and_its_tags(tmp_path):
    spec = _spec(tmp_path, variants={"base": {}, "tis": {"algo.rollout_is": "token"}})
    arm = next(a for a in expand_arms(spec) if a.name == "grpo-r3-tis-s3")
    assert wandb_env(spec, arm) == {"WANDB_RUN_GROUP": "my_ablation", "WANDB_JOB_TYPE": "grpo-r3-tis",
                                    "WANDB_TAGS": "algo=grpo,replay=r3,variant=tis,seed=3"}
    plain = _spec(tmp_path)
    assert wandb_env(plain, expand_arms(plain)[0])["WANDB_TAGS"] == "algo=gspo,replay=none,seed=0"


def test_the_local_runner_gives_each_run_its_own_wandb_environment(tmp_path):
    spec = _spec(tmp_path)
    runner = SubprocessArmRunner(arm_env=lambda arm: wandb_env(spec, arm), env={"OMP_NUM_THREADS": "1"})
    show = [sys.executable, "-c", "import os; print([os.environ.get(k) for k in ('WANDB_RUN_GROUP', 'WANDB_JOB_TYPE', "
            "'WANDB_TAGS', 'OMP_NUM_THREADS')])"]
    for arm in expand_arms(spec)[:2]:
        arm.run_dir.mkdir(parents=True)
        assert runner(arm, show, arm.run_dir / "train.log") == 0
        env = wandb_env(spec, arm)
        assert (arm.run_dir / "train.log").read_text().splitlines()[-1] == str(
            [env["WANDB_RUN_GROUP"], env["WANDB_JOB_TYPE"], env["WANDB_TAGS"], "1"])


def test_an_offline_run_carries_the_group_job_type_and_tags(tmp_path, monkeypatch):
    spec = _spec(tmp_path)
    arm = expand_arms(spec)[3]
    for k, v in wandb_env(spec, arm).items():
        monkeypatch.setenv(k, v)  # as the runner sets them for the run's process
    arm.run_dir.mkdir(parents=True)
    sink = MetricsSink(arm.run_dir, enabled=True, wandb_mode="offline", project="moe-gspo", run_name=arm.run_dir.name,
                       config={"algo": {"name": arm.algo}}, start_step=0)
    sink.log(0, {"reward/mean": 0.5})
    sink.close()
    rec = offline_run_record(arm.run_dir)
    assert (rec.run_group, rec.job_type, rec.display_name) == ("my_ablation", "gspo-r3", "gspo-r3-s3")
    assert list(rec.tags) == ["algo=gspo", "replay=r3", "seed=3"]
    assert rec.run_id == wandb_run_id(arm.run_dir, arm.run_dir.name)


def test_wandb_run_ids_differ_between_ablations_and_stay_on_resume(tmp_path):
    """Two ablations' `gspo-none-s0` runs were one W&B id (the run name): synced into one project, the second
    resumed the first. The id now also depends on the run directory, and stays the same for the same one."""
    a, b = tmp_path / "abl_a" / "gspo-none-s0", tmp_path / "abl_b" / "gspo-none-s0"
    assert wandb_run_id(a, "gspo-none-s0") != wandb_run_id(b, "gspo-none-s0")
    assert wandb_run_id(a, "gspo-none-s0") == wandb_run_id(tmp_path / "abl_a" / "." / "gspo-none-s0", "gspo-none-s0")
    assert wandb_run_id(a, "x/y").startswith("x_y-") and len(wandb_run_id(a, "n" * 200)) <= 64
