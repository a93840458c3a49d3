"""The experts as one parameter per projection: megatron-core's legacy `GroupedMLP`, on `torch._grouped_mm`.

`model.expert_layout=grouped` (issue 40) builds the MoE layers with `moe_grouped_gemm=True` on the local
(no Transformer Engine) spec, which gives megatron-core 0.16's legacy `GroupedMLP`: per MoE layer two
parameters, `experts.weight1` [H, E*2F] and `experts.weight2` [E*F, H], whose storage is read as
`[E, H, 2F]` and `[E, F, H]` (expert `e`'s fc1 is `weight1.view(E, H, 2F)[e]`, its gate columns first,
then its up columns: the transpose of `SequentialMLP`'s `linear_fc1.weight` = cat(gate, up) [2F, H];
its fc2 is `weight2.view(E, F, H)[e]`, the transpose of `linear_fc2.weight` [H, F]).
`moe_gspo.mcore.weights` maps these names to and from HF's per-expert weights.

Why: a grouped GEMM takes all experts' weights as one `[E, in, out]` tensor. With one parameter per
expert (`SequentialMLP`, `batched_experts`) that tensor is a view only while the experts' weights lie back
to back in one storage; Megatron's distributed optimizer moves every `param.data` into its buffer in
reverse order, fc1 and fc2 interleaved, so there each forward copies all expert weights (`torch.stack`,
and the copy is saved for backward). One parameter per projection is one contiguous slice of that
buffer wherever DDP puts it: the `[E, in, out]` view needs no copy, under every optimizer
(`GroupedExperts.num_weight_copies` counts forwards that did copy; tested to stay 0 under the
distributed optimizer, `tests/mcore/test_grouped_experts.py`).

Upstream `GroupedMLP` needs the `grouped_gemm` CUDA extension (`grouped_gemm.ops.gmm`) and asserts bf16.
Here:
- `gmm(a, b, batch_sizes, trans_b=False)` is that extension's contract on `torch._grouped_mm`, with int32
  offsets (the cumulative `batch_sizes`) staged in pinned host memory and moved to the device without a
  sync; `moe_gspo.mcore.shims.install_grouped_gemm` puts it in megatron's `grouped_gemm_util` slot so that
  `GroupedMLP` can be built. Fast path where `batched_experts.expert_groups` says so (torch >= 2.9; the
  CPU in any float dtype; CUDA in bf16 on compute capability major 9 or 10, where on major 10 the weight
  gradients of experts without tokens are zeroed, pytorch#172439; the operands' 16-byte strides and
  starts, fewer than 1024 groups); elsewhere a loop over the experts' row blocks (its
  `batch_sizes.tolist()` syncs when the counts live on the device; megatron's dispatchers hand them over
  on the host). The kernel's contract is checked call by call at Qwen3-30B-A3B shapes on the `meta`
  device (tests/mcore/test_grouped_meta_contract.py).
- `GroupedExperts(GroupedMLP)` (what the spec builds) keeps upstream's parameters, init and checkpoint
  sharding and replaces only the forward: any float dtype (fp32 on the CPU, for parity and tests), the
  offsets and kernel choice prepared once per forward for both projections (`expert_groups`), the SwiGLU
  with the routing probabilities as one fused autograd function on CUDA (`moe_gspo.mcore.swiglu`:
  Megatron's `weighted_bias_swiglu_impl` maths, `torch.compile`d, saving the fc1 output and the
  probabilities only) and elsewhere `SequentialMLP`'s unfused activation (`batched_experts.mlp_activation`:
  the same maths and rounding as the per-expert layout), the copy counter, and the count of forwards
  that left the fast path, with why (`expert_path_counts`; issue 61: no silent slow path, see
  `expert_path`). Experts without tokens take part with zero rows; a layer whose experts got no token at
  all multiplies the empty input by the whole weights, as upstream does, so every parameter still gets a
  (zero) gradient.

With Transformer Engine importable, `moe_grouped_gemm` selects TE's `TEGroupedMLP` instead (one weight per
expert inside TE's own grouped linear); this module is then not used.
"""

from __future__ import annotations

import types

import torch
from megatron.core.transformer.moe.experts import GroupedMLP

from moe_gspo.mcore.batched_experts import (GROUPED_MM_MAX_GROUPS, ExpertGroups,
                                            _contiguous_grad, expert_groups, fast_kernel_problem,
                                            grouped_mm_torch_problem, kernel_device, mask_empty_expert_grads,
                                            mlp_activation, swap_expert_module)
from moe_gspo.mcore.swiglu import swiglu_fusable, swiglu_with_probs

EXPERT_LAYOUTS = ("auto", "per_expert", "grouped")
"""`model.expert_layout` values: `per_expert` (megatron's `SequentialMLP`, one parameter per expert and
projection), `grouped` (`GroupedExperts`, one per projection), `auto` (see `resolve_expert_layout`)."""


def resolve_expert_layout(layout: str, *, device: torch.device | str, params_dtype: torch.dtype) -> str:
    """`per_expert` or `grouped` for `model.expert_layout` on this machine. `auto`: `grouped` on CUDA in bf16
    on compute capability major 9 or 10 with torch >= 2.9 (torch's fast grouped GEMM, which the distributed
    optimizer, the CUDA default, leaves copy-free only in this layout); `per_expert` elsewhere, the CPU
    included (measured there: `docs/gpu.md`, "Expert layout"). `grouped` on a torch older than 2.9 is a
    ValueError (`batched_experts.GROUPED_MM_MIN_TORCH`: its grouped GEMM could hang on empty experts)."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"model.expert_layout={layout!r}: use one of {', '.join(EXPERT_LAYOUTS)}")
    old_torch = grouped_mm_torch_problem()
    if layout == "grouped" and old_torch is not None:
        raise ValueError(f"model.expert_layout=grouped: {old_torch}; use model.expert_layout=auto or per_expert, "
                         "or upgrade torch")
    if layout != "auto":
        return layout
    return "per_expert" if auto_layout_problem(device, params_dtype) else "grouped"


def auto_layout_problem(device: torch.device | str, params_dtype: torch.dtype) -> str | None:
    """Why `model.expert_layout=auto` keeps the per-expert layout on `device` in `params_dtype`, in a few words
    ("torch 2.8.0 < 2.9", "no CUDA", "params float32, grouped needs bf16", "compute capability 8.0, ...");
    None where it takes the grouped one."""
    kind, capability = kernel_device(device)
    return fast_kernel_problem(kind, capability, params_dtype, auto=True)


def expert_path(layout: str, *, device: torch.device | str, params_dtype: torch.dtype, batched_experts: bool,
                use_te: bool, hidden: int, ffn: int, num_local_experts: int) -> dict:
    """How a model built with these settings computes its experts, said once per run (`line`, printed by the
    main job and recorded in run.json; `moe_gspo.mcore.model.build_gpt_model` sets `model.expert_path`):
    `layout` (`per_expert` / `grouped`, what `resolve_expert_layout` gives), `path` (`grouped`: ours on
    `torch._grouped_mm`; `grouped_loop`: the grouped layout's loop over experts, a slow path; `te_grouped`;
    `batched`: the per-expert layout's grouped GEMM, `model.batched_experts`; `loop`: Megatron's
    `SequentialMLP`), `fast` (whether the experts take a grouped GEMM), and `line`, e.g. "grouped
    (torch._grouped_mm)", "per_expert (torch 2.8.0 < 2.9); Megatron's SequentialMLP loop over experts",
    "per_expert (params float32, grouped needs bf16); ...", "per_expert (no CUDA); ...". The grouped layout's
    forward can still leave the fast path call by call; `GroupedExperts` counts those calls
    (`expert_path_counts`, metric `perf/expert_path_fallback_frac`)."""
    resolved = resolve_expert_layout(layout, device=device, params_dtype=params_dtype)
    kind, capability = kernel_device(device)
    if use_te and resolved == "grouped":
        return {"asked": layout, "layout": "grouped", "path": "te_grouped", "fast": True,
                "line": "grouped (Transformer Engine's TEGroupedMLP)"}
    kernel = fast_kernel_problem(kind, capability, params_dtype)
    size = torch.empty(0, dtype=params_dtype).element_size()
    if kernel is None and (hidden * size % 16 or ffn * size % 16):
        kernel = f"widths {hidden} and {ffn} x {size} B not multiples of 16 B"
    if kernel is None and num_local_experts > GROUPED_MM_MAX_GROUPS:
        kernel = f"{num_local_experts} local experts > {GROUPED_MM_MAX_GROUPS} groups"
    if resolved == "grouped":
        if kernel is None:
            return {"asked": layout, "layout": "grouped", "path": "grouped", "fast": True,
                    "line": "grouped (torch._grouped_mm)"}
        return {"asked": layout, "layout": "grouped", "path": "grouped_loop", "fast": False,
                "line": f"grouped, a loop over experts ({kernel})"}
    why = auto_layout_problem(device, params_dtype) if layout == "auto" else f"model.expert_layout={layout}"
    if use_te:
        how, path, fast = "Transformer Engine's TEGroupedMLP", "te_grouped", True
    elif batched_experts:
        how, path, fast = ("model.batched_experts: " + ("torch._grouped_mm" if kernel is None else
                                                        f"padded bmm ({kernel})")), "batched", kernel is None
    else:
        how, path, fast = "Megatron's SequentialMLP loop over experts", "loop", False
    return {"asked": layout, "layout": "per_expert", "path": path, "fast": fast, "line": f"per_expert ({why}); {how}"}


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False, *,
        groups: ExpertGroups | None = None) -> torch.Tensor:
    """`grouped_gemm.ops.gmm`: rows `a` [T, K], grouped by expert in order (`batch_sizes[e]` rows for expert
    e, summing to T), times that expert's `b[e]` ([E, K, N]; with `trans_b`, `b` is [E, N, K]) -> [T, N].
    `groups`: the layer forward's `expert_groups` (offsets, kernel choice), shared by its GEMMs; by default
    computed for this call."""
    w_EKN = b.transpose(1, 2) if trans_b else b
    assert a.dim() == 2 and w_EKN.dim() == 3 and a.shape[1] == w_EKN.shape[1], (a.shape, b.shape, trans_b)
    assert batch_sizes.numel() == w_EKN.shape[0], (batch_sizes.shape, b.shape)
    if groups is None:
        groups = expert_groups(a, batch_sizes, ffn=w_EKN.shape[2], weights=(w_EKN,))
    if groups.fast:
        if groups.nonempty_E is not None and torch.is_grad_enabled() and w_EKN.requires_grad:
            w_EKN = mask_empty_expert_grads(w_EKN, groups.nonempty_E)
        return _contiguous_grad(torch._grouped_mm(a, w_EKN, offs=groups.offs_E))
    rows = a.split(batch_sizes.tolist())  # not the fast path: a host sync where the counts are on the device
    return torch.cat([x @ w_EKN[e] for e, x in enumerate(rows)])


ops = types.SimpleNamespace(gmm=gmm)
"""What megatron's `grouped_gemm_util.ops` expects (`ops.gmm`)."""


class GroupedExperts(GroupedMLP):
    """Megatron's legacy `GroupedMLP` (same parameters `weight1`/`weight2`) with a forward on `gmm` in any
    float dtype (module docstring)."""

    num_weight_copies: int = 0
    """Forwards whose `[E, in, out]` weight views needed a copy (a parameter that is not one contiguous
    tensor); 0 in every layout Megatron's optimizers give it."""
    num_forwards: int = 0
    """Forwards with tokens (`expert_path_counts`)."""
    num_slow_forwards: int = 0
    """Of those, the ones off the fast path (`expert_groups` chose the loop over experts)."""
    slow_because: str | None = None
    """Why the last slow forward was slow (`ExpertGroups.slow_because`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        if self.activation_recompute or c.fp8 or c.fp4 or self.tp_group.size() != 1:
            raise ValueError("model.expert_layout=grouped supports no selective moe_act recompute, FP8/FP4 or "
                             "expert tensor parallelism; use model.expert_layout=per_expert")

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`weight1` as [E, H, 2F] and `weight2` as [E, F, H], views of the parameters (a copy only where a
        parameter is not contiguous: counted)."""
        E, H = self.num_local_experts, self.config.hidden_size
        w1_EHF, w2_EFH = self.weight1.reshape(E, H, -1), self.weight2.reshape(E, -1, H)
        if w1_EHF.data_ptr() != self.weight1.data_ptr() or w2_EFH.data_ptr() != self.weight2.data_ptr():
            self.num_weight_copies += 1
        return w1_EHF, w2_EFH

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x_TH, probs_T = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # upstream's: probabilities multiply the input instead
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with topk=1"
            x_TH = (probs_T.unsqueeze(-1) * x_TH).to(x_TH.dtype)
            probs_T = torch.ones_like(probs_T)
        w1_EHF, w2_EFH = self._weights()
        if x_TH.shape[0] == 0:  # no token for any local expert: zero rows through the whole weights (grads)
            h_TF = mlp_activation(self.config, x_TH @ self.weight1.view(self.config.hidden_size, -1), probs_T)
            return h_TF @ self.weight2.view(-1, self.config.hidden_size), None
        # offsets, kernel choice and gradient mask once for both projections (widths H, 2F and F)
        groups = expert_groups(x_TH, tokens_per_expert, ffn=w2_EFH.shape[1], weights=(w1_EHF, w2_EFH))
        self.num_forwards += 1
        if not groups.fast:  # counted on the host, no sync: the metric perf/expert_path_fallback_frac
            self.num_slow_forwards += 1
            self.slow_because = groups.slow_because
        h_TF = self._activation(gmm(x_TH, w1_EHF, tokens_per_expert, groups=groups), probs_T, groups.kind)
        return gmm(h_TF, w2_EFH, tokens_per_expert, groups=groups), None

    def _activation(self, h_TF: torch.Tensor, probs_T: torch.Tensor, kind: str) -> torch.Tensor:
        """The SwiGLU and the routing probabilities: on CUDA one fused autograd function (`moe_gspo.mcore.swiglu`,
        compiled; saves only the fc1 output and the probabilities, as Megatron's `weighted_bias_swiglu_impl`);
        elsewhere, or for another activation, `SequentialMLP`'s unfused maths (`mlp_activation`: the CPU's
        numbers stay bit for bit those of the per-expert layout's activation)."""
        c = self.config
        if kind == "cuda" and swiglu_fusable(c):
            return swiglu_with_probs(h_TF, probs_T, offset=c.glu_linear_offset, compiled=h_TF.is_cuda)
        return mlp_activation(c, h_TF, probs_T)


def with_grouped_experts(block_spec):
    """A copy of a GPT decoder block spec whose legacy `GroupedMLP` experts are `GroupedExperts`; and how many."""
    return swap_expert_module(block_spec, GroupedMLP, GroupedExperts)


def expert_modules(model) -> list:
    """The expert modules of `model`'s MoE layers (`SequentialMLP`, `GroupedMLP`, `TEGroupedMLP`, ...), in order."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m.experts for m in model.modules() if isinstance(m, MoELayer)]  # through DDP wrappers too


def built_expert_layout(model) -> str:
    """`grouped` when `model`'s MoE layers hold `GroupedExperts` (one parameter per projection), else
    `per_expert`: the parameter naming a checkpoint of `model` has."""
    return "grouped" if any(isinstance(m, GroupedExperts) for m in expert_modules(model)) else "per_expert"


def weight_copies(model) -> int:
    """Forwards of `model`'s experts that copied their weights (`num_weight_copies` of `GroupedExperts` and
    `batched_experts.BatchedSequentialMLP`, summed over layers)."""
    return sum(getattr(m, "num_weight_copies", 0) for m in expert_modules(model))


def expert_path_counts(model, *, reset: bool = False) -> dict:
    """The grouped layout's expert forwards with tokens since the last reset, summed over `model`'s
    `GroupedExperts` (empty without them): `forwards`, `slow_forwards` (off the fast path: the loop over
    experts), `slow_layers` (MoE layers with a slow one) and `slow_because` (their causes, sorted).
    `reset`: start the counts again (the training loop does, once per step)."""
    mods = [m for m in expert_modules(model) if isinstance(m, GroupedExperts)]
    if not mods:
        return {}
    out = {"forwards": sum(m.num_forwards for m in mods), "slow_forwards": sum(m.num_slow_forwards for m in mods),
           "slow_layers": sum(m.num_slow_forwards > 0 for m in mods), "layers": len(mods),
           "slow_because": sorted({m.slow_because for m in mods if m.num_slow_forwards})}
    if reset:
        for m in mods:
            m.num_forwards = m.num_slow_forwards = 0
            m.slow_because = None
    return out


def expert_path_metrics(model) -> dict[str, float]:
    """`perf/expert_path_fallback_frac`: the share of this step's grouped-layout expert forwards (all MoE layers,
    every pass) that left the fast path; absent without the grouped layout or without such forwards. Resets
    the counts (`expert_path_counts`)."""
    counts = expert_path_counts(model, reset=True)
    if not counts.get("forwards"):
        return {}
    return {"perf/expert_path_fallback_frac": counts["slow_forwards"] / counts["forwards"]}
