"""Loss aggregation modes: how per-token loss terms l_{i,t} become one number (verl's `loss_agg_mode`).

With n_i the valid tokens of sequence i, N the sequences with at least one valid token and L a
constant (`loss_scale_factor`):

| mode | value | peers |
|---|---|---|
| `token-mean` | sum_{i,t} l_{i,t} / sum_i n_i | DAPO (Yu et al. 2025, arXiv 2503.14476); TRL `dapo` / `bnpo`, CISPO's paper form |
| `seq-mean-token-mean` | (1/N) sum_i (1/n_i) sum_t l_{i,t} | GRPO (DeepSeekMath, arXiv 2402.03300); TRL `grpo`; this project's old `seq_mean` |
| `seq-mean-token-sum` | (1/N) sum_i sum_t l_{i,t} | verl's mode of that name |
| `seq-mean-token-sum-norm` | (1/N) sum_i sum_t l_{i,t} / L | Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): no 1/n_i length normalisation, a constant instead; TRL `dr_grpo` (L = max_completion_length) |

Differences from the peers, chosen for data-parallel exactness:
- `seq-mean-token-sum-norm` divides by N as well, like TRL's `dr_grpo` (sum / (B * L)); verl's
  function divides only by L and gets the 1/N from the caller's mini-batch scaling. L is
  `algo.loss_scale_factor` (null = `rollout.max_new_tokens`, like TRL), never the padded length of
  one micro-batch (verl's default when unset), which would change with the sharding.
- The old `algo.aggregation` values are aliases: `seq_mean` = `seq-mean-token-mean`,
  `token_mean` = `token-mean` (`ALIASES`).

Every mode is a sum of per-unit values divided by a count of units: tokens for `token-mean`,
sequences for the three `seq-mean-*` modes (`num_units`). The learner weights each micro-batch's
loss by its share of the mini-batch's units, so that data-parallel ranks and micro-batches add up
to the loss of the whole mini-batch.
"""

from __future__ import annotations

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ALIASES = {"seq_mean": "seq-mean-token-mean", "token_mean": "token-mean"}
"""The old `aggregation` values and the modes they name."""
SEQUENCE_LEVEL_MODE = "seq-mean-token-mean"
"""The one mode of the sequence-level methods (gspo, gspo_token, gmpo): one term per sequence, its
token mean already inside the sequence ratio."""


def resolve_loss_agg_mode(loss_agg_mode: str | None, aggregation: str | None, default: str) -> str:
    """The mode named by `loss_agg_mode`, else by the alias `aggregation`, else `default`; ValueError
    for unknown names or two that contradict each other."""
    if loss_agg_mode is not None and loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    if aggregation is not None and aggregation not in ALIASES:
        raise ValueError(f"aggregation must be one of {tuple(ALIASES)} (aliases of loss_agg_mode "
                         f"{tuple(ALIASES.values())}), got {aggregation!r}")
    alias = ALIASES.get(aggregation) if aggregation is not None else None
    if loss_agg_mode is not None and alias is not None and alias != loss_agg_mode:
        raise ValueError(f"aggregation={aggregation!r} means loss_agg_mode={alias!r}, which contradicts "
                         f"loss_agg_mode={loss_agg_mode!r}; give only loss_agg_mode")
    return loss_agg_mode or alias or default


def check_loss_scale_factor(mode: str, loss_scale_factor: float | None) -> None:
    """ValueError unless seq-mean-token-sum-norm has a positive constant (and only it uses one)."""
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or not float(loss_scale_factor) > 0:
            raise ValueError(f"loss_agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor > 0 (the constant "
                             f"length L each sequence's token sum is divided by, e.g. the maximum response length), "
                             f"got {loss_scale_factor!r}")


def aggregate(values_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, *,
              loss_scale_factor: float | None = None) -> torch.Tensor:
    """The 0-dim aggregate of per-token values (which must be 0 at masked positions) under `mode`;
    0 when there is no valid token."""
    num_tok_B = mask_BT.sum(-1)
    if mode == "token-mean":
        return values_BT.sum() / num_tok_B.sum().clamp(min=1).to(values_BT.dtype)
    num_seqs = (num_tok_B > 0).sum().clamp(min=1).to(values_BT.dtype)
    per_seq_B = values_BT.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq_B = per_seq_B / num_tok_B.clamp(min=1).to(values_BT.dtype)
    elif mode == "seq-mean-token-sum-norm":
        per_seq_B = per_seq_B / float(loss_scale_factor)
    else:
        assert mode == "seq-mean-token-sum", mode
    return per_seq_B.sum() / num_seqs


def unit_count(mask_BT: torch.Tensor, mode: str) -> torch.Tensor:
    """`num_units` as an int64 0-dim tensor on the mask's device (no host sync)."""
    if mode == "token-mean":
        return mask_BT.sum()
    return mask_BT.any(-1).sum()


def num_units(mask_BT: torch.Tensor, mode: str) -> int:
    """How many units `mode` averages over in this batch: valid tokens for token-mean, sequences with
    a valid token otherwise (the weights of micro-batches and data-parallel shards)."""
    return int(unit_count(mask_BT, mode))


def piece_weight(mask_BT: torch.Tensor, mode: str, *, dp_size: int, num_units_total: int) -> torch.Tensor:
    """float32 0-dim tensor on the mask's device: the weight `units * dp_size / num_units_total` of a piece
    (micro-batch, data-parallel shard) of a batch with `num_units_total` units in all, whose mean loss over
    its own units then sums to the batch's mean over all ranks. Computed in float64 and rounded once, so it
    equals the Python number `num_units(mask, mode) * dp_size / num_units_total` rounded to float32, without
    reading the count on the host."""
    return (unit_count(mask_BT, mode).double() * dp_size / num_units_total).float()
