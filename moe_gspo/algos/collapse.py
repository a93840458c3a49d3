"""Signs of policy collapse in a batch: entropy, groups without learning signal, zero advantages.

A group-relative method (GRPO, GSPO) learns only from groups whose G rewards differ: a group whose
responses all get the same reward has advantage 0 for every response, and once most groups are like
that the gradient vanishes although the reward may still be below its maximum (a deterministic,
partly wrong policy). These metrics make that visible, per step:

- `actor/entropy`: mean per-token entropy (nats) of the policy's next-token distribution over the
  valid response tokens of the batch (one token mean over the whole batch, not per sequence).
  Peers: verl's `actor/entropy` and TRL's `entropy` are the same quantity (the mean entropy of the
  distributions that predicted the response tokens), but measured in the update's forward passes,
  i.e. averaged over the mini-batches' current policies; the caller here passes the entropies of
  the old-policy pass (the policy that sampled the batch, before this step's updates, which is the
  first mini-batch's policy) and says so.
- `reward/frac_zero_std`: share of prompt groups whose G rewards are all equal (TRL's
  `frac_reward_zero_std`; TRL tests the std with `isclose(std, 0)`, here max == min exactly).
- `advantage/nonzero_frac`: share of sequences whose advantage is not 0 (those that carry gradient).

Pure functions on tensors; no distributed code.
"""

from __future__ import annotations

import torch

from moe_gspo.algos.ratios import as_bool_mask, masked_mean

COLLAPSE_KEYS = ("actor/entropy", "reward/frac_zero_std", "advantage/nonzero_frac")


def group_signal_metrics(rewards_N: torch.Tensor, advantages_N: torch.Tensor, group_size: int) -> dict[str, float]:
    """`reward/frac_zero_std` and `advantage/nonzero_frac` of one batch.

    Args:
        rewards_N: [N] rewards, groups contiguous (rewards_N[g*G:(g+1)*G] = prompt g's responses).
        advantages_N: [N] the advantages the loss uses.
        group_size: G (must divide N).
    """
    rewards_N, advantages_N = torch.as_tensor(rewards_N), torch.as_tensor(advantages_N)
    if rewards_N.dim() != 1 or advantages_N.shape != rewards_N.shape:
        raise ValueError(f"rewards_N and advantages_N must be 1-D of one length, got {tuple(rewards_N.shape)} and "
                         f"{tuple(advantages_N.shape)}")
    num = rewards_N.numel()
    if group_size < 1 or num % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the {num} rewards")
    if num == 0:
        return {"reward/frac_zero_std": float("nan"), "advantage/nonzero_frac": float("nan")}
    r_GS = rewards_N.detach().double().reshape(-1, group_size)
    zero_std_G = r_GS.amax(-1) == r_GS.amin(-1)
    return {"reward/frac_zero_std": float(zero_std_G.double().mean()),
            "advantage/nonzero_frac": float((advantages_N.detach() != 0).double().mean())}


def mean_token_entropy(entropy_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """Mean of `entropy_BT` over the valid tokens of `mask_BT` ([B, T]; masked positions may hold
    garbage); NaN when no token is valid."""
    if entropy_BT.shape != mask_BT.shape or entropy_BT.dim() != 2:
        raise ValueError(f"entropy_BT and mask_BT must be [B, T] of one shape, got {tuple(entropy_BT.shape)} and "
                         f"{tuple(mask_BT.shape)}")
    mask = as_bool_mask(mask_BT)
    num = mask.sum()
    if int(num) == 0:
        return float("nan")
    values = torch.where(mask, entropy_BT.detach().double(), 0.0)
    return float(masked_mean(values, mask, num))
