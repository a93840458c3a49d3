"""`python -m benchmarks.gpu_check --out DIR`: does moe-gspo work on this GPU machine? (~6-8 min, one GPU)

Writes `DIR/gpu_check.json` and `DIR/gpu_check.md` (the summary), with the logs of every run beside
them, and exits 0 when every check passed, 1 when one failed, 2 without CUDA (one line, at once).
One GPU; needs torch, transformers and megatron-core only (no Transformer Engine, vLLM, wandb or
network: a GPU machine with torch and transformers takes megatron-core's wheel with
`pip install --no-deps megatron_core-0.16.1-*.whl`; see docs/gpu.md, "Validating a GPU machine").

The checks, in order (each one's failure is recorded and the others still run):

1. **parity** (`check_parity`): a random Qwen3-MoE (`MODEL`, ~0.7 B parameters) in bf16 on CUDA,
   Megatron learner vs transformers, against the same model in fp32 (transformers) as the reference:
   token log-probs of a random batch and the gradients of their mean. Passes when the learner's bf16
   error is within twice transformers' own bf16 error (plus a small absolute slack): "as close to the
   fp32 truth as transformers itself".
2. **memory** and **mfu**: `benchmarks.memory_bench` on the same model (16 sequences of 1024
   tokens, EP=1, distributed optimizer, full recompute; the precision-aware CPU-offload variant too when
   Transformer Engine imports): planned (`moe_gspo.plan`) vs `torch.cuda.max_memory_allocated` per
   phase, within the bench's 15% on its checked phases; and the learner's model FLOPs utilization of
   the update (`train_step`) and of the old-policy log-prob pass, from their fastest repeat
   (`moe_gspo.plan.flops`: PaLM's 6 N_active + 12 L a d T per token; the GPU's dense bf16 peak from
   `PEAK_BF16_TFLOPS` or `--peak-tflops`; recomputed forwards are not counted).
3. **learning**: the main job, `python -m moe_gspo.launch ... -m moe_gspo.train` (here through this
   module's `job` mode, which only makes torch deterministic first), for `--steps` RL steps on the same
   geometry with the shipped tiny tokenizer (vocabulary 51, ~0.6 B parameters): GSPO, the transformers
   rollout engine in bf16, the `copy_first` task with 2 symbols (answer: the prompt's first symbol,
   then EOS). A random model answers right 1 time in ~50; the reward rises once the policy puts its
   mass on the two symbol tokens and EOS, an easy direction for a policy gradient: Adam moves every
   weight by ~lr per step, so the logits move by ~lr x hidden per step and lr = 1e-4 at hidden 1024
   gives the same logit steps as the 1.6e-3 at hidden 64 with which the tiny CPU model, same task,
   went from 0.009 to 0.22 mean reward in 30 steps. Passes when the last 10% of steps'
   mean reward exceeds the first 10%'s by `MIN_REWARD_GAIN`.
4. **resume**: the same job again, killed (SIGKILL of the launcher, mid-run) once its step-10
   checkpoint exists, then `--resume`d: every metric of every step after the checkpoint must equal the
   uninterrupted run's (wall times aside). The run's first segment doubles as a determinism control:
   when it already differs from the uninterrupted run, the job is not bitwise reproducible on this
   machine and the resume check says "inconclusive" instead of failing.

Not covered: vLLM (optional on GPU; see `tests/rollout/test_vllm_gpu.py`), multi-GPU expert
parallelism (`tests/plan/test_plan_gpu.py`, `tests/learner` under torchrun).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=512,
             num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=32,
             num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
             max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1e6},
             tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
"""The random Qwen3-MoE of the checks (the job uses it with the tiny tokenizer's vocabulary)."""
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.4), ("H100", 989.4),
                    ("H200", 989.4), ("H800", 989.4), ("H20", 148.0), ("B200", 2250.0), ("A100", 312.0),
                    ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0))
"""Dense bf16 tensor-core peak (vendor data sheets, no sparsity) by device-name substring, first match."""
MIN_REWARD_GAIN = 0.05
KILL_AFTER = "step_000010"
JOB_ENV = "MOE_GSPO_GPU_CHECK_RUN"


class CheckFailed(Exception):
    """A check that could not complete (its message goes into the summary)."""


# ---------------------------------------------------------------------------------------- pure pieces
def peak_bf16_tflops(device_name: str) -> float | None:
    """The device's dense bf16 peak in TFLOP/s, or None when it is not in `PEAK_BF16_TFLOPS`."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def learner_mfu(bench: dict, peak_tflops: float | None) -> dict:
    """MFU of the update and the log-prob pass of one `memory_bench` result (see the module docstring)."""
    from transformers import Qwen3MoeConfig

    from moe_gspo.plan.flops import forward_flops, mfu, train_flops
    from moe_gspo.plan.params import Geometry

    geom = Geometry.from_hf(Qwen3MoeConfig.from_dict(bench["hf_config"]))
    b = bench["batch"]
    lens = [b["seq_len"]] * b["num_seqs"]
    out = {"variant": bench["variant"], "tokens": sum(lens), "peak_bf16_tflops": peak_tflops}
    for phase, flops in (("update", train_flops(geom, lens)), ("logprobs", forward_flops(geom, lens))):
        seconds = min(bench["phases"][phase]["seconds"])
        out[phase] = {"model_tflop": round(flops / 1e12, 3), "seconds": round(seconds, 4),
                      "tflops_per_s": round(flops / seconds / 1e12, 2),
                      "mfu": None if not peak_tflops else round(mfu(flops, seconds, peak_tflops * 1e12), 4)}
    return out


def memory_rows(bench_results: list[dict], *, checked: tuple[str, ...], tolerance: float) -> list[dict]:
    """Plan-vs-measured rows (variant, phase, planned, measured, diff, within tolerance or not checked)."""
    rows = []
    for res in bench_results:
        for phase, row in res["phases"].items():
            diff = row.get("rel_diff")
            ok = None if phase not in checked or diff is None else abs(diff) <= tolerance
            rows.append({"variant": res["variant"], "phase": phase, "planned_gib": row.get("planned_gib"),
                         "measured_gib": row.get("measured_gib"), "rel_diff": diff, "ok": ok})
    return rows


def resume_verdict(ref: list[dict], cut: list[dict], *, resumed_at: int) -> dict:
    """Compare the killed-and-resumed run's metrics rows with the uninterrupted run's (see the module
    docstring): rows before `resumed_at` (the first segment) test determinism, rows from it on the resume."""
    def first_diff(a_rows, b_rows):
        for a, b in zip(a_rows, b_rows):
            for k in sorted(set(a) | set(b)):
                if not k.startswith("perf/") and a.get(k) != b.get(k):
                    return {"step": a.get("step"), "key": k, "uninterrupted": a.get(k), "resumed": b.get(k)}
        return None

    steps_ok = [r["step"] for r in cut] == [r["step"] for r in ref]
    before = [r for r in ref if r["step"] < resumed_at], [r for r in cut if r["step"] < resumed_at]
    after = [r for r in ref if r["step"] >= resumed_at], [r for r in cut if r["step"] >= resumed_at]
    diff_before, diff_after = first_diff(*before), first_diff(*after)
    exact = steps_ok and bool(after[0]) and diff_after is None
    deterministic = diff_before is None
    status = "pass" if exact else ("fail" if deterministic else "inconclusive")
    return {"status": status, "resumed_at_step": resumed_at, "steps_match": steps_ok, "exact": exact,
            "first_segment_reproduces": deterministic, "first_difference_after_resume": diff_after,
            "first_difference_before_resume": diff_before}


def learning_verdict(summary: dict) -> dict:
    """`moe_gspo.train.learning_summary` of the job -> pass when the reward rose by `MIN_REWARD_GAIN`."""
    gain = summary["reward_last10"] - summary["reward_first10"]
    return {"status": "pass" if gain >= MIN_REWARD_GAIN else "fail", "reward_first10": summary["reward_first10"],
            "reward_last10": summary["reward_last10"], "gain": gain, "min_gain": MIN_REWARD_GAIN,
            "num_steps": summary["num_steps"]}


def _fmt(v, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def render_markdown(result: dict) -> str:
    """The human summary of a `gpu_check.json` result."""
    env, checks = result["environment"], result["checks"]
    lines = [f"# moe-gspo GPU check: {result['status'].upper()}", "",
             f"{env.get('device', '?')}, {env.get('gpu_mem_gib', 0):.0f} GiB; " +
             ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items()) +
             f"; {result.get('wall_s', 0):.0f} s; `{result.get('command', '')}`", "",
             "| check | status | figures |", "|---|---|---|"]
    for name, c in checks.items():
        lines.append(f"| {name} | {c.get('status', '?')} | {c.get('headline', c.get('error', ''))} |")
    mem = checks.get("memory", {})
    if mem.get("rows"):
        lines += ["", "## Memory per phase: planned (`moe_gspo.plan`) vs `torch.cuda.max_memory_allocated`", "",
                  "| variant | phase | planned GiB | measured GiB | planned/measured - 1 | checked |",
                  "|---|---|---|---|---|---|"]
        for r in mem["rows"]:
            ok = {True: "ok", False: "OVER TOLERANCE", None: "reported"}[r["ok"]]
            lines.append(f"| {r['variant']} | {r['phase']} | {_fmt(r['planned_gib'], '.2f')} | "
                         f"{_fmt(r['measured_gib'], '.2f')} | {_fmt(r['rel_diff'], '+.1%')} | {ok} |")
    mfu = checks.get("mfu", {})
    for m in mfu.get("variants", []):
        lines += ["", f"## Learner MFU ({m['variant']}, {m['tokens']} tokens, peak "
                      f"{_fmt(m['peak_bf16_tflops'], '.1f')} TFLOP/s bf16)", "",
                  "| pass | model TFLOP | seconds | TFLOP/s | MFU |", "|---|---|---|---|---|"]
        for phase in ("update", "logprobs"):
            p = m[phase]
            lines.append(f"| {phase} | {p['model_tflop']:.2f} | {p['seconds']:.3f} | {p['tflops_per_s']:.1f} | "
                         f"{_fmt(p['mfu'], '.1%')} |")
    lines += ["", "Model FLOPs: PaLM's 6 N_active + 12 L a d T per token (moe_gspo/plan/flops.py); "
                  "details of every check in gpu_check.json."]
    return "\n".join(lines) + "\n"


def write_summary(result: dict, out_dir: Path) -> tuple[Path, Path]:
    """`gpu_check.json` and `gpu_check.md` in `out_dir` (each written atomically)."""
    from moe_gspo.run.sinks import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out_dir / "gpu_check.json", out_dir / "gpu_check.md"
    atomic_write_text(jpath, json.dumps(result, indent=1, default=str))
    atomic_write_text(mpath, render_markdown(result))
    return jpath, mpath


# ---------------------------------------------------------------------------------------- checks
def check_parity(hf_kwargs: dict, *, device, dtype, batch: int = 4, seq_len: int = 256, seed: int = 0) -> dict:
    """Learner (Megatron) vs transformers in `dtype`, both against transformers in fp32 (see the module
    docstring). Needs `moe_gspo.mcore.parallel.init_distributed` (EP=1) in this process."""
    import torch
    from transformers import Qwen3MoeConfig

    from moe_gspo.learner.logprobs import token_logprobs
    from moe_gspo.mcore.model import build_gpt_model, forward_logits
    from moe_gspo.mcore.weights import load_hf_model_into_megatron, megatron_to_hf
    from moe_gspo.tiny import build_tiny_model

    cfg = Qwen3MoeConfig(**hf_kwargs)
    ref = build_tiny_model(cfg, seed=seed)  # fp32 truth (router weights scaled as in every run)
    low = copy.deepcopy(ref).to(device=device, dtype=dtype)
    ref = ref.to(device)
    model = build_gpt_model(cfg, params_dtype=dtype)
    load_hf_model_into_megatron(model, low)
    ids = torch.randint(3, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed)).to(device)

    def run(logits_fn, params):
        for p in params:
            p.grad = None
        logp, _ = token_logprobs(logits_fn(), ids)
        (-logp[:, 1:].mean()).backward()
        return logp[:, 1:].detach().float()

    lp_ref = run(lambda: ref(ids).logits, ref.parameters())
    lp_low = run(lambda: low(ids).logits, low.parameters())
    lp_mc = run(lambda: forward_logits(model, ids), model.parameters())
    g_ref = {k: p.grad.float() for k, p in ref.named_parameters()}
    g_low = {k: p.grad.float() for k, p in low.named_parameters()}
    g_mc = {k: v.float() for k, v in megatron_to_hf({k: p.grad for k, p in model.named_parameters()}, cfg).items()}

    def rel(grads) -> float:
        num = sum(float((grads[k] - g).pow(2).sum()) for k, g in g_ref.items())
        return (num / sum(float(g.pow(2).sum()) for g in g_ref.values())) ** 0.5

    out = {"logp_abs_err_mean": {"learner": float((lp_mc - lp_ref).abs().mean()),
                                 "transformers": float((lp_low - lp_ref).abs().mean())},
           "logp_abs_err_max": {"learner": float((lp_mc - lp_ref).abs().max()),
                                "transformers": float((lp_low - lp_ref).abs().max())},
           "grad_rel_err": {"learner": rel(g_mc), "transformers": rel(g_low)},
           "learner_vs_transformers_logp_abs_diff_max": float((lp_mc - lp_low).abs().max()),
           "batch": [batch, seq_len], "dtype": str(dtype).replace("torch.", "")}
    ok = (out["logp_abs_err_mean"]["learner"] <= 2 * out["logp_abs_err_mean"]["transformers"] + 1e-3
          and out["grad_rel_err"]["learner"] <= 2 * out["grad_rel_err"]["transformers"] + 1e-2)
    out["status"] = "pass" if ok else "fail"
    out["headline"] = (f"log-prob error vs fp32 {out['logp_abs_err_mean']['learner']:.2e} (transformers bf16 "
                       f"{out['logp_abs_err_mean']['transformers']:.2e}); gradient rel. error "
                       f"{out['grad_rel_err']['learner']:.3f} ({out['grad_rel_err']['transformers']:.3f})")
    del ref, low, model
    return out


def _parity_on_cuda() -> dict:
    import torch

    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed

    init_distributed(ep_size=1, num_experts=MODEL["num_experts"], seed=0)
    try:
        return check_parity(MODEL, device=torch.device("cuda"), dtype=torch.bfloat16)
    finally:
        destroy_distributed()
        torch.cuda.empty_cache()


def _env(extra: dict | None = None) -> dict:
    root = Path(__file__).resolve().parents[1]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
                **(extra or {}))


def _memory_and_mfu(out: Path, have_te: bool, peak: float | None) -> tuple[dict, dict]:
    from benchmarks.memory_bench import CHECKED

    m = MODEL
    variants = "dist,dist_offload" if have_te else "dist"
    cmd = [sys.executable, "-m", "benchmarks.memory_bench", "--variants", variants, "--hidden",
           str(m["hidden_size"]), "--layers", str(m["num_hidden_layers"]), "--heads", str(m["num_attention_heads"]),
           "--kv-heads", str(m["num_key_value_heads"]), "--experts", str(m["num_experts"]), "--top-k",
           str(m["num_experts_per_tok"]), "--moe-intermediate", str(m["moe_intermediate_size"]), "--vocab",
           str(m["vocab_size"]), "--seq-len", "1024", "--seqs", "16", "--group", "4", "--minibatches", "2",
           "--steps", "2", "--tolerance", "0.15", "--json", str(out / "memory_bench.json")]
    with open(out / "memory_bench.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), timeout=900).returncode
    if not (out / "memory_bench.json").is_file():
        raise CheckFailed(f"memory_bench exited {rc} without results; see {out / 'memory_bench.log'}")
    results = json.loads((out / "memory_bench.json").read_text())["results"]
    rows = memory_rows(results, checked=CHECKED, tolerance=0.15)
    bad = [f"{r['variant']}/{r['phase']} {r['rel_diff']:+.1%}" for r in rows if r["ok"] is False]
    memory = {"status": "fail" if bad else "pass", "rows": rows, "variants": [r["variant"] for r in results],
              "headline": ("over 15%: " + ", ".join(bad)) if bad else
              f"{sum(r['ok'] is True for r in rows)} checked phases within 15% of the plan"}
    mfus = [learner_mfu(r, peak) for r in results]
    first = mfus[0]
    mfu = {"status": "reported", "variants": mfus,
           "headline": f"update {_fmt(first['update']['mfu'], '.1%')} ({first['update']['tflops_per_s']:.0f} TFLOP/s), "
                       f"log-prob pass {_fmt(first['logprobs']['mfu'], '.1%')} ({first['variant']})"}
    return memory, mfu


def job_config(steps: int):
    """The main job's `Config` (see the module docstring, check 3)."""
    from moe_gspo.config_load import config_from_dict

    tiny = {k: v for k, v in MODEL.items() if k not in ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id")}
    tiny["max_position_embeddings"] = 256
    return config_from_dict({
        "model": {"path": None, "tiny": tiny, "init_seed": 0, "router_scale": 4.0, "params_dtype": "auto"},
        "parallel": {"expert_parallel_size": 1, "token_dispatcher": "alltoall"},
        "rollout": {"engine": "hf", "dtype": "bfloat16", "prompts_per_step": 16, "samples_per_prompt": 8,
                    "max_new_tokens": 2, "record_routes": True, "record_probs": True},
        "algo": {"name": "gspo"},
        "task": {"name": "copy_first", "prompt_len": 4, "num_symbols": 2},
        "train": {"steps": steps, "lr": 1e-4, "num_minibatches": 2, "checkpoint_every": 10, "keep_checkpoints": 1,
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
    from moe_gspo.train import learning_summary

    config, ref_dir = out / "job.yaml", out / "runs" / "uninterrupted"
    config.write_text(job_config(steps).to_yaml())
    for d in (ref_dir, out / "runs" / "killed_and_resumed"):
        if d.exists():
            raise CheckFailed(f"{d} exists from an earlier check; pass another --out or move it away")
    _finish(_launch(config, ref_dir, out / "job_uninterrupted.log"), out / "job_uninterrupted.log")
    learning = learning_verdict(learning_summary(ref_dir / "metrics.jsonl"))
    learning["headline"] = (f"mean reward {learning['reward_first10']:.3f} (first 10% of {steps} steps) -> "
                            f"{learning['reward_last10']:.3f} (last 10%)")
    learning["hf_export"] = (ref_dir / "hf_export" / "config.json").is_file()
    if not learning["hf_export"]:
        learning["status"] = "fail"
        learning["headline"] += "; no HF export written"
    return learning


def _resume(out: Path) -> dict:
    config, ref_dir, cut_dir = out / "job.yaml", out / "runs" / "uninterrupted", out / "runs" / "killed_and_resumed"
    if not (ref_dir / "done.json").is_file():
        raise CheckFailed("needs the uninterrupted run of the learning check, which did not finish")
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
    resume = resume_verdict(_metrics(ref_dir), _metrics(cut_dir), resumed_at=resumed_at)
    resume["headline"] = (f"killed after the step-{resumed_at} checkpoint, resumed: "
                          + ("every metric of every later step equals the uninterrupted run's" if resume["exact"] else
                             f"first difference {resume['first_difference_after_resume']}")
                          + ("" if resume["first_segment_reproduces"] else
                             " (the job is not bitwise reproducible on this machine: inconclusive)"))
    return resume


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers", "megatron-core", "transformer-engine", "vllm", "wandb"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def _run(out: Path, steps: int, peak_override: float | None, command: str) -> dict:
    import torch

    from moe_gspo.mcore.shims import have_transformer_engine

    t0 = time.time()
    name = torch.cuda.get_device_name(0)
    peak = peak_override or peak_bf16_tflops(name)
    have_te = have_transformer_engine()
    result = {"status": "running", "command": command, "checks": {},
              "environment": {"device": name, "cuda": torch.version.cuda,
                              "gpu_mem_gib": torch.cuda.get_device_properties(0).total_memory / 2 ** 30,
                              "transformer_engine_importable": have_te, "peak_bf16_tflops": peak,
                              "versions": _versions()}}
    checks = result["checks"]

    def record(name: str, fn):
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001  (one check's failure must not hide the others)
            got = {"status": "fail", "error": f"{type(e).__name__}: {e}"[:2000]}
        for key, value in (got.items() if isinstance(got, dict) and "status" not in got else [(name, got)]):
            checks[key] = value
            print(f"[gpu_check] {key}: {value.get('status')} - {value.get('headline', value.get('error', ''))}",
                  flush=True)
        write_summary(result, out)

    record("parity", _parity_on_cuda)
    record("memory", lambda: dict(zip(("memory", "mfu"), _memory_and_mfu(out, have_te, peak))))
    record("learning", lambda: _learning(out, steps))
    record("resume", lambda: _resume(out))
    statuses = [c.get("status") for c in checks.values()]
    result["status"] = "fail" if "fail" in statuses else "pass"
    result["wall_s"] = time.time() - t0
    return result


def _job(argv: list[str]) -> int:
    """`job TRAIN_ARGS...`: `moe_gspo.train` with torch's deterministic algorithms (where they exist)."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    from moe_gspo.train import main as train_main

    return train_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["job"]:
        return _job(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[1])
    p.add_argument("--out", required=True, help="directory for gpu_check.json, gpu_check.md and the run logs")
    p.add_argument("--steps", type=int, default=30, help="RL steps of the main job (default 30; at least 20)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's dense bf16 peak in TFLOP/s, for MFU (default: from the device name)")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: benchmarks.gpu_check needs CUDA (torch.cuda.is_available() is False here); run it on "
              "the GPU machine", file=sys.stderr)
        return 2
    if args.steps < 20:
        print(f"error: --steps {args.steps}: at least 20 (the run is killed after its step-10 checkpoint and "
              "resumed)", file=sys.stderr)
        return 2
    out = Path(args.out)
    result = _run(out, args.steps, args.peak_tflops, "python -m benchmarks.gpu_check " + " ".join(argv))
    jpath, mpath = write_summary(result, out)
    print(f"[gpu_check] {result['status'].upper()} in {result['wall_s']:.0f} s: {mpath} (details: {jpath})", flush=True)
    return 0 if result["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
