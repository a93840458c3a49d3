"""Benchmark of the vLLM rollout engine next to the Megatron learner: rollout speed, route-capture
overhead, weight-sync time and memory, and vLLM-bf16 vs learner routing drift.

    python -m benchmarks.vllm_bench                                   # one process, EP=1
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.vllm_bench  # EP=2

What it measures (tiny random Qwen3-MoE unless `--geometry small`; every rank runs its own engine,
rank 0 prints the slowest rank's figures):

- **rollout speed**: generated tokens/s and ms per generated token of `--prompts` x `--n` samples x
  `--max-new-tokens`, fp32, best of `--repeats`. On CPU, vLLM's Model Runner V2 runs its Triton kernels
  (input preparation, Gumbel sampling) in Triton's *interpreter*: CPU figures say nothing about vLLM on
  a GPU, they size CPU tests and runs.
- **route-capture overhead**: the same with ``enable_return_routed_experts`` off vs on (two engines,
  timed alternately so that load on a shared machine biases neither).
- **weight sync**: `engine.update_weights(learner.hf_weight_stream())`, best of `--repeats`; the stream's
  peak extra bytes per rank (exact, from its own accounting: the gathered layer, this rank's staged
  experts, q/k/v), the process's peak RSS rise during the sync (sampled every 1 ms: includes vLLM's
  layer-wise materialisation and, on CPU, the fused-MoE re-pack), and the same two figures for the
  old path (the whole HF state dict gathered on every rank, then handed over).
- **30B estimate** (counted, not measured): the same accounting at Qwen3-30B-A3B geometry in bf16.
- **drift**: every rank's samples of a bf16 (and, as a control, an fp32) vLLM engine, gathered and
  recomputed by the fp32 learner: routing disagreement per MoE layer and any-layer flip fraction (all
  positions vLLM ran), |delta log p| mean / max and k3 KL over response tokens.
"""

from __future__ import annotations

import argparse
import gc
import threading
import time

import numpy as np
import torch

from benchmarks.rollout_bench import time_interleaved
from moe_gspo.rollout.base import SamplingParams

GIB = 2**30
QWEN3_30B_A3B = dict(num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                     num_experts_per_tok=8, vocab_size=151936, tie_word_embeddings=False, mlp_only_layers=[])
SMALL = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64, moe_intermediate_size=256,
             intermediate_size=1024, num_experts=32, num_experts_per_tok=4, num_hidden_layers=4)


def sync_bytes_estimate(hf_config, *, ep_size: int, dtype_bytes: int) -> dict[str, int]:
    """Counted extra bytes per rank of one weight sync: streamed (one layer) vs the whole HF state dict."""
    from moe_gspo.mcore.model import moe_layer_pattern

    c = hf_config
    E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
    hd = getattr(c, "head_dim", None) or H // c.num_attention_heads
    layer_experts = E * 3 * I * H * dtype_bytes
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd * H * dtype_bytes
    moe_layers = sum(moe_layer_pattern(c))
    return {"stream_peak": layer_experts + layer_experts // ep_size + qkv,
            "vllm_layer_copy": layer_experts,  # vLLM's layer-wise reload materialises the layer it loads
            # gather_hf_state_dict: every local expert concatenated once, then all-gathered; q/k/v copied
            "full_state_dict": moe_layers * (layer_experts + layer_experts // ep_size) + c.num_hidden_layers * qkv}


class PeakRSS:
    """Peak resident set size of this process while the block runs (sampled every `period` s)."""

    def __init__(self, period: float = 0.001):
        import psutil

        self._proc, self.period, self.peak, self.base = psutil.Process(), period, 0, 0

    def __enter__(self):
        gc.collect()
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def rise(self) -> int:
        return self.peak - self.base


def _prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [[2] + g.integers(3, vocab, length - 1).tolist() for _ in range(num)]


def run(args) -> dict:
    import os

    import torch.distributed as dist

    from moe_gspo.config import AlgoConfig
    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.learner.learner import Learner
    from moe_gspo.mcore.model import build_gpt_model
    from moe_gspo.mcore.parallel import init_distributed
    from moe_gspo.mcore.weights import load_hf_model_into_megatron
    from moe_gspo.rollout.vllm_engine import VLLMEngine
    from moe_gspo.routing.drift_metrics import rollout_vs_learner
    from moe_gspo.run.steps import gather_samples
    from moe_gspo.tiny import build_tiny_model, tiny_qwen3_moe_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = tiny_qwen3_moe_config(**(SMALL if args.geometry == "small" else {}))
    info = init_distributed(ep_size=world, num_experts=cfg.num_experts, seed=0)
    model = build_gpt_model(cfg, ep_size=world, params_dtype=torch.float32, enable_routing_replay=True)
    load_hf_model_into_megatron(model, build_tiny_model(cfg, seed=0))
    learner = Learner(model, cfg, parallel=info, algo=AlgoConfig(), train=None)
    prompts = _prompts(cfg.vocab_size, args.prompts, args.prompt_len, seed=info.rank)
    sampling = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=1)
    kw = dict(eos_token_ids=[cfg.eos_token_id], max_model_len=args.prompt_len + args.max_new_tokens + 8)
    out: dict = {"rank": info.rank, "world": world}

    t = time.perf_counter()
    engines = {routes: VLLMEngine.from_hf_config(cfg, dtype="float32", record_routes=routes, **kw)
               for routes in (False, True)}
    out["engine_start_s"] = (time.perf_counter() - t) / 2
    try:
        for e in engines.values():
            e.update_weights(learner.hf_weight_stream())
        best = time_interleaved(engines, prompts, sampling, args.repeats)
        for routes, (sec, toks) in best.items():
            out[f"rollout_routes_{routes}"] = dict(seconds=sec, tokens=toks, tokens_per_s=toks / sec,
                                                   ms_per_token=1e3 * sec / toks)
        out["routes_overhead_pct"] = 100 * (best[True][0] - best[False][0]) / best[False][0]

        engine = engines[True]
        syncs = []
        for _ in range(args.repeats):
            stream = learner.hf_weight_stream()
            with PeakRSS() as rss:
                t = time.perf_counter()
                engine.update_weights(stream)
                syncs.append((time.perf_counter() - t, rss.rise, stream.stats.peak_bucket_bytes))
        out["sync_s"] = min(s[0] for s in syncs)
        out["sync_rss_rise"] = min(s[1] for s in syncs)
        out["sync_stream_peak"] = syncs[0][2]
        olds = []
        for _ in range(args.repeats):  # the old path: every rank gathers the whole HF state dict first
            with PeakRSS() as rss:
                t = time.perf_counter()
                full = learner.hf_state_dict()
                engine.update_weights(list(full.items()))
                del full
                olds.append((time.perf_counter() - t, rss.rise))
        out["full_sync_s"], out["full_sync_rss_rise"] = min(o[0] for o in olds), min(o[1] for o in olds)
    finally:
        for e in engines.values():
            e.close()

    drift = {}
    for dtype in ("float32", "bfloat16"):
        e = VLLMEngine.from_hf_config(cfg, dtype=dtype, **kw)
        try:
            e.update_weights(learner.hf_weight_stream())
            samples = e.generate(prompts, sampling)
        finally:
            e.close()
        samples = gather_samples(samples, info, prompt_offset=info.rank * len(prompts))
        batch = PackedBatch.from_samples(samples, torch.zeros(len(samples)), pad_id=0)
        res = learner.compute_logprobs(batch, record_routes=True)  # the global batch, on every rank
        m = rollout_vs_learner(rollout_logp_BS=batch.rollout_logp_BS, learner_logp_BS=res.logp_BS,
                               response_mask_BS=batch.response_mask_BS, rollout_routes=batch.rollout_routes,
                               learner_routes=res.routes, num_experts=cfg.num_experts)
        drift[dtype] = {k: m[k] for k in ("routing/layer_disagree", "routing/any_layer_flip",
                                          "mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max",
                                          "mismatch/k3_kl")}
    out["drift"] = drift
    out["estimate_this"] = sync_bytes_estimate(cfg, ep_size=world, dtype_bytes=4)
    parts = [None] * world
    if world > 1:
        dist.all_gather_object(parts, out)
    else:
        parts = [out]
    return {"ranks": parts, "cfg": cfg, "info": info}


def _report(res: dict, args) -> None:
    from transformers import Qwen3MoeConfig

    ranks = res["ranks"]
    cfg = res["cfg"]
    slow = lambda key: max(ranks, key=lambda r: r[key])[key]  # noqa: E731
    world = ranks[0]["world"]
    print(f"vLLM engine bench: {args.geometry} Qwen3-MoE ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_experts} experts, top-{cfg.num_experts_per_tok}), {world} rank(s), learner fp32 EP={world}")
    print(f"engine start (in-process, random weights): {slow('engine_start_s'):.1f} s")
    print(f"rollout, per rank: {args.prompts} prompts x {args.n} samples x {args.max_new_tokens} new tokens "
          f"(prompt {args.prompt_len} tokens), fp32, best of {args.repeats}; slowest rank:")
    for routes in (False, True):
        r = max((x[f"rollout_routes_{routes}"] for x in ranks), key=lambda d: d["seconds"])
        print(f"  routes {'on ' if routes else 'off'}: {r['seconds']:.2f} s, {r['tokens']} tokens, "
              f"{r['tokens_per_s']:.1f} tokens/s, {r['ms_per_token']:.1f} ms/token")
    print(f"  route-capture overhead per rank: {', '.join('%+.1f%%' % r['routes_overhead_pct'] for r in ranks)}")
    print(f"weight sync (learner stream -> vLLM, best of {args.repeats}): {slow('sync_s') * 1e3:.0f} ms; "
          f"stream peak {slow('sync_stream_peak') / 2**20:.2f} MiB/rank (counted), "
          f"peak RSS rise {slow('sync_rss_rise') / 2**20:.2f} MiB (measured)")
    print(f"  old path (whole HF state dict per rank): {slow('full_sync_s') * 1e3:.0f} ms, "
          f"peak RSS rise {slow('full_sync_rss_rise') / 2**20:.2f} MiB (measured)")
    big = Qwen3MoeConfig(**QWEN3_30B_A3B)
    for ep in (8,):
        est = sync_bytes_estimate(big, ep_size=ep, dtype_bytes=2)
        print(f"Qwen3-30B-A3B bf16, EP={ep} (counted): stream peak {est['stream_peak'] / GIB:.2f} GiB/rank "
              f"+ vLLM's copy of the layer being loaded {est['vllm_layer_copy'] / GIB:.2f} GiB; "
              f"whole HF state dict per rank {est['full_state_dict'] / GIB:.1f} GiB")
    print(f"drift, rollout engine vs fp32 learner ({world * args.prompts * args.n} sequences, every position vLLM ran):")
    for dtype, d in ranks[0]["drift"].items():
        print(f"  vLLM {dtype:<8}: layer disagreement {['%.4f' % v for v in d['routing/layer_disagree']]}, "
              f"any-layer flip {d['routing/any_layer_flip']:.4f}, |dlogp| mean {d['mismatch/logp_abs_diff_mean']:.2e} "
              f"max {d['mismatch/logp_abs_diff_max']:.2e}, k3 KL {d['mismatch/k3_kl']:.2e}")


def main(argv: list[str] | None = None) -> None:
    from moe_gspo.mcore.parallel import destroy_distributed
    from moe_gspo.run.setup import quiet_known_warnings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=["tiny", "small"], default="tiny",
                        help="tiny = the default CPU model; small = hidden 512, 32 experts, 4 layers (MiB-scale sync)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    quiet_known_warnings()
    try:
        res = run(args)
        if res["info"].is_main:
            _report(res, args)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
