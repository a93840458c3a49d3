"""Pure conversions between moe_gspo and vLLM (no vLLM import; unit-tested on data objects).

- `vllm_sampling_kwargs`: our `SamplingParams` -> ``vllm.SamplingParams`` keyword arguments.
- `request_outputs_to_samples` / `completion_to_sample` / `routed_experts_to_routes` /
  `sampled_logprobs` / `sampling_mask_to_support`: ``LLM.generate`` results -> grouped `RolloutSample`s
  (routes of the MoE layers only, sampled-token log-probs, same-support sampling supports).
- `split_fused_experts`: transformers-5 fused expert tensors -> the on-disk per-expert names vLLM's
  Qwen3-MoE loader reads (views, no copies).

What vLLM returns is described in `moe_gspo.rollout.vllm_engine`.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from moe_gspo.algos.support import check_sample_support, support_top_k
from moe_gspo.rollout.base import RolloutSample, SamplingParams
from moe_gspo.routing.trace import ids_dtype

_FUSED_GATE_UP = re.compile(r"^(?P<prefix>.*\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(?P<prefix>.*\.experts)\.down_proj$")


def vllm_sampling_kwargs(sampling: SamplingParams, prompt_index: int, eos_token_ids: Sequence[int], *,
                         same_support: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` for prompt `prompt_index`.

    ``top_k=0`` is vLLM's "off" (0.32 and 0.33; -1 is also accepted). Top-p / top-k sampling needs an
    engine built with `same_support` (``return_sampling_mask``, ``logprobs_mode="processed_logprobs"``),
    which returns each token's support and its log-prob renormalised over it; vLLM's mask capture needs
    ``top_k > 0`` and ``temperature > 0`` in every request, so such an engine sends ``top_k`` = the
    support's k (`moe_gspo.algos.support.support_top_k`: top_k, or support_cap with top-p alone, or
    support_cap without truncation) and decodes greedily as top-1 sampling at temperature 1 (the same
    token, log-prob 0). Its log-probs are tempered, so it refuses temperatures other than 0 and 1.

    The seed is ``sampling.seed + prompt_index * n``; vLLM adds the sample index j, so every
    (prompt, sample) pair of one call gets its own seed. ``logprobs=0`` asks for the sampled token's
    log-prob only; ``detokenize=False`` skips text decoding (we only use token ids). Generation stops
    at exactly `eos_token_ids` (``ignore_eos`` drops vLLM's own EOS, ``stop_token_ids`` sets ours, and the
    stop token stays in the response), as in `HFEngine`.
    """
    if sampling.n < 1:
        raise ValueError(f"sampling.n must be >= 1, got {sampling.n}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
        raise ValueError(f"sampling.temperature={sampling.temperature} must be >= 0 and sampling.top_p="
                         f"{sampling.top_p} in (0, 1]")
    if sampling.temperature == 0 and sampling.n > 1:
        raise ValueError(f"greedy decoding (temperature 0) gives identical samples; vLLM refuses it with n="
                         f"{sampling.n} > 1: set a temperature > 0 or n=1")
    if not eos_token_ids:
        raise ValueError("eos_token_ids is empty; pass the tokenizer's EOS id(s)")
    temperature, top_p = float(sampling.temperature), float(sampling.top_p)
    k = support_top_k(temperature=temperature, top_p=top_p, top_k=int(sampling.top_k), cap=int(sampling.support_cap))
    if not same_support:
        if k:
            raise ValueError(f"sampling.top_p={top_p} / sampling.top_k={sampling.top_k} need a vLLM engine built with "
                             "same_support=True (rollout.top_p < 1 or rollout.top_k > 0 builds one): otherwise vLLM's "
                             "log-probs are the full-vocabulary ones, not the sampled support's")
        top_k = 0
    elif temperature == 0:
        temperature, top_p, top_k = 1.0, 1.0, 1  # greedy as top-1 sampling (the mask capture refuses T = 0)
    elif temperature != 1.0:
        raise ValueError(f"sampling.temperature={temperature} with a same-support vLLM engine: its log-probs "
                         "(processed_logprobs) would be the tempered ones; use temperature 1.0 (or 0)")
    else:
        top_k = k or int(sampling.support_cap)
    return dict(n=int(sampling.n), temperature=temperature, top_p=top_p,
                top_k=top_k, max_tokens=int(sampling.max_new_tokens),
                seed=int(sampling.seed) + int(prompt_index) * int(sampling.n), logprobs=0,
                detokenize=False, ignore_eos=True, stop_token_ids=[int(t) for t in eos_token_ids])


def routed_experts_to_routes(arr: Any, prompt_len: int, response_len: int, num_experts: int, *,
                             moe_layer_ids: Sequence[int] | None = None) -> np.ndarray:
    """Convert vLLM's ``CompletionOutput.routed_experts`` to a ``routes_TLK`` array (uint8/uint16).

    `arr` is ``[T, num_layers, K]`` integer ids with ``T = P + R - 1`` (vLLM with
    ``routed_experts_prompt_start=0``; ``T = P + R`` is accepted too). When `moe_layer_ids` is given
    and `arr` has more layer columns than MoE layers, the MoE columns are selected (vLLM 0.33 has
    one column per decoder layer); with equally many columns, `arr` is taken as MoE-only.
    """
    a = np.asarray(arr)
    if a.ndim != 3:
        raise ValueError(f"routed_experts must have shape [seq_len, num_layers, top_k], got {a.shape}")
    if a.dtype.kind not in "iu":
        raise ValueError(f"routed_experts must hold integer expert ids, got dtype {a.dtype}")
    total = int(prompt_len) + int(response_len)
    if not total - 1 <= a.shape[0] <= total:
        raise ValueError(
            f"routed_experts has {a.shape[0]} rows, expected prompt_len + response_len - 1 = {total - 1} "
            f"(rows are positions 0..P+R-2); was SamplingParams.routed_experts_prompt_start set to a "
            f"non-zero value, or the prompt/response lengths mixed up?")
    if moe_layer_ids is not None:
        ids = [int(i) for i in moe_layer_ids]
        if a.shape[1] != len(ids):
            if not ids or max(ids) >= a.shape[1] or min(ids) < 0:
                raise ValueError(f"routed_experts has {a.shape[1]} layer columns, which neither equals the "
                                 f"{len(ids)} MoE layers nor covers moe_layer_ids={ids}")
            a = a[:, ids, :]
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"routed_experts holds expert ids in [{lo}, {hi}], outside [0, {num_experts}); "
                             f"wrong num_experts, or a dense layer's column kept (pass moe_layer_ids)?")
    return np.ascontiguousarray(a.astype(ids_dtype(num_experts), copy=False))


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> np.ndarray:
    """float32 [R]: ``logprobs[t][token_ids[t]].logprob`` for each generated token.

    `logprobs` is ``CompletionOutput.logprobs``: a list (or vLLM ``FlatLogprobs``) with one
    ``{token_id: Logprob}`` mapping per generated token.
    """
    if logprobs is None:
        raise ValueError("CompletionOutput.logprobs is None: request them with SamplingParams(logprobs=0)")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"got {len(logprobs)} logprob entries for {len(token_ids)} generated tokens")
    out = np.empty(len(token_ids), dtype=np.float32)
    for t, tok in enumerate(token_ids):
        entry = logprobs[t]
        tok = int(tok)
        if entry is None or tok not in entry:
            raise ValueError(f"logprobs[{t}] has no entry for the sampled token {tok}")
        out[t] = entry[tok].logprob
    return out


def sampling_mask_to_support(token_ids: Sequence[int], sampling_mask: Any) -> tuple[np.ndarray, np.ndarray]:
    """`(support_ids_N int32, support_sizes_R int32)` from ``CompletionOutput.sampling_mask`` (vLLM's
    ``SamplingMask``: ``token_ids[t]`` = the ids that survived top-k / top-p for generated token t, in
    vocabulary order, wider than top_k on logit ties); checks that each sampled token is in its support."""
    rows = getattr(sampling_mask, "token_ids", sampling_mask)
    if len(rows) != len(token_ids):
        raise ValueError(f"sampling_mask has {len(rows)} rows for {len(token_ids)} generated tokens")
    sizes = np.asarray([len(r) for r in rows], dtype=np.int32)
    ids = np.concatenate([np.zeros(0, np.int32)] + [np.asarray(r, dtype=np.int32) for r in rows])
    check_sample_support(np.asarray(token_ids, dtype=np.int64), ids, sizes, where="vLLM sampling_mask")
    return ids, sizes


def completion_to_sample(prompt_index: int, prompt_ids: Sequence[int], completion_output: Any, *,
                         num_experts: int | None = None, moe_layer_ids: Sequence[int] | None = None,
                         require_support: bool = False) -> RolloutSample:
    """A `RolloutSample` from one vLLM ``CompletionOutput``.

    Routes are converted when the output carries ``routed_experts`` and `num_experts` is given; the
    sampling support when it carries ``sampling_mask`` (required with `require_support`).
    Aborted or failed completions raise ValueError (they must not be trained on).
    """
    c = completion_output
    reason = c.finish_reason
    if reason is None:
        raise ValueError(f"completion {c.index} of prompt {prompt_index} has not finished")
    if reason in ("abort", "error"):
        raise ValueError(f"completion {c.index} of prompt {prompt_index} finished with {reason!r}; "
                         f"it has no usable response")
    response = np.asarray(list(c.token_ids), dtype=np.int64)
    prompt = np.asarray(list(prompt_ids), dtype=np.int64)
    routes = None
    routed = getattr(c, "routed_experts", None)
    if routed is not None and num_experts is not None:
        try:
            routes = routed_experts_to_routes(routed, len(prompt), len(response), num_experts,
                                              moe_layer_ids=moe_layer_ids)
        except ValueError as e:
            raise ValueError(f"prompt {prompt_index}, completion {c.index}: {e}") from e
    support_ids = support_sizes = None
    mask = getattr(c, "sampling_mask", None)
    if mask is None and require_support:
        raise ValueError(f"completion {c.index} of prompt {prompt_index} has no sampling_mask; build the engine "
                         "with return_sampling_mask=True (VLLMEngine(same_support=True))")
    if mask is not None:
        try:
            support_ids, support_sizes = sampling_mask_to_support(response.tolist(), mask)
        except ValueError as e:
            raise ValueError(f"prompt {prompt_index}, completion {c.index}: {e}") from e
    return RolloutSample(prompt_index=int(prompt_index), prompt_ids=prompt, response_ids=response,
                         response_logprobs=sampled_logprobs(response.tolist(), c.logprobs),
                         finish_reason=str(reason), routes_TLK=routes, router_probs_TLK=None,
                         support_ids_N=support_ids, support_sizes_R=support_sizes,
                         extra={"stop_reason": getattr(c, "stop_reason", None)})


def request_outputs_to_samples(request_outputs: Sequence[Any], prompts: Sequence[Sequence[int]], n: int, *,
                               num_experts: int | None = None, moe_layer_ids: Sequence[int] | None = None,
                               require_support: bool = False) -> list[RolloutSample]:
    """Flatten ``LLM.generate`` results into grouped samples (prompt i's n samples contiguous)."""
    if len(request_outputs) != len(prompts):
        raise ValueError(f"got {len(request_outputs)} request outputs for {len(prompts)} prompts")
    samples = []
    for i, (ro, prompt) in enumerate(zip(request_outputs, prompts)):
        if ro.prompt_token_ids is not None and list(ro.prompt_token_ids) != [int(x) for x in prompt]:
            raise ValueError(f"request output {i} is for a different prompt than prompts[{i}]")
        outs = sorted(ro.outputs, key=lambda c: c.index)
        if len(outs) != n:
            raise ValueError(f"prompt {i} returned {len(outs)} completions, expected n={n}")
        samples.extend(completion_to_sample(i, prompt, c, num_experts=num_experts, moe_layer_ids=moe_layer_ids,
                                            require_support=require_support) for c in outs)
    return samples


def split_fused_experts(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename transformers-5 in-memory Qwen3-MoE weights to the on-disk per-expert layout.

    ``<p>.experts.gate_up_proj`` [E, 2I, H] becomes ``<p>.experts.{e}.gate_proj.weight`` = rows
    ``[:I]`` and ``<p>.experts.{e}.up_proj.weight`` = rows ``[I:]``; ``<p>.experts.down_proj``
    [E, H, I] becomes ``<p>.experts.{e}.down_proj.weight``. Other tensors pass through unchanged.
    Outputs are views of the inputs (no copies).
    """
    for name, t in named_tensors:
        m = _FUSED_GATE_UP.match(name)
        if m:
            if t.dim() != 3 or t.shape[1] % 2:
                raise ValueError(f"{name} must be [E, 2*I, H] (gate rows then up rows), got {tuple(t.shape)}")
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{m['prefix']}.{e}.gate_proj.weight", t[e, :inter]
                yield f"{m['prefix']}.{e}.up_proj.weight", t[e, inter:]
            continue
        m = _FUSED_DOWN.match(name)
        if m:
            if t.dim() != 3:
                raise ValueError(f"{name} must be [E, H, I], got {tuple(t.shape)}")
            for e in range(t.shape[0]):
                yield f"{m['prefix']}.{e}.down_proj.weight", t[e]
            continue
        yield name, t
