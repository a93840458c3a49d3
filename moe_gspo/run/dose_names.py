"""The dose-naming rule of a phase matrix (issue 60): how an ablation's variants that set the routing-drift dial
are named, so that `analysis.phase` finds each method's zero dose and its dosed arms.

A variant is named `<dose>[_<fix>]` (`p10_tis`: dose `p10`, fix `tis`). The dose of a variant that sets the dial
(`rollout.router_flip_prob` or `rollout.router_noise_std`) says what it sets:
- `p0`: zero drift, the dial off (every dial matrix has one: each method's drops are against it);
- `p<N>`: `rollout.router_flip_prob` = N/100 (`p10`: 0.1, `p2.5`: 0.025);
- `s<X>`: `rollout.router_noise_std` = X (`s0.25`: 0.25).
Flip and noise doses are analysed on the same axis: the realised per-layer flip rate each run measured
(`routing/layer_disagree`). Any other name (`bf16`, `pos`, `mb4`, ...) is a reference arm and sets no dial.
`check_variant_names` enforces the rule when an ablation spec is read (`moe_gspo.run.ablation_spec`);
`analysis.phase_runs` reads names by it. This module imports nothing of the package.
"""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

FLIP, NOISE = "rollout.router_flip_prob", "rollout.router_noise_std"
ZERO_DOSE = "p0"
DIAL_DOSE = re.compile(r"^(?P<kind>[ps])(?P<value>\d+(?:\.\d+)?)$")
"""A dial dose label: `p0`, `p<N>` (flip, percent), `s<X>` (noise std)."""
STALENESS_DOSE = re.compile(r"^mb(?P<n>[1-9]\d*)$")
"""A staleness dose label `mb<N>` (N = train.num_minibatches >= 1, no leading zero; `analysis.staleness`)."""
DOSE_RULE = ("the dose-naming rule: a variant that sets the routing-drift dial is named <dose>[_<fix>], p0 for "
             f"zero drift, p<N> for {FLIP} = N/100 (p10 = 0.1), s<X> for {NOISE} = X (s0.25 = 0.25); other "
             "names set no dial")


def split_variant(variant: str) -> tuple[str, str]:
    """'p40_tis' -> ('p40', 'tis'); 'p40' -> ('p40', '')."""
    dose, _, fix = variant.partition("_")
    return dose, fix


def _number(value: Any) -> float | None:
    """A dial value as a float; None when it is not a number (the config check refuses it later)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def check_variant_names(variants: Mapping[str, Mapping[str, Any]], overrides: Mapping[str, Any] | None = None) -> None:
    """ValueError (one line naming the variant and the rule) when a variant's name does not say the dial it sets
    (`DOSE_RULE`), or when a matrix that sets the dial has no zero-dose variant `p0`. `overrides`: the spec's own
    overrides, under every variant's."""
    dialled = []
    for name, own in variants.items():
        merged = {**(overrides or {}), **own}
        flip, noise = _number(merged.get(FLIP, 0.0)), _number(merged.get(NOISE, 0.0))
        if flip is None or noise is None:
            continue
        dose, _ = split_variant(name)
        m = DIAL_DOSE.match(dose)
        sets = f"{FLIP}={flip:g}, {NOISE}={noise:g}"
        if m is None:
            if flip or noise:
                raise ValueError(f"ablation spec: variant {name!r} sets the routing-drift dial ({sets}) but is not "
                                 f"named by {DOSE_RULE}")
            if dose.startswith("mb") and not STALENESS_DOSE.match(dose):
                raise ValueError(f"ablation spec: variant {name!r}: a staleness dose is mb<N> with N = "
                                 "train.num_minibatches >= 1 written without a leading zero (mb1, mb4, mb16)")
            continue
        value = float(m["value"])
        if m["kind"] == "p" and value == 0:
            ok = flip == 0 and noise == 0
        elif m["kind"] == "p":
            ok = math.isclose(flip, value / 100, rel_tol=1e-9, abs_tol=1e-12)
        else:
            ok = value > 0 and math.isclose(noise, value, rel_tol=1e-9, abs_tol=1e-12)
        if not ok:
            raise ValueError(f"ablation spec: variant {name!r} sets {sets}, against {DOSE_RULE}")
        dialled.append(name)
    doses = {split_variant(n)[0] for n in dialled}
    if doses and ZERO_DOSE not in doses:
        raise ValueError(f"ablation spec: variants {sorted(dialled)} set the routing-drift dial but none is the zero "
                         f"dose {ZERO_DOSE}; add `{ZERO_DOSE}: {{}}` ({DOSE_RULE})")
