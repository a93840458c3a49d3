"""The transformers engine's decoder interface: a prefill and one-token steps, each giving logits and routes.

`HFEngine._generate` (moe_gspo/rollout/hf_engine.py) runs one sampling loop over an `HFDecoder`:

    step = decoder.prefill(input_ids_PT, mask_PT, positions_PT, repeat=n, max_new_tokens)
    loop: sample tokens_B from step.logits_BV; step = decoder.step(tokens_B, positions_B)
    decoder.end()

Two implementations compute the same numbers:

- `TransformersDecoder` (here): the model's own forward with a `DynamicCache` (the prompts' cache repeated
  `n` times after the prefill, the attention mask grown by one column per step), the routes recorded by
  `HFRouterRecorder` hooks;
- `moe_gspo.rollout.compact_decode.CompactDecoder`: the same forward computed from the model's parameters
  in about a third of the tensor calls, routes returned directly (the engine's default where it supports
  the model; `rollout.compact_decode`).

Both return a `DecodeStep`: float32 logits of the next token for every sampled row (B = P * n: the prefill
feeds each distinct prompt once and returns its logits repeated `n` times), and the routes of the tokens
fed, `[N, T, L, K]` with N the rows fed and T the tokens per row (prefill: P prompts x their padded length;
step: B rows x 1), L the MoE layers, K the experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from moe_gspo.rollout.hf_router_hooks import HFRouterRecorder


@dataclass
class DecodeStep:
    """One decoder forward: the next-token logits of every sampled row and the routes of the tokens fed."""

    logits_BV: torch.Tensor
    """float32 [B, V] logits of the next token (unscaled; the sampler applies temperature / top-p / top-k)."""
    ids_NTLK: torch.Tensor | None = None
    """int16 (int32 past 32767 experts) [N, T, L, K] top-k expert ids of the fed tokens, or None when the
    decoder does not record routes."""
    probs_NTLK: torch.Tensor | None = None
    """float32 [N, T, L, K] full-softmax router probabilities of those experts (before renormalisation), or None."""
    stats_NTL2: torch.Tensor | None = None
    """float32 [N, T, L, 2] router margin and entropy per fed token and MoE layer, or None."""


class HFDecoder(Protocol):
    """What `HFEngine._generate` needs of a decoder (see the module docstring)."""

    record_routes: bool
    """Return the routes (`DecodeStep.ids_NTLK`, and probs / stats as the decoder records them); False: None."""

    def prefill(self, input_ids_PT: torch.Tensor, mask_PT: torch.Tensor, positions_PT: torch.Tensor,
                repeat: int, max_new_tokens: int) -> DecodeStep:
        """Feed the left-padded prompts (each distinct prompt once; `mask_PT` 1 on prompt tokens, `positions_PT`
        their positions) and start a generation of `repeat` rows per prompt and up to `max_new_tokens` steps.
        Logits: [P * repeat, V]; routes: [P, T, L, K]."""
        ...

    def step(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> DecodeStep:
        """Feed one token per row at its position. Logits: [B, V]; routes: [B, 1, L, K]."""
        ...

    def end(self) -> None:
        """Release the generation's state (its KV cache)."""
        ...


class TransformersDecoder:
    """`HFDecoder` on the model's own forward (see the module docstring).

    Args:
        model: the engine's `Qwen3MoeForCausalLM`.
        recorder: the `HFRouterRecorder` hooked into `model`, or None (no routes).
        num_moe_layers / top_k: L and K of the routes.
    """

    def __init__(self, model: nn.Module, recorder: HFRouterRecorder | None, *, num_moe_layers: int, top_k: int):
        self.model = model
        self.recorder = recorder
        self.record_routes = recorder is not None
        self.num_moe_layers = num_moe_layers
        self.top_k = top_k
        self._cache = None
        self._mask_BT: torch.Tensor | None = None

    def _routes(self, rows: int, tokens: int) -> tuple:
        """The single recorded forward as ([rows, tokens, L, K] ids, probs or None, [rows, tokens, L, 2] router
        margin and entropy or None); (None, None, None) without routes."""
        if not self.record_routes or self.recorder is None:
            return None, None, None
        calls = self.recorder.pop()
        assert len(calls) == 1, f"expected one recorded forward, got {len(calls)}"
        L, K = self.num_moe_layers, self.top_k
        ids = calls[0].topk_ids_NLK.reshape(rows, tokens, L, K)
        probs, stats = calls[0].probs_NLK, calls[0].stats_NL2
        if probs is not None:
            probs = probs.reshape(rows, tokens, L, K)
        if stats is not None:
            stats = stats.reshape(rows, tokens, L, 2)
        return ids, probs, stats

    def prefill(self, input_ids_PT: torch.Tensor, mask_PT: torch.Tensor, positions_PT: torch.Tensor,
                repeat: int, max_new_tokens: int) -> DecodeStep:
        from transformers import DynamicCache

        self._cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids_PT, attention_mask=mask_PT, position_ids=positions_PT,
                         past_key_values=self._cache, use_cache=True, logits_to_keep=1,
                         output_router_logits=False)
        routes = self._routes(*input_ids_PT.shape)
        if repeat > 1:
            self._cache.batch_repeat_interleave(repeat)
        self._mask_BT = mask_PT.repeat_interleave(repeat, dim=0)
        return DecodeStep(out.logits[:, -1].float().repeat_interleave(repeat, dim=0), *routes)

    def step(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> DecodeStep:
        assert self._cache is not None, "call prefill() first"
        rows = tokens_B.shape[0]
        self._mask_BT = torch.cat([self._mask_BT, self._mask_BT.new_ones((rows, 1))], dim=1)
        out = self.model(input_ids=tokens_B[:, None], attention_mask=self._mask_BT,
                         position_ids=positions_B[:, None], past_key_values=self._cache,
                         use_cache=True, output_router_logits=False)
        return DecodeStep(out.logits[:, -1].float(), *self._routes(rows, 1))

    def end(self) -> None:
        self._cache = self._mask_BT = None
