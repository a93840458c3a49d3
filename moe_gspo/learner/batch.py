"""The learner's batch: rollout samples packed into right-padded tensors, and how ranks split it.

Layout (shared by every learner pass):
- sequence b is `prompt_ids + response_ids`, laid out from position 0 and right-padded with the pad id
  up to `S = max(seq_lens)`; no attention mask beyond the causal one is needed for right padding;
- log-probs are aligned with the tokens: `logp_BS[b, t] = log p(token[b, t] | tokens[b, < t])` for
  `t >= 1` and 0 at position 0, so `response_mask_BS` selects the response log-probs directly;
- `rollout_routes[b]` is the engine's `[T_b, L, K]` routing of the tokens at positions `0 .. T_b - 1`
  (`T_b <= seq_lens[b]`, see `moe_gspo.rollout.base`);
- under top-p / top-k sampling, `support_sizes_BS` / `support_ids` hold the support each response token
  was drawn from, and every learner pass computes that token's log-prob over it (`support_index`,
  `moe_gspo.algos.support`).

Every data-parallel rank holds the same (global) batch; `plan_shards` says which contiguous rows a rank
processes and how its rows are cut into micro-batches. Expert parallelism exchanges tokens between
ranks inside every MoE layer (Megatron's all-gather dispatcher gathers equal-sized blocks), so all ranks
must run the same number of forwards with the same `[S, B]` shape: shards are padded with dummy rows
(all pad tokens, no response token) and each micro-batch is cut to the longest sequence that any rank
has in that micro-batch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from moe_gspo.algos.support import check_sample_support, pad_supports
from moe_gspo.rollout.base import RolloutSample


@dataclass(kw_only=True)
class PackedBatch:
    """B sequences (prompt + response), right-padded to a common length S."""

    input_ids_BS: torch.Tensor
    """int64 [B, S] token ids, right-padded with `pad_id`."""
    response_mask_BS: torch.Tensor
    """bool [B, S]: True at the positions that hold response tokens."""
    seq_lens_B: torch.Tensor
    """int64 [B] real lengths (prompt + response)."""
    prompt_lens_B: torch.Tensor
    """int64 [B] prompt lengths."""
    advantages_B: torch.Tensor
    """float32 [B] one advantage per sequence."""
    rollout_logp_BS: torch.Tensor
    """float32 [B, S] rollout-engine log-probs at response positions, 0 elsewhere."""
    rollout_routes: list[np.ndarray] | None = None
    """B arrays [T_b, L, K] of the rollout engine's top-k expert ids as the engine gave them (T_b = 0:
    none for that sample), or None when not recorded; checked before any replay
    (`moe_gspo.routing.replay_checks`)."""
    pad_id: int = 0
    """The padding token id."""
    support_sizes_BS: torch.Tensor | None = None
    """int32 [B, S] under top-p / top-k sampling: at each response position, the size of the support
    its token was sampled from; 0 elsewhere. None = sampled from the full vocabulary."""
    support_ids: list[np.ndarray] | None = None
    """B int32 arrays [N_b] with `support_sizes_BS`: each sequence's support ids, concatenated over its
    response positions in order (`RolloutSample.support_ids_N`)."""

    def __post_init__(self):
        B, S = self.input_ids_BS.shape
        for name in ("response_mask_BS", "rollout_logp_BS"):
            if tuple(getattr(self, name).shape) != (B, S):
                raise ValueError(f"PackedBatch.{name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"expected [B, S] = {(B, S)} like input_ids_BS")
        for name in ("seq_lens_B", "prompt_lens_B", "advantages_B"):
            if tuple(getattr(self, name).shape) != (B,):
                raise ValueError(f"PackedBatch.{name} has shape {tuple(getattr(self, name).shape)}, "
                                 f"expected [B] = ({B},)")
        if self.rollout_routes is not None and len(self.rollout_routes) != B:
            raise ValueError(f"PackedBatch.rollout_routes has {len(self.rollout_routes)} entries for "
                             f"B={B} sequences")
        if (self.support_sizes_BS is None) != (self.support_ids is None):
            raise ValueError("PackedBatch.support_sizes_BS and support_ids go together (both or neither)")
        if self.support_sizes_BS is not None and (tuple(self.support_sizes_BS.shape) != (B, S)
                                                  or len(self.support_ids) != B):
            raise ValueError(f"PackedBatch supports: sizes {tuple(self.support_sizes_BS.shape)} and "
                             f"{len(self.support_ids)} id arrays for [B, S] = {(B, S)}")

    @property
    def num_seqs(self) -> int:
        return int(self.input_ids_BS.shape[0])

    @property
    def seq_len_padded(self) -> int:
        return int(self.input_ids_BS.shape[1])

    @classmethod
    def from_samples(cls, samples: Sequence[RolloutSample], advantages, pad_id: int) -> "PackedBatch":
        """Pack rollout samples; `advantages` holds one number per sample (array, tensor or list).

        `rollout_routes` is the list of every sample's `routes_TLK` when any sample carries routes (a
        sample without routes gets an empty `[0, L, K]` array: no row known, so under R3 all its rows
        replay the learner's own routing, `moe_gspo.routing.replay_checks`), None when none does.
        """
        if not samples:
            raise ValueError("from_samples: samples is empty; pass at least one RolloutSample")
        if isinstance(advantages, torch.Tensor):
            advantages = advantages.detach().cpu().numpy()
        adv = torch.as_tensor(np.asarray(advantages, dtype=np.float32).reshape(-1))
        if adv.shape[0] != len(samples):
            raise ValueError(f"from_samples: got {adv.shape[0]} advantages for {len(samples)} samples; "
                             "pass one advantage per sample")
        prompt_lens = [len(s.prompt_ids) for s in samples]
        resp_lens = [len(s.response_ids) for s in samples]
        for i, s in enumerate(samples):
            if len(s.response_logprobs) != resp_lens[i]:
                raise ValueError(f"sample {i}: response_logprobs has {len(s.response_logprobs)} entries for "
                                 f"{resp_lens[i]} response tokens")
        seq_lens = [p + r for p, r in zip(prompt_lens, resp_lens)]
        B, S = len(samples), max(max(seq_lens), 1)
        ids = np.full((B, S), pad_id, dtype=np.int64)
        mask = np.zeros((B, S), dtype=bool)
        logp = np.zeros((B, S), dtype=np.float32)
        for b, s in enumerate(samples):
            P, R = prompt_lens[b], resp_lens[b]
            ids[b, :P] = s.prompt_ids
            ids[b, P:P + R] = s.response_ids
            mask[b, P:P + R] = True
            logp[b, P:P + R] = s.response_logprobs
        sizes, support_ids = _pack_supports(samples, prompt_lens, S)
        routes = None
        given = [np.asarray(s.routes_TLK) for s in samples if s.routes_TLK is not None]
        if given:
            like = next((r for r in given if r.ndim == 3), given[0])
            empty = np.zeros((0, *like.shape[1:]), dtype=like.dtype)
            routes = [empty if s.routes_TLK is None else np.asarray(s.routes_TLK) for s in samples]
        return cls(input_ids_BS=torch.from_numpy(ids), response_mask_BS=torch.from_numpy(mask),
                   seq_lens_B=torch.tensor(seq_lens, dtype=torch.int64),
                   prompt_lens_B=torch.tensor(prompt_lens, dtype=torch.int64), advantages_B=adv,
                   rollout_logp_BS=torch.from_numpy(logp), rollout_routes=routes, pad_id=int(pad_id),
                   support_sizes_BS=sizes, support_ids=support_ids)

    def select(self, indices) -> "PackedBatch":
        """The sequences at `indices` (any integer index sequence), in that order; S is kept. The indices are
        checked on the host (no device sync); each tensor is indexed on its own device."""
        ix = np.asarray(indices, dtype=np.int64).reshape(-1)
        if ix.size and (int(ix.min()) < 0 or int(ix.max()) >= self.num_seqs):
            raise ValueError(f"select: indices must be in [0, {self.num_seqs}), got [{int(ix.min())}, {int(ix.max())}]")
        on = {}

        def take(t: torch.Tensor) -> torch.Tensor:
            if t.device not in on:
                on[t.device] = torch.from_numpy(ix).to(t.device)
            return t[on[t.device]]

        routes = None if self.rollout_routes is None else [self.rollout_routes[i] for i in ix.tolist()]
        has_support = self.support_sizes_BS is not None
        return PackedBatch(input_ids_BS=take(self.input_ids_BS), response_mask_BS=take(self.response_mask_BS),
                           seq_lens_B=take(self.seq_lens_B), prompt_lens_B=take(self.prompt_lens_B),
                           advantages_B=take(self.advantages_B), rollout_logp_BS=take(self.rollout_logp_BS),
                           rollout_routes=routes, pad_id=self.pad_id,
                           support_sizes_BS=take(self.support_sizes_BS) if has_support else None,
                           support_ids=[self.support_ids[i] for i in ix.tolist()] if has_support else None)

    def split(self, num_chunks: int) -> list["PackedBatch"]:
        """`num_chunks` contiguous chunks (sizes differ by at most one), e.g. the mini-batches."""
        if not 1 <= int(num_chunks) <= self.num_seqs:
            raise ValueError(f"split: num_chunks={num_chunks} must be in [1, B={self.num_seqs}]")
        return [self.select(ix) for ix in np.array_split(np.arange(self.num_seqs), int(num_chunks))]

    def shard(self, rank: int, world: int) -> "PackedBatch":
        """Data-parallel rank `rank`'s contiguous share of the batch (may be empty when B < world)."""
        if not 0 <= int(rank) < int(world):
            raise ValueError(f"shard: rank={rank} must be in [0, world={world})")
        return self.select(np.array_split(np.arange(self.num_seqs), int(world))[int(rank)])

    def trim(self, seq_len: int) -> "PackedBatch":
        """The same sequences cut (or right-padded) to length `seq_len` (must be >= max(seq_lens))."""
        seq_len = int(seq_len)
        longest = int(self.seq_lens_B.max()) if self.num_seqs else 0
        if seq_len < max(longest, 1):
            raise ValueError(f"trim: seq_len={seq_len} would cut real tokens (longest sequence {longest})")
        S = self.seq_len_padded
        if seq_len <= S:
            cut = slice(0, seq_len)
            sizes = None if self.support_sizes_BS is None else self.support_sizes_BS[:, cut]
            return dataclasses.replace(self, input_ids_BS=self.input_ids_BS[:, cut],
                                       response_mask_BS=self.response_mask_BS[:, cut],
                                       rollout_logp_BS=self.rollout_logp_BS[:, cut], support_sizes_BS=sizes)
        extra = seq_len - S
        return dataclasses.replace(
            self,
            input_ids_BS=torch.nn.functional.pad(self.input_ids_BS, (0, extra), value=self.pad_id),
            response_mask_BS=torch.nn.functional.pad(self.response_mask_BS, (0, extra), value=False),
            rollout_logp_BS=torch.nn.functional.pad(self.rollout_logp_BS, (0, extra), value=0.0),
            support_sizes_BS=None if self.support_sizes_BS is None
            else torch.nn.functional.pad(self.support_sizes_BS, (0, extra), value=0))

    def pad_rows(self, num_rows: int) -> "PackedBatch":
        """Append dummy sequences (all pad tokens, length 0, no response token, advantage 0) up to
        `num_rows` rows. Dummy rows contribute nothing to any loss or metric; they only keep the
        shapes of expert-parallel ranks equal. Their routes, when routes are present, are empty."""
        extra = int(num_rows) - self.num_seqs
        if extra < 0:
            raise ValueError(f"pad_rows: num_rows={num_rows} < B={self.num_seqs}")
        if extra == 0:
            return self

        def cat(t, fill):
            return torch.cat([t, torch.full((extra, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)], 0)

        routes = self.rollout_routes
        if routes is not None:
            if routes:
                r0 = np.asarray(routes[0])
                empty = np.zeros((0, *r0.shape[1:]), dtype=r0.dtype)
            else:
                empty = np.zeros((0, 1, 1), dtype=np.int64)
            routes = list(routes) + [empty] * extra
        has_support = self.support_sizes_BS is not None
        return PackedBatch(input_ids_BS=cat(self.input_ids_BS, self.pad_id),
                           response_mask_BS=cat(self.response_mask_BS, False),
                           seq_lens_B=cat(self.seq_lens_B, 0), prompt_lens_B=cat(self.prompt_lens_B, 0),
                           advantages_B=cat(self.advantages_B, 0.0), rollout_logp_BS=cat(self.rollout_logp_BS, 0.0),
                           rollout_routes=routes, pad_id=self.pad_id,
                           support_sizes_BS=cat(self.support_sizes_BS, 0) if has_support else None,
                           support_ids=list(self.support_ids) + [np.zeros(0, np.int32)] * extra
                           if has_support else None)

    def support_index(self, rows, device=None) -> tuple[torch.Tensor, ...] | None:
        """The supports of the response tokens of rows `rows` (in that order) for a learner forward over
        exactly those rows: `(b_N, t_N, ids_NK, valid_NK)` (`moe_gspo.learner.logprobs.token_logprobs`'s
        `support`), b_N indexing `rows`; None when the batch has no supports. Memory: N x K int64 ids,
        K = the widest support among those tokens (<= rollout.support_cap)."""
        if self.support_sizes_BS is None:
            return None
        rows = [int(r) for r in np.asarray(rows, dtype=np.int64).reshape(-1)]
        sizes_RS = self.support_sizes_BS.cpu()[torch.as_tensor(rows, dtype=torch.long)]
        b_N, t_N = sizes_RS.nonzero(as_tuple=True)  # row-major: the order the ids are concatenated in
        flat = np.concatenate([np.zeros(0, np.int32)] + [self.support_ids[r] for r in rows])
        ids_NK, valid_NK = pad_supports(torch.from_numpy(flat), sizes_RS[b_N, t_N])
        return tuple(t.to(device) if device is not None else t for t in (b_N, t_N, ids_NK, valid_NK))

    def to(self, device) -> "PackedBatch":
        """The tensors a forward or a loss reads moved to `device`; the host metadata (`HOST_FIELDS`: lengths and
        support sizes, read as Python numbers to plan micro-batches and replay) and the routes stay on the host,
        so that planning a pass never waits for the device."""
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                     if isinstance(getattr(self, f.name), torch.Tensor) and f.name not in HOST_FIELDS})


HOST_FIELDS = ("seq_lens_B", "prompt_lens_B", "support_sizes_BS")
"""`PackedBatch` fields that `PackedBatch.to` leaves on the host."""


def _pack_supports(samples: Sequence[RolloutSample], prompt_lens: list[int], S: int):
    """(`support_sizes_BS`, `support_ids`) of `from_samples`: None when no sample carries a support; a mix
    raises ValueError, as does a sampled token outside its own support."""
    has = [s.support_sizes_R is not None for s in samples]
    if not any(has):
        return None, None
    if not all(has):
        raise ValueError("from_samples: some samples carry a sampling support (top-p / top-k) and some do not; "
                         "sample every batch with the same rollout.top_p / rollout.top_k")
    sizes = np.zeros((len(samples), S), dtype=np.int32)
    ids = []
    for b, s in enumerate(samples):
        check_sample_support(s.response_ids, s.support_ids_N, s.support_sizes_R, where=f"from_samples: sample {b}")
        sizes[b, prompt_lens[b]:prompt_lens[b] + len(s.response_ids)] = s.support_sizes_R
        ids.append(np.ascontiguousarray(s.support_ids_N, dtype=np.int32))
    return torch.from_numpy(sizes), ids


@dataclass(frozen=True)
class MicroBatch:
    """Rows `[start, stop)` of a rank's padded shard, run as one forward of padded length `seq_len`."""

    start: int
    stop: int
    seq_len: int


@dataclass(frozen=True)
class ShardPlan:
    """What one data-parallel rank processes out of a global batch of B sequences."""

    indices: np.ndarray
    """Global row indices of this rank's real sequences (contiguous; may be empty)."""
    num_rows: int
    """Rows of the padded shard (the same on every rank): `ceil(B / dp_size)`."""
    micro_batches: tuple[MicroBatch, ...]
    """The same number on every rank; `seq_len` is the longest over all ranks' rows of that slot."""


def plan_shards(seq_lens_B, *, dp_rank: int, dp_size: int, micro_batch_size: int = 0) -> ShardPlan:
    """Shard B sequences contiguously over `dp_size` ranks and cut each shard into micro-batches.

    `micro_batch_size` = sequences per forward (0 = the whole shard). Every rank computes the same
    plan from the global `seq_lens_B`, so no communication is needed to agree on shapes.
    """
    lens = np.asarray(seq_lens_B, dtype=np.int64).reshape(-1)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"plan_shards: dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    if micro_batch_size < 0:
        raise ValueError(f"plan_shards: micro_batch_size={micro_batch_size} must be >= 0 (0 = whole shard)")
    shards = np.array_split(np.arange(lens.shape[0]), dp_size)
    num_rows = max(1, math.ceil(lens.shape[0] / dp_size))
    mbs = micro_batch_size or num_rows
    padded = np.zeros((dp_size, num_rows), dtype=np.int64)  # dummy rows have length 0
    for r, ix in enumerate(shards):
        padded[r, :len(ix)] = lens[ix]
    micro = tuple(MicroBatch(start, min(start + mbs, num_rows),
                             max(1, int(padded[:, start:start + mbs].max())))
                  for start in range(0, num_rows, mbs))
    return ShardPlan(indices=shards[dp_rank], num_rows=num_rows, micro_batches=micro)


@dataclass(frozen=True)
class PassPiece:
    """One forward of a rank's old-policy pass in pieces: `rows` of its padded shard (positions, not global
    indices), then `num_pad` rows of padding tokens, so that every rank runs the same shapes."""

    rows: np.ndarray
    num_pad: int
    seq_len: int


def split_first_minibatch(seq_lens_B, first_rows, *, dp_rank: int, dp_size: int) -> tuple[PassPiece, PassPiece | None]:
    """This rank's shard (`plan_shards`, micro_batch_size 0) cut into the rows of the first mini-batch
    (global rows `first_rows`) and the others, for `Learner.compute_logprobs(keep_graph=True)`: the first
    piece's forward keeps its graph for that mini-batch's update. Both pieces have the same row count and
    padded length on every rank (the most any rank holds, the longest sequence of the piece over all
    ranks); the second is None when the first mini-batch is the whole batch."""
    lens = np.asarray(seq_lens_B, dtype=np.int64).reshape(-1)
    first = np.zeros(lens.shape[0], dtype=bool)
    first[np.asarray(first_rows, dtype=np.int64)] = True
    shards = np.array_split(np.arange(lens.shape[0]), dp_size)
    counts = [(int(first[ix].sum()), int((~first[ix]).sum())) for ix in shards]
    mine = shards[dp_rank]
    pieces = []
    for k, in_first in enumerate((True, False)):
        most = max(c[k] for c in counts)
        if most == 0:
            pieces.append(None)
            continue
        rows = np.flatnonzero(first[mine] == in_first)
        seq_len = max(1, int(lens[first == in_first].max()))
        pieces.append(PassPiece(rows=rows, num_pad=most - len(rows), seq_len=seq_len))
    assert pieces[0] is not None, "the first mini-batch has no rows"
    return pieces[0], pieces[1]


def pad_token_frac(seq_lens_B, *, dp_size: int = 1, micro_batch_size: int = 0) -> float:
    """The share of the token positions one learner pass over these sequences computes that are padding:
    every rank's micro-batches of `plan_shards` (rows x the micro-batch's padded length, dummy rows included)
    against the sequences' real tokens. Padding is embedded, routed to experts and computed like any token
    (issue 61); what it costs is this share."""
    lens = np.asarray(seq_lens_B, dtype=np.int64).reshape(-1)
    plan = plan_shards(lens, dp_rank=0, dp_size=dp_size, micro_batch_size=micro_batch_size)
    computed = dp_size * sum((mb.stop - mb.start) * mb.seq_len for mb in plan.micro_batches)
    return 1.0 - float(lens.sum()) / computed
