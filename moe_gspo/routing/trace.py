"""Compact routing traces: which experts every token used, for a batch of sequences.

A `RoutingTrace` stores, for N sequences, the top-k expert ids each token was routed to in each MoE
layer (and optionally the router probabilities of those experts). Sequences are concatenated
("ragged") along the token axis, so no padding is stored.

On-disk format (one uncompressed `.npz`, readable with plain `np.load(path)`; no pickles):

=================  ==========================  =====================================================
key                dtype / shape               meaning
=================  ==========================  =====================================================
``format_version``  int64 scalar               format version (currently 1); newer files are refused
``topk_ids``        uint8 [sum_T, L, K]        top-k expert ids per token row, MoE layer and slot;
                    (uint16 if E > 256)        uint8 when ``num_experts <= 256``, else uint16
``router_probs``    float16 [sum_T, L, K]      optional (key absent when not recorded): full-softmax
                                               router probability of each listed expert, i.e.
                                               softmax over all E experts of the router logits
                                               (fp32), read at the chosen experts, *before* the
                                               top-k renormalisation: the K values of a row sum to
                                               the top-k mass (<= 1). The gate weights that mix the
                                               experts are ``p / p.sum(-1)`` when the model has
                                               ``norm_topk_prob`` (Qwen3-MoE), else ``p``. Both
                                               recorders (transformers engine, Megatron learner)
                                               store this quantity; vLLM records no probabilities
``router_margin``   float16 [sum_T, L]         optional (key absent when not recorded): router margin
                                               per token row and MoE layer, the K-th minus the
                                               (K+1)-th largest router logit (+inf when K = E;
                                               `moe_gspo.routing.router_stats`): how far the token is
                                               from changing its top-k set. Recorded by the
                                               transformers engine and the learner; not by vLLM.
                                               Files without it are read as before (``None``)
``seq_offsets``     int64 [N+1]                sequence i owns rows ``seq_offsets[i]:seq_offsets[i+1]``;
                                               ``seq_offsets[0] == 0``, ``seq_offsets[-1] == sum_T``
``prompt_lens``     int32 [N]                  prompt length P_i in tokens
``response_lens``   int32 [N]                  response length R_i in tokens
``num_experts``     int64 scalar               E, experts per MoE layer
``layer_ids``       int32 [L]                  model layer index of each stored MoE layer (L counts
                                               MoE layers only, in model order)
``meta``            unicode scalar             JSON object (e.g. ``source``, ``step``, ``dtype``)
=================  ==========================  =====================================================

Row ``t`` of sequence i (``topk_ids[seq_offsets[i] + t]``) is the token at position ``t`` of
``prompt_ids + response_ids``; a sequence has ``T_i = seq_offsets[i+1] - seq_offsets[i] <= P_i + R_i``
rows (an engine never routes its last sampled token, so usually ``T_i = P_i + R_i - 1``; see
`moe_gspo.rollout.base`). The order of the K ids within a row is whatever the engine produced; only
the set matters to the drift metrics.

Reading without this package::

    z = np.load("step_000010_rollout.npz")
    off = z["seq_offsets"]; ids_TLK = z["topk_ids"][off[3]:off[4]]   # sequence 3
    meta = json.loads(str(z["meta"]))

Size: ids cost ``L * K`` bytes per token with uint8 (Qwen3-30B-A3B: 48 layers x top-8 = 384 B/token),
probabilities another ``2 * L * K`` bytes, margins ``2 * L``.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np


FORMAT_VERSION = 1
"""Version written into every trace file; `load_trace` refuses files with a larger version."""

_REQUIRED_KEYS = ("format_version", "topk_ids", "seq_offsets", "prompt_lens", "response_lens",
                  "num_experts", "layer_ids", "meta")


def ids_dtype(num_experts: int, *, collective: bool = False) -> np.dtype:
    """The expert-id dtype rule, the one place it is written: the narrowest unsigned dtype holding expert ids
    ``0 .. num_experts-1`` (uint8 up to 256 experts, else uint16), as engines, traces, the rollout routes and
    the learner's recorded routes keep them. ``collective=True``: the dtype of ids on the device while a
    torch collective gathers them (the learner's log-prob pass): the same where gloo carries it (uint8), else
    int32 (gloo has no int16 / uint16)."""
    num_experts = int(num_experts)
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 65536:
        return np.dtype(np.int32 if collective else np.uint16)
    raise ValueError(f"num_experts={num_experts} exceeds 65536, the most a uint16 trace can store")


def _as_ids(arr: Any, num_experts: int, what: str) -> np.ndarray:
    """Convert integer ids to the trace dtype, checking the range first."""
    a = np.asarray(arr)
    if a.ndim != 3:
        raise ValueError(f"{what} must have shape [T, L, K], got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integer expert ids, got dtype {a.dtype}")
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{what} holds expert ids in [{lo}, {hi}], outside [0, {num_experts})")
    return a.astype(ids_dtype(num_experts), copy=False)


@dataclass
class RoutingTrace:
    """Top-k routing of N sequences, stored ragged (see the module docstring for the fields)."""

    topk_ids: np.ndarray
    """uint8/uint16 [sum_T, L, K] expert ids."""
    seq_offsets: np.ndarray
    """int64 [N+1] row offsets of the sequences."""
    prompt_lens: np.ndarray
    """int32 [N] prompt lengths."""
    response_lens: np.ndarray
    """int32 [N] response lengths."""
    num_experts: int
    """Experts per MoE layer."""
    layer_ids: np.ndarray
    """int32 [L] model layer index of each stored MoE layer."""
    router_probs: np.ndarray | None = None
    """float16 [sum_T, L, K] full-softmax router probabilities of the listed experts (not the
    renormalised gate weights; see the module docstring), or None."""
    meta: dict = field(default_factory=dict)
    """JSON-serialisable metadata (source, step, dtype, ...)."""
    router_margin: np.ndarray | None = None
    """float16 [sum_T, L] router margin (K-th minus (K+1)-th router logit) per token row and layer, or None."""

    def __post_init__(self) -> None:
        self.num_experts = int(self.num_experts)
        self.topk_ids = _as_ids(self.topk_ids, self.num_experts, "topk_ids")
        self.seq_offsets = np.asarray(self.seq_offsets).astype(np.int64, copy=False)
        self.prompt_lens = np.asarray(self.prompt_lens).astype(np.int32, copy=False)
        self.response_lens = np.asarray(self.response_lens).astype(np.int32, copy=False)
        self.layer_ids = np.asarray(self.layer_ids).astype(np.int32, copy=False)
        n = self.prompt_lens.shape[0] if self.prompt_lens.ndim == 1 else -1
        if self.prompt_lens.ndim != 1 or self.response_lens.shape != (n,):
            raise ValueError(f"prompt_lens and response_lens must both be 1-D of length N, got shapes "
                             f"{self.prompt_lens.shape} and {self.response_lens.shape}")
        if self.seq_offsets.shape != (n + 1,):
            raise ValueError(f"seq_offsets must have shape [N+1] = [{n + 1}], got {self.seq_offsets.shape}")
        if self.seq_offsets[0] != 0 or self.seq_offsets[-1] != self.topk_ids.shape[0]:
            raise ValueError(f"seq_offsets must start at 0 and end at the number of rows "
                             f"({self.topk_ids.shape[0]}), got {self.seq_offsets[0]} .. {self.seq_offsets[-1]}")
        lens = np.diff(self.seq_offsets)
        if (lens < 0).any():
            raise ValueError("seq_offsets must be non-decreasing")
        too_long = np.nonzero(lens > self.prompt_lens.astype(np.int64) + self.response_lens)[0]
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(f"sequence {i} has {lens[i]} routed rows but only prompt_lens + response_lens = "
                             f"{self.prompt_lens[i] + self.response_lens[i]} tokens")
        if self.layer_ids.shape != (self.topk_ids.shape[1],):
            raise ValueError(f"layer_ids must have one entry per stored layer (L={self.topk_ids.shape[1]}), "
                             f"got shape {self.layer_ids.shape}")
        if self.router_probs is not None:
            self.router_probs = np.asarray(self.router_probs).astype(np.float16, copy=False)
            if self.router_probs.shape != self.topk_ids.shape:
                raise ValueError(f"router_probs must have the shape of topk_ids {self.topk_ids.shape}, "
                                 f"got {self.router_probs.shape}")
        if self.router_margin is not None:
            self.router_margin = np.asarray(self.router_margin).astype(np.float16, copy=False)
            if self.router_margin.shape != self.topk_ids.shape[:2]:
                raise ValueError(f"router_margin must have shape [sum_T, L] = {self.topk_ids.shape[:2]}, "
                                 f"got {self.router_margin.shape}")
        if self.meta is None:
            self.meta = {}
        try:
            json.dumps(self.meta)
        except (TypeError, ValueError) as e:
            raise ValueError(f"meta must be JSON-serialisable: {e}") from e

    # ----------------------------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return int(self.prompt_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Stored token rows (sum of T_i)."""
        return int(self.topk_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.topk_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[2])

    @property
    def seq_lens(self) -> np.ndarray:
        """int64 [N] routed rows per sequence (T_i)."""
        return np.diff(self.seq_offsets)

    def seq(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Rows of sequence `i`: ``(topk_TLK, probs_TLK or None)`` (views, not copies)."""
        if not -self.num_sequences <= i < self.num_sequences:
            raise IndexError(f"sequence {i} out of range for a trace of {self.num_sequences} sequences")
        i %= max(self.num_sequences, 1)
        a, b = int(self.seq_offsets[i]), int(self.seq_offsets[i + 1])
        probs = None if self.router_probs is None else self.router_probs[a:b]
        return self.topk_ids[a:b], probs

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_samples(cls, routes: Sequence[np.ndarray], prompt_lens: Sequence[int],
                     response_lens: Sequence[int], num_experts: int, layer_ids: Sequence[int],
                     probs: Sequence[np.ndarray] | None = None, meta: dict | None = None,
                     *, top_k: int | None = None, margins: Sequence[np.ndarray] | None = None) -> "RoutingTrace":
        """Concatenate per-sequence ``[T_i, L, K]`` id arrays (and optional ``[T_i, L, K]`` probs and
        ``[T_i, L]`` router margins).

        `top_k` is only needed for an empty batch (it gives K its size); otherwise it is checked.
        """
        n = len(routes)
        if len(prompt_lens) != n or len(response_lens) != n:
            raise ValueError(f"got {n} routes but {len(prompt_lens)} prompt_lens and "
                             f"{len(response_lens)} response_lens; pass one of each per sequence")
        if probs is not None and len(probs) != n:
            raise ValueError(f"got {n} routes but {len(probs)} probs arrays")
        num_layers = len(layer_ids)
        k = top_k
        arrs = []
        for i, r in enumerate(routes):
            if r is None:
                raise ValueError(f"routes[{i}] is None: the engine did not record routes for sequence {i}")
            r = np.asarray(r)
            if r.ndim != 3 or r.shape[1] != num_layers:
                raise ValueError(f"routes[{i}] must have shape [T, L={num_layers}, K], got {r.shape}")
            if k is None:
                k = r.shape[2]
            if r.shape[2] != k:
                raise ValueError(f"routes[{i}] has K={r.shape[2]}, expected K={k} like the others")
            arrs.append(r)
        k = 0 if k is None else int(k)
        dt = ids_dtype(num_experts)
        if arrs:
            topk = _as_ids(np.concatenate(arrs, axis=0), int(num_experts), "routes")
        else:
            topk = np.zeros((0, num_layers, k), dtype=dt)
        offsets = np.zeros(n + 1, dtype=np.int64)
        if n:
            np.cumsum([a.shape[0] for a in arrs], out=offsets[1:])
        probs_arr = None
        if probs is not None:
            for i, (p, a) in enumerate(zip(probs, arrs)):
                if p is None or np.shape(p) != a.shape:
                    raise ValueError(f"probs[{i}] must have the shape of routes[{i}] {a.shape}, "
                                     f"got {None if p is None else np.shape(p)}")
            probs_arr = (np.concatenate([np.asarray(p, dtype=np.float16) for p in probs], axis=0)
                         if n else np.zeros((0, num_layers, k), dtype=np.float16))
        margin_arr = None
        if margins is not None:
            if len(margins) != n:
                raise ValueError(f"got {n} routes but {len(margins)} margins arrays")
            for i, (m, a) in enumerate(zip(margins, arrs)):
                if m is None or np.shape(m) != a.shape[:2]:
                    raise ValueError(f"margins[{i}] must have shape [T, L] = {a.shape[:2]}, "
                                     f"got {None if m is None else np.shape(m)}")
            margin_arr = (np.concatenate([np.asarray(m, dtype=np.float16) for m in margins], axis=0)
                          if n else np.zeros((0, num_layers), dtype=np.float16))
        return cls(topk_ids=topk, seq_offsets=offsets, prompt_lens=np.asarray(prompt_lens, dtype=np.int32),
                   response_lens=np.asarray(response_lens, dtype=np.int32), num_experts=int(num_experts),
                   layer_ids=np.asarray(layer_ids, dtype=np.int32), router_probs=probs_arr,
                   meta=dict(meta or {}), router_margin=margin_arr)


# --------------------------------------------------------------------------------------------------
def save_trace(path: str | os.PathLike, trace: RoutingTrace) -> Path:
    """Write `trace` to one `.npz` file atomically (temp file in the same folder + `os.replace`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {
        "format_version": np.asarray(FORMAT_VERSION, dtype=np.int64),
        "topk_ids": trace.topk_ids,
        "seq_offsets": trace.seq_offsets,
        "prompt_lens": trace.prompt_lens,
        "response_lens": trace.response_lens,
        "num_experts": np.asarray(trace.num_experts, dtype=np.int64),
        "layer_ids": trace.layer_ids,
        "meta": np.asarray(json.dumps(trace.meta)),
    }
    if trace.router_probs is not None:
        arrays["router_probs"] = trace.router_probs
    if trace.router_margin is not None:
        arrays["router_margin"] = trace.router_margin
    from moe_gspo.files import publish_mode

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        publish_mode(tmp)  # mkstemp's 0600 -> what open() gives (others may read the run dir)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def load_trace(path: str | os.PathLike) -> RoutingTrace:
    """Read a trace written by `save_trace`; ValueError naming the file and field if it is not one."""
    path = Path(path)
    try:
        z = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable RoutingTrace .npz file ({type(e).__name__}: {e})") from e
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: holds a single array, not a RoutingTrace .npz archive")
    with z:
        missing = [k for k in _REQUIRED_KEYS if k not in z.files]
        if missing:
            raise ValueError(f"{path}: not a RoutingTrace file, missing field(s) {missing}")
        try:
            fields = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise ValueError(f"{path}: corrupt field data ({type(e).__name__}: {e})") from e
    version = fields["format_version"]
    if version.shape != () or version.dtype.kind not in "iu" or not 1 <= int(version) <= FORMAT_VERSION:
        raise ValueError(f"{path}: bad field 'format_version' ({version!r}); this reader knows "
                         f"versions 1..{FORMAT_VERSION}")
    for k in ("num_experts", "meta"):
        if fields[k].shape != ():
            raise ValueError(f"{path}: bad field {k!r}: expected a scalar, got shape {fields[k].shape}")
    try:
        meta = json.loads(str(fields["meta"]))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: bad field 'meta': not JSON ({e})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: bad field 'meta': expected a JSON object, got {type(meta).__name__}")
    try:
        return RoutingTrace(topk_ids=fields["topk_ids"], seq_offsets=fields["seq_offsets"],
                            prompt_lens=fields["prompt_lens"], response_lens=fields["response_lens"],
                            num_experts=int(fields["num_experts"]), layer_ids=fields["layer_ids"],
                            router_probs=fields.get("router_probs"), meta=meta,
                            router_margin=fields.get("router_margin"))
    except ValueError as e:
        raise ValueError(f"{path}: inconsistent trace: {e}") from e


def bytes_per_token(trace: RoutingTrace) -> dict[str, int]:
    """In-memory (and uncompressed on-disk) bytes per stored token row: ids, probs, margin, total."""
    per_row = trace.num_layers * trace.top_k
    ids = per_row * trace.topk_ids.dtype.itemsize
    probs = per_row * trace.router_probs.dtype.itemsize if trace.router_probs is not None else 0
    margin = trace.num_layers * trace.router_margin.dtype.itemsize if trace.router_margin is not None else 0
    return {"ids": ids, "probs": probs, "margin": margin, "total": ids + probs + margin}
