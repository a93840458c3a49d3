"""Per-token log-probabilities (and entropies) of a token sequence from a causal LM's logits.

Convention: the result is aligned with the tokens, `logp_BS[b, t] = log p(ids[b, t] | ids[b, < t])`
computed from `logits_BSV[b, t - 1]`, for t >= 1; position 0 (no context) is 0. Likewise
`entropy_BS[b, t]` is the entropy of the distribution that predicted token t.

Numerics: float32 whatever the logits' dtype (`logsumexp` and a gather of the target logit, no full
`log_softmax` tensor), processed in row chunks so that a bf16 `[B, S, V]` input never needs a full
float32 copy at once in the forward. Differentiable.

Memory for backward: float32 logits go through plain autograd ops, which keep each float32 chunk
(the logits themselves, and with entropies the chunk's softmax too). Logits of any other dtype (bf16
on a GPU) go through `ChunkedTokenLogprobs`, an autograd function that keeps only the input logits in
their own dtype and O(tokens) floats (log-sum-exp, entropy, targets) and recomputes each chunk's
softmax in float32 in the backward: at Qwen3's 151,936-token vocabulary and 4096 tokens it keeps
1.24 GB (the bf16 logits, which the output layer made anyway) instead of a 2.5 GB float32 copy (5 GB
with entropies). The values are those of the plain path (same float32 ops); the gradients equal it
to float32 rounding (`tests/learner/test_logprobs.py`).

Same-support log-probs (top-p / top-k sampling, `moe_gspo.algos.support`): with `support`, each listed
response token's log-prob is the log-softmax over the support it was sampled from only (the other
logits count as -inf), gathered as `[N, K]` logits (no `[B, S, V]` mask); entropies stay those of the full
distribution.
"""

from __future__ import annotations

import torch

from moe_gspo.algos.support import support_logprob

_CHUNK_ELEMENTS = 1 << 25  # float32 elements per chunk (128 MiB)


def token_logprobs(logits_BSV: torch.Tensor, input_ids_BS: torch.Tensor, *, with_entropy: bool = False,
                   chunk_elements: int = _CHUNK_ELEMENTS, support: tuple[torch.Tensor, ...] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(logp_BS, entropy_BS or None)`, float32, aligned with `input_ids_BS` (0 at position 0).

    `support` = `(b_N, t_N, ids_NK, valid_NK)` (`PackedBatch.support_index`): the tokens at positions
    `(b_N, t_N)` (t >= 1) get their log-prob renormalised over `ids_NK[n][valid_NK[n]]` instead."""
    if logits_BSV.dim() != 3 or input_ids_BS.dim() != 2 or logits_BSV.shape[:2] != input_ids_BS.shape:
        raise ValueError(f"token_logprobs: need logits [B, S, V] and input_ids [B, S] with the same B, S; got "
                         f"{tuple(logits_BSV.shape)} and {tuple(input_ids_BS.shape)}")
    B, S, V = logits_BSV.shape
    # The target of row (b, s) is token (b, s + 1); the last row of each sequence predicts nothing.
    targets_BS = torch.nn.functional.pad(input_ids_BS[:, 1:], (0, 1), value=0).long()
    if B * S:
        _check_ids(targets_BS, V)
    flat_NV = logits_BSV.reshape(B * S, V)
    tgt_N = targets_BS.reshape(B * S)
    chunk = max(1, int(chunk_elements) // max(V, 1))
    logps, ents = [], []
    if logits_BSV.dtype != torch.float32 and B * S:
        logp_N, ent_N = ChunkedTokenLogprobs.apply(flat_NV, tgt_N, with_entropy, chunk)
        logps, ents = [logp_N], ([ent_N] if with_entropy else [])
    else:
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

    logp_BS = align(logps)
    if support is not None and support[0].numel():
        logp_N = support_token_logprobs(logits_BSV, input_ids_BS, *support)
        logp_BS = logp_BS.index_put((support[0], support[1]), logp_N)
    return logp_BS, (align(ents) if with_entropy else None)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """`(logp_N, entropy_N)` float32 of logits `[N, V]` (any dtype) and targets `[N]`, computed in float32
    `chunk` rows at a time; saves for backward only the logits (their own dtype, no copy), the targets and
    float32 `[N]` log-sum-exps and entropies, and recomputes each chunk's softmax in the backward.
    `entropy_N` is an empty tensor unless `with_entropy`. The gradient has the logits' dtype."""

    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, tgt_N: torch.Tensor, with_entropy: bool, chunk: int):
        N = logits_NV.shape[0]
        logp_N = logits_NV.new_empty(N, dtype=torch.float32)
        lse_N = logits_NV.new_empty(N, dtype=torch.float32)
        ent_N = logits_NV.new_empty(N if with_entropy else 0, dtype=torch.float32)
        for i in range(0, N, chunk):
            x = logits_NV[i:i + chunk].float()  # the same float32 ops as token_logprobs' plain path
            lse = torch.logsumexp(x, dim=-1)
            lse_N[i:i + chunk] = lse
            logp_N[i:i + chunk] = x.gather(-1, tgt_N[i:i + chunk, None]).squeeze(-1) - lse
            if with_entropy:
                p = torch.exp(x - lse[:, None])
                ent_N[i:i + chunk] = lse - (p * x).sum(-1)
        ctx.save_for_backward(logits_NV, tgt_N, lse_N, ent_N)
        ctx.with_entropy, ctx.chunk = with_entropy, chunk
        ctx.set_materialize_grads(False)
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):
        logits_NV, tgt_N, lse_N, ent_N = ctx.saved_tensors
        if g_logp_N is None and (g_ent_N is None or not ctx.with_entropy):
            return None, None, None, None
        grad_NV = torch.empty_like(logits_NV)
        for i in range(0, logits_NV.shape[0], ctx.chunk):
            j = min(i + ctx.chunk, logits_NV.shape[0])
            x = logits_NV[i:j].float()
            lse = lse_N[i:j, None]
            p = torch.exp(x - lse)
            g = torch.zeros_like(x)
            if g_logp_N is not None:
                # d logp / dx = onehot(target) - p
                g_lp = g_logp_N[i:j, None]
                g.sub_(p * g_lp).scatter_add_(-1, tgt_N[i:j, None], g_lp)
            if ctx.with_entropy and g_ent_N is not None:
                # H = lse - sum p x; dH / dx_v = -p_v (x_v - lse + H)
                g.sub_(p * (x - lse + ent_N[i:j, None]) * g_ent_N[i:j, None])
            grad_NV[i:j] = g
        return grad_NV, None, None, None


def _check_ids(ids: torch.Tensor, V: int) -> None:
    """Token ids in [0, V): a ValueError on the CPU; on an accelerator an asynchronous device-side assert,
    so that a learner micro-batch does not wait for the device (the batch's ids were checked on the host
    when it was packed)."""
    if ids.device.type == "cpu":
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise ValueError(f"token_logprobs: token ids must be in [0, V={V}), got [{int(ids.min())}, {int(ids.max())}]")
    else:
        torch._assert_async(((ids >= 0) & (ids < V)).all(), f"token_logprobs: token ids must be in [0, V={V})")


def support_token_logprobs(logits_BSV: torch.Tensor, input_ids_BS: torch.Tensor, b_N: torch.Tensor,
                           t_N: torch.Tensor, ids_NK: torch.Tensor, valid_NK: torch.Tensor) -> torch.Tensor:
    """float32 [N]: log p(token (b, t)) renormalised over its support, from the logits of position t - 1
    (differentiable; gathers N x K logits and N targets)."""
    if b_N.numel():
        if t_N.device.type == "cpu":
            if int(t_N.min()) < 1:
                raise ValueError("support_token_logprobs: position 0 has no predicting logits; supports start at t >= 1")
        else:
            torch._assert_async((t_N >= 1).all(), "support_token_logprobs: supports start at t >= 1")
    prev_N = t_N - 1
    support_NK = logits_BSV[b_N[:, None], prev_N[:, None], ids_NK]
    target_N = logits_BSV[b_N, prev_N, input_ids_BS[b_N, t_N].long()]
    return support_logprob(support_NK, valid_NK, target_N)
