"""benchmarks.phase_pilot.power_training: experiment 6's pilot is 3S's committed runs, Holm over its two tests counts a
test only when it is decided the claimed way, and the config the pre-registration names has the arms it lists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.phase_pilot import power_training as pt

ROOT = Path(__file__).resolve().parents[2]


def test_the_pilot_is_3s_with_grpos_two_stalls_at_n16():
    st, stalled = pt.pilot(str(ROOT / "reports/phase/metrics.jsonl.gz"),
                           str(ROOT / "reports/phase_staleness/metrics.jsonl.gz"))
    g = pt.final(st[pt.GRPO][16])
    assert len(g) == 5 and (g < pt.STALL).sum() == 2
    assert all((pt.final(st[f][16]) >= pt.STALL).all() for f in pt.FIXES)
    assert stalled.max() < pt.STALL and len(stalled) >= 5


def test_holm_counts_a_test_only_decided_the_claimed_way():
    rng = np.random.default_rng(0)
    up = 0.1 + 0.01 * rng.random((200, 20))
    assert pt.holm_power(up, up) == (1.0, 1.0, 1.0)
    assert pt.holm_power(-up, up) == (0.0, 1.0, 0.0)  # H1 decided, the wrong way
    noise = rng.normal(0, 0.1, (200, 20))
    r1, _, both = pt.holm_power(noise, up)
    assert r1 < 0.1 and both <= r1  # no effect: about α (Holm's second step at α once H2 is rejected)
    # Holm: a test with p between α/2 and α is rejected only after the other one is
    weak = 0.012 + rng.normal(0, 0.03, (200, 20))
    alone = pt.holm_power(weak, noise)[0]
    assert alone < pt.holm_power(weak, up)[0]


def test_the_config_has_the_preregistered_arms():
    from moe_gspo.run.ablation_arms import expand_arms
    from moe_gspo.run.ablation_spec import load_spec

    spec = load_spec(str(ROOT / "configs/ablation_training_exp6.yaml"))
    arms = {}
    for arm in expand_arms(spec, warn=False):
        arms.setdefault(arm.group, set()).add(arm.seed)
    assert arms == {"grpo-none-mb16": set(range(6000, 6040)), "grpo-r2-mb16": set(range(6000, 6040)),
                    "gspo-none-mb16": set(range(6000, 6040)), "grpo-none-mb1": set(range(6000, 6010)),
                    "grpo-r2-mb1": set(range(6000, 6010)), "grpo-none-mb4": set(range(6000, 6010))}
    assert pt.CHOSEN_SEEDS == 40 and pt.CONTROL_SEEDS == 10
