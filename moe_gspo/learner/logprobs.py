"""Per-token log-probabilities (and entropies) of a token sequence from a causal LM's logits.

Convention: the result is aligned with the tokens, `logp_BS[b, t] = log p(ids[b, t] | ids[b, < t])`
computed from `logits_BSV[b, t - 1]`, for t >= 1; position 0 (no context) is 0. Likewise
`entropy_BS[b, t]` is the entropy of the distribution that predicted token t.

Numerics: float32 whatever the logits' dtype (`logsumexp` and a gather of the target logit, no full
`log_softmax` tensor), processed in row chunks so that a bf16 `[B, S, V]` input never needs a full
float32 copy at once in the forward. Differentiable.
"""

from __future__ import annotations

import torch

_CHUNK_ELEMENTS = 1 << 25  # float32 elements per chunk (128 MiB)


def token_logprobs(logits_BSV: torch.Tensor, input_ids_BS: torch.Tensor, *, with_entropy: bool = False,
                   chunk_elements: int = _CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(logp_BS, entropy_BS or None)`, float32, aligned with `input_ids_BS` (0 at position 0)."""
    if logits_BSV.dim() != 3 or input_ids_BS.dim() != 2 or logits_BSV.shape[:2] != input_ids_BS.shape:
        raise ValueError(f"token_logprobs: need logits [B, S, V] and input_ids [B, S] with the same B, S; got "
                         f"{tuple(logits_BSV.shape)} and {tuple(input_ids_BS.shape)}")
    B, S, V = logits_BSV.shape
    # The target of row (b, s) is token (b, s + 1); the last row of each sequence predicts nothing.
    targets_BS = torch.nn.functional.pad(input_ids_BS[:, 1:], (0, 1), value=0).long()
    if B * S and (int(targets_BS.min()) < 0 or int(targets_BS.max()) >= V):
        raise ValueError(f"token_logprobs: token ids must be in [0, V={V}), got "
                         f"[{int(targets_BS.min())}, {int(targets_BS.max())}]")
    flat_NV = logits_BSV.reshape(B * S, V)
    tgt_N = targets_BS.reshape(B * S)
    chunk = max(1, int(chunk_elements) // max(V, 1))
    logps, ents = [], []
    for i in range(0, B * S, chunk):
        x = flat_NV[i:i + chunk].float()
        lse = torch.logsumexp(x, dim=-1)
        logps.append(x.gather(-1, tgt_N[i:i + chunk, None]).squeeze(-1) - lse)
        if with_entropy:
            p = torch.exp(x - lse[:, None])
            ents.append(lse - (p * x).sum(-1))
    zero_col = logits_BSV.new_zeros((B, 1), dtype=torch.float32)

    def align(parts):
        pred_BS = torch.cat(parts).view(B, S) if parts else logits_BSV.new_zeros((B, S), dtype=torch.float32)
        return torch.cat([zero_col, pred_BS[:, :-1]], dim=1)

    return align(logps), (align(ents) if with_entropy else None)
