"""Bitwise on-policy on the CPU (issue 41): does the fp32 transformers forward equal the fp32 Megatron learner's
bit for bit once the MoE block computes in Megatron's order?

`python -m benchmarks.bitwise_moe_order [--model DIR] [--seqs 12,20,31,40]`

Runs the divergence localiser (`moe_gspo.routing.localize`, hooks of `moe_gspo.probe_localize`) on
teacher-forced forwards of random token sequences (positions 0..T-1, one sequence per forward) twice: with
transformers' Qwen3-MoE block as shipped (router weights = softmax over all experts, top-k, renormalised;
each expert's output multiplied by its weight after the down projection), then with that block replaced by
`megatron_order_moe`: softmax over the k chosen logits (Megatron's `moe_router_pre_softmax=False`), the weight
multiplied into silu(gate)*up before the down projection (Megatron's `SequentialMLP` activation with probs),
expert outputs index-added in expert order (Megatron's unpermute). Prints the first bitwise difference, the
logits' max |delta| and the max |dlogp| of each. Without --model, a tiny random checkpoint
(`moe_gspo.tiny.make_tiny_checkpoint(seed=1)`, as the probe tests) in a temporary directory.
"""

from __future__ import annotations

import argparse
import tempfile
import types

import torch
import torch.nn.functional as F


def megatron_order_moe(self, hidden_BSH: torch.Tensor) -> torch.Tensor:
    """A transformers `Qwen3MoeSparseMoeBlock.forward` computing in Megatron-core 0.16's order (local experts)."""
    B, S, H = hidden_BSH.shape
    x = hidden_BSH.reshape(-1, H)
    logits, _, _ = self.gate(x)
    top_v, idx = torch.topk(logits, self.gate.top_k, dim=-1)
    w = torch.softmax(top_v, dim=-1, dtype=torch.float32).to(x.dtype)
    out = torch.zeros_like(x)
    ex = self.experts
    for e in range(ex.num_experts):
        rows, pos = torch.where(idx == e)
        if rows.numel() == 0:
            continue
        g, u = F.linear(x[rows], ex.gate_up_proj[e]).chunk(2, dim=-1)
        out.index_add_(0, rows, F.linear(F.silu(g) * u * w[rows, pos][:, None], ex.down_proj[e]))
    return out.reshape(B, S, H)


def use_megatron_order(model) -> int:
    """Replace the forward of every MoE block of a transformers Qwen3-MoE model; returns how many."""
    n = 0
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            layer.mlp.forward = types.MethodType(megatron_order_moe, layer.mlp)
            n += 1
    return n


def compare(model_dir, seq_lens=(12, 20, 31, 40), seed: int = 0) -> dict:
    """{"shipped": ..., "megatron_order": ...}: each {first_difference, logits_max_abs, logp_max_abs}."""
    from transformers import Qwen3MoeForCausalLM

    from moe_gspo.mcore.checkpoint import load_hf_config, load_megatron_from_hf_dir
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed
    from moe_gspo.routing.localize import concat_sequences, localize
    from moe_gspo.probe_localize import hf_capture, mcore_capture, response_logp

    hc = load_hf_config(model_dir)
    init_distributed(ep_size=1, num_experts=hc.num_experts, seed=seed)
    try:
        m, _ = load_megatron_from_hf_dir(model_dir, ep_size=1, params_dtype=torch.float32,
                                         enable_routing_replay=False, token_dispatcher="allgather")
        hf = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(seed)
        seqs = [torch.randint(0, hc.vocab_size, (n,), generator=g) for n in seq_lens]
        out = {}
        for label in ("shipped", "megatron_order"):
            if label == "megatron_order":
                use_megatron_order(hf)
            a = [hf_capture(hf, t) for t in seqs]
            b = [mcore_capture(m, t) for t in seqs]
            (al, af), (bl, bf) = concat_sequences(a), concat_sequences(b)
            r = localize(al, bl, af, bf, tol=1e-5)
            lp = max(float((response_logp(x[1]["logits"], t, 1) - response_logp(y[1]["logits"], t, 1)).abs().max())
                     for x, y, t in zip(a, b, seqs))
            out[label] = {"first_difference": r["first_difference"], "logits_max_abs": r["final"]["logits"]["max_abs"],
                          "logp_max_abs": lp}
        return out
    finally:
        destroy_distributed()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bitwise_moe_order", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF Qwen3-MoE checkpoint (default: a tiny random one)")
    p.add_argument("--seqs", default="12,20,31,40", help="comma-separated sequence lengths")
    args = p.parse_args(argv)
    lens = tuple(int(x) for x in args.seqs.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from moe_gspo.tiny import make_tiny_checkpoint

            model_dir = make_tiny_checkpoint(f"{tmp}/model", seed=1)
        res = compare(model_dir, lens)
    for label, r in res.items():
        print(f"{label:15s} first bitwise difference: {r['first_difference']}; logits max |d| "
              f"{r['logits_max_abs']:.3g}; max |dlogp| {r['logp_max_abs']:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
