"""Issue 12: runs are safe to kill, resume, rerun and misconfigure. One test per defect of the issue,
each reproducing it through the real entry points (tiny runs, a few steps; in-process at world size
1 unless the defect needs two ranks)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _procs import alive, worker_pids
from moe_gspo import ablate, probe, train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "parallel.expert_parallel_size=1",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=2",
        "train.num_minibatches=2", "logging.wandb_mode=disabled", "logging.progress=false",
        "logging.trace_every=0", "train.export_hf=false", "train.checkpoint_every=1"]


def _train(run_dir: Path, *args: str) -> int:
    return train.main([*TINY, "--run-dir", str(run_dir), *args])


def _snapshot(d: Path) -> dict[str, str]:
    """The run's files and their hashes; the lock file (`.moe_gspo.lock`, which records the last holder and
    stays in RUN_DIR on --overwrite) is not run data."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(d.rglob("*")) if p.name != ".moe_gspo.lock"}


def _errors(text: str) -> list[str]:
    return [l for l in text.splitlines() if l.startswith("error:")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run with checkpoints at steps 1 and 2 (tests copy it)."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    assert _train(run_dir, "train.steps=2") == 0
    return run_dir


@pytest.fixture
def run(finished, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(finished, dst)
    return dst


# ----------------------------------------------------------------------------- defect 1: data loss on rerun

def test_rerun_into_a_finished_run_dir_is_refused_and_changes_nothing(run, capsys):
    before = _snapshot(run)
    assert _train(run, "train.steps=1") == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and "already holds a finished run" in err
    assert "--resume" in err and "--overwrite" in err
    assert _snapshot(run) == before


def test_overwrite_moves_the_previous_run_aside(run, capsys):
    before = _snapshot(run)
    assert _train(run, "train.steps=1", "--overwrite") == 0
    prev = run.with_name("run.prev1")
    assert _snapshot(prev) == before  # nothing deleted
    assert json.loads((run / "done.json").read_text())["step"] == 1
    assert f"moved the previous run to {prev}" in capsys.readouterr().out


# ----------------------------------------------------------------------------- defects 2 and 3: resume fallback

@pytest.mark.parametrize("how", ["no_meta", "truncated"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(run, capsys, how):
    latest = run / "checkpoints" / "step_000002"
    if how == "no_meta":
        (latest / "meta.json").unlink()
    else:
        f = latest / "rank_00000.pt"
        os.truncate(f, f.stat().st_size // 3)
    rows_before = (run / "metrics.jsonl").read_text().splitlines()
    assert _train(run, "--resume", "train.steps=3") == 0
    out, err = capsys.readouterr()
    warnings = [l for l in err.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and "resuming from step_000001 (step 1) instead: step_000002 is unusable" in warnings[0]
    assert ("meta.json is missing" if how == "no_meta" else "rank_00000.pt is truncated") in warnings[0]
    assert "resuming at step 1" in out
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [0, 1, 2]
    assert rows[0] == rows_before[0]  # the step before the checkpoint was kept, not recomputed


def test_resume_without_an_intact_checkpoint_stops_and_keeps_everything(run, capsys):
    for s in (1, 2):
        (run / "checkpoints" / f"step_{s:06d}" / "meta.json").unlink()
    before = _snapshot(run)
    assert _train(run, "--resume", "train.steps=3") == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and "no intact checkpoint" in err and "--overwrite" in err
    assert _snapshot(run) == before


# ----------------------------------------------------------------------------- defect 4: a stopped rank hangs

@pytest.mark.slow
def test_a_stopped_rank_becomes_a_clear_error_within_the_timeout(tmp_path):
    """Defect 4: with SIGSTOP on one rank the other waited >= 160 s silently (gloo's default 30 min)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train",
           *TINY, "--run-dir", str(run_dir), "train.steps=200", "train.checkpoint_every=0",
           "parallel.collective_timeout_s=20"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    stopped = None
    try:
        deadline = time.time() + 240
        while time.time() < deadline and p.poll() is None:
            metrics = run_dir / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 1:
                break
            time.sleep(0.2)
        assert p.poll() is None, p.communicate()[0][-3000:]
        workers = worker_pids(p.pid)  # moe_gspo.launch runs the torchrun agent in-process
        assert sorted(workers) == [0, 1], workers
        stopped = workers[1]
        os.kill(stopped, signal.SIGSTOP)
        t_stop = time.time()
        while p.poll() is None and alive(workers[0]) and time.time() - t_stop < 120:
            time.sleep(0.2)
        waited = time.time() - t_stop
        os.kill(stopped, signal.SIGKILL)  # the agent's SIGTERM stays pending on a stopped process
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert waited < 20 + 60, waited  # the timeout plus the step in flight, not gloo's 30 minutes
    errors = _errors(out)
    assert len(errors) == 1, out[-3000:]
    assert "rank 0 waited 20 s (parallel.collective_timeout_s)" in errors[0]
    assert "rank 1 is still in '" in errors[0]
    assert p.returncode == 3, out[-3000:]


# ----------------------------------------------------------------------------- defect 5: NaN guard gap

@pytest.mark.parametrize("fault,what", [
    ("overflow", "(its "),  # lr 1e30: weights ~1e28 that overflow (log-probs NaN), or turn NaN/Inf themselves
    ("nan_weight", "its weights hold NaN/Inf"),  # an optimizer step that leaves a NaN in the weights
])
def test_a_non_finite_update_stops_before_the_rollout_engine(tmp_path, capsys, monkeypatch, fault, what):
    """Defect 5: the guard checked loss and grad norm only; with train.lr=1e30 train.grad_clip=0 the
    weights reached the rollout engine, which died in torch.multinomial. (Weight decay makes the
    blow-up independent of the sampled rewards; torch's Adam itself refuses lr >= ~3.4e37.)"""
    from moe_gspo.learner.optim import LearnerOptimizer
    from moe_gspo.rollout.hf_engine import HFEngine

    synced = []
    update_weights = HFEngine.update_weights

    def spy(self, named_tensors):
        named = list(named_tensors)
        synced.append(all(bool(torch.isfinite(t).all()) and float(t.abs().max()) < 1e20 for _, t in named))
        return update_weights(self, named)

    monkeypatch.setattr(HFEngine, "update_weights", spy)
    overrides = ["train.lr=1e30", "train.weight_decay=0.1", "train.grad_clip=0"]
    if fault == "nan_weight":
        step = LearnerOptimizer.step

        def nan_step(self):
            step(self)
            with torch.no_grad():
                self._params[-1].view(-1)[0] = float("nan")

        monkeypatch.setattr(LearnerOptimizer, "step", nan_step)
        overrides = []
    run_dir = tmp_path / "run"
    assert _train(run_dir, "train.steps=3", *overrides) == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and "step 0: the update made the policy non-finite" in err and what in err
    assert "train.lr" in err and "train.grad_clip" in err and "--overwrite" in err
    assert synced == [True]  # only the initial weights were ever synced
    assert not (run_dir / "checkpoints").exists()


# ----------------------------------------------------------------------------- defect 6: silently wrong runs

def test_resume_with_another_algorithm_is_refused_and_config_kept(run, capsys):
    before = (run / "config.yaml").read_text()
    assert _train(run, "--resume", "--algo", "grpo", "train.steps=3") == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and "algo.name=gspo" in err and "--algo gspo" in err
    assert (run / "config.yaml").read_text() == before


def test_a_flag_and_a_contradicting_override_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _train(tmp_path / "run", "--algo", "gspo", "algo.name=grpo")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert _errors(err) == ["error: --algo gspo contradicts the override algo.name=grpo; give one of them"]


# ----------------------------------------------------------------------------- defect 7: tracebacks

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    from moe_gspo.tiny import make_tiny_checkpoint

    d = tmp_path_factory.mktemp("hf") / "model"
    make_tiny_checkpoint(d, seed=1)
    return d


def _broken_checkpoint(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    if how == "truncated":
        os.truncate(f, f.stat().st_size // 2)
    elif how == "corrupt_header":
        data = bytearray(f.read_bytes())
        data[8:40] = b"\xff" * 32
        f.write_bytes(bytes(data))
    elif how == "nan":
        from safetensors.torch import load_file, save_file

        sd = load_file(f)
        name = sorted(k for k in sd if "layers.1.self_attn.q_proj" in k)[0]
        sd[name][0, 0] = float("nan")
        save_file(sd, f, metadata={"format": "pt"})
    return f


@pytest.mark.parametrize("how,msg", [
    ("truncated", "cannot be read"),
    ("corrupt_header", "cannot be read"),
    ("nan", "holds NaN/Inf values"),
])
def test_a_broken_model_checkpoint_is_one_line_naming_the_file(tiny_ckpt, tmp_path, capsys, how, msg):
    """Defect 7: SafetensorError without the file; NaN weights died later in torch.multinomial."""
    f = _broken_checkpoint(tiny_ckpt, tmp_path / "model", how)
    assert _train(tmp_path / "run", "train.steps=1", f"model.path={f.parent}") == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and str(f) in err and msg in err, err[-2000:]


def test_non_utf8_data_names_file_and_line(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "\xff\xfe", "answer": 3}\n')
    assert _train(tmp_path / "run", "task.name=jsonl", f"task.path={data}") == 2
    err = capsys.readouterr().err
    assert _errors(err) == [f"error: {data}:2: not valid UTF-8 (byte 0xff at column 13); save the file as UTF-8"]
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_resume_with_another_model_geometry_is_one_line(run, capsys):
    assert _train(run, "--resume", "train.steps=3", "model.tiny={moe_intermediate_size: 16}") == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and "another model geometry (moe_intermediate_size 32 -> 16)" in err


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]}); needs root")
    yield mnt
    if subprocess.run(["umount", str(mnt)]).returncode:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_disk_is_one_line_and_leaves_no_partial_files(tiny_fs, capsys):
    run_dir = tiny_fs / "run"  # 1 MiB: config and metrics fit, a 2.5 MB checkpoint does not
    assert _train(run_dir, "train.steps=2") == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and "disk full while writing checkpoint file" in err and str(run_dir) in err
    leftovers = [p for p in tiny_fs.rglob("*") if ".tmp" in p.name or p.name.endswith(".part")]
    assert leftovers == []
    assert not (run_dir / "checkpoints" / "latest").exists()
    assert [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0]


def test_probe_out_under_a_file_fails_before_any_compute(tiny_ckpt, tmp_path, capsys, monkeypatch):
    import moe_gspo.mcore.checkpoint as mcore_ckpt

    def compute(*a, **k):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(mcore_ckpt, "load_megatron_from_hf_dir", compute)
    (tmp_path / "prompts.txt").write_text("0123:\n")
    (tmp_path / "afile").write_text("x")
    rc = probe.main(["--model", str(tiny_ckpt), "--prompts", str(tmp_path / "prompts.txt"),
                     "--out", str(tmp_path / "afile" / "drift.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and "--out=" in err and "is a file, not a directory" in err


# ----------------------------------------------------------------------------- defect 8: CLI

def test_overrides_may_follow_flags_for_train_probe_and_ablate(tmp_path):
    from moe_gspo.run.cli import parse_train_args

    args, cfg = parse_train_args(["--run-dir", "x", "train.steps=6", "--resume", "rollout.dtype=float32",
                                  "--algo", "grpo"])
    assert (cfg.train.steps, cfg.rollout.dtype, cfg.algo.name, args.resume, args.run_dir) == (6, "float32", "grpo",
                                                                                            True, "x")
    pargs = probe.build_parser().parse_intermixed_args(["--model", "m", "--out", "o.json", "--prompts", "p"])
    assert (pargs.model, pargs.out, pargs.prompts) == ("m", "o.json", "p")
    spec = tmp_path / "abl.yaml"
    spec.write_text(f"base_config: {ROOT / 'configs/tiny_cpu_copy_first.yaml'}\nalgos: [gspo]\nrouting_replay: [none]\n"
                    f"seeds: [0]\nout_dir: {tmp_path / 'abl'}\n")
    assert ablate.main([str(spec), "--dry-run", "train.steps=7", "--out", str(tmp_path / "o")]) == 0


def test_ablate_dry_run_validates_every_arm(tmp_path, capsys):
    spec = tmp_path / "abl.yaml"
    spec.write_text(f"base_config: {ROOT / 'configs/tiny_cpu_copy_first.yaml'}\nalgos: [gspo, grpo]\nrouting_replay: [none]\n"
                    f"seeds: [0]\nout_dir: {tmp_path / 'abl'}\noverrides: {{train.lr: abc}}\n")
    assert ablate.main([str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert _errors(err) == ["error: arm gspo-none-s0: train.lr='abc' must be a number",
                            "error: arm grpo-none-s0: train.lr='abc' must be a number"]
    assert not (tmp_path / "abl").exists()


def test_messages_name_real_keys_and_both_sides_of_a_tokenizer_mismatch(tmp_path, capsys):
    assert _train(tmp_path / "run", f"model.path={tmp_path / 'nope'}") == 2
    err = capsys.readouterr().err
    assert "model.path=" in err and "model.checkpoint" not in err
    assert _train(tmp_path / "run2", "model.tiny={vocab_size: 20}") == 2
    err = capsys.readouterr().err
    assert len(_errors(err)) == 1 and "tokenizer 'the shipped tiny tokenizer' has 51 tokens" in err
    assert "vocab_size=20" in err


@pytest.mark.slow
def test_a_user_error_under_torchrun_is_printed_once_and_exits_2(tmp_path):
    """Defect 8: every rank printed the error, buried under torchrun's ChildFailedError; exit code 1."""
    args = ["--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train", *TINY, "--run-dir", str(tmp_path),
            "train.lr=abc"]
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 1  # torchrun's own exit code after any worker failure; cannot be changed
    assert "traceback : error: train.lr='abc' must be a number" in plain.stderr  # summary quotes the line
    short = subprocess.run([sys.executable, "-m", "moe_gspo.launch", *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert short.returncode == 2, short.stderr[-3000:]
    assert _errors(short.stderr) == ["error: train.lr='abc' must be a number"]
    # the launcher checked the train command itself: no worker started, that line is all
    assert short.stderr.strip().splitlines() == ["error: train.lr='abc' must be a number"]


def test_an_unimportable_transformer_engine_runs_the_main_job_and_warns_once(tmp_path):
    """Issue 31: an installed TE that raises ImportError crashed Megatron's import (it catches only
    ModuleNotFoundError); now it counts as absent, with one warning line from rank 0."""
    pkg = tmp_path / "site" / "transformer_engine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('raise ImportError("libtransformer_engine.so: undefined symbol: _ZN3c10")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkg.parent), str(ROOT)])}
    args = ["--nproc-per-node", "2", "-m", "moe_gspo.train", *TINY, "--run-dir", str(tmp_path / "run"),
            "train.steps=2", "parallel.expert_parallel_size=2"]
    out = subprocess.run([sys.executable, "-m", "moe_gspo.launch", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    warned = [l for l in out.stderr.splitlines() if "Transformer Engine is installed but does not import" in l]
    assert len(warned) == 1 and "ImportError: libtransformer_engine.so" in warned[0], out.stderr[-3000:]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


# ----------------------------------------------------------------------------- defect 9: wall time

def test_done_json_wall_time_accumulates_over_resumed_segments(run, finished):
    first = json.loads((finished / "done.json").read_text())
    assert _train(run, "--resume", "train.steps=3") == 0
    done = json.loads((run / "done.json").read_text())
    assert done["step"] == 3 and done["segments"] == 2
    assert done["wall_s"] > first["wall_s"]
    assert _train(run, "--resume", "train.steps=3") == 0  # finished: nothing to do, nothing rewritten
    assert json.loads((run / "done.json").read_text()) == done
