"""Benchmark of the transformers rollout engine: tokens/s with router capture on vs off, fp32 vs bf16.

Run `python -m benchmarks.rollout_bench` (tiny random Qwen3-MoE, 16 prompts x 8 samples x 16 new
tokens by default; well under a minute on 2 CPU cores). Tokens/s counts generated response tokens;
the capture overhead is the relative slowdown of the best-of-`--repeats` time with capture on (runs
with and without capture alternate, so that load on a shared machine biases neither).
"""

from __future__ import annotations

import argparse
import time

import torch

from moe_gspo.rollout.base import SamplingParams
from moe_gspo.rollout.hf_engine import HFEngine
from moe_gspo.tiny import build_tiny_model


def time_interleaved(engines: dict, prompts, sampling: SamplingParams, repeats: int):
    """Best wall time per engine over `repeats` rounds (after one warm-up each).

    The engines run alternately within each round, so that load from other processes on a shared
    machine hits every configuration alike. Returns `{key: (seconds, response_tokens)}`.
    """
    for engine in engines.values():
        engine.generate(prompts, sampling)
    best = {key: (float("inf"), 0) for key in engines}
    for _ in range(repeats):
        for key, engine in engines.items():
            start = time.perf_counter()
            samples = engine.generate(prompts, sampling)
            seconds = time.perf_counter() - start
            if seconds < best[key][0]:
                best[key] = (seconds, sum(len(s.response_ids) for s in samples))
    return best


def run(num_prompts: int = 16, n: int = 8, max_new_tokens: int = 16, prompt_len: int = 12,
        repeats: int = 5, device: str | None = None, seed: int = 0) -> list[dict]:
    """Time every (dtype, capture) combination; returns one row per combination."""
    model = build_tiny_model(seed=seed)
    g = torch.Generator().manual_seed(seed)
    # varied prompt lengths so that left padding is exercised
    prompts = [torch.randint(3, model.config.vocab_size, (int(length),), generator=g).tolist()
               for length in torch.randint(prompt_len // 2, prompt_len + 1, (num_prompts,), generator=g)]
    sampling = SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed)
    rows = []
    for dtype in ("float32", "bfloat16"):
        engines = {capture: HFEngine(model, dtype=dtype, device=device, record_routes=capture)
                   for capture in (False, True)}
        best = time_interleaved(engines, prompts, sampling, repeats)
        for capture, (seconds, num_tokens) in best.items():
            rows.append(dict(dtype=dtype, capture=capture, seconds=seconds, tokens=num_tokens,
                             tokens_per_s=num_tokens / seconds))
        rows[-1]["overhead_pct"] = 100.0 * (best[True][0] - best[False][0]) / best[False][0]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    rows = run(args.prompts, args.n, args.max_new_tokens, args.prompt_len, args.repeats, args.device)
    print(f"HFEngine on tiny Qwen3-MoE: {args.prompts} prompts x {args.n} samples x "
          f"{args.max_new_tokens} new tokens, best of {args.repeats}")
    print(f"{'dtype':<10}{'capture':<9}{'seconds':>9}{'tokens':>8}{'tokens/s':>11}{'overhead':>10}")
    for r in rows:
        overhead = f"{r['overhead_pct']:+.1f}%" if "overhead_pct" in r else ""
        print(f"{r['dtype']:<10}{str(r['capture']):<9}{r['seconds']:>9.3f}{r['tokens']:>8d}"
              f"{r['tokens_per_s']:>11.0f}{overhead:>10}")


if __name__ == "__main__":
    main()
