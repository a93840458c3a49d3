"""Every EP=2 check in one torchrun launch (2 CPU processes over gloo); results go to a JSON file.

Launched by `tests/mcore/test_ep2.py` as
`python -m torch.distributed.run --standalone --nproc-per-node 2 _ep2_worker.py OUT_JSON`.
Rank 0 writes a sharded tiny checkpoint next to OUT_JSON; both ranks load it with EP=2 (world 2 =
EP 2 x DP 1 in the expert layout, i.e. each rank is its own data-parallel shard for the dense
weights). Batch convention: a [4, 16] batch, rank r runs rows [2r, 2r+2) (its own shard), and the
allgather token dispatcher sends tokens to the experts of both ranks. The reference is the
transformers model on the same rows. Each rank records its numbers; rank 0 writes
`{"ranks": [rank0_results, rank1_results]}`.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _max_rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


def run_checks(out_dir: Path) -> dict:
    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from _mcore_parity import hf_forward, mcore_forward, topk_mismatches
    from moe_gspo.mcore.checkpoint import (load_hf_config, load_megatron_from_hf_dir, read_hf_weights,
                                           save_hf_checkpoint)
    from moe_gspo.mcore.parallel import init_distributed
    from moe_gspo.mcore.weights import gather_hf_state_dict, gather_to_hf, megatron_to_hf
    from moe_gspo.tiny import make_tiny_checkpoint

    info = init_distributed(ep_size=2, num_experts=8, seed=0)
    res: dict = {"rank": info.rank, "ep_rank": info.ep_rank, "world_size": info.world_size}
    ckpt = out_dir / "ckpt"
    if info.rank == 0:
        make_tiny_checkpoint(ckpt, seed=7, max_shard_size="50KB")
    dist.barrier()

    cfg = load_hf_config(ckpt)
    read = read_hf_weights(ckpt, cfg, ep_rank=info.ep_rank, ep_size=2)
    res["experts_read"] = sorted({int(k.split(".")[5]) for k in read if ".mlp.experts." in k})
    res["num_tensors_read"] = len(read)

    model, cfg = load_megatron_from_hf_dir(ckpt, ep_size=2, vocab_pad_multiple=8)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    res["local_expert_modules"] = len(model.decoder.layers[1].mlp.experts.local_experts)

    # logits and routed top-k sets on this rank's shard of the batch
    ids = torch.randint(1, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    mine = ids[2 * info.ep_rank: 2 * info.ep_rank + 2]
    ref_logits, ref_masks = hf_forward(hf, mine)
    logits, masks = mcore_forward(model, mine)
    res["max_abs_logit_diff"] = float((logits.detach() - ref_logits.detach()).abs().max())
    res["topk_mismatches"] = topk_mismatches(masks, ref_masks)
    res["num_tokens_routed"] = [int(m.shape[0] * m.shape[1]) for m in masks]

    # gradients: dense grads summed over the DP ranks, expert grads gathered, vs the full-batch HF grads
    w = torch.randn(4, 16, cfg.vocab_size, generator=torch.Generator().manual_seed(1))
    (logits * w[2 * info.ep_rank: 2 * info.ep_rank + 2]).sum().backward()
    (hf(ids).logits * w).sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    for k, g in grads.items():
        if ".local_experts." not in k:
            dist.all_reduce(g)
    hf_grads = gather_to_hf(grads, cfg)
    res["max_rel_grad_diff"] = max(_max_rel(hf_grads[n], p.grad) for n, p in hf.named_parameters())
    res["grad_names_compared"] = len(hf_grads)

    # weights back to HF names, bit-exact, both layouts
    sd = hf.state_dict()
    fused = gather_hf_state_dict(model)
    res["gather_fused_exact"] = set(fused) == set(sd) and all(torch.equal(fused[k], sd[k]) for k in sd)
    per_expert = gather_hf_state_dict(model, layout="per_expert")
    disk = {}
    with open(ckpt / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    for name, fname in weight_map.items():
        with safe_open(str(ckpt / fname), framework="pt") as f:
            disk[name] = f.get_tensor(name)
    res["gather_per_expert_exact"] = set(per_expert) == set(disk) and all(
        torch.equal(per_expert[k], disk[k]) for k in disk)
    # the rollout weight stream: per layer, experts gathered over EP, same tensors as the full gather
    from moe_gspo.mcore.weight_stream import HFWeightStream

    for layout, want in (("fused", sd), ("per_expert", disk)):
        stream = HFWeightStream(model, layout=layout)
        got = [(n, t.clone()) for n, t in stream]
        res[f"stream_{layout}_exact"] = [n for n, _ in got] == [s.name for s in stream.specs] and \
            set(want) == {n for n, _ in got} and all(torch.equal(t, want[n]) for n, t in got)
        res[f"stream_{layout}_peak_bytes"] = stream.stats.peak_bucket_bytes
        res[f"stream_{layout}_bytes"] = stream.stats.bytes_yielded
    res["layer_expert_bytes"] = cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    res["qkv_bytes"] = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim * cfg.hidden_size * 4
    all_sds = [None] * info.world_size
    dist.all_gather_object(all_sds, {k: v.detach().clone() for k, v in model.state_dict().items()
                                     if not k.endswith("_extra_state")})
    merged = megatron_to_hf(all_sds, cfg)
    res["merge_per_rank_exact"] = set(merged) == set(sd) and all(torch.equal(merged[k], sd[k]) for k in sd)

    # the grouped expert layout (issue 40: experts.weight1/weight2 per layer) at EP=2: same logits and
    # gradients as the per-expert layout, and every HF conversion exact
    grouped, _ = load_megatron_from_hf_dir(ckpt, ep_size=2, vocab_pad_multiple=8, expert_layout="grouped")
    res["grouped_expert_params"] = sorted(n for n, _ in grouped.named_parameters() if ".experts." in n)[:2]
    g_logits, g_masks = mcore_forward(grouped, mine)
    res["grouped_max_abs_logit_diff"] = float((g_logits.detach() - logits.detach()).abs().max())
    (g_logits * w[2 * info.ep_rank: 2 * info.ep_rank + 2]).sum().backward()
    g_grads = {k: p.grad.clone() for k, p in grouped.named_parameters()}
    for k, g in g_grads.items():
        if ".experts." not in k:
            dist.all_reduce(g)
    g_hf_grads = gather_to_hf(g_grads, cfg)
    res["grouped_max_rel_grad_diff"] = max(_max_rel(g_hf_grads[n], hf_grads[n]) for n in hf_grads)
    g_fused, g_per = gather_hf_state_dict(grouped), gather_hf_state_dict(grouped, layout="per_expert")
    ok = set(g_fused) == set(sd) and all(torch.equal(g_fused[k], sd[k]) for k in sd)
    ok = ok and set(g_per) == set(disk) and all(torch.equal(g_per[k], disk[k]) for k in disk)
    for layout, want in (("fused", sd), ("per_expert", disk)):
        got = [(n, t.clone()) for n, t in HFWeightStream(grouped, layout=layout)]
        ok = ok and set(want) == {n for n, _ in got} and all(torch.equal(t, want[n]) for n, t in got)
    g_sds = [None] * info.world_size
    dist.all_gather_object(g_sds, {k: v.detach().clone() for k, v in grouped.state_dict().items()
                                   if not k.endswith("_extra_state")})
    g_merged = megatron_to_hf(g_sds, cfg)
    res["grouped_conversions_exact"] = ok and set(g_merged) == set(sd) and all(
        torch.equal(g_merged[k], sd[k]) for k in sd)

    # save from EP=2 (rank 0 writes), reload in transformers, same logits
    saved = save_hf_checkpoint(model, cfg, out_dir / "saved", tokenizer_dir=ckpt, max_shard_size="100KB")
    reloaded, loading = AutoModelForCausalLM.from_pretrained(str(saved), output_loading_info=True)
    res["saved_missing_or_unexpected"] = list(loading["missing_keys"]) + list(loading["unexpected_keys"])
    with torch.no_grad():
        res["saved_logits_equal"] = bool(torch.equal(reloaded.eval()(ids).logits, hf(ids).logits))
    return res


def main() -> None:
    import torch.distributed as dist

    out_json = Path(sys.argv[1])
    try:
        res = run_checks(out_json.parent)
    except Exception:
        res = {"error": traceback.format_exc()}
    gathered = [None, None]
    if dist.is_initialized():
        dist.all_gather_object(gathered, res)
        if dist.get_rank() == 0:
            tmp = out_json.with_suffix(".tmp")
            tmp.write_text(json.dumps({"ranks": gathered}, indent=1))
            tmp.replace(out_json)
        dist.barrier()
        from moe_gspo.mcore.parallel import destroy_distributed

        destroy_distributed()
    else:
        out_json.write_text(json.dumps({"ranks": [res]}))


if __name__ == "__main__":
    main()
