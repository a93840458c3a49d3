"""Benchmark: overhead of router recording and of R2 routing replay in the Megatron learner.

`python -m benchmarks.learner_bench [--seqs 16] [--repeats 5]` builds the tiny Qwen3-MoE in a
single-process learner (EP=1) and times, as medians over `--repeats` runs after a warm-up:
- the old-policy pass `compute_logprobs` without and with `record_routes` (router forward hooks);
- `train_step` without replay (model built without routing replay) and with R2 replay.
It prints the times and the overheads in percent. Not a test; takes well under a minute on 2 CPU cores.

`python -m benchmarks.learner_bench --expert-layouts [--config configs/tiny_cpu.yaml] [--repeats 12]` instead
times the learner's expert paths on the config's model and one step's batch (`rollout.prompts_per_step` x
`rollout.samples_per_prompt` sequences, `train.*` as configured), interleaved call by call in one process
(`benchmarks.fastpath_bench.interleaved`): the per-expert layout with its grouped GEMM (`model.batched_experts`),
the grouped layout (`model.expert_layout=grouped`, `moe_gspo.mcore.grouped_experts`) and Megatron's loop; the
old-policy pass (routes and entropies recorded) and one `train_step`, medians and ratios to the per-expert path.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


EXPERT_PATHS = {"per_expert": {"batched_experts": True}, "grouped": {"expert_layout": "grouped"},
                "loop": {"batched_experts": False}}
"""The expert paths `--expert-layouts` times: `build_gpt_model` keywords (per-expert layout with its grouped
GEMM, the grouped layout, Megatron's loop over experts)."""


def bench_expert_layouts(config: str, repeats: int) -> dict[str, float]:
    """Median seconds of the old-policy pass and of `train_step` per expert path (module docstring)."""
    from benchmarks.fastpath_bench import time_learner_variants
    from moe_gspo.config_load import load_config
    from moe_gspo.mcore.grouped_experts import expert_modules
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
    from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

    cfg = load_config(config)
    if cfg.model.path is not None:
        raise ValueError(f"{config}: --expert-layouts runs the tiny random model; the config needs model.path=null")
    hf_cfg = tiny_qwen3_moe_config(**cfg.model.tiny)
    info = init_distributed(ep_size=1, num_experts=hf_cfg.num_experts, seed=0)
    try:
        hf = build_tiny_model(hf_cfg, seed=cfg.model.init_seed, router_scale=cfg.model.router_scale)
        learners, batch, passes, steps = time_learner_variants(cfg, hf_cfg, hf, info, EXPERT_PATHS, repeats)
        num = batch.num_seqs
        for name, learner in learners.items():
            print(f"{name}: {type(expert_modules(learner.model)[0]).__name__}", flush=True)
    finally:
        destroy_distributed()
    print(f"{config}: {num} sequences, {cfg.train.num_minibatches} optimizer steps per train_step, median of "
          f"{repeats} interleaved calls each, {torch.get_num_threads()} threads")
    for what, medians in (("old-policy pass", passes), ("train_step", steps)):
        print(f"  {what:16s}" + "".join(f"  {k} {v * 1e3:7.1f} ms ({v / medians['per_expert']:.2f}x)"
                                        for k, v in medians.items()))
    return {**{f"old_pass/{k}": v for k, v in passes.items()}, **{f"train_step/{k}": v for k, v in steps.items()}}


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=16, help="sequences per batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="train.micro_batch_size")
    parser.add_argument("--expert-layouts", action="store_true",
                        help="time the expert paths (per-expert, grouped layout, loop) on --config instead")
    parser.add_argument("--config", default="configs/tiny_cpu.yaml", help="with --expert-layouts: the run config")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.expert_layouts:
        return bench_expert_layouts(args.config, args.repeats)

    from moe_gspo.config import AlgoConfig, TrainConfig
    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.learner.learner import Learner
    from moe_gspo.learner.old_pass import OldPolicyPass
    from moe_gspo.mcore.model import build_gpt_model
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
    from moe_gspo.mcore.weights import load_hf_model_into_megatron
    from moe_gspo.rollout.base import RolloutSample
    from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

    cfg = tiny_qwen3_moe_config()
    info = init_distributed(ep_size=1, num_experts=cfg.num_experts, seed=0)
    try:
        hf = build_tiny_model(cfg, seed=0)
        rng = np.random.default_rng(0)
        samples = []
        for i in range(args.seqs):
            response = rng.integers(3, cfg.vocab_size, int(rng.integers(8, 24)))
            samples.append(RolloutSample(prompt_index=i // 4, prompt_ids=rng.integers(3, cfg.vocab_size, 8),
                                         response_ids=response, finish_reason="length",
                                         response_logprobs=np.full(len(response), -2.0, np.float32)))
        batch = PackedBatch.from_samples(samples, rng.standard_normal(args.seqs), pad_id=0)
        train = TrainConfig(lr=1e-5, num_minibatches=2, micro_batch_size=args.micro_batch_size)

        def learner(replay: str) -> Learner:
            model = build_gpt_model(cfg, enable_routing_replay=replay != "none")
            load_hf_model_into_megatron(model, hf)
            return Learner(model, cfg, parallel=info, algo=AlgoConfig(name="gspo", routing_replay=replay), train=train)

        plain, r2 = learner("none"), learner("r2")
        old = plain.compute_logprobs(batch).logp_BS
        r2_old = r2.compute_logprobs(batch)  # with the old routing that R2 replays
        t = {
            "logprobs_s": _median_time(lambda: plain.compute_logprobs(batch), args.repeats),
            "logprobs_record_s": _median_time(lambda: plain.compute_logprobs(batch, record_routes=True),
                                              args.repeats),
            "train_step_s": _median_time(lambda: plain.train_step(batch, OldPolicyPass(logp_BS=old)), args.repeats),
            "train_step_r2_s": _median_time(lambda: r2.train_step(batch, OldPolicyPass(logp_BS=old, natural=r2_old)),
                                           args.repeats),
        }
    finally:
        destroy_distributed()
    t["record_overhead_pct"] = 100.0 * (t["logprobs_record_s"] / t["logprobs_s"] - 1.0)
    t["r2_overhead_pct"] = 100.0 * (t["train_step_r2_s"] / t["train_step_s"] - 1.0)
    tokens = int(batch.seq_lens_B.sum())
    print(f"tiny Qwen3-MoE learner, EP=1 on {info.device}, {args.seqs} sequences / {tokens} tokens, "
          f"micro-batch {args.micro_batch_size}, median of {args.repeats}")
    print(f"  compute_logprobs            {t['logprobs_s'] * 1e3:8.1f} ms")
    print(f"  compute_logprobs + record   {t['logprobs_record_s'] * 1e3:8.1f} ms   "
          f"overhead {t['record_overhead_pct']:+.1f}%")
    print(f"  train_step (no replay)      {t['train_step_s'] * 1e3:8.1f} ms")
    print(f"  train_step (R2 replay)      {t['train_step_r2_s'] * 1e3:8.1f} ms   "
          f"overhead {t['r2_overhead_pct']:+.1f}%")
    return t


if __name__ == "__main__":
    main()
