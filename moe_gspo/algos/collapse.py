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

`detect_failure` reads a run's logged curves of these (and `reward/mean`) and says whether and
when the run failed: its reward collapsed, or it stalled without learning signal (`FailureCriteria`).

Pure functions on tensors / numpy arrays; no distributed code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
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


# --------------------------------------------------------------------------- failure of a run

@dataclass(frozen=True, kw_only=True)
class FailureCriteria:
    """Pre-registered definition of a failed run (fixed before the confirmatory experiment).

    Per step t (the position in the run's logged steps, 0-based; T steps):
    R̄_t = mean of `reward/mean` over steps t - window + 1 .. t (fewer at the start), Z̄_t = the same
    trailing mean of `reward/frac_zero_std` (share of prompt groups whose rewards are all equal: no
    learning signal); B_t = max over s ≤ t of R̄_s.

    - collapse at t: R̄_t ≤ B_t − drop, and R̄_u ≤ B_t − drop at every later step u (it never recovers
      to within `drop` of that best);
    - stall at t: Z̄_t ≥ stall_enter and R̄_t < solved, and at every later u Z̄_u ≥ stall_stay and
      R̄_u < solved (the policy became nearly deterministic and partly wrong, so group-relative
      methods get no gradient);
    - an event counts only when it holds from t to the last step and t ≤ T − min_persist (at least
      `min_persist` steps from t on); otherwise the run is censored at its last step;
    - dead at t (only with `dead_reward` set; issue 47's detector, `analysis.phase_runs.FAILURE_V2`): R̄_u ≤
      dead_reward at t and at every later step u. It needs no `min_persist` steps: a run that *ends* dead failed,
      however late it fell (the end-of-run miss of experiments 1-2, where a reward fell to ~0 without a relative
      drop of `drop` from a low best, or late);
    - the failure step is the earliest t of any kind; collapse wins a tie, then stall.
    """

    window: int = 10
    drop: float = 0.3
    stall_enter: float = 0.9
    stall_stay: float = 0.75
    solved: float = 0.9
    min_persist: int = 20
    dead_reward: float | None = None
    """None (experiments 1-2's pre-registered detector): no "dead" kind."""


@dataclass(frozen=True)
class FailureEvent:
    kind: Literal["collapse", "stall", "dead"] | None
    step: int | None
    """Index of the failure step in the given arrays (None: no failure, censored)."""
    censored_at: int
    """Index of the run's last step (T - 1); -1 for an empty run."""


def trailing_mean(x_T: np.ndarray, window: int) -> np.ndarray:
    """Mean of x over the last `window` steps up to each t (fewer at the start), NaN entries left out
    (NaN where a window holds none)."""
    x_T = np.asarray(x_T, np.float64)
    if x_T.size == 0:
        return x_T.copy()
    padded = np.concatenate([np.full(window - 1, np.nan), np.where(np.isfinite(x_T), x_T, np.nan)])
    win_TW = np.lib.stride_tricks.sliding_window_view(padded, window)  # sums of ≤ window values: no drift
    ok_TW = np.isfinite(win_TW)
    n_T = ok_TW.sum(axis=1)
    sums = np.where(ok_TW, win_TW, 0.0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_T > 0, sums / np.maximum(n_T, 1), np.nan)


def _first(cond_T: np.ndarray, last_allowed: int) -> int | None:
    hits = np.flatnonzero(cond_T[:max(0, last_allowed + 1)])
    return int(hits[0]) if hits.size else None


def detect_failure(reward_T, zero_std_T=None, criteria: FailureCriteria = FailureCriteria()) -> FailureEvent:
    """Collapse or stall of one run (see `FailureCriteria`) from its per-step `reward/mean` and
    `reward/frac_zero_std` (same steps, in order; NaN steps are left out of the trailing means;
    `zero_std_T` None or all NaN: no stall can be detected)."""
    c = criteria
    r = trailing_mean(np.asarray(reward_T, np.float64), c.window)
    T = r.size
    if T == 0:
        return FailureEvent(None, None, -1)
    eps = 1e-9  # a mean of 10 x 0.9 is 0.8999999999999999: thresholds are met within rounding
    r_ok = np.where(np.isfinite(r), r, -np.inf)
    best = np.maximum.accumulate(r_ok)
    suffix_max = np.maximum.accumulate(np.where(np.isfinite(r), r, -np.inf)[::-1])[::-1]
    collapse = np.isfinite(r) & (suffix_max <= best - c.drop + eps)
    if zero_std_T is None:
        stall = np.zeros(T, bool)
    else:
        z = trailing_mean(np.asarray(zero_std_T, np.float64), c.window)
        if z.size != T:
            raise ValueError(f"reward_T and zero_std_T must have one length, got {T} and {z.size}")
        z_min = np.minimum.accumulate(np.where(np.isfinite(z), z, -np.inf)[::-1])[::-1]
        r_max = np.maximum.accumulate(np.where(np.isfinite(r), r, np.inf)[::-1])[::-1]
        stall = (np.isfinite(z) & np.isfinite(r) & (z >= c.stall_enter - eps) & (r < c.solved - eps)
                 & (z_min >= c.stall_stay - eps) & (r_max < c.solved - eps))
    last = T - c.min_persist
    events = [(t, kind) for t, kind in ((_first(collapse, last), "collapse"), (_first(stall, last), "stall"))
              if t is not None]
    if c.dead_reward is not None:
        r_max = np.maximum.accumulate(np.where(np.isfinite(r), r, np.inf)[::-1])[::-1]
        td = _first(np.isfinite(r) & (r_max <= c.dead_reward + eps), T - 1)
        if td is not None:
            events.append((td, "dead"))
    if not events:
        return FailureEvent(None, None, T - 1)
    order = {"collapse": 0, "stall": 1, "dead": 2}
    t, kind = min(events, key=lambda e: (e[0], order[e[1]]))
    return FailureEvent(kind, t, T - 1)
