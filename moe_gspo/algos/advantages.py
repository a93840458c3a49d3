"""Group-normalised advantages (the "group relative" part of GRPO and GSPO).

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, outcome supervision) and GSPO
(Zheng et al. 2025, arXiv 2507.18071, eq. for A_hat_i) score each of the G responses of one prompt
by its reward relative to the group: A_i = (r_i - mean(r)) / std(r).

Scaling (`scale_rewards`, TRL's `GRPOConfig.scale_rewards` names): the numerator is always
r_i - mean of its group; the denominator is
- `group` (default; the papers): std of the group's rewards + eps;
- `batch`: std of ALL rewards of the batch + eps (TRL cites "PPO Lite", Liu et al. 2025,
  arXiv 2508.08221: group mean, batch std);
- `none`: 1 (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783: the division by the group std biases the
  update towards groups that are nearly solved or nearly failed; verl's `norm_adv_by_std_in_grpo=False`).

Choices and simplifications:
- std is the POPULATION standard deviation by default (divide by G, or the batch size,
  `std_correction=0`). The papers write std(r) without saying which; TRL and verl use the
  Bessel-corrected one (divide by G - 1, `std_correction=1`), which gives advantages smaller by a
  factor sqrt((G - 1) / G). The population std is defined for G = 1 as well.
- `eps` is added to the std (not under a square root), so A = (r - mean) / (std + eps); TRL's eps is
  1e-4, this project's `algo.adv_eps` default 1e-6.
- A group whose rewards are all equal gets advantage exactly 0 (not a rounding residue divided by
  eps); such a group carries no learning signal.
- The same advantage is given to every token of a response (outcome rewards only; no process
  rewards, no discounting).
- Groups are contiguous: rewards_N[g*G : (g+1)*G] are the G responses of prompt g, the order the
  rollout engines return samples in.
"""

from __future__ import annotations

import torch


SCALE_REWARDS = ("group", "batch", "none")


def group_advantages(rewards_N: torch.Tensor, group_size: int, eps: float = 1e-6, *,
                     scale_rewards: str = "group", std_correction: int = 0) -> torch.Tensor:
    """Centre rewards within contiguous groups and scale them: (r - mean_group) / scale.

    Args:
        rewards_N: [N] rewards, N = num_groups * group_size, groups contiguous. Any real dtype.
        group_size: G, the number of responses per prompt (>= 1, must divide N).
        eps: added to the population std (>= 0).
        scale_rewards: "group" (scale = std of the group + eps), "batch" (std of all N rewards + eps)
            or "none" (scale = 1).
        std_correction: 0 = population std (divide by the count), 1 = Bessel-corrected (divide by the
            count - 1, as TRL and verl).

    Returns:
        [N] advantages, in the rewards' dtype when it is floating point, else the default float
        dtype; computed in float64. Groups with all-equal rewards get exactly 0.
    """
    if not isinstance(rewards_N, torch.Tensor):
        rewards_N = torch.as_tensor(rewards_N)
    if rewards_N.dim() != 1:
        raise ValueError(f"rewards_N must be a 1-D tensor [N], got shape {tuple(rewards_N.shape)}; flatten it")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int (responses per prompt), got {group_size!r}")
    num = rewards_N.shape[0]
    if num % group_size != 0:
        raise ValueError(
            f"rewards_N has {num} entries, not a multiple of group_size={group_size}; "
            "pass num_groups * group_size rewards with each group's responses contiguous"
        )
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if std_correction not in (0, 1):
        raise ValueError(f"std_correction must be 0 (population std) or 1 (Bessel-corrected), got {std_correction!r}")
    if std_correction and scale_rewards == "group" and group_size < 2:
        raise ValueError("std_correction=1 needs group_size >= 2 (the corrected std of one reward is undefined)")
    out_dtype = rewards_N.dtype if rewards_N.is_floating_point() else torch.get_default_dtype()

    rewards_GS = rewards_N.detach().to(torch.float64).reshape(-1, group_size)
    if not bool(torch.isfinite(rewards_GS).all()):
        raise ValueError("rewards_N contains nan or inf; fix the reward function")
    mean_G1 = rewards_GS.mean(-1, keepdim=True)
    centred_GS = rewards_GS - mean_G1
    if scale_rewards == "group":
        adv_GS = centred_GS / (rewards_GS.std(-1, correction=std_correction, keepdim=True) + eps)
    elif scale_rewards == "batch":
        adv_GS = centred_GS / (rewards_GS.std(correction=std_correction) + eps)
    else:
        adv_GS = centred_GS
    constant_G1 = (rewards_GS.amax(-1, keepdim=True) == rewards_GS.amin(-1, keepdim=True))
    adv_GS = torch.where(constant_G1, 0.0, adv_GS)
    return adv_GS.reshape(num).to(out_dtype)
