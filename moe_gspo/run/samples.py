"""What the model wrote: a few of a step's samples saved to RUN_DIR/samples.jsonl (`logging.samples_every`,
`logging.num_samples`), shown by the report.

One JSON object per saved sample: `step`, `prompt`, `prompt_encoded` (the exact prompt token ids the rollout
engine got, after `task.chat_template` and `task.system_prompt`, decoded with special tokens kept), `answer`,
`response` (the text the reward judged),
`reward`, `advantage`, `finish_reason`, `response_tokens` (each response token decoded on its own,
special tokens kept) and `routing_flips`: for each response token, the number of MoE layers whose top-k
expert set differs between the rollout engine and the learner's old-policy pass (natural routing) on the
row that produced that token's log-prob (position P - 1 + j, the rows `routing/*` compares); null for the
whole list when routes were not recorded, null for a token whose row one side did not compute.
The sample saved for a prompt group is its first.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def token_flips(rollout_TLK: np.ndarray, learner_TLK: np.ndarray, prompt_len: int,
                response_len: int) -> list[int | None]:
    """Per response token j: MoE layers whose top-k sets differ on row prompt_len - 1 + j (None past
    either side's rows); pure."""
    num_rows = min(len(rollout_TLK), len(learner_TLK))
    rows = np.arange(int(response_len)) + int(prompt_len) - 1
    ok = rows < num_rows
    flips: list[int | None] = [None] * int(response_len)
    if ok.any():  # every token's row at once: one sort per side
        a = np.sort(np.asarray(rollout_TLK)[rows[ok]], axis=-1)
        b = np.sort(np.asarray(learner_TLK)[rows[ok]], axis=-1)
        for j, n in zip(np.flatnonzero(ok).tolist(), (a != b).any(axis=-1).sum(axis=-1).tolist()):
            flips[j] = n
    return flips


def sample_rows(step: int, tokenizer, prompts, samples, rewards, advantages_B, *, rollout_routes: Sequence | None,
                learner_routes: Sequence | None, num_groups: int) -> list[dict]:
    """The rows of the first sample of each of the first `num_groups` prompt groups."""
    from moe_gspo.run.steps import response_text

    rows, seen = [], set()
    for b, s in enumerate(samples):
        if s.prompt_index in seen:
            continue
        if len(seen) == num_groups:
            break
        seen.add(s.prompt_index)
        p = prompts[s.prompt_index]
        ids = [int(t) for t in s.response_ids]
        flips = None
        if rollout_routes is not None and learner_routes is not None:
            flips = token_flips(rollout_routes[b], learner_routes[b], len(s.prompt_ids), len(ids))
        prompt_ids = [int(t) for t in s.prompt_ids]
        rows.append({"step": step, "prompt": p.text,
                     "prompt_encoded": tokenizer.decode(prompt_ids, skip_special_tokens=False),
                     "answer": p.answer, "response": response_text(tokenizer, ids),
                     "reward": float(rewards[b]), "advantage": float(advantages_B[b]), "finish_reason": s.finish_reason,
                     "response_tokens": [tokenizer.decode([t], skip_special_tokens=False) for t in ids],
                     "routing_flips": flips})
    return rows
