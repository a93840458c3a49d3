"""Per-token estimators of KL(pi_theta || pi_ref) for the reference penalty (`algo.kl_estimator`).

Schulman 2020, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html); names as verl's
`kl_penalty` / slime use them. With d = log pi_theta(y_t) - log pi_ref(y_t) for a sampled token y_t:

| name | per-token value | verl alias | value, y ~ pi_theta |
|---|---|---|---|
| `k1` | d | `kl` | unbiased, high variance, can be negative |
| `k2` | d^2 / 2 | `mse` | biased (low bias when pi_ref is close), >= 0 |
| `k3` | exp(-d) + d - 1 | `low_var_kl` | unbiased, low variance, >= 0 (this project's default, as the GRPO paper) |

As a loss term (differentiated with respect to theta at theta = theta_old, samples from pi_theta)
the three give different gradients — derived, not measured: k1's per-token gradient is grad log pi,
whose expectation is 0 (no pull towards pi_ref at all on policy); k2's is d * grad log pi, whose
expectation is the gradient of KL(pi_theta || pi_ref); k3's is (1 - pi_ref/pi_theta) grad log pi,
whose expectation is the gradient of the *forward* KL(pi_ref || pi_theta). verl's `k3+`-style
straight-through variants are not provided.

Simplifications: d is clamped to +-`max_log_ratio` before use (verl clamps k3's exponent at 20 and
its value at 10; here only the exponent); the samples come from the rollout policy, not pi_theta,
and no importance weight corrects that (as in verl and TRL by default).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, mask_BT: torch.Tensor, estimator: str,
                *, max_log_ratio: float) -> torch.Tensor:
    """[B, T] per-token estimates (0 at masked positions) of KL(pi_theta || pi_ref).

    `logp_BT` carries the gradient; `ref_logp_BT` is a constant; both must already be finite at
    masked positions (see `loss_inputs.prepare`)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    limit = float(max_log_ratio)
    d = (logp_BT - ref_logp_BT.detach()).clamp(-limit, limit)
    if estimator == "k1":
        est = d
    elif estimator == "k2":
        est = 0.5 * d.square()
    else:  # k3 = r - 1 - log r with r = pi_ref / pi_theta = exp(-d); expm1 avoids cancellation near 0
        est = torch.expm1(-d) + d
    return torch.where(mask_BT, est, 0.0)
