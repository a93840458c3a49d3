"""Calling a plug-in loss's terms function (`algo.name=file.py:Spec`) with the reward plug-in's one-line errors.

A built-in's terms function is called as it is (a failure there is a bug: its traceback says where). A
plug-in's (`moe_gspo.algos.registry.plugin_ref`) may raise, return something other than `PolicyTerms`, or
return no objective, one of the wrong shape, or one cut off from the log-probs' gradient; each used to end the
run in a raw traceback (exit code 1). Here each is one ValueError naming `algo.name` and, for a raise, the
exception and the line of the user's file (`moe_gspo.plugins.user_frame`), as `task.reward` does
(`moe_gspo.tasks.plugin`): exit code 2 at the entry points.
"""

from __future__ import annotations

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
    return terms
