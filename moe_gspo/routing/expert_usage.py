"""Dead experts over a trailing window of steps (issue 41; NeMo Automodel logs per-expert utilisation and dead
experts): an expert of a MoE layer is *dead* when the learner routed none of the window's tokens to it.

`expert_token_counts` counts, per MoE layer and expert, the top-k slots of rows [lo_b, hi_b) of every
sequence's routes; `ExpertUsageWindow` keeps the counts of the last steps and returns, after each step,
`router/dead_experts`: the number of (MoE layer, expert) pairs with no token in the last
`logging.dead_expert_window` steps, the current one included (fewer at the run's start, until that many
steps have been seen). The training loop feeds it the learner side: the old-policy pass with natural
routing, on the rows of `routing/*` (those that produce response log-probs, positions P-1 .. P+R-2), the
rows `routing/expert_load_learner` describes as shares. The window travels with the learner's checkpoint
(`Learner.state_dict`), so a resumed run counts exactly as an uninterrupted one.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def expert_token_counts(routes: Sequence[np.ndarray], lo_B, hi_B, *, num_layers: int, num_experts: int) -> np.ndarray:
    """int64 [L, E]: per MoE layer, how many top-k slots of rows [lo_b, hi_b) of every sequence's routes
    ([T_b, L, K] expert ids) go to each expert."""
    counts = np.zeros((int(num_layers), int(num_experts)), np.int64)
    parts = []
    for r, lo, hi in zip(routes, np.asarray(lo_B).tolist(), np.asarray(hi_B).tolist()):
        if r is None:
            continue
        rows = np.asarray(r)[lo:hi]
        if not rows.size:
            continue
        if rows.ndim != 3 or rows.shape[1] != num_layers:
            raise ValueError(f"expert_token_counts: routes of shape {rows.shape}, expected [T, {num_layers}, K]")
        parts.append(rows)
    if not parts:
        return counts
    # the rows of every sequence at once (in the ids' own dtype), one count per layer; a top-k width that
    # differs between sequences keeps them apart
    for rows in ([np.concatenate(parts)] if len({p.shape[2] for p in parts}) == 1 else parts):
        for layer in range(num_layers):
            ids = rows[:, layer, :].ravel().astype(np.int64)
            counts[layer] += np.bincount(ids, minlength=num_experts)[:num_experts]
    return counts


def dead_experts(counts_SLE) -> int:
    """The number of (layer, expert) pairs whose count is 0 in every step of `counts_SLE` [S, L, E]
    (0 for S = 0: nothing was seen, nothing is declared dead)."""
    c = np.asarray(counts_SLE)
    if c.ndim != 3 or c.shape[0] == 0:
        return 0
    return int((c.sum(0) == 0).sum())


class ExpertUsageWindow:
    """The learner's per-step expert token counts of the last steps (at most the largest window asked for)."""

    def __init__(self):
        self._steps: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._steps)

    def update(self, counts_LE: np.ndarray, window: int) -> int:
        """Add this step's counts [L, E], keep the last `window` steps and return `dead_experts` over them."""
        if int(window) < 1:
            raise ValueError(f"dead-expert window must be >= 1 step, got {window}")
        counts = np.asarray(counts_LE, np.int64)
        if self._steps and self._steps[-1].shape != counts.shape:
            self._steps = []  # another model geometry: start afresh
        self._steps = (self._steps + [counts])[-int(window):]
        return dead_experts(np.stack(self._steps))

    def state_dict(self) -> torch.Tensor:
        """int64 [S, L, E] (S may be 0): what a checkpoint keeps."""
        if not self._steps:
            return torch.zeros((0, 0, 0), dtype=torch.int64)
        return torch.from_numpy(np.stack(self._steps))

    def load_state_dict(self, state: torch.Tensor | None) -> None:
        self._steps = [] if state is None or state.numel() == 0 else [s.numpy().astype(np.int64) for s in state]
