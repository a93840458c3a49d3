"""Calling a plug-in loss's terms function (`algo.name=file.py:Spec`) with the reward plug-in's one-line errors.

A built-in's terms function is called as it is (a failure there is a bug: its traceback says where). A
plug-in's (`moe_gspo.algos.registry.plugin_ref`) may raise, return something other than `PolicyTerms`, or
return no objective, one of the wrong shape, or one cut off from the log-probs' gradient; each used to end the
run in a raw traceback (exit code 1). Here each is one ValueError naming `algo.name` and, for a raise, the
exception and the line of the user's file (`moe_gspo.plugins.user_frame`), as `task.reward` does
(`moe_gspo.tasks.plugin`): exit code 2 at the entry points.

A plug-in's metrics live in its own namespace: each key is logged as `<AlgoSpec.name>/<key>` (a key that
already starts with `<AlgoSpec.name>/` is kept as it is), so a metric named `step`, `reward/mean` or
`loss/policy` cannot change the row's own keys (`moe_gspo.algos.registry` refuses a plug-in named after one of
the run's namespaces, `RUN_NAMESPACES`). A value must be a real number: a 0-dim (or one-element) tensor or a
Python int / float; anything else (a string, a list) is one ValueError naming `algo.name` and the key.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_gspo.algos.algo_spec import AlgoSpec
from moe_gspo.algos.loss_common import LossInputs, PolicyTerms
from moe_gspo.algos.registry import plugin_ref
from moe_gspo.plugins import user_frame


def _shape(t) -> str:
    return f"a tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"


def call_terms(spec: AlgoSpec, inp: LossInputs, **kwargs) -> PolicyTerms:
    """`spec.terms(inp, **kwargs)`, its result checked for a plug-in (see the module docstring)."""
    ref = plugin_ref(spec)
    if ref is None:
        return spec.terms(inp, **kwargs)
    where = f"algo.name={ref!r}: its terms function {getattr(spec.terms, '__name__', '?')}"
    try:
        terms = spec.terms(inp, **kwargs)
    except Exception as e:  # noqa: BLE001 - the user's function
        raise ValueError(f"{where} raised {type(e).__name__}: {e}{user_frame(e)}") from None
    if not isinstance(terms, PolicyTerms):
        raise ValueError(f"{where} returned {_shape(terms)}; it must return PolicyTerms(objective_B=... or "
                         "objective_BT=..., metrics={...}) (moe_gspo.algos.loss_common)")
    B, T = inp.mask.shape
    for name, want in (("objective_B", (B,)), ("objective_BT", (B, T))):
        t = getattr(terms, name)
        if t is not None and not (isinstance(t, torch.Tensor) and tuple(t.shape) == want and t.is_floating_point()):
            raise ValueError(f"{where} returned {name} as {_shape(t)}; it must be a float tensor of shape {want}")
    objective = terms.objective_B if terms.objective_B is not None else terms.objective_BT
    if objective is None:
        raise ValueError(f"{where} returned no objective (PolicyTerms.objective_B and objective_BT are both None); "
                         "give one: per sequence [B] or per token [B, T]")
    if inp.logp.requires_grad and not objective.requires_grad:
        raise ValueError(f"{where} returned an objective without a gradient (detached from inp.logp / inp.lr): the "
                         "update would not change the policy; build it from inp's tensors without .detach()")
    if not isinstance(terms.metrics, dict):
        raise ValueError(f"{where} returned metrics as {_shape(terms.metrics)}; it must be a dict of 0-dim tensors")
    return dataclasses.replace(terms, metrics=namespaced_metrics(spec.name, terms.metrics, where))


def _metric_value(value) -> torch.Tensor | None:
    """`value` as a detached 0-dim float64 tensor, or None when it is not one real number."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        return value.detach().reshape(()).double()
    if isinstance(value, (int, float)):  # bool is an int
        return torch.tensor(float(value), dtype=torch.float64)
    return None


def namespaced_metrics(name: str, metrics: dict, where: str) -> dict[str, torch.Tensor]:
    """A plug-in's `metrics` under its own namespace `<name>/` (see the module docstring), values as detached
    0-dim float64 tensors; ValueError (`where` ...) for a key that is not a non-empty string, a value that is not
    one real number, or two keys that name the same metric once namespaced."""
    out: dict[str, torch.Tensor] = {}
    prefix = f"{name}/"
    for key, value in metrics.items():
        if not (isinstance(key, str) and key.strip()):
            raise ValueError(f"{where} returned a metric keyed {key!r}; metric keys must be non-empty strings")
        v = _metric_value(value)
        if v is None:
            raise ValueError(f"{where} returned metric {key!r} as {_shape(value) if isinstance(value, torch.Tensor) else repr(value)[:60]}; "
                             "a metric must be one real number (a 0-dim tensor or a Python int / float)")
        full = key if key.startswith(prefix) else prefix + key
        if full in out:
            raise ValueError(f"{where} returned metrics {key!r} and {full!r}, which are both logged as {full!r} "
                             f"(a plug-in's metrics are namespaced as '{prefix}...'); drop one")
        out[full] = v
    return out
