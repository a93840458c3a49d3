"""The routing-drift dial: perturb which experts a router selects, and nothing else (issue 47).

A controlled dose of rollout/learner routing drift. The rollout engine's routers select their top-k
experts from perturbed scores; the gate weights of the selected experts come from the *clean* router logits,
gathered at the selected ids (softmax over all experts, then renormalised over the k chosen when
`norm_topk_prob`), exactly as Megatron's routing replay computes them for replayed ids
(`router_replay.py`: the scores of the current logits gathered at the replayed top-k). So the dial moves
routing only: R3, replaying the rollout's (perturbed) routes in the learner, removes its effect up to the
engines' float tolerance, and a dial at zero runs none of this code (bit-identical to an undialled run).

Two forms, usable together (noise first, then the swap on the noisy ranking):
- `noise_std` = σ: Gaussian noise on the router logits before top-k, in units of each token's own logit
  standard deviation over the experts (`logits + σ * std_E(logits) * N(0, 1)`), so σ means the same on
  routers of any scale. The flip rate rises with σ and with how close each token's k-th and (k+1)-th
  experts are (the router margin).
- `flip_prob` = p: with probability p per (token, MoE layer), the k-th chosen expert is swapped for the
  (k+1)-th. Each swap changes the token's expert set, so the flip rate is p exactly in expectation.

Pure maths: tensors and scalars in, tensors out; the caller owns the random generator (one stream per
generation, drawn in the same order by both of the transformers engine's decoders:
`moe_gspo.rollout.routing_dial`).
"""

from __future__ import annotations

import math

import torch


def check_dial(noise_std: float, flip_prob: float, *, top_k: int | None = None,
               num_experts: int | None = None) -> None:
    """ValueError naming the field and the fix for settings the dial cannot run."""
    if not (isinstance(noise_std, (int, float)) and math.isfinite(noise_std) and noise_std >= 0):
        raise ValueError(f"rollout.router_noise_std={noise_std!r} must be a finite number >= 0 (0 = off)")
    if not (isinstance(flip_prob, (int, float)) and 0.0 <= flip_prob <= 1.0):
        raise ValueError(f"rollout.router_flip_prob={flip_prob!r} must be in [0, 1] (0 = off)")
    if (noise_std > 0 or flip_prob > 0) and top_k is not None and num_experts is not None and top_k >= num_experts:
        raise ValueError(f"rollout.router_noise_std / rollout.router_flip_prob change which experts a router picks, "
                         f"but the model routes every token to all its experts (top_k={top_k} of num_experts="
                         f"{num_experts}); set both to 0 or use a model with num_experts > top_k")


def dial_is_on(noise_std: float, flip_prob: float) -> bool:
    return noise_std > 0 or flip_prob > 0


def dial_topk(logits_NE: torch.Tensor, top_k: int, *, norm_topk_prob: bool, out_dtype: torch.dtype,
              noise_std: float, flip_prob: float, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dialled top-k of one router call.

    Args:
        logits_NE: the router's clean logits for N tokens over E experts (any float dtype).
        top_k: experts per token.
        norm_topk_prob: renormalise the chosen experts' probabilities to sum to 1 (Qwen3-MoE's flag).
        out_dtype: dtype of the returned gate weights (the router's own output dtype).
        noise_std / flip_prob: the dial (module docstring); both 0 gives the router's own top-k.
        generator: the random stream (on the logits' device); draws N*E normals when `noise_std` > 0, then
            N uniforms when `flip_prob` > 0.

    Returns:
        `(weights_NK out_dtype, ids_NK int64, probs_NK, changed_N bool)`: the gate weights of the chosen
        experts (the clean softmax gathered, renormalised when asked), their ids (in the perturbed ranking's
        order), the clean float32 full-softmax probabilities at those ids before renormalisation (what the
        route recorders store, `HFRouterRecorder`), and whether the chosen expert *set* differs from the clean top-k.
    """
    num_experts = logits_NE.shape[-1]
    assert 1 <= top_k <= num_experts, (top_k, num_experts)
    prob_dtype = torch.float64 if logits_NE.dtype == torch.float64 else torch.float32
    probs_NE = torch.softmax(logits_NE, dim=-1, dtype=prob_dtype)
    clean_ids_NK = torch.topk(probs_NE, top_k, dim=-1).indices
    width = min(top_k + 1, num_experts) if flip_prob > 0 else top_k
    if noise_std > 0:
        x_NE = logits_NE.to(prob_dtype)
        noise_NE = torch.randn(x_NE.shape, generator=generator, device=x_NE.device, dtype=prob_dtype)
        scores_NE = x_NE + noise_std * x_NE.std(dim=-1, keepdim=True) * noise_NE
    else:
        scores_NE = probs_NE  # the router's own ranking (its tie-breaking too)
    ranked_NW = torch.topk(scores_NE, width, dim=-1).indices
    ids_NK = ranked_NW[:, :top_k]
    if flip_prob > 0 and width > top_k:
        swap_N = torch.rand(ids_NK.shape[0], generator=generator, device=ids_NK.device) < flip_prob
        ids_NK = ids_NK.clone()
        ids_NK[:, -1] = torch.where(swap_N, ranked_NW[:, top_k], ids_NK[:, -1])
    chosen_NK = probs_NE.gather(-1, ids_NK)
    weights_NK = chosen_NK / chosen_NK.sum(dim=-1, keepdim=True) if norm_topk_prob else chosen_NK
    changed_N = (ids_NK.sort(dim=-1).values != clean_ids_NK.sort(dim=-1).values).any(dim=-1)
    probs32_NE = probs_NE if prob_dtype == torch.float32 else torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
    return weights_NK.to(out_dtype), ids_NK, probs32_NE.gather(-1, ids_NK), changed_N
