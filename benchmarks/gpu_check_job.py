"""The main job of `benchmarks.gpu_check`'s learning and resume checks (checks 4 and 5; the reasoning is in
`benchmarks.gpu_check`'s docstring), the random model the checks share, and `CheckFailed`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_check_report import learning_verdict, nondeterminism_reported, resume_verdict

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
             num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=32,
             num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1e6},
             tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
"""The random Qwen3-MoE of the checks (the job uses it with the tiny tokenizer's vocabulary)."""
JOB_LR = 1e-3
"""The learning job's learning rate (see the module docstring, check 4)."""
RESUME_STEPS = 20
"""Steps of the resume check's job (killed after its step-10 checkpoint, resumed, compared with the first
`RESUME_STEPS` steps of the learning job's run)."""
KILL_AFTER = "step_000010"
JOB_ENV = "MOE_GSPO_GPU_CHECK_RUN"

class CheckFailed(Exception):
    """A check that could not complete (its message goes into the summary)."""


def _env(extra: dict | None = None) -> dict:
    root = Path(__file__).resolve().parents[1]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
                **(extra or {}))


def job_config(steps: int, lr: float = JOB_LR):
    """The main job's `Config` (see the module docstring, check 4)."""
    from moe_gspo.config_load import config_from_dict

    tiny = {k: v for k, v in MODEL.items() if k not in ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id")}
    tiny["max_position_embeddings"] = 256
    return config_from_dict({
        "model": {"path": None, "tiny": tiny, "init_seed": 0, "router_scale": 4.0, "params_dtype": "auto"},
        "parallel": {"expert_parallel_size": 1, "token_dispatcher": "alltoall"},
        "rollout": {"engine": "hf", "dtype": "bfloat16", "prompts_per_step": 32, "samples_per_prompt": 8,
                    "max_new_tokens": 2, "record_routes": True, "record_probs": True},
        "algo": {"name": "gspo"},
        "task": {"name": "copy_first", "prompt_len": 4, "num_symbols": 2},
        "train": {"steps": steps, "lr": lr, "num_minibatches": 2, "checkpoint_every": 10, "keep_checkpoints": 1,
                  "export_hf": True},
        "logging": {"wandb_mode": "disabled", "progress": False, "trace_every": 0},
    })


def _launch(config: Path, run_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "1",
           "-m", "benchmarks.gpu_check", "job", "--config", str(config), "--run-dir", str(run_dir), *extra]
    env = _env({JOB_ENV: str(run_dir), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    with open(log, "a") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _finish(p: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise CheckFailed(f"the job did not finish within {timeout:.0f} s; see {log}") from None
    if rc != 0:
        raise CheckFailed(f"the job exited with {rc}; see {log}: {log.read_text()[-400:]!r}")


def _job_processes(run_dir: Path) -> list[int]:
    """Live (non-zombie) processes of the job writing `run_dir` (the launcher and its workers)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if f"{JOB_ENV}={run_dir}\0".encode() in (d / "environ").read_bytes():
                pids.append(int(d.name))
        except (OSError, IndexError):
            continue
    return pids


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _learning(out: Path, steps: int) -> dict:
    """Check 4: the job for `steps` steps; `learning_verdict` of its per-step mean rewards."""
    config, ref_dir = out / "job.yaml", out / "runs" / "uninterrupted"
    config.write_text(job_config(steps).to_yaml())
    for d in (ref_dir, out / "runs" / "killed_and_resumed"):
        if d.exists():
            raise CheckFailed(f"{d} exists from an earlier check; pass another --out or move it away")
    _finish(_launch(config, ref_dir, out / "job_uninterrupted.log"), out / "job_uninterrupted.log")
    learning = learning_verdict([r["reward/mean"] for r in _metrics(ref_dir)])
    if "error" in learning:
        raise CheckFailed(learning["error"])
    learning["lr"] = JOB_LR
    learning["headline"] = (f"mean reward {learning['reward_first']:.3f} (first {learning['window_steps']} of "
                            f"{learning['num_steps']} steps) -> {learning['reward_last']:.3f} (last "
                            f"{learning['window_steps']}): gain {learning['gain']:+.3f}, needed >= "
                            f"{learning['min_gain']} and > {learning['z']:g} SE = {learning['noise_bound']:.3f}")
    learning["hf_export"] = (ref_dir / "hf_export" / "config.json").is_file()
    if not learning["hf_export"]:
        learning["status"] = "fail"
        learning["headline"] += "; no HF export written"
    return learning


def _resume(out: Path) -> dict:
    """Check 5: the job (`RESUME_STEPS` steps) killed after its step-10 checkpoint and resumed, against the
    first `RESUME_STEPS` steps of the learning check's run (the learning rate is constant: nothing in a
    step depends on the run's length)."""
    config, ref_dir = out / "job_resume.yaml", out / "runs" / "uninterrupted"
    cut_dir = out / "runs" / "killed_and_resumed"
    if not (ref_dir / "done.json").is_file():
        raise CheckFailed("needs the uninterrupted run of the learning check, which did not finish")
    config.write_text(job_config(RESUME_STEPS).to_yaml())
    log = out / "job_killed_and_resumed.log"
    p = _launch(config, cut_dir, log)
    latest, deadline = cut_dir / "checkpoints" / "latest", time.time() + 600
    while p.poll() is None and time.time() < deadline:
        if latest.is_file() and latest.read_text().strip() >= KILL_AFTER:
            break
        time.sleep(0.2)
    if p.poll() is not None:
        raise CheckFailed(f"the run ended (exit {p.returncode}) before it could be killed; see {log}")
    resumed_at = int(latest.read_text().strip().split("_")[1])
    os.killpg(p.pid, signal.SIGKILL)  # the launcher; its workers die with it (moe_gspo.run.activity)
    p.wait()
    deadline = time.time() + 60
    while _job_processes(cut_dir) and time.time() < deadline:
        time.sleep(0.2)
    if _job_processes(cut_dir):
        raise CheckFailed(f"processes of the killed run outlived it: {_job_processes(cut_dir)}")
    if (cut_dir / "done.json").exists():
        raise CheckFailed("the run finished before the kill took effect")
    _finish(_launch(config, cut_dir, log, "--resume"), log)
    if f"resuming at step {resumed_at}" not in log.read_text():
        raise CheckFailed(f"the resumed run did not report 'resuming at step {resumed_at}'; see {log}")
    resume = resume_verdict(_metrics(ref_dir)[:RESUME_STEPS], _metrics(cut_dir), resumed_at=resumed_at)
    return dict(resume, **resume_headline(resume, "\n".join(
        f.read_text(errors="replace") for f in (out / "job_uninterrupted.log", log) if f.is_file())))


def resume_headline(resume: dict, logs: str) -> dict:
    """The resume check's headline, and the non-deterministic ops its jobs' logs report
    (`nondeterministic_ops`, named in the headline when the run was not reproducible)."""
    ops = nondeterminism_reported(logs)
    at = resume["resumed_at_step"]
    headline = (f"killed after the step-{at} checkpoint, resumed: "
                + ("every metric of every later step equals the uninterrupted run's" if resume["exact"] else
                   f"first difference {resume['first_difference_after_resume']}"))
    if not resume["first_segment_reproduces"]:
        headline += (" (the job is not bitwise reproducible on this machine: inconclusive; "
                     + (f"non-deterministic ops reported: {', '.join(ops)})" if ops else
                        "no non-deterministic op reported by torch)"))
    return {"headline": headline, "nondeterministic_ops": ops}


def deterministic_job_setup() -> None:
    """What `job` mode sets before the main job (the learning and resume checks' runs): torch's deterministic
    algorithms with `warn_only=True` (an op without a deterministic kernel warns and the job goes on; the
    resume check names the ops its logs report) and attention through SDPA's math kernel only (matmuls and
    a softmax, deterministic under `CUBLAS_WORKSPACE_CONFIG`): under `warn_only` flash and memory-efficient
    attention keep their non-deterministic backward (issue 48), which with longer sequences would make the
    resume check "inconclusive" for a setting of this check rather than for the machine."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)


def _job(argv: list[str]) -> int:
    """`job TRAIN_ARGS...`: `moe_gspo.train` after `deterministic_job_setup`."""
    deterministic_job_setup()
    from moe_gspo.train import main as train_main

    return train_main(argv)
