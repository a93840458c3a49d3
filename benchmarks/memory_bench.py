"""Benchmark: measured GPU memory per phase of an RL step versus the memory plan (`moe_gspo.plan`).

`python -m benchmarks.memory_bench [--variants dist,dist_offload] [--tolerance 0.15] [--json OUT]`
builds a random Qwen3-MoE of ~2 B parameters (default geometry below) on the one GPU of this process
(world size 1, EP=1, bf16, `--token-dispatcher`: training's default allgather, full recompute), a Megatron
learner with the variant's optimizer options and the transformers rollout engine, then runs `--steps` RL steps on a synthetic batch
of full-length sequences (rollout on the first step only; it is slow with the transformers engine) and
records `torch.cuda.max_memory_allocated` and the wall time (synchronized) of each phase:
`rollout` (generate), `logprobs` (old-policy pass), `update` (`train_step`: forward, backward and
optimizer step), `weight_sync` (learner -> engine, streamed), and once at the end `hf_export` (the
streamed HF export of `moe_gspo.mcore.checkpoint.save_hf_checkpoint`, into a temporary directory).
It prints, per variant and phase, the plan's counted memory (the phase total without the CUDA-runtime
and fragmentation allowances, which `max_memory_allocated` does not see; `compare_phases`) next to the
measurement, and exits 1 when a checked phase (`CHECKED`) differs by more than `--tolerance`. `rollout`
is reported only: the transformers engine's generate keeps allocator-dependent caches the plan does not
model. The JSON (`--json`) also holds each phase's seconds per step (`seconds`, one entry per step)
and the batch shape (with `recompute` and `rollout_tokens`, the response tokens the engine returned),
from which `benchmarks.gpu_check` computes the learner's MFU and its tokens/s/GPU per phase.

Options for a throughput/MFU measurement rather than a memory one: `--micro-batch` (sequences per
forward/backward; `--micro-batch 4 --seq-len 1024` = micro-batches of 4096 tokens), `--no-recompute`,
`--no-rollout` (skip the slow transformers-engine generate), `--expert-layout grouped` (the experts as one
parameter per projection, Megatron's legacy `GroupedMLP` on `torch._grouped_mm`, copy-free under the
distributed optimizer: `moe_gspo.mcore.grouped_experts`; default `auto`, what a run takes),
`--batched-experts` (the per-expert layout computed as one grouped GEMM per projection); with either the
bench fails when the built model has no grouped experts (the JSON's `experts` names the path, counts the
modules and the forwards that copied expert weights; `optimizer` names the optimizer) and `--profile-train-step PATH` (after the
timed steps, one more `train_step` under `torch.profiler`, its op table written to PATH;
`benchmarks.gpu_profile`).

Variants: `dist` (distributed optimizer), `dist_offload` (+ precision-aware optimizer, CPU offload of
the whole shard, overlapped D2H/H2D), `dist_offload_all` (+ `train.offload_during_rollout=all`),
`nodist` (Megatron's non-distributed mixed-precision optimizer). Without CUDA the bench runs the tiny
model on CPU (fp32, torch AdamW) to exercise the code path and prints the plan only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

VARIANTS = {
    "dist": ["train.distributed_optimizer=true"],
    "dist_offload": ["train.distributed_optimizer=true", "train.precision_aware_optimizer=true",
                     "train.optimizer_cpu_offload=true", "train.optimizer_offload_fraction=1.0",
                     "train.overlap_cpu_optimizer_d2h_h2d=true"],
    "dist_offload_all": ["train.distributed_optimizer=true", "train.precision_aware_optimizer=true",
                         "train.optimizer_cpu_offload=true", "train.optimizer_offload_fraction=1.0",
                         "train.offload_during_rollout=all"],
    "nodist": ["train.distributed_optimizer=false"],
    "cpu": [],
}
CHECKED = ("logprobs", "update", "weight_sync", "hf_export")


def geometry_from_args(args) -> dict:
    if args.tiny:
        from moe_gspo.tiny import TINY_DEFAULTS

        return dict(TINY_DEFAULTS)
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=128,
                num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=max(4096, args.seq_len),
                rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def run_config(args, variant: str, cuda: bool):
    from moe_gspo.config_load import config_from_dict

    prompt_len = max(2, args.seq_len // 4)
    data = {
        "model": {"params_dtype": "bfloat16" if cuda else "float32", "recompute": not args.no_recompute,
                  "batched_experts": args.batched_experts, "expert_layout": args.expert_layout},
        "parallel": {"expert_parallel_size": 1, "token_dispatcher": args.token_dispatcher if cuda else "allgather"},
        "rollout": {"engine": "hf", "dtype": "bfloat16" if cuda else "float32",
                    "prompts_per_step": args.seqs // args.group, "samples_per_prompt": args.group,
                    "max_new_tokens": args.seq_len - prompt_len},
        "train": {"micro_batch_size": args.micro_batch, "num_minibatches": args.minibatches, "lr": 1e-5,
                  "memory_check": "skip"},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return config_from_dict(data, VARIANTS[variant]), prompt_len


def synthetic_batch(args, vocab: int, prompt_len: int, seed: int):
    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.rollout.base import RolloutSample

    rng = np.random.default_rng(seed)
    samples = [RolloutSample(prompt_index=i // args.group, prompt_ids=rng.integers(3, vocab, prompt_len),
                             response_ids=rng.integers(3, vocab, args.seq_len - prompt_len),
                             response_logprobs=np.full(args.seq_len - prompt_len, -2.0, np.float32),
                             finish_reason="length") for i in range(args.seqs)]
    return PackedBatch.from_samples(samples, rng.standard_normal(args.seqs).astype(np.float32), pad_id=0)


class PhaseMeter:
    """Peak `torch.cuda.max_memory_allocated` per phase (max over repeats), in GiB (CUDA only), and the
    wall seconds of every repeat (CUDA synchronized before and after)."""

    def __init__(self, cuda: bool):
        self.cuda, self.peaks, self.seconds = cuda, {}, {}

    def __call__(self, name: str, fn):
        import time

        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
            self.peaks[name] = max(self.peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / float(1 << 30))
        self.seconds.setdefault(name, []).append(time.perf_counter() - t0)
        return out


def compare_phases(planned: dict[str, dict[str, float]], peaks: dict[str, float]) -> dict[str, dict]:
    """Rows of planned vs measured GiB per phase (pure).

    `planned`: phase name -> the plan's parts in GiB (`Phase.parts_gib`); the CUDA-runtime and
    fragmentation allowances are left out (what `max_memory_allocated` cannot see). `update` is
    measured over `train_step`, which includes the optimizer step: it is compared with the larger of the
    plan's `update` and `optimizer_step`. `rel_diff` = planned / measured - 1 (positive: the plan is
    above the measurement)."""
    rows = {name: {"planned_gib": round(sum(v for k, v in parts.items() if k not in ("fragmentation", "cuda_runtime")),
                                        3)} for name, parts in planned.items()}
    if "optimizer_step" in rows:
        step = rows.pop("optimizer_step")["planned_gib"]
        if "update" in rows:
            rows["update"]["planned_gib"] = max(rows["update"]["planned_gib"], step)
    for name, measured in peaks.items():
        row = rows.setdefault(name, {"planned_gib": None})
        row["measured_gib"] = round(measured, 3)
        row["rel_diff"] = (round(row["planned_gib"] / measured - 1, 4)
                           if measured and row["planned_gib"] is not None else None)
    return rows


def run_variant(args, variant: str, cuda: bool) -> dict:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moe_gspo.learner.learner import Learner
    from moe_gspo.learner.old_pass import OldPolicyPass
    from moe_gspo.mcore.checkpoint import save_hf_checkpoint
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
    from moe_gspo.plan import plan_for_config
    from moe_gspo.plan.from_config import default_attention
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.rollout.hf_engine import HFEngine

    from moe_gspo.mcore.grouped_experts import expert_path_counts

    cfg, prompt_len = run_config(args, variant, cuda)
    hf_config = Qwen3MoeConfig(**geometry_from_args(args))
    gpu_mem = torch.cuda.get_device_properties(0).total_memory / float(1 << 30) if cuda else 80.0
    plan = plan_for_config(cfg, num_gpus=1, gpu_mem_gib=gpu_mem, hf_config=hf_config, model_source="bench",
                           attention=default_attention())
    info = init_distributed(ep_size=1, num_experts=hf_config.num_experts, seed=0)
    meter = PhaseMeter(cuda)
    rollout_out, profile = None, None
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        model = build_bench_model(cfg, hf_config, dtype)
        experts = expert_path(model)
        print(f"expert path: {experts['line']}", file=sys.stderr, flush=True)
        asked = ("--expert-layout grouped", ("grouped_layout", "te_grouped")) if args.expert_layout == "grouped" \
            else ("--batched-experts", ("grouped", "grouped_layout", "te_grouped")) if args.batched_experts else None
        if asked is not None and experts["path"] not in asked[1]:
            raise RuntimeError(f"{asked[0]}: the model computes its experts by {experts['path']!r} ({experts})")
        learner = Learner(model, hf_config, parallel=info, algo=cfg.algo, train=cfg.train,
                          recompute=cfg.model.recompute)
        device = torch.device("cuda" if cuda else "cpu")
        with torch.device(device):
            src = Qwen3MoeForCausalLM(hf_config).to(dtype)
        engine = HFEngine(src, dtype=cfg.rollout.dtype, device=device, record_routes=True, record_probs=False)
        del src
        engine.update_weights(learner.hf_weight_stream())
        if cuda:
            torch.cuda.empty_cache()
        batch = synthetic_batch(args, hf_config.vocab_size, prompt_len, seed=0)
        prompts = [list(map(int, batch.input_ids_BS[i, :prompt_len])) for i in range(0, args.seqs, args.group)]
        for step in range(args.steps):
            learner.offload_for_rollout()
            if step == 0 and not args.no_rollout:
                rollout_out = meter("rollout", lambda: engine.generate(prompts, SamplingParams(
                    n=args.group, max_new_tokens=args.seq_len - prompt_len, seed=step)))
            learner.reload_after_rollout()
            old = meter("logprobs", lambda: learner.compute_logprobs(batch))
            meter("update", lambda: learner.train_step(batch, OldPolicyPass(logp_BS=old.logp_BS)))
            meter("weight_sync", lambda: engine.update_weights(learner.hf_weight_stream()))
        if args.profile_train_step:
            from benchmarks.gpu_profile import profile_to_file

            old = learner.compute_logprobs(batch)
            profile = profile_to_file(lambda: learner.train_step(batch, OldPolicyPass(logp_BS=old.logp_BS)),
                                      args.profile_train_step,
                                      title=f"one train_step, {variant}: {args.seqs} x {args.seq_len} tokens, "
                                            f"micro-batch {args.micro_batch}, recompute "
                                            f"{'full' if cfg.model.recompute else 'off'}, {device.type}")
        with tempfile.TemporaryDirectory(prefix="memory_bench_export_") as tmp:
            meter("hf_export", lambda: save_hf_checkpoint(learner.model, hf_config, Path(tmp) / "hf"))
    finally:
        destroy_distributed()
    experts["weight_copies"] = expert_weight_copies(model)
    experts["counts"] = expert_path_counts(model)  # the grouped layout's forwards, and those off its fast path
    rows = compare_phases({p.name: p.parts_gib for p in plan.phases}, meter.peaks)
    for name, secs in meter.seconds.items():
        rows.setdefault(name, {"planned_gib": None})["seconds"] = [round(t, 4) for t in secs]
    return {"variant": variant, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "params": plan.params["total"], "hf_config": hf_config.to_dict(),
            "batch": {"num_seqs": args.seqs, "seq_len": args.seq_len, "num_minibatches": args.minibatches,
                      "micro_batch_size": args.micro_batch, "recompute": bool(cfg.model.recompute),
                      "rollout_tokens": _response_tokens(rollout_out)},
            "optimizer": {"distributed": bool(cfg.train.distributed_optimizer),
                          "precision_aware": bool(cfg.train.precision_aware_optimizer),
                          "cpu_offload": bool(cfg.train.optimizer_cpu_offload)},
            "experts": experts, "phases": rows, "profile": profile,
            "token_dispatcher": cfg.parallel.token_dispatcher}


def build_bench_model(cfg, hf_config, dtype):
    """The bench's Megatron model as the run config says (`model.recompute`, `model.batched_experts`,
    `model.expert_layout`, the dispatcher). With Transformer Engine importable, `--batched-experts` means TE's
    own grouped GEMM (`moe_grouped_gemm`, which `build_gpt_model` picks with TE; it refuses `batched_experts`
    there), as does the grouped layout."""
    from moe_gspo.mcore.model import build_gpt_model
    from moe_gspo.mcore.shims import have_transformer_engine

    batched = bool(cfg.model.batched_experts) and not have_transformer_engine()
    return build_gpt_model(hf_config, params_dtype=dtype, token_dispatcher=cfg.parallel.token_dispatcher,
                           recompute=cfg.model.recompute, batched_experts=batched,
                           expert_layout=cfg.model.expert_layout)


def expert_path(model) -> dict:
    """How `model`'s MoE layers compute their experts, counted over its modules: `grouped` (ours, the
    per-expert layout's `BatchedSequentialMLP`: one `torch._grouped_mm` or padded `bmm` per projection),
    `grouped_layout` (ours, `GroupedExperts`: one parameter per projection, `model.expert_layout=grouped`),
    `te_grouped` (Megatron's `TEGroupedMLP` / `GroupedMLP`), `loop` (Megatron's `SequentialMLP`), with the
    module counts, and `line`: the build's expert-path line (`moe_gspo.mcore.grouped_experts.expert_path`).
    `run_variant` adds `counts` after its steps (`grouped_experts.expert_path_counts`: the grouped layout's
    forwards and those that left the fast path, with why)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from moe_gspo.mcore.batched_experts import BatchedSequentialMLP
    from moe_gspo.mcore.grouped_experts import GroupedExperts

    counts = {"grouped": sum(isinstance(m, BatchedSequentialMLP) for m in model.modules()),
              "grouped_layout": sum(isinstance(m, GroupedExperts) for m in model.modules()),
              "te_grouped": sum(type(m).__name__ in ("TEGroupedMLP", "GroupedMLP") for m in model.modules()),
              "loop": sum(type(m) is SequentialMLP for m in model.modules())}
    present = [k for k, n in counts.items() if n]
    path = present[0] if len(present) == 1 else "mixed" if present else "none"
    line = (getattr(model, "expert_path", None) or {}).get("line")  # `grouped_experts.expert_path`: the path and why
    return {"path": path, "line": line, **{f"{k}_modules": n for k, n in counts.items()}}


def expert_weight_copies(model) -> int:
    """Forwards of `model`'s grouped experts that had to copy the weights (`num_weight_copies` of
    `BatchedSequentialMLP` and `GroupedExperts`: `moe_gspo.mcore.grouped_experts.weight_copies`)."""
    from moe_gspo.mcore.grouped_experts import weight_copies

    return weight_copies(model)


def _response_tokens(samples) -> int | None:
    """Response tokens of the `RolloutSample`s `engine.generate` returned (None: no rollout ran)."""
    return None if samples is None else int(sum(len(s.response_ids) for s in samples))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="dist,dist_offload", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--tiny", action="store_true", help="the tiny CPU geometry (default without CUDA)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=1024, help="prompt + response tokens of every sequence")
    p.add_argument("--seqs", type=int, default=16, help="sequences per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward (train.micro_batch_size)")
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--no-recompute", action="store_true", help="no activation recomputation (model.recompute=false)")
    p.add_argument("--no-rollout", action="store_true", help="skip the rollout phase (transformers generate)")
    p.add_argument("--batched-experts", action="store_true",
                   help="the per-expert layout's experts as one grouped GEMM per projection (model.batched_experts=true)")
    p.add_argument("--expert-layout", choices=("auto", "per_expert", "grouped"), default="auto",
                   help="model.expert_layout: grouped = one parameter per projection (Megatron's GroupedMLP on "
                        "torch._grouped_mm), copy-free under the distributed optimizer (default auto)")
    p.add_argument("--token-dispatcher", choices=("allgather", "alltoall"), default="allgather",
                   help="Megatron's token dispatcher on CUDA (parallel.token_dispatcher; default allgather, "
                        "training's default; the CPU takes allgather)")
    p.add_argument("--profile-train-step", default=None, metavar="PATH",
                   help="profile one more train_step after the timed steps; write the op table to PATH")
    p.add_argument("--tolerance", type=float, default=0.15, help="allowed |planned/measured - 1| on checked phases")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p


def main(argv=None) -> int:
    import torch

    from moe_gspo.run.setup import quiet_known_warnings

    quiet_known_warnings()
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        args.tiny = True
        variants = ["cpu"]
        print("no CUDA: running the tiny model on CPU (code path only; no memory is measured)", file=sys.stderr)
    else:
        variants = [v for v in args.variants.split(",") if v]
        unknown = [v for v in variants if v not in VARIANTS or v == "cpu"]
        if unknown:
            print(f"error: unknown --variants {unknown}; choose from {', '.join(v for v in VARIANTS if v != 'cpu')}",
                  file=sys.stderr)
            return 2
    if args.seqs % args.group or args.seqs % args.minibatches:
        print("error: --seqs must be a multiple of --group and of --minibatches", file=sys.stderr)
        return 2
    results, failed = [], {}
    for v in variants:
        try:
            results.append(run_variant(args, v, cuda))
        except ValueError as e:  # e.g. the precision-aware optimizer without Transformer Engine
            print(f"variant {v} skipped: {e}", file=sys.stderr)
            failed[v] = f"skipped: {e}"
        except torch.OutOfMemoryError as e:  # a setting too large for this GPU: recorded, the others still run
            print(f"variant {v}: out of memory: {str(e)[:500]}", file=sys.stderr)
            failed[v] = f"out of memory: {str(e)[:500]}"
            if cuda:
                torch.cuda.empty_cache()
    if args.json:  # also without results: the failures say why
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "failed": failed}, f, indent=1)
    if not results:
        return 2
    over = False
    print(f"{'variant':<18}{'phase':<15}{'planned GiB':>12}{'measured GiB':>14}{'diff':>9}")
    for res in results:
        for phase, row in res["phases"].items():
            meas = row.get("measured_gib")
            diff = row.get("rel_diff")
            bad = phase in CHECKED and diff is not None and abs(diff) > args.tolerance
            over |= bad
            planned = f"{row['planned_gib']:.2f}" if row.get("planned_gib") is not None else "n/a"
            print(f"{res['variant']:<18}{phase:<15}{planned:>12}"
                  f"{(f'{meas:.2f}' if meas is not None else 'n/a'):>14}"
                  f"{(f'{diff:+.1%}' if diff is not None else ''):>9}{'  <- over tolerance' if bad else ''}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
