"""Building blocks shared by the policy losses of `moe_gspo.algos.policy_loss`: the sanitised inputs,
the per-algorithm result (`PolicyTerms`) and the clip-fraction metrics.

`prepare` turns the caller's tensors into finite float tensors with zeros at masked positions
(`torch.where` before any arithmetic, so masked garbage — nan, +-inf — never reaches a value or a
gradient), clamps the per-token log ratios to +-`max_log_ratio`, and counts tokens and sequences.
Shared conventions (see the `policy_loss` module docstring): float32, or float64 when `logp_BT` is
float64; `old_logp_BT`, `advantages` and `is_weights_BT` are detached constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_gspo.algos.ratios import as_bool_mask, masked_mean


@dataclass
class LossInputs:
    """Sanitised tensors of one policy-loss call ([B, T] unless said; 0 at masked positions)."""

    mask: torch.Tensor
    """bool [B, T]: valid response tokens."""
    logp: torch.Tensor
    """Current-policy log-probs (carries the gradient)."""
    raw_lr: torch.Tensor
    """logp - old_logp before the clamp."""
    lr: torch.Tensor
    """logp - old_logp clamped to +-limit: the log importance ratio every loss uses."""
    adv_B: torch.Tensor | None
    """[B] per-sequence advantages (0 for empty rows), or None when per-token ones were given."""
    adv_BT: torch.Tensor
    """Per-token advantages (the sequence's advantage on each of its tokens)."""
    is_w_BT: torch.Tensor | None
    """Rollout-correction weights, or None (= all 1)."""
    num_tok_B: torch.Tensor
    """[B] valid tokens per sequence."""
    num_tokens: torch.Tensor
    """0-dim: valid tokens in the batch."""
    seq_valid_B: torch.Tensor
    """bool [B]: sequences with at least one valid token."""
    num_seqs: torch.Tensor
    """0-dim: sequences with at least one valid token."""
    inv_len_B: torch.Tensor
    """[B] 1 / max(1, valid tokens of the sequence)."""
    limit: float
    """max_log_ratio."""

    @property
    def dtype(self) -> torch.dtype:
        return self.logp.dtype

    def seq_mean(self, values_B: torch.Tensor) -> torch.Tensor:
        """Mean of per-sequence values over the valid sequences (0 when there is none)."""
        return torch.where(self.seq_valid_B, values_B, 0.0).sum() / self.num_seqs.clamp(min=1).to(self.dtype)

    def token_mean_per_seq(self, values_BT: torch.Tensor) -> torch.Tensor:
        """[B] mean over each sequence's valid tokens of per-token values (0 at masked positions)."""
        return values_BT.sum(-1) * self.inv_len_B


def prepare(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages: torch.Tensor, mask_BT: torch.Tensor,
            *, is_weights_BT: torch.Tensor | None, max_log_ratio: float) -> LossInputs:
    """Sanitise a validated batch (shapes are checked by the caller)."""
    dtype = torch.promote_types(logp_BT.dtype, torch.float32)
    limit = float(max_log_ratio)
    mask = as_bool_mask(mask_BT)
    num_tok_B = mask.sum(-1)
    seq_valid_B = num_tok_B > 0

    logp = torch.where(mask, logp_BT.to(dtype), 0.0)
    old = torch.where(mask, old_logp_BT.detach().to(dtype), 0.0)
    raw_lr = logp - old
    lr = raw_lr.clamp(-limit, limit)

    adv = advantages.detach().to(dtype)
    if adv.dim() == 1:
        adv_B = torch.where(seq_valid_B, adv, 0.0)
        adv_BT = torch.where(mask, adv_B[:, None], 0.0)
    else:
        adv_B = None
        adv_BT = torch.where(mask, adv, 0.0)
    is_w_BT = None if is_weights_BT is None else torch.where(mask, is_weights_BT.detach().to(dtype), 0.0)
    return LossInputs(mask=mask, logp=logp, raw_lr=raw_lr, lr=lr, adv_B=adv_B, adv_BT=adv_BT, is_w_BT=is_w_BT,
                      num_tok_B=num_tok_B, num_tokens=num_tok_B.sum(), seq_valid_B=seq_valid_B,
                      num_seqs=seq_valid_B.sum(), inv_len_B=1.0 / num_tok_B.clamp(min=1).to(dtype), limit=limit)


def grad_carrier(inp: LossInputs) -> torch.Tensor:
    """exp(logp - sg[logp]): 1 in value, d/dlogp = 1 (0 at masked positions). Multiplying a detached
    per-token weight by it gives a term whose value is the weight and whose gradient is weight * grad
    log pi (GSPO-token's s_{i,t}, CISPO's sg(w) * grad log pi)."""
    return torch.exp(inp.logp - inp.logp.detach())


@dataclass
class PolicyTerms:
    """What one algorithm contributes to `policy_loss`: its objective (to maximise) before aggregation,
    per sequence (sequence-level methods) or per token (token-level methods), and its clip / gate
    metrics (detached 0-dim float64 tensors)."""

    metrics: dict[str, torch.Tensor]
    objective_B: torch.Tensor | None = None
    """[B] per-sequence objective (0 for empty rows), averaged over valid sequences."""
    objective_BT: torch.Tensor | None = None
    """[B, T] per-token objective (0 at masked positions), aggregated per `loss_agg_mode`."""


def clip_metrics(inp: LossInputs, bind_low: torch.Tensor, bind_high: torch.Tensor, out_low: torch.Tensor,
                 out_high: torch.Tensor) -> dict[str, torch.Tensor]:
    """The `clip/*` fractions from bool [B, T] token flags (False at masked positions): tokens whose clip
    binds (takes the gradient away) below / above, tokens whose ratio is out of range below / above,
    and sequences with at least one binding token."""
    with torch.no_grad():
        ones_BT = torch.ones_like(inp.lr, dtype=torch.float64)
        out = {}
        for key, sel in (("clip/token_frac", bind_low | bind_high), ("clip/token_frac_low", bind_low),
                         ("clip/token_frac_high", bind_high), ("clip/out_of_range_frac", out_low | out_high),
                         ("clip/out_of_range_frac_low", out_low), ("clip/out_of_range_frac_high", out_high)):
            out[key] = masked_mean(ones_BT, sel, inp.num_tokens)
        ones_B = torch.ones_like(inp.inv_len_B, dtype=torch.float64)
        out["clip/seq_frac"] = masked_mean(ones_B, (bind_low | bind_high).any(-1), inp.num_seqs)
    return out
