"""`python -m benchmarks.gpu_check --out DIR`: does moe-gspo work on this GPU machine, and how fast? (one GPU)

Writes `DIR/gpu_check.json` and `DIR/gpu_check.md` (the summary), with the logs of every run and
`DIR/train_step_profile.txt` beside them, and exits 0 when every check passed, 1 when one failed, 2
without CUDA (one line, at once). One GPU; needs torch, transformers and megatron-core only (no
Transformer Engine, vLLM, wandb or network: an offline GPU machine with torch and transformers takes
megatron-core's wheel for its Python, e.g. the cp312 one, and setuptools' (megatron-core's import reaches
it), with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` and runs this from the checkout
root with `PYTHONPATH=/tmp/site:$PWD`; see docs/gpu.md, "An offline GPU machine, step by step"). Its wall time on an H100 with these defaults has not been measured yet.

The checks (`--checks`, any subset of mfu,parity,memory,learning,resume; default all) run MFU first
(3 below: the figure a short device call is for), then 1, 2, 4, 5 and 6; each one's failure is recorded
and the others still run, and the summary is rewritten after each check (unfinished ones marked "not
run yet"), so a call cut short keeps what finished. The summary names each bench's micro-batch,
optimizer (distributed or not) and expert path. The pure pieces (verdicts, MFU and throughput
arithmetic, the summary) are in `benchmarks.gpu_check_report`:

1. parity: a random Qwen3-MoE (`MODEL`, ~0.7 B parameters) in bf16 on CUDA, Megatron learner vs
   transformers, against the same model in fp32 (transformers) as the reference: token log-probs of a
   random batch and the gradients of their mean. Passes when the learner's bf16 error is within twice
   transformers' own bf16 error (plus a small absolute slack).
2. memory: `benchmarks.memory_bench` on `MODEL` (16 sequences of 1024 tokens, EP=1, distributed
   optimizer, micro-batch 1, full recompute: a memory-lean setting; the precision-aware CPU-offload
   variant too when Transformer Engine imports): planned (`moe_gspo.plan`) vs
   `torch.cuda.max_memory_allocated` per phase, within 15% on the bench's checked phases.
3. mfu (reported, no threshold): the learner's model FLOPs utilization in a realistic training setting,
   the MFU SETTING: `benchmarks.memory_bench` on `MODEL` without its rollout, `--mfu-seqs` (default 32)
   sequences of `--mfu-seq-len` (default 1024) tokens in 2 mini-batches, micro-batches of
   `--mfu-micro-batch` (default 4) sequences, i.e. 4 x 1024 = 4096 tokens per forward/backward, and
   activation recomputation `--mfu-recompute` (default off), the experts `--mfu-experts` (default
   grouped: one parameter per projection, `model.expert_layout=grouped`, Megatron's legacy `GroupedMLP` on
   `torch._grouped_mm`, under Megatron's distributed optimizer, which leaves those weights where the GEMM
   views them without a copy (`moe_gspo.mcore.grouped_experts`); `batched`: the per-expert layout's grouped
   GEMM, `model.batched_experts`, under the non-distributed optimizer (the distributed one would make it
   copy every expert weight per forward); `loop`: Megatron's SequentialMLP under the distributed optimizer;
   the bench counts the expert modules it built, the forwards that copied expert weights and, in the grouped
   layout, the forwards that left `torch._grouped_mm` for the loop (`grouped_experts.expert_path_counts`);
   the check fails, in one line naming the cause, on the wrong path or when any MoE layer took the slow
   one), 3 timed steps, Megatron's token dispatcher `--mfu-dispatcher` (default allgather, training's
   default `parallel.token_dispatcher`; named in the summary), the model `--mfu-geometry` (default `MODEL`;
   `qwen3-30b-a3b-reduced`: Qwen3-30B-A3B's layer shapes, hidden 2048, 128 experts, top-8, expert FFN 768,
   32 query / 4 KV heads of 128, vocabulary 151,936, at `--mfu-layers` (default 4) of its 48 layers; a
   comma list runs each); `--mfu-micro-batches 4,8,16` sweeps
   micro-batches (one bench each; one out of GPU memory is recorded as "oom"); MFU of the update
   (`train_step`: forward, backward, optimizer step) and of the old-policy log-prob pass from their
   fastest step. Model FLOPs by `moe_gspo.plan.flops` (PaLM's 6 N_active + 12 L a d T per token;
   recomputed forwards are not counted), over the GPU's dense bf16 peak (`PEAK_BF16_TFLOPS`, or
   `--peak-tflops`). The memory check's setting is reported beside it for comparison (the first H100
   run's 0.2%, docs/gpu.md, was that setting: micro-batch 1 and full recompute, ~18k small expert calls
   per update).
   After the timed steps one more `train_step` runs under `torch.profiler` (CUDA activity): its
   top-25 ops by CUDA time go to `DIR/train_step_profile.txt` (`benchmarks.gpu_profile`). At 1.03 GFLOP
   per token the defaults' update is 33.7 model TFLOP; the memory plan (`moe_gspo.plan`) puts its peak
   at ~20 GiB without recompute (planned, not measured; the plan and the measurement are printed in
   `DIR/mfu_bench.log` and reported in the summary's memory table).
4. learning: the main job, `python -m moe_gspo.launch ... -m moe_gspo.train` (here through this
   module's `job` mode, which only makes torch deterministic first: `deterministic_job_setup`, attention
   on SDPA's math kernel), `--steps` (default 60) RL steps on
   the same geometry with the shipped tiny tokenizer (vocabulary 51, ~0.6 B parameters): GSPO, the
   transformers rollout engine in bf16, the `copy_first` task with 2 symbols (answer: the prompt's first
   symbol, then EOS), 32 prompts x 8 samples, 2 mini-batches, lr `JOB_LR` = 1e-3. It passes only with
   a clear margin (`gpu_check_report.learning_verdict`): the mean reward of the last 10% of the steps
   (at least 5) must exceed the first 10%'s by `MIN_REWARD_GAIN` = 0.3 absolute AND by `NOISE_Z` = 4
   standard errors of the difference of the two means (from the per-step rewards).
   Why these settings. The first H100 run (16 prompts, lr 1e-4, 30 steps) went from 0.068 to 0.120 mean
   reward: the reward's log grew ~0.021 per step, 5.7x slower than the tiny CPU model's on the same job
   (hidden 64, lr 1.6e-3: 0.009 -> 0.22 in 30 steps, ~0.12 per step), so the old argument that Adam's
   logit steps grow with lr x hidden (1e-4 at hidden 1024 = 1.6e-3 at 64) overestimated the larger
   model's pace. The tiny model on this job (32 prompts, 60 steps, fp32 rollout) shows which paces pass,
   as multiples of its pace at lr 1.6e-3 (gain = last-window minus first-window mean reward):
   lr 1e-9 (no learning): -0.001 (seed 0; 16 prompts, seeds 0-2: -0.002 to +0.005, noise bound ~0.008),
   fail; 1/4 (lr 4e-4): 0.15 (seeds 0, 1), fail; 1/2 (lr 8e-4): 0.63-0.66 (seeds 0-2; with 16 prompts
   only 0.34 and 0.42, hence 32 prompts: the sequences are under 10 tokens, twice the batch costs a GPU
   little); 1x: 0.97; 3x (lr 4.8e-3): 0.97; 6x (lr 9.6e-3): 0.93 and 0.54 (seed 1 solved the task by
   step 20, then fell back to the 0.5-0.6 plateau of a policy that answers one of the two symbols at
   random, which still passes). So the GPU model must reach about half the tiny model's pace, and
   may exceed it 6x. At lr 1e-4 it ran at ~1/5.7 of it; if its pace grows linearly with lr, 1e-3 gives
   ~1.8x, if only with sqrt(lr) (noisy gradients), ~0.55x: both pass, where 5e-4 would give 0.4-0.9x.
   Adam moves each weight by ~lr per step: 1e-3 is 5% of the 0.02 init scale, less than the tiny
   model's 8% at 1.6e-3. Not run on a GPU yet.
5. resume: the same job with `RESUME_STEPS` = 20 steps, killed (SIGKILL of the launcher, mid-run) once
   its step-10 checkpoint exists, then `--resume`d: every metric of every step after the checkpoint must
   equal the learning run's first 20 steps (wall times aside; the learning rate is constant, so no step
   depends on the run's length). The run's first segment doubles as a determinism control: when it
   already differs, the job is not bitwise reproducible on this machine and the check says
   "inconclusive" instead of failing, naming the non-deterministic ops torch warned about in the jobs' logs.
6. throughput (reported): a per-phase table like NeMo-RL's performance summary, tokens/s/GPU = the
   tokens a phase processes (the step's prompt + response tokens) / (its seconds x GPUs), for
   generation (the rollout engine; also per generated token), the old-policy log-prob pass, training
   (the update) and the weight sync, plus the whole RL step, from three sources: the MFU setting's
   bench (no generation: it skips the rollout), the memory check's bench (16 x 1024 tokens, 768
   generated per sequence by the transformers engine) and the learning job's `metrics.jsonl`
   (`perf/rollout_s`, `perf/old_logp_s`, `perf/update_s`, `perf/sync_s`, `perf/step_time_s`; tokens =
   `perf/tokens_per_s` x `perf/step_time_s`, generated tokens = `num_sequences` x `response/len_mean`;
   the first 10% of the steps, at least 2, left out as warm-up). The job's sequences are under 10
   tokens, so its rates show the per-call overheads of a tiny-sequence RL step, not the GPU's throughput.

Not covered: vLLM (optional on GPU; see `tests/rollout/test_vllm_gpu.py`), multi-GPU expert
parallelism (`tests/plan/test_plan_gpu.py`, `tests/learner` under torchrun).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_check_report import (MIN_REWARD_GAIN, NOISE_Z, PEAK_BF16_TFLOPS, _fmt,  # noqa: F401 (re-exported)
                                         bench_throughput, job_throughput, learner_mfu, learning_verdict,
                                         memory_rows, nondeterminism_reported, peak_bf16_tflops, render_markdown,
                                         resume_verdict, write_summary)
from benchmarks.gpu_check_job import (JOB_ENV, JOB_LR, KILL_AFTER, MODEL, RESUME_STEPS,  # noqa: F401 (re-exported)
                                      CheckFailed, _env, _finish, _job, _job_processes, _launch, _learning, _metrics,
                                      _resume, deterministic_job_setup, job_config, resume_headline)
from benchmarks.gpu_check_parity import _parity_on_cuda, check_parity  # noqa: F401 (re-exported)

GEOMETRIES = {
    "default": MODEL,
    "qwen3-30b-a3b-reduced": dict(MODEL, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                  moe_intermediate_size=768, num_hidden_layers=4, num_attention_heads=32,
                                  num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8),
}
"""`--mfu-geometry`: the MFU setting's models. `default` is `MODEL` (hidden 1024, 32 experts, top-4);
`qwen3-30b-a3b-reduced` has Qwen3-30B-A3B's layer shapes (hidden 2048, 128 experts, top-8, expert FFN 768,
32 query / 4 KV heads of 128, vocabulary 151,936) at `--mfu-layers` (default 4) of its 48 layers, so that the
model, its gradients and Adam state fit one GPU (4 layers: 3.11 B parameters, ~46 GiB of state at ~16 B each)."""
MFU_DEFAULTS = {"micro_batch": 4, "seq_len": 1024, "seqs": 32, "recompute": "off", "experts": "grouped",
                "geometry": "default", "layers": 4, "dispatcher": "allgather"}
"""The MFU setting's defaults (`--mfu-*`): micro-batches of 4 x 1024 = 4096 tokens, 32 sequences (2
mini-batches of 4 micro-batches), no recompute, the experts as one parameter per projection
(`model.expert_layout=grouped`, under Megatron's distributed optimizer, which leaves those weights where the
grouped GEMM views them without a copy: `moe_gspo/mcore/grouped_experts.py`), `MODEL`'s geometry
(`layers`: the depth of the reduced Qwen3-30B-A3B), and the token dispatcher training uses by default
(`parallel.token_dispatcher`, `allgather`)."""
MFU_EXPERTS = {"grouped": ("dist", ["--expert-layout", "grouped"], ("grouped_layout", "te_grouped")),
               "batched": ("nodist", ["--expert-layout", "per_expert", "--batched-experts"], ("grouped", "te_grouped")),
               "loop": ("dist", ["--expert-layout", "per_expert"], ("loop",))}
"""`--mfu-experts`: the bench variant (optimizer), its options, and the expert paths
(`memory_bench.expert_path`) it must build (Transformer Engine's grouped GEMM stands for ours where TE imports)."""


# ---------------------------------------------------------------------------------------- checks
def geometry_args(m: dict) -> list[str]:
    """`benchmarks.memory_bench`'s geometry options for the Qwen3-MoE config `m` (head_dim 128 and a dense
    FFN of 3 x hidden there, as in `MODEL` and Qwen3-30B-A3B)."""
    assert m["head_dim"] == 128 and m["intermediate_size"] == 3 * m["hidden_size"], m
    return ["--hidden", str(m["hidden_size"]), "--layers", str(m["num_hidden_layers"]), "--heads",
            str(m["num_attention_heads"]), "--kv-heads", str(m["num_key_value_heads"]), "--experts",
            str(m["num_experts"]), "--top-k", str(m["num_experts_per_tok"]), "--moe-intermediate",
            str(m["moe_intermediate_size"]), "--vocab", str(m["vocab_size"])]


def _bench(out: Path, name: str, *extra: str, timeout: float = 900) -> list[dict]:
    """Run `benchmarks.memory_bench` on `MODEL` with `extra` options (later geometry options win); its results
    (`DIR/<name>.json`, log `DIR/<name>.log`). It exits 1 when a phase is over its tolerance: the JSON decides,
    not the code."""
    cmd = [sys.executable, "-m", "benchmarks.memory_bench", *geometry_args(MODEL), *extra,
           "--json", str(out / f"{name}.json")]
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), timeout=timeout).returncode
    if not (out / f"{name}.json").is_file():
        raise CheckFailed(f"memory_bench exited {rc} without results; see {out / f'{name}.log'}")
    got = json.loads((out / f"{name}.json").read_text())
    if not got["results"]:
        raise CheckFailed(f"memory_bench exited {rc} without results: {got.get('failed')}; see {out / f'{name}.log'}")
    return got["results"]


def _memory(out: Path, have_te: bool) -> dict:
    """Check 2: planned vs measured memory per phase (16 x 1024 tokens, micro-batch 1, full recompute)."""
    from benchmarks.memory_bench import CHECKED

    results = _bench(out, "memory_bench", "--variants", "dist,dist_offload" if have_te else "dist",
                     "--seq-len", "1024", "--seqs", "16", "--group", "4", "--minibatches", "2", "--steps", "2",
                     "--tolerance", "0.15")
    rows = memory_rows(results, checked=CHECKED, tolerance=0.15)
    bad = [f"{r['variant']}/{r['phase']} {r['rel_diff']:+.1%}" for r in rows if r["ok"] is False]
    return {"status": "fail" if bad else "pass", "rows": rows, "variants": [r["variant"] for r in results],
            "setups": [{"variant": r["variant"], "micro_batch": r["batch"]["micro_batch_size"],
                        "optimizer": r.get("optimizer"), "experts": r.get("experts")} for r in results],
            "headline": ("over 15%: " + ", ".join(bad)) if bad else
            f"{sum(r['ok'] is True for r in rows)} checked phases within 15% of the plan"}


def mfu_geometry(geometry: str = "default", layers: int = 4) -> dict:
    """The Qwen3-MoE config of `--mfu-geometry` (`GEOMETRIES`; the reduced Qwen3-30B-A3B at `layers` layers)."""
    if geometry not in GEOMETRIES:
        raise ValueError(f"--mfu-geometry {geometry!r}: choose from {', '.join(GEOMETRIES)}")
    if geometry == "default":
        return dict(MODEL)
    if not 1 <= layers <= 48:
        raise ValueError(f"--mfu-layers {layers}: 1 to 48 (Qwen3-30B-A3B has 48; 4-8 fit one 80-141 GiB GPU)")
    return dict(GEOMETRIES[geometry], num_hidden_layers=layers)


def mfu_bench_args(micro_batch: int, seq_len: int, seqs: int, recompute: str, experts: str = "grouped",
                   geometry: str = "default", layers: int = 4, dispatcher: str = "allgather") -> list[str]:
    """`benchmarks.memory_bench` options of the MFU setting (check 3; no rollout; the experts and optimizer of
    `MFU_EXPERTS[experts]`: the grouped layout under the distributed optimizer by default; the model of
    `mfu_geometry(geometry, layers)`; the token dispatcher)."""
    if seqs % (2 * micro_batch):
        raise ValueError(f"--mfu-seqs {seqs} must be a multiple of 2 x --mfu-micro-batch ({2 * micro_batch}): "
                         "2 mini-batches of whole micro-batches")
    variant, expert_opts, _ = MFU_EXPERTS[experts]
    return ["--variants", variant, *expert_opts, "--no-rollout", "--seq-len", str(seq_len), "--seqs", str(seqs),
            "--group", "4",
            "--minibatches", "2", "--micro-batch", str(micro_batch), "--steps", "3", "--tolerance", "1e9",
            *(["--no-recompute"] if recompute == "off" else []), *geometry_args(mfu_geometry(geometry, layers)),
            "--token-dispatcher", dispatcher]


def check_expert_path(bench: dict, experts: str) -> dict:
    """The MFU bench's `experts` record (`memory_bench.expert_path`), checked against the setting's
    `--mfu-experts` (`MFU_EXPERTS`): `grouped` needs the grouped layout's modules in every MoE layer (or TE's
    with Transformer Engine) and every one of their forwards on the fast path (`counts`,
    `grouped_experts.expert_path_counts`: a layer that fell back to the loop names its cause), `batched` the
    per-expert layout's grouped GEMM, `loop` Megatron's loop; a CheckFailed of one line otherwise (an MFU of
    the wrong path)."""
    got = bench.get("experts") or {}
    want = MFU_EXPERTS[experts][2]
    if got.get("path") not in want:
        raise CheckFailed(f"--mfu-experts {experts}: the bench's model computes its experts by {got.get('path')!r} "
                          f"({got.get('line') or got}), not {' or '.join(want)}")
    counts = got.get("counts")
    if got.get("path") == "grouped_layout":
        if not counts or not counts.get("forwards"):
            raise CheckFailed(f"--mfu-experts {experts}: no grouped expert forward was counted ({counts}); the MFU "
                              "cannot be told to be the fast path's")
        if counts["slow_forwards"]:
            raise CheckFailed(f"--mfu-experts {experts}: not the fast path: {counts['slow_forwards']} of "
                              f"{counts['forwards']} grouped expert forwards, in {counts['slow_layers']} of "
                              f"{counts['layers']} MoE layers, took the loop over experts "
                              f"({'; '.join(counts['slow_because'])})")
    return got


def mfu_settings(setting: dict) -> list[dict]:
    """One MFU setting per micro-batch of `setting["micro_batches"]` (`--mfu-micro-batches`; default the
    single `micro_batch`), each a keyword set of `mfu_bench_args`."""
    base = {k: v for k, v in setting.items() if k not in ("micro_batches", "geometries")}
    return [dict(base, micro_batch=int(mb), **({"geometry": g} if g else {}))
            for g in (setting.get("geometries") or [None])
            for mb in (setting.get("micro_batches") or [setting["micro_batch"]])]


def _is_oom(error: Exception, log: Path) -> bool:
    text = str(error) + (log.read_text(errors="replace")[-20000:] if log.is_file() else "")
    return "out of memory" in text.lower() or "OutOfMemoryError" in text


def _mfu(out: Path, peak: float | None, setting: dict, progress=None) -> dict:
    """Check 3: the learner's MFU in the MFU setting (`--mfu-*`; with `--mfu-micro-batches` one bench per
    micro-batch, an out-of-memory one recorded as such), with a `torch.profiler` table of one more
    train_step of the first micro-batch (`DIR/train_step_profile.txt`). `progress(partial)`: called after
    each micro-batch with the check's result so far (the summary is rewritten)."""
    profile = out / "train_step_profile.txt"
    sweep, variants, first_res, experts = [], [], None, None
    for k, one in enumerate(mfu_settings(setting)):
        mb, geometry = one["micro_batch"], one.get("geometry", "default")
        tag = "" if geometry == "default" else f", {geometry} ({one.get('layers', 4)} layers)"
        name = "mfu_bench" if k == 0 else f"mfu_bench_{geometry}_mb{mb}" if tag else f"mfu_bench_mb{mb}"
        extra = ("--profile-train-step", str(profile)) if k == 0 else ()
        try:
            results = _bench(out, name, *mfu_bench_args(**one), *extra)
        except CheckFailed as e:
            oom = _is_oom(e, out / f"{name}.log")
            sweep.append({"micro_batch": mb, "geometry": geometry, "status": "oom" if oom else "fail",
                          "error": str(e)[:500], "tokens_per_micro_batch": mb * one["seq_len"]})
            if progress is not None and variants:
                progress(_mfu_result(variants, sweep, first_res, experts, profile))
            continue
        try:
            got = check_expert_path(results[0], one.get("experts", "grouped"))
        except CheckFailed as e:  # the bench ran, but not on the path asked: the check fails, in one line
            sweep.append({"micro_batch": mb, "geometry": geometry, "status": "slow_path", "error": str(e)[:500],
                          "tokens_per_micro_batch": mb * one["seq_len"]})
        else:
            m = dict(learner_mfu(results[0], peak), label=f"MFU setting, micro-batch {mb}{tag}",
                     micro_batch=results[0]["batch"]["micro_batch_size"], experts=got,
                     optimizer=results[0].get("optimizer"))
            variants.append(m)
            sweep.append({"micro_batch": mb, "geometry": geometry, "status": "ok", "update_mfu": m["update"]["mfu"],
                          "update_tflops_per_s": m["update"]["tflops_per_s"], "tokens_per_micro_batch":
                          mb * one["seq_len"]})
            if first_res is None:
                first_res, experts = results[0], got
        if progress is not None and variants:
            progress(_mfu_result(variants, sweep, first_res, experts, profile))
    slow = [r for r in sweep if r["status"] == "slow_path"]
    if slow:  # an MFU of the slow path is no MFU of the setting: fail, naming the cause
        raise CheckFailed(f"micro-batch {slow[0]['micro_batch']}: {slow[0]['error']}"
                          + (f" (and {len(slow) - 1} more benches)" if len(slow) > 1 else ""))
    if not variants:
        raise CheckFailed("no MFU setting finished: " + "; ".join(f"micro-batch {r['micro_batch']}: {r['status']} "
                                                                  f"({r['error'][:200]})" for r in sweep))
    return _mfu_result(variants, sweep, first_res, experts, profile)


def _mfu_result(variants: list[dict], sweep: list[dict], first_res: dict, experts: dict, profile: Path) -> dict:
    first = variants[0]
    oom = [r["micro_batch"] for r in sweep if r["status"] == "oom"]
    return {"status": "reported", "variants": list(variants), "setting": first["setting"], "sweep": list(sweep),
            "micro_batch": first_res["batch"]["micro_batch_size"], "experts": experts,
            "optimizer": first_res.get("optimizer"),
            "profile": profile.name if profile.is_file() else None,
            "memory_rows": [dict(r, variant=f"{r['variant']}, MFU setting")
                            for r in memory_rows([first_res], checked=(), tolerance=0.0)],
            "headline": f"{first['setting']}: update {_fmt(first['update']['mfu'], '.1%')} "
                        f"({first['update']['tflops_per_s']:.0f} TFLOP/s), log-prob pass "
                        f"{_fmt(first['logprobs']['mfu'], '.1%')} ({first['logprobs']['tflops_per_s']:.0f} TFLOP/s)"
                        + "".join(f"; micro-batch {v['micro_batch']}: update {_fmt(v['update']['mfu'], '.1%')}"
                                  for v in variants[1:])
                        + (f"; out of memory at micro-batch {', '.join(map(str, oom))}" if oom else "")}


def add_memory_setting_mfu(mfu: dict, out: Path, peak: float | None) -> None:
    """The memory check's setting's MFU beside the MFU setting's (for comparison), once `memory_bench.json`
    exists (the memory check runs after the MFU check)."""
    if mfu.get("status") != "reported" or not (out / "memory_bench.json").is_file():
        return
    memory = json.loads((out / "memory_bench.json").read_text())["results"]
    mfu["variants"] += [dict(learner_mfu(r, peak), label=f"memory-check setting ({r['variant']})",
                             micro_batch=r["batch"]["micro_batch_size"], experts=r.get("experts"),
                             optimizer=r.get("optimizer")) for r in memory]


def _throughput(out: Path) -> dict:
    """Tokens/s/GPU per phase (`gpu_check_report.bench_throughput` / `job_throughput`) of the runs that
    finished: the MFU setting's bench, the memory check's bench (which also generated), the learning job."""
    tables = []
    for name, label in (("mfu_bench", "MFU setting"), ("memory_bench", "memory-check setting")):
        if (out / f"{name}.json").is_file():
            bench = json.loads((out / f"{name}.json").read_text())["results"][0]
            tables.append(bench_throughput(bench, label=f"{label} ({bench['variant']})"))
    metrics = out / "runs" / "uninterrupted" / "metrics.jsonl"
    if metrics.is_file():
        rows = _metrics(metrics.parent)
        tables.append(job_throughput(rows, skip=max(2, len(rows) // 10)))
    if not tables:
        raise CheckFailed("no bench or job finished: nothing to measure")
    figures = [f"{r['phase']} {_fmt(r['tokens_per_s_per_gpu'], ',.0f')}" for r in tables[0]["rows"]]
    return {"status": "reported", "tables": tables,
            "headline": f"tokens/s/GPU, {tables[0]['source']}: " + ", ".join(figures)}


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("torch", "transformers", "megatron-core", "transformer-engine", "vllm", "wandb"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


CHECKS = ("mfu", "parity", "memory", "learning", "resume")
"""The checks `--checks` selects from, in the order they run (the MFU figure first: a call cut short by a
time limit still has it); `throughput` follows whenever a bench or the job ran."""


def parse_checks(text: str) -> list[str]:
    """`--checks`: comma-separated names of `CHECKS` (any subset, any order; run in `CHECKS`' order). A
    ValueError names the unknown ones, an empty list, or `resume` without `learning` (it compares its
    job with the learning check's run)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"--checks: unknown {', '.join(unknown)}; choose from {','.join(CHECKS)}")
    if not names:
        raise ValueError(f"--checks: name at least one of {','.join(CHECKS)}")
    if "resume" in names and "learning" not in names:
        raise ValueError("--checks: resume needs learning (it compares its killed-and-resumed job with the "
                         "learning check's uninterrupted run)")
    return [c for c in CHECKS if c in names]


def _run(out: Path, steps: int, peak_override: float | None, command: str, mfu_setting: dict | None = None,
         checks_to_run: list[str] | tuple[str, ...] = CHECKS) -> dict:
    import torch

    from moe_gspo.mcore.shims import have_transformer_engine

    t0 = time.time()
    name = torch.cuda.get_device_name(0)
    peak = peak_override or peak_bf16_tflops(name)
    have_te = have_transformer_engine()
    setting = mfu_setting or MFU_DEFAULTS
    todo = list(checks_to_run)
    if any(c in todo for c in ("mfu", "memory", "learning")):
        todo.append("throughput")
    result = {"status": "running", "command": command, "checks": {}, "pending": list(todo),
              "environment": {"device": name, "cuda": torch.version.cuda,
                              "gpu_mem_gib": torch.cuda.get_device_properties(0).total_memory / 2 ** 30,
                              "transformer_engine_importable": have_te, "peak_bf16_tflops": peak,
                              "versions": _versions()},
              "learner": {"mfu_setting": dict(setting), "expert_path_asked": setting.get("experts", "grouped")}}
    checks = result["checks"]
    write_summary(result, out)  # at once: a call cut short still leaves a summary of what finished

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
        if name in result["pending"]:
            result["pending"].remove(name)
        result["wall_s"] = time.time() - t0
        write_summary(result, out)

    def mfu_progress(partial: dict) -> None:
        checks["mfu"] = dict(partial, status="running")
        result["wall_s"] = time.time() - t0
        write_summary(result, out)

    run = {"mfu": lambda: _mfu(out, peak, setting, progress=mfu_progress),
           "parity": _parity_on_cuda,
           "memory": lambda: _memory(out, have_te),
           "learning": lambda: _learning(out, steps),
           "resume": lambda: _resume(out),
           "throughput": lambda: _throughput(out)}
    for check in todo:
        record(check, run[check])
        if check == "memory" and "mfu" in checks:
            add_memory_setting_mfu(checks["mfu"], out, peak)
            write_summary(result, out)
    statuses = [c.get("status") for c in checks.values()]
    result["status"] = "fail" if "fail" in statuses else "pass"
    result["wall_s"] = time.time() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["job"]:
        return _job(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--out", required=True, help="directory for gpu_check.json, gpu_check.md and the run logs")
    p.add_argument("--checks", default=",".join(CHECKS),
                   help=f"comma-separated checks to run, any subset of {','.join(CHECKS)} (default all; they run in "
                        "that order, the MFU figure first; resume needs learning; the throughput table follows "
                        "when mfu, memory or learning ran). The summary is rewritten after each check (and after "
                        "each MFU micro-batch), so a call cut short keeps what finished")
    p.add_argument("--steps", type=int, default=60,
                   help=f"RL steps of the learning job (default 60; at least {RESUME_STEPS})")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's dense bf16 peak in TFLOP/s, for MFU (default: from the device name)")
    d = MFU_DEFAULTS
    p.add_argument("--mfu-micro-batch", type=int, default=d["micro_batch"],
                   help=f"MFU setting: sequences per forward/backward (default {d['micro_batch']})")
    p.add_argument("--mfu-micro-batches", default=None, metavar="MB[,MB...]",
                   help="MFU setting: sweep these micro-batches (e.g. 4,8,16: micro-batches of MB x --mfu-seq-len "
                        "tokens), one bench each; one that runs out of GPU memory is recorded as such and the "
                        "others still run (default: --mfu-micro-batch alone)")
    p.add_argument("--mfu-seq-len", type=int, default=d["seq_len"],
                   help=f"MFU setting: tokens per sequence (default {d['seq_len']}: micro-batches of "
                        f"{d['micro_batch'] * d['seq_len']} tokens)")
    p.add_argument("--mfu-seqs", type=int, default=d["seqs"],
                   help=f"MFU setting: sequences per RL step, 2 mini-batches (default {d['seqs']}; a multiple of "
                        "2 x --mfu-micro-batch)")
    p.add_argument("--mfu-recompute", choices=("off", "full"), default=d["recompute"],
                   help=f"MFU setting: activation recomputation (default {d['recompute']})")
    p.add_argument("--mfu-experts", choices=tuple(MFU_EXPERTS), default=d["experts"],
                   help=f"MFU setting: grouped = one weight per projection, grouped GEMMs (model.expert_layout="
                        f"grouped, distributed optimizer); batched = per-expert weights, grouped GEMMs "
                        f"(model.batched_experts, non-distributed optimizer); loop = Megatron's loop over experts "
                        f"(distributed optimizer) (default {d['experts']})")
    p.add_argument("--mfu-geometry", default=d["geometry"], metavar="NAME[,NAME]",
                   help=f"MFU setting: the model(s), one bench per geometry and micro-batch: {', '.join(GEOMETRIES)} "
                        "(default: default = the checks' random model, hidden 1024, 12 layers, 32 experts, top-4; "
                        "qwen3-30b-a3b-reduced = Qwen3-30B-A3B's layer shapes: hidden 2048, 128 experts, top-8, "
                        "expert FFN 768, 32 query / 4 KV heads of 128, vocabulary 151,936, at --mfu-layers layers); "
                        "model FLOPs by moe_gspo/plan/flops.py")
    p.add_argument("--mfu-layers", type=int, default=d["layers"],
                   help=f"MFU setting: layers of qwen3-30b-a3b-reduced (default {d['layers']}; 4-8 fit one GPU)")
    p.add_argument("--mfu-dispatcher", choices=("allgather", "alltoall"), default=d["dispatcher"],
                   help=f"MFU setting: Megatron's token dispatcher (default {d['dispatcher']}, training's default "
                        "parallel.token_dispatcher; the summary names it)")
    args = p.parse_args(argv)
    mfu_setting = {"micro_batch": args.mfu_micro_batch, "seq_len": args.mfu_seq_len, "seqs": args.mfu_seqs,
                   "recompute": args.mfu_recompute, "experts": args.mfu_experts, "layers": args.mfu_layers,
                   "dispatcher": args.mfu_dispatcher}
    try:
        geometries = [g.strip() for g in args.mfu_geometry.split(",") if g.strip()]
        if not geometries:
            raise ValueError("--mfu-geometry: name at least one of " + ", ".join(GEOMETRIES))
        mfu_setting["geometry"] = geometries[0]
        if len(geometries) > 1:
            mfu_setting["geometries"] = geometries
        checks_to_run = parse_checks(args.checks)
        if args.mfu_micro_batches is not None:
            mbs = [m.strip() for m in args.mfu_micro_batches.split(",") if m.strip()]
            if not mbs or not all(m.isdigit() and int(m) > 0 for m in mbs):
                raise ValueError(f"--mfu-micro-batches {args.mfu_micro_batches!r}: positive integers, comma-separated")
            mfu_setting["micro_batches"] = [int(m) for m in mbs]
            mfu_setting["micro_batch"] = mfu_setting["micro_batches"][0]
        for one in mfu_settings(mfu_setting):
            mfu_bench_args(**one)
    except ValueError as e:
        p.error(str(e))
    import torch

    if not torch.cuda.is_available():
        print("error: benchmarks.gpu_check needs CUDA (torch.cuda.is_available() is False here); run it on "
              "the GPU machine", file=sys.stderr)
        return 2
    if "resume" in checks_to_run and args.steps < RESUME_STEPS:
        print(f"error: --steps {args.steps}: at least {RESUME_STEPS} (the resume check compares its "
              f"{RESUME_STEPS}-step job with the learning job's first {RESUME_STEPS} steps)", file=sys.stderr)
        return 2
    out = Path(args.out)
    result = _run(out, args.steps, args.peak_tflops, "python -m benchmarks.gpu_check " + " ".join(argv), mfu_setting,
                  checks_to_run)
    jpath, mpath = write_summary(result, out)
    print(f"[gpu_check] {result['status'].upper()} in {result['wall_s']:.0f} s: {mpath} (details: {jpath})", flush=True)
    return 0 if result["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
