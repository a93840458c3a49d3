"""Divergence localiser (issue 41): where, layer by layer, do the rollout engine's and the learner's numbers of
the same tokens part? Pure comparison of tensors already collected (`moe_gspo.probe_localize`
collects them with forward hooks; `python -m moe_gspo.probe --localize` runs both).

Input: for each side a list over decoder layers of `{name: tensor}` (one sequence's [T, ...] tensors, or
several sequences' concatenated along T), names from `LAYER_TENSORS` in their forward order, plus the
tensors after the last layer (`FINAL_TENSORS`). Every float tensor is compared in fp32:

- `max_abs`: max |a - b| over all elements;
- `rel_err`: max |a - b| / max |b| (b = the learner's tensor; the error relative to the tensor's own scale,
  so that 1e-5 means "a hundred fp32 roundings of the largest element", and 4e-3 one bf16 rounding);
- `topk_ids`: `flip_frac`, the share of token rows whose top-k *sets* differ (order ignored); its
  `rel_err` is that share, its `max_abs` 1 if any row differs.

The **first divergence** is the first (layer, tensor) in forward order whose `rel_err` exceeds the tolerance
(`topk_ids`: any flipped row); the **first difference** the first whose `max_abs` is non-zero (the bitwise
question: which operator's output first differs at all).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

LAYER_TENSORS = ("attn_out", "hidden_after_attn", "router_logits", "topk_ids", "mlp_out", "hidden_after_mlp")
"""Per-layer tensor names in forward order: the attention block's output (before the residual add), the
residual stream after attention, the router logits, the top-k expert ids, the MLP / MoE block output
(before the residual add), the residual stream after the block (the layer's output)."""
FINAL_TENSORS = ("final_norm", "logits")
"""After the last layer: the final RMSNorm's output and the logits (true vocabulary)."""
DEFAULT_TOL = {"float32": 1e-5, "bfloat16": 1e-2}
"""Default `rel_err` tolerance by rollout dtype: 1e-5 (about 80 fp32 roundings of the largest element) for
fp32 rollouts; 1e-2 (about 2.5 bf16 roundings) for bf16 ones, which differ by a rounding from the start."""


def default_tol(rollout_dtype: str) -> float:
    return DEFAULT_TOL.get(str(rollout_dtype).replace("torch.", ""), DEFAULT_TOL["bfloat16"])


def topk_flip_frac(a_NK: torch.Tensor, b_NK: torch.Tensor) -> float:
    """Share of rows whose top-k id sets differ (order inside a row ignored)."""
    if a_NK.shape != b_NK.shape:
        raise ValueError(f"top-k ids of shape {tuple(a_NK.shape)} and {tuple(b_NK.shape)} differ")
    if a_NK.shape[0] == 0:
        return 0.0
    a, b = torch.sort(a_NK.long(), dim=-1).values, torch.sort(b_NK.long(), dim=-1).values
    return float((a != b).any(dim=-1).float().mean())


def compare_pair(name: str, a: torch.Tensor, b: torch.Tensor) -> dict:
    """{max_abs, rel_err[, flip_frac]} of tensor `a` (rollout) against `b` (learner)."""
    if name == "topk_ids":
        f = topk_flip_frac(a, b)
        return {"max_abs": float(f > 0), "rel_err": f, "flip_frac": f}
    if a.shape != b.shape:
        raise ValueError(f"{name}: shapes {tuple(a.shape)} (rollout) and {tuple(b.shape)} (learner) differ")
    a32, b32 = a.detach().float(), b.detach().float()
    if a32.numel() == 0:
        return {"max_abs": 0.0, "rel_err": 0.0}
    d = float((a32 - b32).abs().max())
    scale = float(b32.abs().max())
    return {"max_abs": d, "rel_err": d / scale if scale > 0 else (0.0 if d == 0 else math.inf)}


def localize(rollout_layers: Sequence[dict], learner_layers: Sequence[dict], rollout_final: dict | None = None,
             learner_final: dict | None = None, *, tol: float = 1e-5, layer_ids: Sequence[int] | None = None) -> dict:
    """Compare the two sides' tensors layer by layer; see the module docstring.

    Returns `first_divergence` / `first_difference` ({layer, tensor, max_abs, rel_err}, or None when nothing
    exceeds / differs), `rel_err` and `max_abs` ({tensor: [value per layer, None where the layer has no such
    tensor]}), `final` ({tensor: {max_abs, rel_err}}), `tol`, `layer_ids`, and `growth` (per tensor, the mean
    factor by which `rel_err` grows from one layer to the next, geometric over the layers where it is
    non-zero, None with fewer than two such layers)."""
    if len(rollout_layers) != len(learner_layers):
        raise ValueError(f"{len(rollout_layers)} rollout layers vs {len(learner_layers)} learner layers")
    n = len(rollout_layers)
    layer_ids = list(range(n)) if layer_ids is None else list(layer_ids)
    rel: dict[str, list] = {k: [None] * n for k in LAYER_TENSORS}
    mabs: dict[str, list] = {k: [None] * n for k in LAYER_TENSORS}
    order: list[tuple[int | None, str, dict]] = []
    for i, (ra, lb) in enumerate(zip(rollout_layers, learner_layers)):
        names = [k for k in LAYER_TENSORS if k in ra and k in lb]
        names += sorted(k for k in ra if k in lb and k not in LAYER_TENSORS)
        for k in names:
            c = compare_pair(k, ra[k], lb[k])
            rel.setdefault(k, [None] * n)[i] = c["rel_err"]
            mabs.setdefault(k, [None] * n)[i] = c["max_abs"]
            order.append((layer_ids[i], k, c))
    final = {}
    for k in FINAL_TENSORS:
        if rollout_final and learner_final and k in rollout_final and k in learner_final:
            final[k] = compare_pair(k, rollout_final[k], learner_final[k])
            order.append(("final", k, final[k]))

    def first(pred):
        for layer, k, c in order:
            if pred(k, c):
                return {"layer": layer, "tensor": k, "max_abs": c["max_abs"], "rel_err": c["rel_err"]}
        return None

    growth = {}
    for k, vals in rel.items():
        nz = [(j, v) for j, v in enumerate(vals) if v is not None and 0 < v < math.inf]
        growth[k] = ((nz[-1][1] / nz[0][1]) ** (1.0 / (nz[-1][0] - nz[0][0])) if len(nz) >= 2 else None)
    return {"tol": tol, "layer_ids": layer_ids,
            "first_divergence": first(lambda k, c: (c["rel_err"] > 0) if k == "topk_ids" else c["rel_err"] > tol),
            "first_difference": first(lambda k, c: c["max_abs"] > 0),
            "rel_err": {k: v for k, v in rel.items() if any(x is not None for x in v)},
            "max_abs": {k: v for k, v in mabs.items() if any(x is not None for x in v)},
            "final": final, "growth": growth}


def concat_sequences(per_seq: Sequence[tuple[list[dict], dict]]) -> tuple[list[dict], dict]:
    """Per-sequence captures [(layers, final)] -> one capture with every tensor concatenated over tokens."""
    if not per_seq:
        return [], {}
    n = len(per_seq[0][0])
    layers = [{k: torch.cat([s[0][i][k] for s in per_seq]) for k in per_seq[0][0][i]} for i in range(n)]
    final = {k: torch.cat([s[1][k] for s in per_seq]) for k in per_seq[0][1]}
    return layers, final


def logp_diff_stats(a: Sequence[np.ndarray | torch.Tensor], b: Sequence[np.ndarray | torch.Tensor]) -> dict:
    """max, p95, p99 and mean of |a - b| over the response tokens of every sequence (a[i], b[i]: the i-th
    sequence's response log-probs), with the (sequence, response token) of the maximum."""
    diffs, where = [], []
    for i, (x, y) in enumerate(zip(a, b)):
        x = np.asarray(x, np.float64).reshape(-1)
        y = np.asarray(y, np.float64).reshape(-1)
        if x.shape != y.shape:
            raise ValueError(f"sequence {i}: {x.size} vs {y.size} response log-probs")
        diffs.append(np.abs(x - y))
        where += [(i, t) for t in range(x.size)]
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    if d.size == 0:
        return {"max": None, "p95": None, "p99": None, "mean": None, "argmax": None, "num_tokens": 0}
    j = int(np.argmax(d))
    return {"max": float(d[j]), "p95": float(np.percentile(d, 95)), "p99": float(np.percentile(d, 99)),
            "mean": float(d.mean()), "argmax": {"sequence": where[j][0], "token": where[j][1]},
            "num_tokens": int(d.size)}


def jsonable(v):
    """Nested dicts/lists with non-finite floats as None (strict JSON)."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (np.floating, np.integer)):
        return jsonable(v.item())
    return v


def summary_lines(loc: dict) -> list[str]:
    """A few lines for the probe's printed summary."""
    def where(f):
        if f is None:
            return "none"
        return f"layer {f['layer']} {f['tensor']} (max |d| {f['max_abs']:.3g}, rel {f['rel_err']:.3g})"
    compared = loc.get("compared")
    only = ("" if not compared or set(compared) - {"topk_ids"} else
            " (only the top-k ids and log-probs were compared: the engine returns no hidden states, router logits "
            "or expert outputs)")
    lines = [f"localiser (rel. tol {loc['tol']:g}): first divergence {where(loc.get('first_divergence'))}{only}",
             f"  first bitwise difference {where(loc.get('first_difference'))}"]
    s = loc.get("logp")
    if s and s.get("max") is not None:
        lines.append(f"  |dlogp| rollout vs learner max / p95 / p99  {s['max']:.3e} / {s['p95']:.3e} / {s['p99']:.3e} "
                     f"at sequence {s['argmax']['sequence']} token {s['argmax']['token']}")
    return lines
