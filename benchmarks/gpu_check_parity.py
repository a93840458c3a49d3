"""`benchmarks.gpu_check`'s parity check (check 1): the learner in bf16 against transformers, both against fp32."""

from __future__ import annotations

import copy

from benchmarks.gpu_check_job import MODEL

def check_parity(hf_kwargs: dict, *, device, dtype, batch: int = 4, seq_len: int = 256, seed: int = 0) -> dict:
    """Learner (Megatron) vs transformers in `dtype`, both against transformers in fp32 (see the module
    docstring). Needs `moe_gspo.mcore.parallel.init_distributed` (EP=1) in this process."""
    import torch
    from transformers import Qwen3MoeConfig

    from moe_gspo.learner.logprobs import token_logprobs
    from moe_gspo.mcore.model import build_gpt_model, forward_logits
    from moe_gspo.mcore.weights import load_hf_model_into_megatron, megatron_to_hf
    from moe_gspo.tiny import build_tiny_model

    cfg = Qwen3MoeConfig(**hf_kwargs)
    ref = build_tiny_model(cfg, seed=seed)  # fp32 truth (router weights scaled as in every run)
    low = copy.deepcopy(ref).to(device=device, dtype=dtype)
    ref = ref.to(device)
    model = build_gpt_model(cfg, params_dtype=dtype, expert_layout="auto")  # the experts a run builds here
    load_hf_model_into_megatron(model, low)
    ids = torch.randint(3, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed)).to(device)

    def run(logits_fn, params):
        for p in params:
            p.grad = None
        logp, _ = token_logprobs(logits_fn(), ids)
        (-logp[:, 1:].mean()).backward()
        return logp[:, 1:].detach().float()

    lp_ref = run(lambda: ref(ids).logits, ref.parameters())
    lp_low = run(lambda: low(ids).logits, low.parameters())
    lp_mc = run(lambda: forward_logits(model, ids), model.parameters())
    g_ref = {k: p.grad.float() for k, p in ref.named_parameters()}
    g_low = {k: p.grad.float() for k, p in low.named_parameters()}
    g_mc = {k: v.float() for k, v in megatron_to_hf({k: p.grad for k, p in model.named_parameters()}, cfg).items()}

    def rel(grads) -> float:
        num = sum(float((grads[k] - g).pow(2).sum()) for k, g in g_ref.items())
        return (num / sum(float(g.pow(2).sum()) for g in g_ref.values())) ** 0.5

    out = {"logp_abs_err_mean": {"learner": float((lp_mc - lp_ref).abs().mean()),
                                 "transformers": float((lp_low - lp_ref).abs().mean())},
           "logp_abs_err_max": {"learner": float((lp_mc - lp_ref).abs().max()),
                                "transformers": float((lp_low - lp_ref).abs().max())},
           "grad_rel_err": {"learner": rel(g_mc), "transformers": rel(g_low)},
           "learner_vs_transformers_logp_abs_diff_max": float((lp_mc - lp_low).abs().max()),
           "batch": [batch, seq_len], "dtype": str(dtype).replace("torch.", "")}
    ok = (out["logp_abs_err_mean"]["learner"] <= 2 * out["logp_abs_err_mean"]["transformers"] + 1e-3
          and out["grad_rel_err"]["learner"] <= 2 * out["grad_rel_err"]["transformers"] + 1e-2)
    out["status"] = "pass" if ok else "fail"
    out["headline"] = (f"log-prob error vs fp32 {out['logp_abs_err_mean']['learner']:.2e} (transformers bf16 "
                       f"{out['logp_abs_err_mean']['transformers']:.2e}); gradient rel. error "
                       f"{out['grad_rel_err']['learner']:.3f} ({out['grad_rel_err']['transformers']:.3f})")
    del ref, low, model
    return out


def _parity_on_cuda() -> dict:
    import torch

    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed

    from moe_gspo.mcore.swiglu import compile_status

    init_distributed(ep_size=1, num_experts=MODEL["num_experts"], seed=0)
    try:
        out = check_parity(MODEL, device=torch.device("cuda"), dtype=torch.bfloat16)
        out["fused_swiglu"] = compile_status()  # the grouped experts' SwiGLU on this GPU (issue 48)
        out["headline"] += f"; fused SwiGLU {out['fused_swiglu']}"
        return out
    finally:
        destroy_distributed()
        torch.cuda.empty_cache()
