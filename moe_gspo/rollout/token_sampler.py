"""Next-token sampling of the transformers engine (`moe_gspo.rollout.hf_engine`), with the log-probs and,
under top-p / top-k, the per-token supports that same-support log-probs need (`moe_gspo.algos.support`).

Per decoding step, from float32 logits `[B, V]`:
- temperature 0: argmax; log-prob = full log-softmax (no support recorded);
- no truncation (top_p = 1, top_k = 0): a draw from `softmax(logits / T)`; log-prob = full log-softmax of
  the untempered logits;
- top_p < 1 or top_k > 0: the support `truncated_support` (top-k, k = top_k or the cap, then the top-p
  nucleus of the tempered, renormalised probabilities); a draw from the tempered probabilities over it;
  log-prob = the untempered logits' log-softmax over that support only; the support is recorded.

Memory while generating: the top-k ids of every step, int32 `[B, steps, k]` on the engine's device
(k <= rollout.support_cap); per sample, only the kept ids stay (`RolloutSample.support_ids_N`, int32,
4 bytes per kept id, plus `support_sizes_R`, 4 bytes per token).
"""

from __future__ import annotations

import numpy as np
import torch

from moe_gspo.algos.support import flatten_supports, support_logprobs_of_rows, support_top_k, truncated_support
from moe_gspo.rollout.base import RolloutSample, SamplingParams


def draw_tokens(logits_BV: torch.Tensor, *, temperature: float, top_p: float, k: int,
                generator: torch.Generator | None) -> tuple[torch.Tensor, tuple | None]:
    """One token per row: `(tok_B, support)`; `support` = `(ids_BK, sizes_B)` of `truncated_support` when
    `k > 0` and `temperature > 0`, else None (greedy, or the full distribution)."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1), None
    if k == 0:
        probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
        return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1), None
    ids_BK, sizes_B, probs_BK = truncated_support(logits_BV, temperature=temperature, top_p=top_p, k=k)
    pick_B1 = torch.multinomial(probs_BK, 1, generator=generator)
    return ids_BK.gather(-1, pick_B1).squeeze(-1), (ids_BK, sizes_B)


class TokenSampler:
    """Samples the tokens of one `generate` call step by step and keeps their supports.

    `step(logits_BV, finished_B)` returns `(tok_B, logp_B)` (rows already finished get `pad_token_id`);
    `attach_supports(samples)` fills `support_ids_N` / `support_sizes_R` of the call's samples (row b of
    the batch is `samples[b]`) when the sampling truncates, and leaves them None otherwise.
    """

    def __init__(self, sampling: SamplingParams, *, pad_token_id: int, device: torch.device | str):
        self.temperature, self.top_p = float(sampling.temperature), float(sampling.top_p)
        self.k = support_top_k(temperature=self.temperature, top_p=self.top_p, top_k=int(sampling.top_k),
                               cap=int(sampling.support_cap))
        self.pad_token_id = int(pad_token_id)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int(sampling.seed))
        self._ids: list[torch.Tensor] = []
        self._sizes: list[torch.Tensor] = []

    @property
    def records_support(self) -> bool:
        """True when the sampling truncates (top_p < 1 or top_k > 0, temperature > 0)."""
        return self.k > 0

    def step(self, logits_BV: torch.Tensor, finished_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tok_B, support = draw_tokens(logits_BV, temperature=self.temperature, top_p=self.top_p, k=self.k,
                                     generator=self.generator)
        if support is None:
            tok_B = tok_B.masked_fill(finished_B, self.pad_token_id)
            return tok_B, torch.log_softmax(logits_BV.float(), dim=-1).gather(-1, tok_B[:, None]).squeeze(-1)
        ids_BK, sizes_B = support
        logp_B = support_logprobs_of_rows(logits_BV.float(), tok_B, ids_BK, sizes_B)
        self._ids.append(ids_BK.to(torch.int32))
        self._sizes.append(sizes_B.to(torch.int32))
        return tok_B.masked_fill(finished_B, self.pad_token_id), logp_B  # finished rows are cut off later

    def attach_supports(self, samples: list[RolloutSample]) -> None:
        if not self.records_support:
            return
        ids_BSK = torch.stack(self._ids, 1).cpu().numpy()
        sizes_BS = torch.stack(self._sizes, 1).cpu().numpy()
        if len(samples) != ids_BSK.shape[0]:
            raise ValueError(f"attach_supports: {len(samples)} samples for a batch of {ids_BSK.shape[0]} rows")
        for b, s in enumerate(samples):
            R = len(s.response_ids)
            s.support_sizes_R = np.ascontiguousarray(sizes_BS[b, :R])
            s.support_ids_N = flatten_supports(ids_BSK[b, :R], s.support_sizes_R)
