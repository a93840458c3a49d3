"""Routing-drift metrics: how differently two routings (engines, dtypes, policy versions) route
the same tokens.

Used for rollout-engine vs learner routing (the R3 motivation, Ma et al. 2025, arXiv 2510.11370) and
for the learner's routing before vs after one update (the GSPO paper's Routing Replay motivation,
Zheng et al. 2025, arXiv 2507.18071, §5.3: "about 10% of the experts activated ... differ").

Everything compares top-k *sets*: the order of the K ids within a (token, layer) row is ignored.
Rows are assumed to hold K distinct ids (true for any top-k routing, and for the filler of
`moe_gspo.routing.align`). Inputs are numpy arrays or torch tensors (converted to numpy on the CPU);
the work is vectorised over tokens, layers and slots via a [tokens, L, K, K] slot-equality tensor,
processed in chunks of tokens to bound memory.

Metric keys (`routing_drift`):
- ``routing/layer_disagree`` list[L]: fraction of tokens whose top-k set differs in that layer.
- ``routing/any_layer_flip``: fraction of tokens whose set differs in at least one layer.
- ``routing/mean_layers_differing``: mean number of differing layers per token.
- ``routing/topk_overlap``: mean |A∩B|/K over tokens and layers.
- ``routing/jaccard``: mean |A∩B|/|A∪B| over tokens and layers.
- ``routing/expert_change_frac``: 1 − topk_overlap, the share of activated experts that differ (the
  GSPO paper's "~10% after one update" quantity when a = old policy, b = new policy).
- ``routing/expert_load_a`` / ``_b`` [L][E]: share of each layer's k slots that go to each expert
  (rows sum to 1); ``routing/expert_load_diff`` = b − a.
- ``routing/prob_kl`` (only with full router distributions ``probs_*_NLE``): mean over tokens and
  layers of KL(a‖b) = Σ_e a_e (log a_e − log b_e), probabilities clipped below at 1e-12.
- ``routing/topk_prob_l1`` (only with top-k probabilities ``topk_probs_*_NLK``, as traces store them:
  full-softmax probabilities of the listed experts, not renormalised gate weights): see `topk_prob_l1`.
- ``num_tokens``: tokens compared (after the mask).
Empty inputs give 0 for every metric (never NaN).

Simplification: no per-layer KL and no weighting by response length; `trace_drift` weights every
compared token equally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from moe_gspo.routing.trace import RoutingTrace

_CHUNK_TOKENS = 4096
_PROB_FLOOR = 1e-12


def _np(x: Any) -> np.ndarray | None:
    """numpy view of an array or torch tensor (None passes through)."""
    if x is None:
        return None
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _check_pair(topk_a: Any, topk_b: Any) -> tuple[np.ndarray, np.ndarray]:
    a, b = _np(topk_a), _np(topk_b)
    if a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"topk_a and topk_b must be [N, L, K] arrays, got shapes {a.shape} and {b.shape}")
    if a.shape != b.shape:
        raise ValueError(f"topk_a and topk_b must have the same shape [N, L, K], got {a.shape} vs {b.shape}")
    if a.shape[2] < 1:
        raise ValueError("top-k arrays need K >= 1 slots")
    if a.dtype.kind not in "iu" or b.dtype.kind not in "iu":
        raise ValueError(f"top-k arrays must hold integer expert ids, got {a.dtype} and {b.dtype}")
    return a, b


def _slot_match(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bool [n, L, K, K]: ``[.., i, j]`` is True when slot i of a and slot j of b hold the same id."""
    return a[..., :, None] == b[..., None, :]


def _intersection(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """int [N, L] size of the intersection of the top-k sets of a and b."""
    n, num_layers, _ = a.shape
    out = np.empty((n, num_layers), dtype=np.int32)
    for s in range(0, n, _CHUNK_TOKENS):
        # with K distinct ids per row, each slot of a matches at most one slot of b
        out[s:s + _CHUNK_TOKENS] = _slot_match(a[s:s + _CHUNK_TOKENS], b[s:s + _CHUNK_TOKENS]).sum((-1, -2))
    return out


def per_token_layer_diff(topk_a_NLK: Any, topk_b_NLK: Any) -> np.ndarray:
    """bool [N, L]: True where the two top-k sets of a token differ in that layer."""
    a, b = _check_pair(topk_a_NLK, topk_b_NLK)
    return _intersection(a, b) < a.shape[2]


def per_token_flip_mask(topk_a_NLK: Any, topk_b_NLK: Any) -> np.ndarray:
    """bool [N]: True for tokens whose top-k set differs in at least one layer."""
    return per_token_layer_diff(topk_a_NLK, topk_b_NLK).any(axis=1)


def expert_load(topk_NLK: Any, num_experts: int, *, rows: np.ndarray | None = None) -> np.ndarray:
    """float64 [L, E]: share of each layer's k slots that go to each expert (rows sum to 1; zeros if
    there are no tokens). `rows` (int indices) counts those tokens only, one layer at a time (no copy of
    the selected [M, L, K] rows)."""
    ids = _np(topk_NLK)
    n, num_layers, k = ids.shape
    if rows is not None:
        n = len(rows)
    if n == 0:
        return np.zeros((num_layers, num_experts))
    # per layer, in the ids' own dtype: no int64 copy of the whole [N, L, K] batch (72 B a token instead of 8 L K)
    counts = np.stack([np.bincount((ids[:, l, :] if rows is None else ids[rows, l, :]).ravel(), minlength=num_experts)
                       for l in range(num_layers)])
    return counts / float(n * k)


def topk_prob_l1(topk_a_NLK: Any, probs_a_NLK: Any, topk_b_NLK: Any, probs_b_NLK: Any) -> float:
    """Mean over tokens and layers of the L1 distance between the two sides' top-k probability vectors.

    Each side's K probabilities are placed on their experts in an E-vector that is zero elsewhere;
    the result is Σ_e |p_a(e) − p_b(e)| averaged over (token, layer) rows. Traces store full-softmax
    probabilities of the listed experts (not renormalised over the top k), so a side's K values sum
    to its top-k mass m ≤ 1 and the distance lies in [0, m_a + m_b] ⊂ [0, 2]: 0 for identical routing
    and probabilities, m_a + m_b for disjoint expert sets. Renormalised gate weights (``p / p.sum``)
    may be passed instead; then disjoint sets give exactly 2. It is computed from the K slots only
    (no E-sized arrays), 0 when empty.
    """
    a, b = _check_pair(topk_a_NLK, topk_b_NLK)
    pa, pb = _np(probs_a_NLK), _np(probs_b_NLK)
    if pa.shape != a.shape or pb.shape != b.shape:
        raise ValueError(f"top-k probabilities must have the shape of the ids {a.shape}, got "
                         f"{pa.shape} and {pb.shape}")
    n = a.shape[0]
    if n == 0 or a.shape[1] == 0:
        return 0.0
    total = 0.0
    for s in range(0, n, _CHUNK_TOKENS):
        m = _slot_match(a[s:s + _CHUNK_TOKENS], b[s:s + _CHUNK_TOKENS])        # [n, L, K, K]
        wa = pa[s:s + _CHUNK_TOKENS].astype(np.float32)
        wb = pb[s:s + _CHUNK_TOKENS].astype(np.float32)
        wb_at_a = np.einsum("nlij,nlj->nli", m.astype(np.float32), wb)          # b's weight on a's experts
        b_in_a = m.any(-2)                                                       # b slots whose expert a has
        total += float(np.abs(wa - wb_at_a).sum(dtype=np.float64))
        total += float(wb.sum(dtype=np.float64) - wb[b_in_a].sum(dtype=np.float64))
    return float(total / (n * a.shape[1]))


def _check_ids(a: np.ndarray, b: np.ndarray, num_experts: int) -> None:
    for name, x in (("topk_a_NLK", a), ("topk_b_NLK", b)):
        if x.size and (int(x.min()) < 0 or int(x.max()) >= num_experts):
            raise ValueError(f"{name} holds expert ids outside [0, num_experts={num_experts})")


@dataclass(frozen=True, kw_only=True)
class SetDrift:
    """How the top-k sets of two routings of the same N tokens differ (every value 0 when N = 0 or L = 0).
    The step metrics (`moe_gspo.routing.drift_metrics`) log these fields under their own keys."""

    layer_disagree: list[float]
    """[L] fraction of tokens whose top-k set differs in that layer."""
    any_layer_flip: float
    """Fraction of tokens whose set differs in at least one layer."""
    mean_layers_differing: float
    """Mean number of differing layers per token."""
    topk_overlap: float
    """Mean |A∩B|/K over tokens and layers."""
    jaccard: float
    """Mean |A∩B|/|A∪B| over tokens and layers."""
    expert_change_frac: float
    """1 − topk_overlap: the share of activated experts that differ."""
    num_tokens: int
    """N, the tokens compared."""


def _set_drift(a: np.ndarray, b: np.ndarray) -> SetDrift:
    n, num_layers, k = a.shape
    inter = _intersection(a, b) if n and num_layers else np.zeros((n, num_layers), np.int32)
    return set_drift_of_intersection(inter, k)


def topk_intersection(topk_a_NLK: Any, topk_b_NLK: Any) -> np.ndarray:
    """int32 [N, L]: the size of the intersection of the two top-k sets of each token and layer (computed
    once, it gives `set_drift_of_intersection` of any subset of the tokens)."""
    a, b = _check_pair(topk_a_NLK, topk_b_NLK)
    return _intersection(a, b)


def set_drift_of_intersection(inter_NL: np.ndarray, top_k: int) -> SetDrift:
    """`SetDrift` from the intersection sizes [N, L] (`topk_intersection`) of top-k sets of width `top_k`."""
    n, num_layers = inter_NL.shape
    k = int(top_k)
    if n == 0 or num_layers == 0:
        return SetDrift(layer_disagree=[0.0] * num_layers, any_layer_flip=0.0, mean_layers_differing=0.0,
                        topk_overlap=0.0, jaccard=0.0, expert_change_frac=0.0, num_tokens=int(n))
    inter = inter_NL
    diff = inter < k
    overlap = float(inter.mean() / k)
    return SetDrift(layer_disagree=diff.mean(axis=0).tolist(), any_layer_flip=float(diff.any(axis=1).mean()),
                    mean_layers_differing=float(diff.sum(axis=1).mean()), topk_overlap=overlap,
                    jaccard=float((inter / (2 * k - inter)).mean()), expert_change_frac=1.0 - overlap,
                    num_tokens=int(n))


def check_topk_ids(topk_a_NLK: Any, topk_b_NLK: Any, *, num_experts: int, rows: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Both sides as numpy arrays; ValueError unless they are [N, L, K] integer ids of the same shape, in
    [0, num_experts) (in the tokens `rows` only, when given: checked one layer at a time, no copy of the
    selected rows)."""
    a, b = _check_pair(topk_a_NLK, topk_b_NLK)
    if rows is None:
        _check_ids(a, b, int(num_experts))
    else:
        for name, x in (("topk_a_NLK", a), ("topk_b_NLK", b)):
            for layer in range(x.shape[1]):
                sel = x[rows, layer, :]
                if sel.size and (int(sel.min()) < 0 or int(sel.max()) >= num_experts):
                    raise ValueError(f"{name} holds expert ids outside [0, num_experts={num_experts})")
    return a, b


def set_drift(topk_a_NLK: Any, topk_b_NLK: Any, *, num_experts: int) -> SetDrift:
    """The top-k set comparison of `routing_drift` (no expert loads, no probabilities) as a `SetDrift`;
    ValueError for arrays that are not [N, L, K] integer ids in [0, num_experts)."""
    return _set_drift(*check_topk_ids(topk_a_NLK, topk_b_NLK, num_experts=num_experts))


def routing_drift(topk_a_NLK: Any, topk_b_NLK: Any, *, num_experts: int, probs_a_NLE: Any = None,
                  probs_b_NLE: Any = None, topk_probs_a_NLK: Any = None, topk_probs_b_NLK: Any = None,
                  token_mask_N: Any = None) -> dict[str, Any]:
    """Drift metrics between two routings of the same N tokens (keys in the module docstring).

    `token_mask_N` (bool [N]) restricts every metric to the selected tokens. `probs_*_NLE` are full
    router distributions [N, L, E] (adds ``routing/prob_kl``); `topk_probs_*_NLK` are the
    probabilities of the listed experts [N, L, K] (adds ``routing/topk_prob_l1``).
    """
    a, b = _check_pair(topk_a_NLK, topk_b_NLK)
    num_experts = int(num_experts)
    n_all, num_layers, k = a.shape
    _check_ids(a, b, num_experts)
    pa, pb = _np(probs_a_NLE), _np(probs_b_NLE)
    if (pa is None) != (pb is None):
        raise ValueError("pass both probs_a_NLE and probs_b_NLE, or neither")
    if pa is not None:
        for name, p in (("probs_a_NLE", pa), ("probs_b_NLE", pb)):
            if p.shape != (n_all, num_layers, num_experts):
                raise ValueError(f"{name} must have shape [N, L, E] = {(n_all, num_layers, num_experts)}, "
                                 f"got {p.shape}")
    ta, tb = _np(topk_probs_a_NLK), _np(topk_probs_b_NLK)
    if (ta is None) != (tb is None):
        raise ValueError("pass both topk_probs_a_NLK and topk_probs_b_NLK, or neither")
    if token_mask_N is not None:
        mask = _np(token_mask_N).astype(bool)
        if mask.shape != (n_all,):
            raise ValueError(f"token_mask_N must be a bool array of shape [N] = ({n_all},), got {mask.shape}")
        a, b = a[mask], b[mask]
        pa = pa[mask] if pa is not None else None
        pb = pb[mask] if pb is not None else None
        ta = ta[mask] if ta is not None else None
        tb = tb[mask] if tb is not None else None
    n = a.shape[0]

    load_a, load_b = expert_load(a, num_experts), expert_load(b, num_experts)
    sets = _set_drift(a, b)
    out: dict[str, Any] = {
        "routing/layer_disagree": sets.layer_disagree, "routing/any_layer_flip": sets.any_layer_flip,
        "routing/mean_layers_differing": sets.mean_layers_differing, "routing/topk_overlap": sets.topk_overlap,
        "routing/jaccard": sets.jaccard, "routing/expert_change_frac": sets.expert_change_frac}
    out["routing/expert_load_a"] = load_a.tolist()
    out["routing/expert_load_b"] = load_b.tolist()
    out["routing/expert_load_diff"] = (load_b - load_a).tolist()
    if pa is not None:
        if n == 0 or num_layers == 0:
            out["routing/prob_kl"] = 0.0
        else:
            la = np.log(np.maximum(pa.astype(np.float64), _PROB_FLOOR))
            lb = np.log(np.maximum(pb.astype(np.float64), _PROB_FLOOR))
            out["routing/prob_kl"] = float((np.exp(la) * (la - lb)).sum(-1).mean())
    if ta is not None:
        out["routing/topk_prob_l1"] = topk_prob_l1(a, ta, b, tb)
    out["num_tokens"] = int(n)
    return out


# --------------------------------------------------------------------------------------------------
TokenSelection = Literal["all", "response", "prompt"]


def common_rows(trace_a: RoutingTrace, trace_b: RoutingTrace, *,
                tokens: TokenSelection = "all") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row indices of the tokens both traces routed: ``(rows_a, rows_b, seq_index)``, int64 [M].

    Sequence i contributes its first ``min(T_a_i, T_b_i)`` rows; ``tokens="prompt"`` keeps the rows at
    positions ``t < P_i`` (the prompt tokens), ``"response"`` those at ``t >= P_i`` (the sampled
    tokens; note the logits of response token t come from row t − 1). Raises ValueError when the
    traces do not describe the same sequences (N, L, K, num_experts, layer_ids, lengths).
    """
    _check_compatible(trace_a, trace_b)
    if tokens not in ("all", "response", "prompt"):
        raise ValueError(f"tokens must be 'all', 'response' or 'prompt', got {tokens!r}")
    t_common = np.minimum(trace_a.seq_lens, trace_b.seq_lens)
    p = trace_a.prompt_lens.astype(np.int64)
    if tokens == "all":
        lo, hi = np.zeros_like(t_common), t_common
    elif tokens == "prompt":
        lo, hi = np.zeros_like(t_common), np.minimum(t_common, p)
    else:
        lo, hi = np.minimum(p, t_common), t_common
    counts = hi - lo
    total = int(counts.sum())
    seq_index = np.repeat(np.arange(trace_a.num_sequences, dtype=np.int64), counts)
    # position within each selected run, then shift by each sequence's first selected row
    run_start = np.repeat(np.cumsum(counts) - counts, counts)
    within = np.arange(total, dtype=np.int64) - run_start
    rows_a = trace_a.seq_offsets[:-1][seq_index] + lo[seq_index] + within
    rows_b = trace_b.seq_offsets[:-1][seq_index] + lo[seq_index] + within
    return rows_a, rows_b, seq_index


def _check_compatible(ta: RoutingTrace, tb: RoutingTrace) -> None:
    checks = [("number of sequences N", ta.num_sequences, tb.num_sequences),
              ("number of MoE layers L", ta.num_layers, tb.num_layers),
              ("top-k K", ta.top_k, tb.top_k),
              ("num_experts", ta.num_experts, tb.num_experts)]
    for what, x, y in checks:
        if x != y:
            raise ValueError(f"traces differ in {what}: {x} vs {y}")
    if not np.array_equal(ta.layer_ids, tb.layer_ids):
        raise ValueError(f"traces differ in layer_ids: {ta.layer_ids.tolist()} vs {tb.layer_ids.tolist()}")
    for what, x, y in (("prompt_lens", ta.prompt_lens, tb.prompt_lens),
                       ("response_lens", ta.response_lens, tb.response_lens)):
        bad = np.nonzero(x != y)[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"traces differ in {what} (sequence {i}: {x[i]} vs {y[i]}); they must "
                             f"describe the same tokens")


def trace_drift(trace_a: RoutingTrace, trace_b: RoutingTrace, *,
                tokens: TokenSelection = "all") -> dict[str, Any]:
    """`routing_drift` over the tokens both traces routed (see `common_rows` for `tokens`).

    Adds ``routing/topk_prob_l1`` when both traces store router probabilities.
    """
    rows_a, rows_b, _ = common_rows(trace_a, trace_b, tokens=tokens)
    kw = {}
    if trace_a.router_probs is not None and trace_b.router_probs is not None:
        kw = dict(topk_probs_a_NLK=trace_a.router_probs[rows_a], topk_probs_b_NLK=trace_b.router_probs[rows_b])
    return routing_drift(trace_a.topk_ids[rows_a], trace_b.topk_ids[rows_b],
                         num_experts=trace_a.num_experts, **kw)
