"""Issue 43: the report's "did drift matter" verdict sentences (`analysis.verdicts.drift_verdicts`) on synthetic
records with hand-computed values: one run whose flips and clipping go together, one where they do not, and the
cases without a test (missing metrics, too few steps, a series that never varied)."""

from __future__ import annotations

import math

from scipy.stats import t as student_t

from analysis.verdicts import (
    MIN_TEST_STEPS, drift_clip_sentence, drift_reward_sentence, drift_variance_sentence, drift_verdicts,
)


def _records(flips, clips=None, rewards=None, **extra_lists):
    out = []
    for i, f in enumerate(flips):
        r = {"step": i, "routing/any_layer_flip": f}
        if clips is not None:
            r["clip/token_frac"] = clips[i]
        if rewards is not None:
            r["reward/mean"] = rewards[i]
        for k, vals in extra_lists.items():
            r[k.replace("__", "/")] = vals[i]
        out.append(r)
    return out


def _spearman_p(rho: float, n: int) -> float:
    """scipy's two-sided p of Spearman's ρ: Student t with n − 2 degrees of freedom."""
    t = rho * math.sqrt((n - 2) / (1 - rho * rho))
    return 2 * student_t.sf(abs(t), n - 2)


def test_flips_and_clipping_associated():
    # clip ranks = flip ranks with positions 3 and 4 swapped: Σd² = 2, ρ = 1 − 6·2 / (10·99) = 0.98788
    flips = [0.01 * i for i in range(10)]
    clip_ranks = [0, 1, 2, 4, 3, 5, 6, 7, 8, 9]
    clips = [0.1 + 0.02 * r for r in clip_ranks]
    rho = 1 - 12 / 990
    p = _spearman_p(rho, 10)
    assert drift_clip_sentence(_records(flips, clips)) == (
        "Drift and clipping, per-step share of routing-flipped tokens (routing/any_layer_flip) vs share of clipped "
        f"tokens (clip/token_frac): a positive association (Spearman ρ = 0.99, p = {p:.2g}, n = 10 steps; a "
        "correlation across steps, which a trend shared over training also produces, not evidence of cause).")
    assert f"{p:.2g}" == "9.3e-08"


def test_flips_and_clipping_not_associated():
    # clip ranks (0, 3, 5, 6, 7, 4, 2, 1) against 0..7: Σd² = 0+4+9+9+9+1+16+36 = 84 = n(n²−1)/6, so ρ = 0, p = 1
    flips = [0.02 + 0.01 * i for i in range(8)]
    clips = [0.05 * r for r in (0, 3, 5, 6, 7, 4, 2, 1)]
    assert drift_clip_sentence(_records(flips, clips)) == (
        "Drift and clipping, per-step share of routing-flipped tokens (routing/any_layer_flip) vs share of clipped "
        "tokens (clip/token_frac): no association detected (Spearman ρ = 0.00, p = 1, n = 8 steps).")


def test_flips_and_next_reward_change():
    # reward changes r[t+1] − r[t] for t = 0..7 ordered like the flips (ρ = 1 − 6·0 / … = 1 would give p = 0);
    # use the rank pattern of the no-association case: ρ = 0, p = 1 over 8 step pairs (9 steps of reward)
    flips = [0.01 * i for i in range(8)] + [0.5]
    changes = [0.01 * r for r in (0, 3, 5, 6, 7, 4, 2, 1)]
    rewards = [0.2]
    for c in changes:
        rewards.append(rewards[-1] + c)
    s = drift_reward_sentence(_records(flips, rewards=rewards))
    assert s == ("Drift and reward, a step's share of routing-flipped tokens (routing/any_layer_flip) vs the change "
                 "of reward/mean from that step to the next: no association detected (Spearman ρ = 0.00, p = 1, "
                 "n = 8 step pairs).")
    # rewards falling more after steps with more flips: ρ = −1, a negative association
    falling = [1.0]
    for i in range(8):
        falling.append(falling[-1] - 0.01 * i)
    assert "a negative association (Spearman ρ = -1.00, p = 0, n = 8 step pairs;" in drift_reward_sentence(
        _records(flips, rewards=falling))


def test_variance_share_against_token_share():
    # steps 0 and 1 define the share (step 2's is null): share (0.1 + 0.3) / 2 = 20%, tokens (0.02 + 0.04) / 2 = 3%
    recs = _records([0.1, 0.2, 0.3], mismatch_ratio__token_var_share_flipped=[0.1, 0.3, None],
                    mismatch_ratio__flipped_token_frac=[0.02, 0.04, 0.0])
    assert drift_variance_sentence(recs) == (
        "Drift and ratio variance: tokens routed differently in at least one MoE layer were 3% of the response "
        "tokens and carried 20% of the learner/rollout token-ratio variance (means over the 2 steps with such "
        "tokens of mismatch_ratio/flipped_token_frac and mismatch_ratio/token_var_share_flipped), 6.67× their "
        "share of the tokens.")


def test_no_test_without_data():
    assert MIN_TEST_STEPS == 8
    few = _records([0.1, 0.2, 0.3], clips=[0.1, 0.3, 0.2], rewards=[0.0, 0.1, 0.2])
    assert drift_clip_sentence(few).endswith(
        ": too few steps to test (3 with both routing/any_layer_flip and clip/token_frac; at least 8 needed).")
    assert drift_reward_sentence(few).endswith(
        ": too few step pairs to test (2 with both routing/any_layer_flip and the reward change; at least 8 needed).")
    cispo = _records([0.01 * i for i in range(9)], clips=[0.0] * 9)
    assert drift_clip_sentence(cispo).endswith(": not testable: clip/token_frac was 0 on all 9 steps.")
    assert drift_verdicts([{"step": 0}]) == [
        "Drift and ratio variance: not measured (no step with both mismatch_ratio/token_var_share_flipped and "
        "mismatch_ratio/flipped_token_frac; mismatch_ratio/token_var_share_flipped never logged or never defined).",
        "Drift and clipping: not tested (routing/any_layer_flip and clip/token_frac never logged).",
        "Drift and reward: not tested (routing/any_layer_flip and reward/mean never logged).",
    ]
