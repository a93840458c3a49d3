"""The routing-drift dial in the reports (issue 60): injected drift never passes for natural drift.

A run or probe with the dial on (`rollout.router_flip_prob` = p or `rollout.router_noise_std` = σ > 0; hf engine,
`moe_gspo/routing/dial.py`) perturbs the rollout engine's routes on purpose, so its rollout/learner routing
disagreement (`routing/layer_disagree`, `routing/any_layer_flip`) is the dial's injected drift plus the natural
drift (rollout precision, and the knock-on effect of a dialled route on the hidden states of later layers).
`analysis.report`, `analysis.compare` and `moe_gspo.probe` name the dial, its realised rate and the split:

- **injected**: `routing/dial_flip_frac`, the share of the rollout engine's (token, MoE layer) routes whose
  expert set the dial changed against the clean top-k of the same router logits (counted inside the engine);
- **total**: the share of (token, MoE layer) routes that differ between the rollout engine and the learner
  (natural routing): the mean over MoE layers of `routing/layer_disagree`, the same rows (response positions);
- **natural** (the learner against the undialled routes): not recorded, neither by a run nor by the probe (the
  engine keeps only the routes it used). Per route, "dialled ≠ learner" implies "dialled ≠ clean" or "clean ≠
  learner", so natural ≥ total − injected: the reports give that lower bound, and the probe without the dial
  measures the checkpoint's natural drift itself.

Means are over the steps that logged both a finite `routing/dial_flip_frac` and `routing/layer_disagree`
(the bound holds step by step, so it holds for the means over the same steps). A run without the dial gets no
line, row or table from this module: its report reads as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

INJECTED_KEY = "routing/dial_flip_frac"
TOTAL_KEY = "routing/layer_disagree"
SETTING_KEYS = (("router_flip_prob", "routing/dial_flip_prob"), ("router_noise_std", "routing/dial_noise_std"))
"""(rollout config field, the metric that logs it)."""


@dataclass(frozen=True)
class DialDrift:
    """A dialled run's (or probe's) dial and drift split (module docstring)."""

    flip_prob: float
    noise_std: float
    source: str
    """Where the settings were read: 'config.yaml', 'metrics.jsonl' or 'the probe file'."""
    injected: float
    """Mean `routing/dial_flip_frac` (NaN when never logged)."""
    total: float
    """Mean over MoE layers, then steps, of `routing/layer_disagree` (NaN when never logged)."""
    steps: int
    """Steps with both numbers (1 for a probe)."""

    @property
    def natural_lower_bound(self) -> float:
        """total − injected, floored at 0: a lower bound on the natural drift (module docstring)."""
        if not (math.isfinite(self.total) and math.isfinite(self.injected)):
            return math.nan
        return max(0.0, self.total - self.injected)

    @property
    def settings(self) -> str:
        return f"rollout.router_flip_prob={_g(self.flip_prob)}, rollout.router_noise_std={_g(self.noise_std)}"


def _g(v: float) -> str:
    return "?" if not math.isfinite(v) else f"{v:g}"


def _pct(v: float) -> str:
    return "n/a" if not math.isfinite(v) else f"{100 * v:.3g}%"


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _layer_mean(v: Any) -> float:
    """Mean over MoE layers of a per-layer list (NaN entries and nulls left out); NaN when none is finite."""
    vals = np.asarray([_float(x) for x in (v if isinstance(v, (list, tuple)) else [v])], np.float64)
    vals = vals[np.isfinite(vals)]
    return float(vals.mean()) if vals.size else math.nan


def _settings_from(config: dict | None, records: list[dict]) -> tuple[float, float, str] | None:
    rollout = (config or {}).get("rollout")
    rollout = rollout if isinstance(rollout, dict) else {}
    if any(field in rollout for field, _ in SETTING_KEYS):
        flip, noise = (_float(rollout.get(field, 0.0)) for field, _ in SETTING_KEYS)
        return flip, noise, "config.yaml"
    logged = [next((_float(r[key]) for r in records if key in r), math.nan) for _, key in SETTING_KEYS]
    if any(math.isfinite(v) for v in logged):
        return logged[0], logged[1], "metrics.jsonl"
    return None


def run_dial(config: dict | None, records: list[dict]) -> DialDrift | None:
    """The dial of a run from its config.yaml (else the `routing/dial_*` settings it logged); None when the dial
    was off (both settings 0 or absent, no `routing/dial_flip_frac` logged)."""
    settings = _settings_from(config, records)
    logged = any(INJECTED_KEY in r for r in records)
    if settings is None and not logged:
        return None
    flip, noise, source = settings if settings is not None else (math.nan, math.nan, "metrics.jsonl")
    if not logged and not (flip > 0 or noise > 0):
        return None
    pairs = [(_float(r.get(INJECTED_KEY)), _layer_mean(r.get(TOTAL_KEY))) for r in records]
    pairs = [(i, t) for i, t in pairs if math.isfinite(i) and math.isfinite(t)]
    if pairs:
        injected, total = (float(np.mean(col)) for col in zip(*pairs))
    else:  # one of the two never logged: each over its own steps, no bound
        inj = [v for r in records if math.isfinite(v := _float(r.get(INJECTED_KEY)))]
        tot = [v for r in records if math.isfinite(v := _layer_mean(r.get(TOTAL_KEY)))]
        injected = float(np.mean(inj)) if inj else math.nan
        total = math.nan if inj and tot else (float(np.mean(tot)) if tot else math.nan)
    return DialDrift(flip, noise, source, injected, total, len(pairs))


def probe_dial(probe: dict) -> DialDrift | None:
    """The dial of a probe file (`moe_gspo.probe` writes the `routing/dial_*` keys when it was on); None when off."""
    if not any(key in probe for _, key in SETTING_KEYS) and INJECTED_KEY not in probe:
        return None
    flip, noise = (_float(probe.get(key, 0.0)) for _, key in SETTING_KEYS)
    if not (flip > 0 or noise > 0):
        return None
    return DialDrift(flip, noise, "the probe file", _float(probe.get(INJECTED_KEY)),
                     _layer_mean(probe.get(TOTAL_KEY)), 1)


def _over(d: DialDrift) -> str:
    return "" if d.source == "the probe file" else f", mean over {d.steps} step{'s' if d.steps != 1 else ''}"


def header_line(d: DialDrift) -> str:
    """The report header's line: the settings and the realised rate."""
    return (f"Routing-drift dial: ON, {d.settings} ({d.source}): the rollout engine's routes are perturbed on "
            f"purpose (injected drift); realised: {_pct(d.injected)} of its (token, MoE layer) routes changed by the "
            f"dial ({INJECTED_KEY}{_over(d)})")


def summary_sentence(d: DialDrift) -> str:
    """The summary's sentence on the split (it comes before the routing sentence, which counts both)."""
    text = (f"Injected drift: the routing-drift dial ({d.settings}) changed {_pct(d.injected)} of the rollout "
            f"engine's (token, MoE layer) routes ({INJECTED_KEY}{_over(d)}), of the {_pct(d.total)} that differ "
            f"between the rollout engine and the learner (mean over MoE layers of {TOTAL_KEY}). The natural drift "
            "(the learner against the undialled routes: the rollout precision, and a dialled route's knock-on effect "
            "on later layers) is not recorded")
    if math.isfinite(d.natural_lower_bound):
        text += f"; it is at least {_pct(d.natural_lower_bound)} (total − injected)"
    return text + ". The other sentences, tables and figures count injected and natural drift together."


ROUTING_PREFIX = "Routing: "
DIALLED_ROUTING_PREFIX = "Routing (injected by the dial and natural together): "


def mark_routing_sentence(sentences: list[str]) -> list[str]:
    """The run's verdict sentences with the routing one marked as counting the injected drift."""
    return [DIALLED_ROUTING_PREFIX + s[len(ROUTING_PREFIX):] if s.startswith(ROUTING_PREFIX) else s
            for s in sentences]


def with_dial_summary(sentences: list[str], d: DialDrift | None) -> list[str]:
    """`sentences` unchanged without the dial; else the split's sentence first, then `sentences` with the routing
    one marked."""
    return sentences if d is None else [summary_sentence(d), *mark_routing_sentence(sentences)]


def drift_rows(d: DialDrift, fmt_number: Callable[[float], str], any_layer_flip: float = math.nan
               ) -> list[list[str]]:
    """Rows (quantity, value) of the drift table of a dialled run or probe; `fmt_number`: the report's format."""
    rows = [["dial setting rollout.router_flip_prob", _g(d.flip_prob)],
            ["dial setting rollout.router_noise_std", _g(d.noise_std)],
            [f"injected: (token, MoE layer) routes the dial changed ({INJECTED_KEY}{_over(d)})", fmt_number(d.injected)],
            [f"total: (token, MoE layer) routes that differ, rollout engine vs learner (mean over MoE layers of "
             f"{TOTAL_KEY}{_over(d)})", fmt_number(d.total)],
            ["natural: the learner against the undialled routes", "not recorded (the probe without the dial measures it)"],
            ["total − injected: a lower bound on the natural drift", fmt_number(d.natural_lower_bound)]]
    if math.isfinite(any_layer_flip):
        rows.append(["response tokens routed differently in ≥1 layer, injected and natural together "
                     "(routing/any_layer_flip)", fmt_number(any_layer_flip)])
    return rows


DRIFT_TABLE_TITLE = "Routing drift: injected by the dial, and the rest"


ARM_COLUMNS = ["arm", "dial", "injected: routes the dial changed (routing/dial_flip_frac)",
               "total: routes that differ, rollout vs learner (mean over MoE layers of routing/layer_disagree)",
               "natural: learner vs the undialled routes", "any-layer flip, injected and natural together"]
ARM_TABLE_TITLE = ("Routing drift per arm: injected by the routing-drift dial, and the natural drift ((token, MoE "
                   "layer) routes; means over steps, then over seeds)")


def _seed_mean(values: list[float]) -> float:
    vals = [v for v in values if math.isfinite(v)]
    return float(np.mean(vals)) if vals else math.nan


def arm_dial_row(arm: str, runs: list[tuple[dict | None, list[dict]]], fmt_number: Callable[[float], str]
                 ) -> tuple[list[str], bool]:
    """(row of `ARM_COLUMNS`, whether the dial was on in any seed) of one arm's seeds, each given as (config,
    metric records). Undialled seeds' natural drift is their total (the learner against routes nothing
    perturbed); dialled seeds' is not recorded and shown as its lower bound."""
    dials = [run_dial(cfg, recs) for cfg, recs in runs]
    any_flip = _seed_mean([_seed_mean([_float(r.get("routing/any_layer_flip")) for r in recs]) for _, recs in runs])
    totals = [d.total if d is not None else _seed_mean([_layer_mean(r.get(TOTAL_KEY)) for r in recs])
              for d, (_, recs) in zip(dials, runs)]
    on = [d for d in dials if d is not None]
    if not on:
        total = _seed_mean(totals)
        return [arm, "off", "0 (off)", fmt_number(total), fmt_number(total) + " (measured: no dial)",
                fmt_number(any_flip)], False
    settings = sorted({d.settings for d in on})
    dial = settings[0] if len(settings) == 1 else "differs between seeds: " + "; ".join(settings)
    if len(on) < len(dials):
        dial += f" ({len(on)} of {len(dials)} seeds)"
    bound = _seed_mean([d.natural_lower_bound for d in on])
    return [arm, dial, fmt_number(_seed_mean([d.injected for d in on])), fmt_number(_seed_mean(totals)),
            f"not recorded (≥ {fmt_number(bound)}: total − injected)", fmt_number(any_flip)], True


def arms_intro_line(dialled: list[str], num_arms: int) -> str:
    """The comparison's header line when some arms ran with the dial (none otherwise)."""
    return (f"Routing-drift dial ON in {len(dialled)} of {num_arms} arms ({', '.join(dialled)}): their rollout "
            "routes were perturbed on purpose, so their routing drift is mostly injected, not the engine's or the "
            f"precision's; the table \"{ARM_TABLE_TITLE.split(' (')[0]}\" splits it.")
