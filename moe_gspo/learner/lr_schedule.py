"""Learning-rate schedule: linear warm-up, constant, then an optional decay over the last RL steps.

The shape is warmup-stable-decay ("WSD", Hu et al. 2024, MiniCPM, arXiv 2404.06395; the same family as
transformers' `get_wsd_schedule`, which `benchmarks.trl_peer_bench` hands to TRL for a fair
race): `lr_warmup_steps` RL steps rising linearly to `lr`, `lr` until `lr_decay_steps` before the end of
`train.steps`, then towards `min_lr_ratio * lr` (linear or cosine). The rate is a pure function of the
RL step, so a resumed run continues on the same curve without any saved scheduler state. Every
optimizer step of an RL step uses that step's rate: in the decay, the rate transformers' WSD schedule
gives the RL step's first optimizer step (`tests/learner/test_lr_schedule.py`; TRL and Megatron move
the rate every optimizer step). The warm-up starts at lr / warmup_steps, as Megatron's does
(transformers' starts at min_lr_ratio * lr).

Defaults (no warm-up, no decay) give the constant rate every run had before.
"""

from __future__ import annotations

import math

DECAYS = ("none", "linear", "cosine")


def lr_at(step: int, *, lr: float, num_steps: int, warmup_steps: int = 0, decay: str = "none",
          decay_steps: int = 0, min_lr_ratio: float = 0.0) -> float:
    """The learning rate of RL step `step` (0-based) of a `num_steps`-step run.

    Warm-up: step s < warmup_steps gets lr * (s + 1) / warmup_steps (the first step does not waste
    itself at 0). Decay: over the last `decay_steps` steps (0 = every step after the warm-up), starting
    at step start = num_steps - decay_steps, step s gets min + (lr - min) * f(p) with
    p = (s - start) / decay_steps in [0, 1), f = 1 - p (linear) or (1 + cos(pi p)) / 2 (cosine),
    min = min_lr_ratio * lr; the last step's rate is min + (lr - min) * f(1 - 1 / decay_steps).
    """
    assert decay in DECAYS and 0 <= step and num_steps > 0, (decay, step, num_steps)
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "none":
        return lr
    span = decay_steps or (num_steps - warmup_steps)
    start = num_steps - span
    if step < start:
        return lr
    p = min(1.0, (step - start) / span)
    f = 1.0 - p if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))
    floor = min_lr_ratio * lr
    return floor + (lr - floor) * f
