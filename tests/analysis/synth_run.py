"""Synthetic run directories (metrics.jsonl + traces per notes/run_dir_schema.md, run.json, eval.jsonl,
samples.jsonl) and probe JSON, for the analysis tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np

NUM_STEPS = 12
NUM_LAYERS = 2
NUM_EXPERTS = 8
TOP_K = 2
TRACE_STEPS = (5, 10)
RUN_INFO = {"learner_dtype": "float32", "device": "cpu", "world_size": 2}
EVAL_STEPS = (0, 6, 12)
"""Policy steps evaluated (0 = the initial policy, 12 = train.steps: only in eval.jsonl)."""
SAMPLE_STEPS = (1, 7, 12)


def eval_record(v: int) -> dict:
    """The eval.jsonl record of the policy after v updates (hand-checkable values: they grow with v)."""
    return {"step": v, "eval/reward_mean": 0.25 + v / 48, "eval/accuracy": v / 24, "eval/pass_at_k": 0.5 + v / 48,
            "eval/k": 4, "eval/response_len_mean": 10.0 + v, "eval/num_prompts": 32, "eval/policy_step": v}


def sample_records(step: int) -> list[dict]:
    """4 samples.jsonl records of one step; the second has a response token flipped in 2 layers."""
    out = []
    for i in range(4):
        tokens = ["1", "2", "3", "<eos>"] if i != 3 else ["9"] * 3
        flips = [0, 2, 0, 0] if i == 1 else [0] * len(tokens)
        out.append({"step": step, "prompt": f"copy 123 #{i}", "answer": "123", "response": "".join(tokens),
                    "reward": [1.0, 0.5, 0.75, 0.0][i], "advantage": [0.6, -0.2, 0.3, -1.0][i],
                    "finish_reason": "stop" if i != 3 else "length", "response_tokens": tokens,
                    "routing_flips": flips if step != SAMPLE_STEPS[0] else None})
    return out


def _load_LE(rng: np.random.Generator) -> list[list[float]]:
    w = rng.dirichlet(np.ones(NUM_EXPERTS), size=NUM_LAYERS)
    return w.round(5).tolist()


def synthetic_record(step: int, rng: np.random.Generator) -> dict:
    """One metrics.jsonl record with every key of the schema, plausible values."""
    progress = step / NUM_STEPS
    token_var = float(rng.uniform(1e-4, 1e-3))
    return {
        "step": step,
        "reward/mean": 0.2 + 0.5 * progress + float(rng.normal(0, 0.02)),
        "reward/std": float(rng.uniform(0.1, 0.3)),
        "reward/max": 1.0,
        "response/len_mean": float(rng.uniform(5, 12)),
        "response/len_max": 16.0,
        "response/stop_frac": float(rng.uniform(0.3, 0.9)),
        "actor/entropy": 2.0 * (1.0 - progress) + float(rng.uniform(0.0, 0.1)),
        "reward/frac_zero_std": float(rng.uniform(0.0, 0.5)),
        "advantage/nonzero_frac": float(rng.uniform(0.5, 1.0)),
        "loss/policy": float(rng.normal(0, 0.1)),
        "loss/kl": 0.0,
        "loss/total": float(rng.normal(0, 0.1)),
        "clip/token_frac_low": float(rng.uniform(0, 0.05)),
        "clip/token_frac_high": float(rng.uniform(0, 0.05)),
        "clip/token_frac": float(rng.uniform(0, 0.1)),
        "clip/seq_frac": float(rng.uniform(0, 0.1)),
        "clip/out_of_range_frac": float(rng.uniform(0.1, 0.2)),
        "clip/out_of_range_frac_low": float(rng.uniform(0, 0.1)),
        "clip/out_of_range_frac_high": float(rng.uniform(0, 0.1)),
        "ratio/token_mean": 1.0,
        "ratio/token_var": token_var,
        "ratio/seq_mean": 1.0,
        "ratio/seq_var": token_var / float(rng.uniform(5, 20)),
        "ratio/seq_prod_logvar": float(rng.uniform(1e-3, 1e-2)),
        "ratio/chi2_token": token_var,
        "ratio/chi2_seq": float(rng.uniform(1e-3, 1e-2)),
        "mismatch/k1_kl": float(rng.normal(1e-3, 3e-4)),
        "mismatch/k3_kl": float(rng.uniform(5e-4, 2e-3)),
        "mismatch/logp_abs_diff_mean": float(rng.uniform(0.01, 0.05)),
        "mismatch/logp_abs_diff_max": float(rng.uniform(0.5, 2.0)),
        "mismatch/extreme_frac_ln2": float(rng.uniform(0, 0.01)),
        "mismatch/extreme_frac_ln5": float(rng.uniform(0, 0.001)),
        "mismatch/ppl_ratio_mean": float(rng.uniform(0.99, 1.01)),
        "mismatch_replayed/k3_kl": float(rng.uniform(2e-4, 8e-4)),
        "mismatch_replayed/extreme_frac_ln2": float(rng.uniform(0, 0.005)),
        "mismatch_ratio/token_var": float(rng.uniform(1e-3, 1e-2)),
        "mismatch_ratio/seq_var": float(rng.uniform(1e-4, 1e-3)),
        "mismatch_ratio/seq_prod_logvar": float(rng.uniform(1e-2, 1e-1)),
        "mismatch_ratio/token_var_flipped": float(rng.uniform(1e-2, 5e-2)),
        "mismatch_ratio/token_var_agreed": float(rng.uniform(1e-4, 1e-3)),
        "mismatch_ratio/token_var_share_flipped": (share := float(rng.uniform(0.2, 0.6))),
        "mismatch_ratio/token_var_share_agreed": 1.0 - share,
        "mismatch_ratio/flipped_token_frac": float(rng.uniform(0.02, 0.08)),
        "rollout_corr/is_raw_mean": float(rng.uniform(0.99, 1.01)),
        "rollout_corr/is_raw_max": float(rng.uniform(1.5, 3.0)),
        "rollout_corr/is_weight_mean": float(rng.uniform(0.99, 1.0)),
        "rollout_corr/is_truncated_frac": float(rng.uniform(0, 0.01)),
        "rollout_corr/is_ess": float(rng.uniform(0.95, 1.0)),
        "routing/layer_disagree": rng.uniform(0.01, 0.05, NUM_LAYERS).tolist(),
        "routing/any_layer_flip": float(rng.uniform(0.02, 0.08)),
        "routing/mean_layers_differing": float(rng.uniform(0.02, 0.1)),
        "routing/topk_overlap": float(rng.uniform(0.95, 0.99)),
        "routing/jaccard": float(rng.uniform(0.93, 0.99)),
        "routing/expert_load_rollout": _load_LE(rng),
        "routing/expert_load_learner": _load_LE(rng),
        "update/layer_change": rng.uniform(0.05, 0.15, NUM_LAYERS).tolist(),
        "update/any_layer_change": float(rng.uniform(0.1, 0.25)),
        "update/expert_change_frac": float(rng.uniform(0.05, 0.15)),
        "update_all_minibatches/expert_change_frac": float(rng.uniform(0.15, 0.3)),
        "grad/norm": float(rng.uniform(0.1, 1.0)),
        "train/skipped_steps": 0,
        "train/lr": 1e-5,
        "perf/step_time_s": float(rng.uniform(1, 2)),
        "perf/tokens_per_s": float(rng.uniform(100, 200)),
        "perf/rollout_s": float(rng.uniform(0.3, 0.6)),
        "perf/learner_s": float(rng.uniform(0.5, 1.0)),
    }


def _write_trace(path: Path, rng: np.random.Generator, prompt_lens, response_lens) -> None:
    total = prompt_lens + response_lens - 1
    seq_offsets = np.concatenate([[0], np.cumsum(total)]).astype(np.int64)
    num_tokens = int(seq_offsets[-1])
    topk = np.stack([np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False)
                               for _ in range(NUM_LAYERS)]) for _ in range(num_tokens)])
    np.savez(path, topk_ids=topk.astype(np.uint8),
             router_probs=rng.uniform(0, 1, topk.shape).astype(np.float16),
             seq_offsets=seq_offsets, prompt_lens=prompt_lens.astype(np.int32),
             response_lens=response_lens.astype(np.int32), num_experts=np.int64(NUM_EXPERTS),
             layer_ids=np.asarray([1, 2], np.int32), meta=np.asarray(json.dumps({"engine": "hf"})),
             format_version=np.int64(1))


def write_synthetic_run(run_dir: Path, seed: int = 0, with_traces: bool = True,
                        num_ranks: int = 1, with_extras: bool = True) -> Path:
    """A run dir with config.yaml, metrics.jsonl (NUM_STEPS steps), done.json, and traces at
    TRACE_STEPS (per-rank `_rank{r}` files, as a multi-process run writes, when num_ranks > 1); with
    `with_extras` also run.json (RUN_INFO), eval.jsonl (EVAL_STEPS; their eval/* keys also on the
    metrics rows of the steps < NUM_STEPS, as the training logs them) and samples.jsonl (SAMPLE_STEPS)."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("algo:\n  name: gspo\n  routing_replay: none\n"
                                         "train:\n  steps: 12\n  seed: 0\n")
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, NUM_STEPS + 1):
            rec = synthetic_record(step, rng)
            if with_extras and step in EVAL_STEPS:
                rec.update({k: v for k, v in eval_record(step).items() if k != "step"})
            f.write(json.dumps(rec) + "\n")
    if with_extras:
        (run_dir / "run.json").write_text(json.dumps(RUN_INFO))
        (run_dir / "eval.jsonl").write_text("".join(json.dumps(eval_record(v)) + "\n" for v in EVAL_STEPS))
        (run_dir / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for step in SAMPLE_STEPS
                                                       for r in sample_records(step)))
    if with_traces:
        traces = run_dir / "traces"
        traces.mkdir()
        for step in TRACE_STEPS:
            for rank in range(num_ranks):
                sfx = "" if num_ranks == 1 else f"_rank{rank}"
                n = 24
                prompt_lens = rng.integers(3, 6, n)
                response_lens = rng.integers(1, 17, n)
                for kind in ("rollout", "learner", "updated"):
                    _write_trace(traces / f"step_{step:06d}_{kind}{sfx}.npz", rng, prompt_lens,
                                 response_lens)
                total_r = int(response_lens.sum())
                rollout = rng.uniform(-3, -0.1, total_r).astype(np.float32)
                learner = (rollout + rng.normal(0, 0.05, total_r)).astype(np.float32)
                np.savez(traces / f"step_{step:06d}_logprobs{sfx}.npz", rollout_logp=rollout,
                         learner_logp=learner, response_lens=response_lens.astype(np.int32),
                         rewards=rng.uniform(0, 1, n).astype(np.float32))
    (run_dir / "done.json").write_text(json.dumps({"step": NUM_STEPS, "wall_s": 12.5, "summary": {}}))
    return run_dir


def synthetic_probe(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "model": "tiny", "engine": "hf", "dtype": "bfloat16", "num_tokens": 1234, "num_sequences": 64,
        "routing/layer_disagree": [0.02, 0.03], "routing/any_layer_flip": 0.045,
        "routing/mean_layers_differing": 0.05, "routing/topk_overlap": 0.98,
        "routing/expert_load_rollout": _load_LE(rng), "routing/expert_load_learner": _load_LE(rng),
        "mismatch/k1_kl": 1e-3, "mismatch/k3_kl": 9e-4, "mismatch/logp_abs_diff_mean": 0.02,
        "mismatch/logp_abs_diff_max": 0.9, "mismatch/extreme_frac_ln2": 0.004,
        "mismatch/extreme_frac_ln5": 0.0002, "mismatch/ppl_ratio_mean": 1.001,
        "mismatch_ratio/token_var": 2e-3, "mismatch_ratio/seq_var": 2e-4, "mismatch_ratio/seq_prod_logvar": 0.03,
        "mismatch_ratio/token_var_flipped": 3e-2, "mismatch_ratio/token_var_agreed": 5e-4, "layer_ids": [1, 2],
        "mismatch_ratio/token_var_share_flipped": 0.4, "mismatch_ratio/token_var_share_agreed": 0.6,
        "mismatch_ratio/flipped_token_frac": 0.05, "routing_prompt/any_layer_flip": 0.03,
        # the divergence localiser (probe --localize); layer 0 dense
        "localize/engine": "hf", "localize/tol": 1e-2, "localize/layer_ids": [0, 1, 2],
        "localize/rel_err": {"attn_out": [6e-3, 5e-3, 7e-3], "hidden_after_attn": [6e-3, 7e-3, 9e-3],
                             "router_logits": [None, 6e-3, 9e-3], "topk_ids": [None, 2e-3, 7e-3],
                             "mlp_out": [8e-3, 0.28, 0.42], "hidden_after_mlp": [0.0, 1e-2, 1.3e-2]},
        "localize/final": {"final_norm": {"max_abs": 0.06, "rel_err": 0.017},
                           "logits": {"max_abs": 0.009, "rel_err": 0.015}},
        "localize/first_divergence": {"layer": 1, "tensor": "topk_ids", "max_abs": 1.0, "rel_err": 2e-3},
    }


def recompute_headline(metrics_path) -> dict[str, float]:
    """Independent recomputation straight from the JSONL text."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]

    def mean_of(key):
        vals = [r[key] for r in rows if key in r and r[key] is not None]
        return sum(vals) / len(vals) if vals else math.nan

    rewards = [r["reward/mean"] for r in rows]
    k = max(1, len(rewards) // 10)
    return {
        "num_steps": len(rows),
        "reward_last10_mean": sum(rewards[-k:]) / k,
        "reward_first10_mean": sum(rewards[:k]) / k,
        "reward_last_step": rewards[-1],
        "any_layer_flip_mean": mean_of("routing/any_layer_flip"),
        "k3_kl_mean": mean_of("mismatch/k3_kl"),
        "k3_kl_replayed_mean": mean_of("mismatch_replayed/k3_kl"),
        "clip_token_frac_mean": mean_of("clip/token_frac"),
        "clip_out_of_range_frac_mean": mean_of("clip/out_of_range_frac"),
        "update_expert_change_mean": mean_of("update/expert_change_frac"),
        "update_all_expert_change_mean": mean_of("update_all_minibatches/expert_change_frac"),
        "num_update_steps": sum(1 for r in rows if r.get("update/expert_change_frac") is not None),
        "flipped_var_share_mean": mean_of("mismatch_ratio/token_var_share_flipped"),
        "mismatch_token_var_mean": mean_of("mismatch_ratio/token_var"),
        "mismatch_seq_var_mean": mean_of("mismatch_ratio/seq_var"),
        "mismatch_token_seq_var_ratio": mean_of("mismatch_ratio/token_var") / mean_of("mismatch_ratio/seq_var"),
        "update_token_var_mean": mean_of("ratio/token_var"),
        "update_seq_var_mean": mean_of("ratio/seq_var"),
        "update_token_seq_var_ratio": mean_of("ratio/token_var") / mean_of("ratio/seq_var"),
    }


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_real_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 1024, path
    assert float(np.var(mpimg.imread(path))) > 0, path


def write_degenerate_run(run_dir: Path, fill: float | None, num_steps: int = 3) -> Path:
    """A run dir (no traces) whose every metric is `fill` (0.0 or None = JSON null), lists included."""
    rng = np.random.default_rng(0)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(num_steps):
            rec = synthetic_record(step, rng)
            rec = {k: v if k == "step" else np.full(np.shape(v), np.nan if fill is None else fill).tolist()
                   if isinstance(v, list) else fill for k, v in rec.items()}
            f.write(json.dumps(rec).replace("NaN", "null") + "\n")
    return run_dir
