"""Benchmark: the step's CPU fast paths against what they replace, interleaved in one process.

`python -m benchmarks.fastpath_bench [--config configs/tiny_cpu.yaml] [--repeats 12] [--threads N]`

Whole-job timings on a shared 2-core machine drift by ±30% within minutes (`benchmarks.step_profile` runs
taken back to back disagree by more than these paths change), so each comparison here alternates its
variants call by call in one process on the config's model, batch shape and sampling, and prints the
median of each (after one warm-up call each) and their ratio:

- **rollout**: `HFEngine.generate` of one step's prompts (`rollout.prompts_per_step` x
  `rollout.samples_per_prompt`, `rollout.max_new_tokens`) in bf16 as the engine runs it on a CPU without
  bf16 kernels (`moe_gspo.rollout.cpu_gemm.fp32_gemms_in`: fp32 GEMMs of the bf16 values with cached fp32
  weights, fp32-compute attention) vs torch's own bf16 kernels (`fp32_gemm=False`); also counts the
  identical samples (the same draws but for rare rounding-decided ones); the engine's decode steps by
  `moe_gspo.rollout.compact_decode` vs transformers' forward (`compact_decode=False`; identical samples
  counted too); and, for scale, the same engine in fp32 (what a rollout without the bf16 mismatch costs:
  TRL's peer benchmark samples in fp32);
- **learner**: the old-policy pass (`compute_logprobs`, routes and entropies recorded, as the train loop
  calls it) and one `train_step` (`train.num_minibatches` optimizer steps) on a batch of the step's size,
  four learners with the same weights, one process (EP=1): the default (`model.batched_experts=true`:
  grouped expert GEMMs; `model.sdpa_attention=true`: attention as one fused SDPA call; RoPE as one
  autograd function, `moe_gspo.mcore.fused_rope`), the loop over experts (Megatron's `SequentialMLP`),
  Megatron's local attention, and Megatron's unfused RoPE; and the default learner's old-policy pass
  followed by its `train_step` with and without `train.fuse_old_logp_pass`.

Not a test; about a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch


def interleaved(variants: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each variant, calling them in turn `repeats` times after a warm-up each."""
    for fn in variants.values():
        fn()
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _print(what: str, medians: dict[str, float], new: str, old: str) -> None:
    print(f"{what}: {new} {medians[new] * 1e3:.1f} ms, {old} {medians[old] * 1e3:.1f} ms "
          f"({medians[new] / medians[old]:.2f}x)", flush=True)


def bench_rollout(cfg, repeats: int) -> dict[str, float]:
    from moe_gspo.rollout.base import SamplingParams
    from moe_gspo.rollout.hf_engine import HFEngine
    from moe_gspo.tasks import make_task
    from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config
    from moe_gspo.tokenizer import load_tiny_tokenizer

    r = cfg.rollout
    tok = load_tiny_tokenizer()
    prompts = [tok.encode(p.text) for p in make_task(cfg.task).prompts(0, r.prompts_per_step, cfg.train.seed)]
    model = build_tiny_model(tiny_qwen3_moe_config(**cfg.model.tiny), seed=cfg.model.init_seed,
                             router_scale=cfg.model.router_scale)
    engines = {"engine": HFEngine(model, dtype="bfloat16", device="cpu", fp32_gemm=True),
               "native bf16": HFEngine(model, dtype="bfloat16", device="cpu", fp32_gemm=False),
               "transformers decode": HFEngine(model, dtype="bfloat16", device="cpu", fp32_gemm=True,
                                               compact_decode=False),
               "fp32": HFEngine(model, dtype="float32", device="cpu")}
    sampling = SamplingParams(n=r.samples_per_prompt, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                              top_p=r.top_p, seed=0)
    outs = {}

    def run(name):
        def call():
            outs[name] = engines[name].generate(prompts, sampling)
        return call

    medians = interleaved({name: run(name) for name in engines}, repeats)
    same = sum(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(outs["engine"], outs["native bf16"]))
    _print(f"rollout ({len(prompts)} prompts x {r.samples_per_prompt}, bf16; identical samples: {same} of "
           f"{len(outs['engine'])})", medians, "engine", "native bf16")
    same = sum(np.array_equal(a.response_ids, b.response_ids)
               for a, b in zip(outs["engine"], outs["transformers decode"]))
    _print(f"rollout, compact decode steps vs transformers' forward (identical samples: {same} of "
           f"{len(outs['engine'])})", medians, "engine", "transformers decode")
    _print("rollout, the same engine in bf16 vs in fp32 (no train-inference mismatch)", medians, "engine", "fp32")
    return medians


def synthetic_batch(cfg, vocab_size: int):
    """A `PackedBatch` shaped like one RL step of `cfg` (prompts_per_step x samples_per_prompt sequences,
    the task's prompt length, response lengths drawn in [9, max_new_tokens]), random ids and advantages."""
    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.rollout.base import RolloutSample

    rng = np.random.default_rng(0)
    r, t = cfg.rollout, cfg.task
    num = r.prompts_per_step * r.samples_per_prompt
    prompt_len = (t.prompt_len_max or t.prompt_len) + 2  # the copy task's field, "=" and BOS
    lens = rng.integers(9, r.max_new_tokens + 1, num)
    samples = [RolloutSample(prompt_index=i // r.samples_per_prompt,
                             prompt_ids=rng.integers(3, vocab_size, prompt_len),
                             response_ids=rng.integers(3, vocab_size, int(n)), finish_reason="stop",
                             response_logprobs=np.full(int(n), -2.0, np.float32)) for i, n in enumerate(lens)]
    return PackedBatch.from_samples(samples, rng.standard_normal(num), pad_id=0)


def time_learner_variants(cfg, hf_cfg, hf, info, builds: dict[str, dict], repeats: int):
    """A `Learner` per `build_gpt_model` keyword set in `builds` (the HF model `hf`'s weights), timed on one
    `synthetic_batch` of `cfg`: (learners, batch, old-policy pass medians, `train_step` medians), the calls
    interleaved across the variants; the update's pi_old is the first variant's."""
    from moe_gspo.learner.learner import Learner
    from moe_gspo.learner.old_pass import OldPolicyPass
    from moe_gspo.mcore.model import build_gpt_model
    from moe_gspo.mcore.weights import load_hf_model_into_megatron

    batch = synthetic_batch(cfg, hf_cfg.vocab_size)
    learners = {}
    for name, kw in builds.items():
        model = build_gpt_model(hf_cfg, **kw)
        load_hf_model_into_megatron(model, hf)
        learners[name] = Learner(model, hf_cfg, parallel=info, algo=cfg.algo, train=cfg.train)
    old = next(iter(learners.values())).compute_logprobs(batch).logp_BS
    passes = interleaved({k: (lambda L=L: L.compute_logprobs(batch, record_routes=True, no_replay=True,
                                                             with_entropy=True)) for k, L in learners.items()},
                         repeats)
    steps = interleaved({k: (lambda L=L: L.train_step(batch, OldPolicyPass(logp_BS=old)))
                         for k, L in learners.items()}, repeats)
    return learners, batch, passes, steps


def bench_learner(cfg, repeats: int) -> dict[str, float]:
    from moe_gspo.learner.old_pass import OldPolicyPass
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
    from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

    hf_cfg = tiny_qwen3_moe_config(**cfg.model.tiny)
    info = init_distributed(ep_size=1, num_experts=hf_cfg.num_experts, seed=0)
    try:
        hf = build_tiny_model(hf_cfg, seed=cfg.model.init_seed, router_scale=cfg.model.router_scale)
        builds = {name: dict(batched_experts=batched, sdpa_attention=sdpa, fused_rope=rope)
                  for name, batched, sdpa, rope in (("default", True, True, True), ("loop experts", False, True, True),
                                                    ("local attention", True, False, True),
                                                    ("unfused RoPE", True, True, False))}
        learners, batch, passes, steps = time_learner_variants(cfg, hf_cfg, hf, info, builds, repeats)
        num = batch.num_seqs
        default = learners["default"]

        def old_pass_and_update(fuse: bool):
            def call():
                result = default.compute_logprobs(batch, record_routes=True, no_replay=True, with_entropy=True,
                                                  keep_graph=fuse)
                default.train_step(batch, OldPolicyPass(logp_BS=result.logp_BS, fused=result.fused))
            return call

        both = interleaved({"fused old pass": old_pass_and_update(True), "separate passes": old_pass_and_update(False)},
                           repeats)
        for what, medians in ((f"learner old-policy pass ({num} sequences, routes + entropies)", passes),
                              (f"learner train_step ({cfg.train.num_minibatches} optimizer steps)", steps)):
            for other in ("loop experts", "local attention", "unfused RoPE"):
                _print(what, medians, "default", other)
        _print("learner old-policy pass + train_step (train.fuse_old_logp_pass)", both, "fused old pass",
               "separate passes")
        return {**{f"old_pass/{k}": v for k, v in passes.items()}, **{f"train_step/{k}": v for k, v in steps.items()},
                **{f"old_pass_and_update/{k}": v for k, v in both.items()}}
    finally:
        destroy_distributed()


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_cpu.yaml")
    parser.add_argument("--repeats", type=int, default=12, help="timed calls per variant (interleaved)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from moe_gspo.config_load import load_config

    cfg = load_config(args.config)
    if cfg.model.path is not None:
        raise ValueError(f"{args.config}: fastpath_bench runs the tiny random model; the config needs model.path=null")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{args.config}, {torch.get_num_threads()} threads, median of {args.repeats} interleaved calls each", flush=True)
    return {**{f"rollout/{k}": v for k, v in bench_rollout(cfg, args.repeats).items()}, **bench_learner(cfg, args.repeats)}


if __name__ == "__main__":
    main()
