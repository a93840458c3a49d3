"""Values derived from tensors (casts, concatenations, cos/sin tables), rebuilt only when a source changed.

The CPU fast paths keep tensors derived from weights or frequency tables between calls instead of
deriving them at every forward: the transformers rollout engine's fp32 copies of its bf16 weights
(`moe_gspo.rollout.cpu_gemm`) and the compact decoder's concatenated weights
(`moe_gspo.rollout.compact_decode`) in one `TensorCache` per engine, and the learner's RoPE `cos` / `sin`
tables (`moe_gspo.mcore.fused_rope`).

A cached value stays valid while each of its sources is the same tensor object, at the same version
counter (bumped by every in-place write, also through a view: a weight sync's `copy_`) and on the same
storage (`data_ptr`: `param.data = ...` moves it). The entry holds its source tensors, so that their
`id`s cannot be reused by other tensors while the entry exists. Each key holds one entry: a changed
source replaces it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Hashable, Sequence

import torch


class TensorCache:
    """`cache(key, sources, build)`: `build(*sources detached)`, reused until a source changes (see the module
    docstring).

    Args:
        leave_inference_mode: build outside `torch.inference_mode` (and under `no_grad`), so that a value
            first built during a generation is an ordinary tensor that autograd may use later; False
            builds under `no_grad` in whatever mode the caller is in.
    """

    def __init__(self, *, leave_inference_mode: bool = True) -> None:
        self.leave_inference_mode = leave_inference_mode
        self._entries: dict[Hashable, tuple[tuple[torch.Tensor, ...], tuple, Any]] = {}

    @staticmethod
    def _stamp(sources: Sequence[torch.Tensor], extra: tuple) -> tuple:
        return tuple((t._version, t.data_ptr()) for t in sources) + extra

    def __call__(self, key: Hashable, sources: Sequence[torch.Tensor], build: Callable[..., Any], *,
                 extra: tuple = ()) -> Any:
        """The value cached under `key` if `sources` (and `extra`, e.g. a dtype) are unchanged since it was
        built, else `build(*[s.detach() for s in sources])`, cached under `key` in its place."""
        stamp = self._stamp(sources, extra)
        hit = self._entries.get(key)
        if hit is not None and len(hit[0]) == len(sources) and all(a is b for a, b in zip(hit[0], sources)) \
                and hit[1] == stamp:
            return hit[2]
        mode = torch.inference_mode(False) if self.leave_inference_mode else contextlib.nullcontext()
        with mode, torch.no_grad():
            value = build(*[t.detach() for t in sources])
        self._entries[key] = (tuple(sources), stamp, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry (and the references to their sources)."""
        self._entries.clear()
