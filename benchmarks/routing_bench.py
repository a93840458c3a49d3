"""Benchmark of the routing-trace format and the drift metrics (not a test).

``python -m benchmarks.routing_bench [--tokens 20000] [--repeats 3]`` prints:
- bytes per token of a trace (ids, probs, total) for the tiny CPU geometry (2 MoE layers x top-2,
  8 experts) and the Qwen3-30B-A3B geometry (48 MoE layers x top-8, 128 experts), with and without
  router probabilities, plus the measured `.npz` file size per token;
- the throughput of `routing_drift` and `trace_drift` in (token, layer) entries per second on
  `--tokens` tokens of the Qwen3-30B-A3B geometry with ~10% of the rows changed;
- the time of `build_replay_topk` for a micro-batch of that geometry.
Takes a few seconds on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from moe_gspo.routing.align import build_replay_topk
from moe_gspo.routing.drift import routing_drift, trace_drift
from moe_gspo.routing.trace import RoutingTrace, bytes_per_token, load_trace, save_trace


def _distinct_topk(rng: np.random.Generator, n: int, num_layers: int, k: int, num_experts: int) -> np.ndarray:
    """[n, L, K] rows of K distinct ids: a random start and the next K-1 experts (mod E)."""
    return (rng.integers(0, num_experts, (n, num_layers, 1)) + np.arange(k)) % num_experts


def _perturb(rng: np.random.Generator, a: np.ndarray, num_experts: int, frac: float) -> np.ndarray:
    """Copy of `a` with slot 0 of ~`frac` of the (token, layer) rows swapped for an unused expert."""
    b = a.copy()
    k = a.shape[-1]
    rows = rng.random(a.shape[:2]) < frac
    outside = (a[..., 0] + k + rng.integers(0, num_experts - k, a.shape[:2])) % num_experts
    b[..., 0] = np.where(rows, outside, a[..., 0])
    return b


def _trace(topk: np.ndarray, num_experts: int, seq_len: int, probs: bool) -> RoutingTrace:
    n, num_layers, k = topk.shape
    num_seqs = n // seq_len
    offsets = np.arange(num_seqs + 1, dtype=np.int64) * seq_len
    p = np.full(topk.shape, 1.0 / k, dtype=np.float16)[: num_seqs * seq_len] if probs else None
    return RoutingTrace(topk_ids=topk[: num_seqs * seq_len], seq_offsets=offsets,
                        prompt_lens=np.full(num_seqs, seq_len // 2), response_lens=np.full(num_seqs, seq_len // 2),
                        num_experts=num_experts, layer_ids=np.arange(num_layers), router_probs=p)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20000, help="tokens in the drift benchmark")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats (best is reported)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)

    print("== trace size (bytes per stored token) ==")
    geometries = {"tiny (2 MoE layers x top-2, E=8)": (2, 2, 8),
                  "Qwen3-30B-A3B (48 x top-8, E=128)": (48, 8, 128)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (num_layers, k, num_experts) in geometries.items():
            topk = _distinct_topk(rng, 2048, num_layers, k, num_experts)
            for probs in (False, True):
                tr = _trace(topk, num_experts, 128, probs)
                b = bytes_per_token(tr)
                path = save_trace(Path(tmp) / "t.npz", tr)
                on_disk = path.stat().st_size / tr.num_tokens
                print(f"{name:36s} probs={str(probs):5s} ids={b['ids']:5d} probs={b['probs']:5d} "
                      f"total={b['total']:5d}  npz={on_disk:8.1f} B/token")

        num_layers, k, num_experts = 48, 8, 128
        n = args.tokens
        print(f"\n== drift metrics: {n} tokens x {num_layers} layers x top-{k}, E={num_experts} ==")
        a = _distinct_topk(rng, n, num_layers, k, num_experts).astype(np.uint8)
        b = _perturb(rng, a, num_experts, 0.10)
        entries = n * num_layers
        t = _best(lambda: routing_drift(a, b, num_experts=num_experts), args.repeats)
        m = routing_drift(a, b, num_experts=num_experts)
        print(f"routing_drift      {t * 1e3:8.1f} ms  {entries / t / 1e6:7.1f} M entries/s  "
              f"(expert_change_frac={m['routing/expert_change_frac']:.4f}, "
              f"any_layer_flip={m['routing/any_layer_flip']:.3f})")
        ta, tb = _trace(a, num_experts, 500, True), _trace(b, num_experts, 500, True)
        t = _best(lambda: trace_drift(ta, tb, tokens="response"), args.repeats)
        print(f"trace_drift(resp.) {t * 1e3:8.1f} ms  {ta.num_tokens // 2 * num_layers / t / 1e6:7.1f} M entries/s "
              f"(with top-k prob L1)")
        path = Path(tmp) / "big.npz"
        t_save = _best(lambda: save_trace(path, ta), 1)
        t_load = _best(lambda: load_trace(path), 1)
        print(f"save/load trace    {t_save * 1e3:8.1f} / {t_load * 1e3:.1f} ms for {ta.num_tokens} tokens "
              f"({path.stat().st_size / 1e6:.1f} MB)")

    seqs, seq_len = 8, 1024
    routes = [a[i * seq_len:(i + 1) * seq_len - 1] for i in range(min(seqs, n // seq_len))]
    if routes:
        t = _best(lambda: build_replay_topk(routes, [seq_len] * len(routes), seq_len, num_experts=num_experts,
                                            top_k=k), args.repeats)
        print(f"build_replay_topk  {t * 1e3:8.1f} ms  for B={len(routes)} x S={seq_len} x L={num_layers} x K={k}")


if __name__ == "__main__":
    main()
