"""The training entry point: a short smoke run of every algo x replay arm, CLI errors, and
kill + resume (past a truncated rank file in the latest checkpoint) reproducing an uninterrupted EP=2
run exactly. Faults and bad input: tests/test_train_faults.py."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _metric_docs import undocumented_metric_keys
from _procs import alive, worker_pids
from moe_gspo import train

ROOT = Path(__file__).resolve().parents[1]


SMALL = ["parallel.expert_parallel_size=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "rollout.max_new_tokens=3", "logging.wandb_mode=disabled", "logging.progress=false",
         "train.export_hf=false", "logging.trace_every=1", "train.checkpoint_every=0", "logging.update_drift_every=1"]


def _metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl, each of whose keys docs/metrics.md documents (by name, or as `prefix/*`)."""
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert undocumented_metric_keys(k for r in rows for k in r) == []
    return rows


@pytest.mark.parametrize("algo", ["gspo", "gspo_token", "grpo"])
@pytest.mark.parametrize("replay", ["none", "r2", "r3"])
def test_smoke_every_arm(tmp_path, algo, replay):
    run_dir = tmp_path / "run"
    rc = train.main(["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--algo", algo, "--routing-replay", replay,
                     "--run-dir", str(run_dir), "train.steps=2", *SMALL])
    assert rc == 0
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["num_sequences"] == 16
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert len(r["routing/layer_disagree"]) == 2 and len(r["update/layer_change"]) == 2
        for k in ("loss/policy", "clip/token_frac", "clip/out_of_range_frac", "ratio/token_var", "ratio/seq_var",
                  "mismatch/k3_kl", "routing/any_layer_flip", "routing_prompt/any_layer_flip",
                  "update/expert_change_frac", "update_all_minibatches/expert_change_frac", "grad/norm",
                  "perf/tokens_per_s"):
            assert k in r and r[k] is not None, k
        assert r["clip/token_frac"] <= r["clip/out_of_range_frac"]
        assert r["routing/num_tokens"] == r["mismatch/num_tokens"]  # routing rows = response log-prob rows
        # R3: the replayed pass (the loss's pi_old) is compared with the rollout engine too
        replayed = [k for k in r if k.startswith("mismatch_replayed/")]
        if replay == "r3":
            assert {k.split("/")[1] for k in replayed} == {k.split("/")[1] for k in r if k.startswith("mismatch/")}
            assert all(r[k] is not None and math.isfinite(r[k]) for k in replayed if not isinstance(r[k], list))
            assert r["r3/replay_mismatch_frac"] == 0.0  # issue 41: the learner ran the replayed experts
        else:
            assert replayed == []
        assert len(r["mismatch/extreme_frac_curve"]) == 7  # issue 41: F(tau) on its tau grid
        assert not any(k.startswith("rollout_corr/") for k in r)
    done = json.loads((run_dir / "done.json").read_text())
    assert done["step"] == 2
    assert (run_dir / "traces" / "step_000001_rollout.npz").is_file()
    cfg = (run_dir / "config.yaml").read_text()
    assert f"name: {algo}" in cfg and f"routing_replay: {replay}" in cfg


def test_corrected_grpo_with_kl_reference(tmp_path):
    """GRPO + R3 with TIS, geometric MIS and a KL penalty to the frozen initial policy; one mini-batch
    per step, so step 0's update starts exactly at the reference; update drift every 2nd step."""
    run_dir = tmp_path / "run"
    rc = train.main(["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--algo", "grpo", "--routing-replay", "r3",
                     "--run-dir", str(run_dir), "train.steps=4", *SMALL, "rollout.samples_per_prompt=8", "train.num_minibatches=1",
                     "algo.kl_coef=0.1", "algo.rollout_is=token", "algo.rollout_rs=geometric",
                     "algo.rollout_rs_threshold=1.001", "logging.update_drift_every=2",
                     "train.lr_warmup_steps=2", "train.lr_decay=linear", "train.lr_decay_steps=2",
                     # an evaluation of 2 samples per prompt on steps 0 and 2, so that the eval/* keys (pass@k
                     # included) are among the keys checked against docs/metrics.md (`_metrics`)
                     "eval.every=2", "eval.greedy=false", "eval.samples_per_prompt=2", "eval.num_prompts=4"])
    assert rc == 0
    rows = _metrics(run_dir)
    assert ["eval/pass_at_k" in r for r in rows] == [True, False, True, False]
    lr = rows[1]["train/lr"]  # the schedule reaches the optimizer: warm-up 1/2, 1, then decay 1, 1/2
    assert [r["train/lr"] for r in rows] == pytest.approx([lr / 2, lr, lr, lr / 2])
    # the reference replays the rollout routes like the update: KL(pi_theta || pi_ref) = 0 before
    # the first update that moves the weights (a step whose advantages are all 0 has no gradient),
    # > 0 after it
    assert abs(rows[0]["loss/kl"]) < 1e-6
    moved = [i for i, r in enumerate(rows) if r["grad/norm"] > 0]
    assert moved and moved[0] < len(rows) - 1
    for i, r in enumerate(rows):
        assert (r["loss/kl"] > 1e-6) == (i > moved[0]), (i, r["loss/kl"])
    for r in rows:
        for k in ("is_raw_mean", "is_raw_max", "is_weight_mean", "is_truncated_frac", "is_ess",
                  "rs_masked_token_frac", "rs_masked_seq_frac", "rs_frac_high", "rs_frac_low"):
            assert math.isfinite(r[f"rollout_corr/{k}"]), k
        assert 0 < r["rollout_corr/is_ess"] <= 1 and 0 <= r["rollout_corr/rs_masked_seq_frac"] <= 1
        assert math.isfinite(r["mismatch_replayed/k3_kl"])
    assert ["update/any_layer_change" in r for r in rows] == [True, False, True, False]
    assert rows[0]["update/expert_change_frac"] == rows[0]["update_all_minibatches/expert_change_frac"]
    traces = run_dir / "traces"
    assert (traces / "step_000000_updated.npz").is_file() and not (traces / "step_000001_updated.npz").exists()
    import numpy as np
    with np.load(traces / "step_000001_logprobs.npz") as z:
        assert z["learner_replayed_logp"].shape == z["learner_logp"].shape


def test_r3_with_an_engine_that_drops_prompt_routes(tmp_path, monkeypatch, capsys):
    """Safe R3 against an engine that loses routes (vLLM prefix omission / never-written rows, slime's
    dropped requests): every sample's prompt rows 0 .. P-1 are zeroed (expert 0 twice: invalid) and one
    sample per step has no routes at all. The run trains, logs exactly the share of replayed rows that fell
    back, and warns once."""
    from moe_gspo.rollout.hf_engine import HFEngine

    generate, seen = HFEngine.generate, []

    def dropping(self, prompts, sampling):
        out = generate(self, prompts, sampling)
        for s in out:
            s.routes_TLK[:len(s.prompt_ids)] = 0
        out[1].routes_TLK = None
        seen.append(out)
        return out

    monkeypatch.setattr(HFEngine, "generate", dropping)
    run_dir = tmp_path / "run"
    rc = train.main(["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--algo", "grpo",
                     "--routing-replay", "r3", "--run-dir", str(run_dir), "train.steps=2", *SMALL, "eval.every=0",
                     "rollout.prompts_per_step=8", "task.num_symbols=2"])
    assert rc == 0
    rows = _metrics(run_dir)
    assert len(rows) == 2 == len(seen)
    for r, samples in zip(rows, seen):
        n = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        failed = sum(len(s.prompt_ids) for i, s in enumerate(samples) if i != 1) + n[1] - 1
        assert r["r3/num_rows"] == sum(k - 1 for k in n)
        assert r["r3/fallback_token_frac"] == pytest.approx(failed / r["r3/num_rows"])
        assert r["r3/fallback_seq_frac"] == 1.0 and r["r3/fallback_rows_missing"] == n[1] - 1
        assert r["r3/fallback_rows_duplicate"] == failed - (n[1] - 1)
        assert r["r3/fallback_rows_range"] == r["r3/fallback_rows_shape"] == r["r3/fallback_rows_length"] == 0
        for k in ("loss/policy", "grad/norm", "reward/mean", "mismatch_replayed/k3_kl"):
            assert math.isfinite(r[k]), k
        # the dropped rows are left out of the rollout-vs-learner routing comparison, not counted as flips
        assert r["routing_prompt/num_tokens"] == 0 and r["routing/num_tokens"] < r["mismatch/num_tokens"]
    assert capsys.readouterr().err.count("of the replayed token rows had no usable rollout route") == 1


def test_opsm_run_logs_its_masked_fractions(tmp_path):
    """GSPO with off-policy sequence masking and a bf16 rollout (so that the engine and the learner differ):
    the masked shares and the drift are logged every step."""
    run_dir = tmp_path / "run"
    rc = train.main(["--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--algo", "gspo",
                     "--run-dir", str(run_dir), "train.steps=3", *SMALL, "rollout.dtype=bfloat16", "algo.opsm=true",
                     "rollout.prompts_per_step=8", "task.num_symbols=2", "eval.every=0"])
    assert rc == 0
    rows = _metrics(run_dir)
    for r in rows:
        seq, tok = r["rollout_corr/opsm_masked_seq_frac"], r["rollout_corr/opsm_masked_token_frac"]
        assert 0.0 <= seq <= 1.0 and 0.0 <= tok <= 1.0 and math.isfinite(r["rollout_corr/opsm_kl_mean"])
        assert seq <= r["advantage/nonzero_frac"] + 1e-9  # only A < 0 is masked (equal-sized mini-batches)
        assert math.isfinite(r["loss/policy"])
    print({k: [r[k] for r in rows] for k in rows[0] if k.startswith("rollout_corr/opsm")})


@pytest.mark.parametrize("args,msg", [
    (["--algo", "ppo"], "error: algo.name='ppo' is not one of ['gspo', "),  # checked by the config: plug-ins pass
    (["--routing-replay", "r9"], "invalid choice: 'r9'"),
    (["train.lr=abc"], "train.lr='abc' must be a number"),
    (["bogus.key=1"], "must be section.key"),
    (["--config", "nope.yaml"], "does not exist"),
])
def test_bad_cli_exits_2_naming_the_field(capsys, args, msg):
    with pytest.raises(SystemExit) as e:
        train.main(args)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_help_documents_every_field(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = capsys.readouterr().out
    for key in ("algo.clip_low", "rollout.samples_per_prompt", "train.num_minibatches", "--routing-replay", "--resume"):
        assert key in out


def _torchrun(run_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "moe_gspo.train", "--config", str(ROOT / "configs/tiny_cpu.yaml"), "--run-dir", str(run_dir),
           "train.steps=5", "train.checkpoint_every=1", "rollout.prompts_per_step=4",
           "rollout.samples_per_prompt=4", "logging.wandb_mode=disabled", "logging.progress=false",
           "train.export_hf=false", "parallel.expert_parallel_size=2", "train.lr_decay_fraction=0.8", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(p: subprocess.Popen, timeout=300) -> str:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_ep2_kill_and_resume_reproduces_uninterrupted_run(tmp_path):
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    _finish(_torchrun(ref_dir))
    p = _torchrun(cut_dir)
    deadline = time.time() + 240
    latest = cut_dir / "checkpoints" / "latest"
    while time.time() < deadline and p.poll() is None:
        if latest.is_file() and latest.read_text().strip() >= "step_000002":
            break
        time.sleep(0.05)
    assert p.poll() is None, "run finished before it could be killed"
    workers = worker_pids(p.pid)
    assert sorted(workers) == [0, 1], workers
    os.killpg(p.pid, signal.SIGKILL)  # torchrun's process group, mid-step (its workers run in their own sessions)
    p.wait()
    # Issue 12: the workers used to survive their launcher and keep writing into the run directory,
    # racing the resumed run; now the kernel kills them with it (PR_SET_PDEATHSIG).
    deadline = time.time() + 30
    while any(alive(pid) for pid in workers.values()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in workers.values()), "workers outlived a killed torchrun"
    assert not (cut_dir / "done.json").exists()
    # Issue 12, defect 3: a truncated rank file in the latest checkpoint (here rank 1's only) made
    # both ranks die with tracebacks; now both agree to fall back to the previous checkpoint.
    latest_dir = cut_dir / "checkpoints" / latest.read_text().strip()
    rank1 = latest_dir / "rank_00001.pt"
    os.truncate(rank1, rank1.stat().st_size // 2)
    out = _finish(_torchrun(cut_dir, "--resume"))
    assert "resuming at step" in out
    warnings = [l for l in out.splitlines() if l.startswith("warning:")]
    assert len(warnings) == 1 and f"{latest_dir.name} is unusable: rank_00001.pt is truncated" in warnings[0], out
    ref, cut = _metrics(ref_dir), _metrics(cut_dir)
    assert [r["step"] for r in cut] == list(range(5))
    lr = ref[0]["train/lr"]  # the resumed steps stay on the schedule: the decay over steps 1-4 is compared below
    assert [r["train/lr"] for r in ref] == pytest.approx([lr, lr, 0.75 * lr, 0.5 * lr, 0.25 * lr])
    for a, b in zip(ref, cut):
        for k in a:
            if k.startswith("perf/"):
                continue
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
