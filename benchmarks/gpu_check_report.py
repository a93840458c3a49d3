"""The pure pieces of `benchmarks.gpu_check`: peak FLOP/s by device name, MFU and throughput arithmetic, the
verdicts of the memory, learning and resume checks, and the summary files (`gpu_check.json`, `gpu_check.md`).

No CUDA here: everything is unit-tested on CPU (tests/benchmarks/test_gpu_check.py) with hand-computed
values. See `benchmarks.gpu_check`'s docstring for what the checks do and why.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.4), ("H100", 989.4),
                    ("H200", 989.4), ("H800", 989.4), ("H20", 148.0), ("B200", 2250.0), ("A100", 312.0),
                    ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0))
"""Dense bf16 tensor-core peak (vendor data sheets, no sparsity) by device-name substring, first match."""
MIN_REWARD_GAIN = 0.3
"""Learning check: the last window's mean reward must exceed the first window's by this much (absolute)..."""
NOISE_Z = 4.0
"""...and by this many standard errors of the difference of the two window means (from the per-step rewards)."""
MIN_WINDOW = 5
"""Learning check windows: the first and the last 10% of the steps, at least this many steps each."""
THROUGHPUT_PHASES = (("generation", "rollout", "rollout"), ("old-policy pass", "old_logp", "logprobs"),
                     ("training", "update", "update"), ("weight sync", "sync", "weight_sync"))
"""(table row, the job's `perf/<phase>_s` phase, `benchmarks.memory_bench`'s phase) of the throughput table."""


# ---------------------------------------------------------------------------------------- MFU
def peak_bf16_tflops(device_name: str) -> float | None:
    """The device's dense bf16 peak in TFLOP/s, or None when it is not in `PEAK_BF16_TFLOPS`."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def bench_setting(bench: dict) -> str:
    """A `memory_bench` result's learner setting in words: sequences, micro-batch, recompute."""
    b = bench["batch"]
    mb = b.get("micro_batch_size") or b["num_seqs"] // b.get("num_minibatches", 1)
    rec = b.get("recompute", True)
    words = (f"{b['num_seqs']} x {b['seq_len']} tokens, micro-batch {mb} x {b['seq_len']} = {mb * b['seq_len']} "
             f"tokens, recompute {'full' if rec else 'off'}")
    if "token_dispatcher" in bench:  # the model and the dispatcher (issue 61: the bench's, named)
        from transformers import Qwen3MoeConfig

        from moe_gspo.plan.params import Geometry

        g = Geometry.from_hf(Qwen3MoeConfig.from_dict(bench["hf_config"]))
        words += (f"; hidden {g.hidden}, {g.num_layers} layers, {g.num_experts} experts top-{g.top_k}, expert FFN "
                  f"{g.moe_intermediate}, vocabulary {g.vocab_size:,}; {bench['token_dispatcher']} dispatcher")
    return words


def learner_mfu(bench: dict, peak_tflops: float | None) -> dict:
    """MFU of the update and the log-prob pass of one `memory_bench` result, from their fastest repeat
    (model FLOPs of `moe_gspo.plan.flops`; recomputed forwards are not counted)."""
    from transformers import Qwen3MoeConfig

    from moe_gspo.plan.flops import forward_flops, mfu, train_flops
    from moe_gspo.plan.params import Geometry

    geom = Geometry.from_hf(Qwen3MoeConfig.from_dict(bench["hf_config"]))
    b = bench["batch"]
    lens = [b["seq_len"]] * b["num_seqs"]
    out = {"variant": bench["variant"], "setting": bench_setting(bench), "tokens": sum(lens),
           "peak_bf16_tflops": peak_tflops}
    for phase, flops in (("update", train_flops(geom, lens)), ("logprobs", forward_flops(geom, lens))):
        seconds = min(bench["phases"][phase]["seconds"])
        out[phase] = {"model_tflop": round(flops / 1e12, 3), "seconds": round(seconds, 4),
                      "tflops_per_s": round(flops / seconds / 1e12, 2),
                      "mfu": None if not peak_tflops else round(mfu(flops, seconds, peak_tflops * 1e12), 4)}
    return out


# ---------------------------------------------------------------------------------------- throughput
def _row(phase: str, tokens: float, seconds: float, num_gpus: int) -> dict:
    return {"phase": phase, "tokens": round(tokens), "seconds": round(seconds, 4),
            "tokens_per_s_per_gpu": round(tokens / seconds / num_gpus, 1) if seconds > 0 else None}


def job_throughput(rows: list[dict], *, skip: int, num_gpus: int = 1) -> dict:
    """Tokens/s/GPU per phase of a `moe_gspo.train` run from its `metrics.jsonl` rows after the first `skip`
    (warm-up), NeMo-RL's definition: the tokens a stage processes / (its seconds x GPUs), as a ratio of sums
    over the steps. A step's tokens are its batch's prompt + response tokens, `perf/tokens_per_s` x
    `perf/step_time_s`; a phase's seconds are `perf/<phase>_s`; "generation, generated tokens" counts the
    response tokens only (`num_sequences` x `response/len_mean`). `tokens` and `seconds` in the rows are
    means per step."""
    rows = rows[skip:]
    if not rows:
        raise ValueError(f"no steps left after skipping {skip}")
    n = len(rows)
    tokens = sum(r["perf/tokens_per_s"] * r["perf/step_time_s"] for r in rows)
    out = []
    for name, key, _ in THROUGHPUT_PHASES:
        secs = sum(r.get(f"perf/{key}_s", 0.0) for r in rows)
        out.append(_row(name, tokens / n, secs / n, num_gpus))
        if key == "rollout":
            gen = sum(r["num_sequences"] * r["response/len_mean"] for r in rows)
            out.append(_row("generation, generated tokens", gen / n, secs / n, num_gpus))
    out.append(_row("RL step (end to end)", tokens / n, sum(r["perf/step_time_s"] for r in rows) / n, num_gpus))
    first, last = rows[0].get("step", skip), rows[-1].get("step", skip + n - 1)
    return {"source": "learning job", "setting": f"mean of steps {first}-{last} (the first {skip} left out)",
            "num_steps": n, "num_gpus": num_gpus, "rows": out}


def bench_throughput(bench: dict, *, label: str | None = None, num_gpus: int = 1) -> dict:
    """Tokens/s/GPU per phase of one `memory_bench` result (definition of `job_throughput`): tokens =
    the batch's `num_seqs` x `seq_len`, seconds = the phase's fastest repeat (the rollout runs once, on
    the first step); "generation, generated tokens" counts `rollout_tokens` (the responses the engine
    returned). Phases the bench did not run are left out."""
    b, phases = bench["batch"], bench["phases"]
    tokens = b["num_seqs"] * b["seq_len"]
    out = []
    for name, _, key in THROUGHPUT_PHASES:
        secs = phases.get(key, {}).get("seconds")
        if not secs:
            continue
        out.append(_row(name, tokens, min(secs), num_gpus))
        if key == "rollout" and b.get("rollout_tokens"):
            out.append(_row("generation, generated tokens", b["rollout_tokens"], min(secs), num_gpus))
    return {"source": label or f"bench ({bench['variant']})", "setting": bench_setting(bench), "num_gpus": num_gpus,
            "rows": out}


# ---------------------------------------------------------------------------------------- verdicts
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
    """Compare the killed-and-resumed run's metrics rows with the uninterrupted run's: rows before
    `resumed_at` (the first segment) test determinism, rows from it on the resume."""
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


NONDETERMINISM = (re.compile(r"(\S+) does not have a deterministic implementation"),
                  re.compile(r"([A-Z][\w ]*?) defaults to a non-deterministic algorithm"))
"""torch's warnings under `use_deterministic_algorithms(True, warn_only=True)` (an op without a deterministic
kernel; flash / memory-efficient attention's backward)."""


def nondeterminism_reported(log_text: str) -> list[str]:
    """The ops a job's log says ran non-deterministically (torch's warnings), each once, in order."""
    found: list[str] = []
    for pattern in NONDETERMINISM:
        for m in pattern.finditer(log_text):
            if m.group(1) not in found:
                found.append(m.group(1))
    return found


def _mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def learning_verdict(rewards: list[float], *, min_gain: float = MIN_REWARD_GAIN, z: float = NOISE_Z,
                     min_window: int = MIN_WINDOW) -> dict:
    """The per-step mean rewards of the job (`reward/mean`) -> pass when the last window's mean exceeds the
    first window's by `min_gain` (absolute) AND by `z` standard errors of the difference of the two means
    (each window's SE = its per-step rewards' sample std / sqrt(steps); combined in quadrature). Windows:
    the first and last 10% of the steps, at least `min_window` steps each and at most half the run."""
    n = len(rewards)
    k = min(max(min_window, n // 10), n // 2)
    if k < 2:
        return {"status": "fail", "num_steps": n, "error": f"{n} steps: too few for two windows of 2 steps"}
    first_mean, first_se = _mean_se(rewards[:k])
    last_mean, last_se = _mean_se(rewards[-k:])
    gain, se = last_mean - first_mean, math.hypot(first_se, last_se)
    noise_bound = z * se
    ok = gain >= min_gain and gain > noise_bound
    return {"status": "pass" if ok else "fail", "num_steps": n, "window_steps": k,
            "reward_first": round(first_mean, 4), "reward_last": round(last_mean, 4), "gain": round(gain, 4),
            "min_gain": min_gain, "gain_se": round(se, 4), "noise_bound": round(noise_bound, 4), "z": z,
            "margin": round(gain - max(min_gain, noise_bound), 4)}


# ---------------------------------------------------------------------------------------- summary files
def _fmt(v, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def throughput_lines(tables: list[dict]) -> list[str]:
    """The Markdown of the throughput tables (one block; empty when there are none)."""
    if not tables:
        return []
    lines = ["", "## Throughput per phase (tokens/s/GPU)", "",
             "NeMo-RL's definition: the tokens a phase processes (the step's prompt + response tokens) / its "
             "seconds / GPUs; \"generated tokens\" counts responses only.", "",
             "| source | phase | tokens per step | seconds per step | tokens/s/GPU |", "|---|---|---|---|---|"]
    for t in tables:
        for r in t["rows"]:
            lines.append(f"| {t['source']} | {r['phase']} | {r['tokens']} | {r['seconds']:.3f} | "
                         f"{_fmt(r['tokens_per_s_per_gpu'], ',.0f')} |")
    lines += [""] + [f"- {t['source']}: {t['setting']}" for t in tables if t.get("setting")]
    return lines


def _optimizer_words(opt: dict | None) -> str:
    if not opt:
        return "?"
    words = "distributed" if opt.get("distributed") else "non-distributed"
    extras = [w for w, k in (("precision-aware", "precision_aware"), ("CPU offload", "cpu_offload")) if opt.get(k)]
    return words + (f" ({', '.join(extras)})" if extras else "")


def _experts_words(experts: dict | None) -> str:
    if not experts:
        return "?"
    path = experts.get("path", "?")
    count = experts.get(f"{path}_modules")
    words = {"grouped": "grouped GEMM (model.batched_experts)", "te_grouped": "Transformer Engine grouped GEMM",
             "grouped_layout": "one weight per projection, grouped GEMM (model.expert_layout=grouped)",
             "loop": "Megatron's loop over experts"}.get(path, path)
    copies, counts = experts.get("weight_copies"), experts.get("counts") or {}
    return words + (f", {count} MoE layers" if count is not None else "") + \
        (f", {copies} weight copies" if copies else "") + \
        (f", {counts['slow_forwards']} of {counts['forwards']} forwards off the fast path" if counts else "") + \
        (f" [{experts['line']}]" if experts.get("line") else "")


def setup_lines(mfu: dict, mem: dict) -> list[str]:
    """The learner setups the benches ran: micro-batch, optimizer (distributed or not) and expert path."""
    rows = [(v.get("label", v.get("variant")), v.get("micro_batch"), v.get("optimizer"), v.get("experts"))
            for v in mfu.get("variants", [])]
    labels = {r[0] for r in rows}
    rows += [(f"memory-check setting ({s['variant']})", s.get("micro_batch"), s.get("optimizer"), s.get("experts"))
             for s in mem.get("setups", []) if f"memory-check setting ({s['variant']})" not in labels]
    if not rows:
        return []
    out = ["", "## Learner setups", "", "| bench | micro-batch | optimizer | experts |", "|---|---|---|---|"]
    out += [f"| {label} | {_fmt(mb, 'd')} | {_optimizer_words(opt)} | {_experts_words(ex)} |"
            for label, mb, opt, ex in rows]
    return out


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
    for name in result.get("pending", []):
        if name not in checks:
            lines.append(f"| {name} | not run yet | |")
    mem, mfu = checks.get("memory", {}), checks.get("mfu", {})
    lines += setup_lines(mfu, mem)
    if mfu.get("sweep"):
        lines += ["", "## MFU setting per micro-batch", "", "| micro-batch | tokens per micro-batch | status | "
                  "update MFU | update TFLOP/s |", "|---|---|---|---|---|"]
        for r in mfu["sweep"]:
            lines.append(f"| {r['micro_batch']} | {_fmt(r.get('tokens_per_micro_batch'), ',')} | {r['status']} | "
                         f"{_fmt(r.get('update_mfu'), '.1%')} | {_fmt(r.get('update_tflops_per_s'), '.1f')} |")
    mem_rows = mem.get("rows", []) + mfu.get("memory_rows", [])  # the MFU setting's rows: reported only
    if mem_rows:
        lines += ["", "## Memory per phase: planned (`moe_gspo.plan`) vs `torch.cuda.max_memory_allocated`", "",
                  "| variant | phase | planned GiB | measured GiB | planned/measured - 1 | checked |",
                  "|---|---|---|---|---|---|"]
        for r in mem_rows:
            ok = {True: "ok", False: "OVER TOLERANCE", None: "reported"}[r["ok"]]
            lines.append(f"| {r['variant']} | {r['phase']} | {_fmt(r['planned_gib'], '.2f')} | "
                         f"{_fmt(r['measured_gib'], '.2f')} | {_fmt(r['rel_diff'], '+.1%')} | {ok} |")
    for m in mfu.get("variants", []):
        setting = f"{m['setting']}; " if m.get("setting") else ""
        lines += ["", f"## Learner MFU: {m.get('label', m['variant'])} ({setting}{m['tokens']} tokens per step, "
                      f"peak {_fmt(m['peak_bf16_tflops'], '.1f')} TFLOP/s bf16)", "",
                  "| pass | model TFLOP | seconds | TFLOP/s | MFU |", "|---|---|---|---|---|"]
        for phase in ("update", "logprobs"):
            p = m[phase]
            lines.append(f"| {phase} | {p['model_tflop']:.2f} | {p['seconds']:.3f} | {p['tflops_per_s']:.1f} | "
                         f"{_fmt(p['mfu'], '.1%')} |")
    if mfu.get("profile"):
        lines += ["", f"`torch.profiler` summary of one `train_step` in the MFU setting ({mfu.get('setting', '')}): "
                      f"[{mfu['profile']}]({mfu['profile']}), beside this file."]
    lines += throughput_lines(checks.get("throughput", {}).get("tables", []))
    lines += ["", "Model FLOPs: PaLM's 6 N_active + 12 L a d T per token (moe_gspo/plan/flops.py); "
                  "details of every check in gpu_check.json."]
    return "\n".join(lines) + "\n"


def write_summary(result: dict, out_dir: Path) -> tuple[Path, Path]:
    """`gpu_check.json` and `gpu_check.md` in `out_dir` (each written atomically)."""
    from moe_gspo.files import atomic_write_text

    out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out_dir / "gpu_check.json", out_dir / "gpu_check.md"
    atomic_write_text(jpath, json.dumps(result, indent=1, default=str))
    atomic_write_text(mpath, render_markdown(result))
    return jpath, mpath
