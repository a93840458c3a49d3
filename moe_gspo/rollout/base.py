"""The rollout-engine interface: what every engine (transformers, vLLM) returns.

Conventions shared by every engine and by the learner:
- Samples come grouped: `generate(prompts, sampling)` returns `len(prompts) * sampling.n` samples,
  the `n` samples of prompt `i` at positions `i*n ... i*n+n-1` (so GRPO/GSPO groups are contiguous).
- `routes_TLK` lists, for each token whose routing the engine computed, the top-k expert ids in each
  MoE layer (MoE layers only, in model order). Row `t` is the token at position `t` of
  `prompt_ids + response_ids`. An engine never runs the last sampled token through the model, so
  `T <= P + R` (usually `P + R - 1`); rows past `T` are unknown.
- `response_logprobs` are the engine's log-probabilities of the sampled tokens under the raw model
  distribution (temperature 1), which is what the importance ratios need; under top-p / top-k
  sampling, renormalised over the support each token was drawn from, which the sample records
  (`support_ids_N`, `support_sizes_R`; the learner uses the same support, `moe_gspo.algos.support`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from moe_gspo.algos.support import DEFAULT_SUPPORT_CAP


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample responses."""

    n: int = 1
    """Samples per prompt (the group size G)."""
    temperature: float = 1.0
    """Sampling temperature; 1.0 samples from the policy itself."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 disables it (at most `support_cap`)."""
    support_cap: int = DEFAULT_SUPPORT_CAP
    """Most token ids in one token's recorded support: with top_p < 1 and top_k = 0 it acts as top_k
    (`moe_gspo.algos.support`)."""
    max_new_tokens: int = 16
    """Maximum response length in tokens."""
    seed: int = 0
    """Seed of the sampling RNG (the same seed and weights give the same samples)."""


@dataclass(kw_only=True)
class RolloutSample:
    """One sampled response."""

    prompt_index: int
    """Index of the prompt in the `generate` call (the group id)."""
    prompt_ids: np.ndarray
    """int64 [P] prompt token ids (no padding)."""
    response_ids: np.ndarray
    """int64 [R] sampled token ids, including the EOS token when one was sampled."""
    response_logprobs: np.ndarray
    """float32 [R] engine log-probs of the sampled tokens."""
    finish_reason: str
    """"stop" (EOS sampled) or "length" (max_new_tokens reached)."""
    routes_TLK: np.ndarray | None = None
    """uint8/uint16 [T, L, K] top-k expert ids per token and MoE layer, or None if not recorded."""
    router_probs_TLK: np.ndarray | None = None
    """float16 [T, L, K] full-softmax router probabilities of those experts (softmax over all experts,
    before the top-k renormalisation; see `moe_gspo.routing.trace`), or None."""
    router_margin_TL: np.ndarray | None = None
    """float16 [T, L] router margin per token and MoE layer: the k-th minus the (k+1)-th largest router logit
    (`moe_gspo.routing.router_stats`; transformers engine with record_probs), or None."""
    router_entropy_TL: np.ndarray | None = None
    """float16 [T, L] entropy (nats) of the router's softmax over all experts per token and MoE layer, or None."""
    support_ids_N: np.ndarray | None = None
    """int32 [N] under top-p / top-k sampling: the token ids each response token was drawn from (its
    support), concatenated in response order (token t's are the `support_sizes_R[t]` ids after the first
    `support_sizes_R[:t].sum()`), any order within a token; None = the full vocabulary (no truncation)."""
    support_sizes_R: np.ndarray | None = None
    """int32 [R] the number of ids in each response token's support (>= 1), with `support_ids_N`."""
    extra: dict = field(default_factory=dict)


class RolloutEngine(abc.ABC):
    """A generator of samples with per-token log-probs and routes."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[RolloutSample]:
        """Sample `sampling.n` responses for each prompt (token ids); groups are contiguous."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights, named as in transformers' `Qwen3MoeForCausalLM` (fused in-memory
        `experts.gate_up_proj` / `experts.down_proj`, or the per-expert checkpoint names).

        `named_tensors` may be a stream (`moe_gspo.mcore.weight_stream.HFWeightStream`): tensors are
        consumed one by one, valid only until the next is read, and the stream must be iterated to its
        end even on error (it runs collectives); its `specs` let the engine check names up front."""

    @property
    @abc.abstractmethod
    def records_routes(self) -> bool:
        """True when `generate` fills `routes_TLK` (required for R3 routing replay)."""

    def sleep(self) -> None:
        """Release accelerator memory while the learner runs (engines that can); the next
        `update_weights` or `generate` wakes the engine. Default: nothing to release."""

    def close(self) -> None:
        """Release the engine's resources; it must not be used afterwards. Default: nothing to do."""
