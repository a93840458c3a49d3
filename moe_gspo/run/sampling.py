"""One step's batch of prompt groups: one generation round, or DAPO's dynamic sampling.

Dynamic sampling (`algo.dynamic_sampling`; Yu et al. 2025, "DAPO", arXiv 2503.14476, §3.2; verl's
`algorithm.filter_groups`): a group whose G rewards are all equal has advantage 0 and carries no
policy-gradient signal. Each generation round draws the next `rollout.prompts_per_step` prompts of
the task's stream, generates and scores them (every rank the same global batch, as without dynamic
sampling), and keeps the groups with signal; rounds continue until `prompts_per_step` such groups are
kept or `algo.max_num_gen_batches` rounds have run (the first included; verl's name and meaning).
The batch is the first `prompts_per_step` kept groups, in draw order; the surplus of the last round
is dropped, as verl does.

When the bound is hit with fewer groups with signal (verl stops the run with an error there), the
batch is filled up to `prompts_per_step` groups with all-equal groups, the earliest drawn first, and
the step trains on it: their advantages are exactly 0, so they add nothing to the gradient and only
count in the loss's normalisation, exactly as they would without dynamic sampling. The batch keeps
its shape — the mini-batch split (`train.num_minibatches` must divide it), the data-parallel shards
and every per-step metric see the same number of sequences as every other step — and a step of a
saturated policy (every group solved) costs `max_num_gen_batches` rounds and then trains like a step
without dynamic sampling.

Resume: the prompt stream is a pure function of the run's state. A step draws the prompts numbered
`prompts_consumed ... prompts_consumed + rounds * prompts_per_step - 1` and the loop advances
`state.prompts_consumed` (saved in checkpoints) by `num_prompts_drawn`; round r > 0 samples with the
seed (train.seed, step, engine share, r) (round 0 with the seed a run without dynamic sampling uses),
so a resumed run draws, generates and keeps exactly what the uninterrupted run did.

Metrics (every step, `sampling/*`): `num_gen_batches` (rounds run; verl's `train/num_gen_batches`),
`num_prompts_drawn` (prompts taken from the stream), `first_prompt_index` (the stream position of the
step's first prompt), `num_groups_with_signal` (drawn groups whose rewards differ, before the batch is
cut), `num_filler_groups` (all-equal groups put into the batch because the bound was hit; 0 otherwise),
`reward_mean_drawn` (mean reward of every sample drawn this step: with dynamic sampling `reward/mean`
describes the filtered batch, this one the policy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_gspo.config import Config
from moe_gspo.mcore.parallel import ParallelInfo
from moe_gspo.rollout.base import RolloutSample
from moe_gspo.run import steps
from moe_gspo.run.setup import Policy
from moe_gspo.run.timing import PhaseTimer
from moe_gspo.tasks import Prompt, Task


@dataclass
class StepBatch:
    """The prompt groups a step trains on."""

    prompts: list[Prompt]
    """The batch's prompts; sample `s` answers `prompts[s.prompt_index]`."""
    samples: list[RolloutSample]
    """G samples per prompt, groups contiguous, in `prompts` order."""
    rewards: torch.Tensor
    """float32 [len(samples)]."""
    num_prompts_drawn: int
    """Prompts taken from the stream this step (the loop advances `state.prompts_consumed` by it)."""
    metrics: dict[str, float]


@dataclass
class _Group:
    order: int
    """Draw order of the group in this step."""
    prompt: Prompt
    samples: list[RolloutSample]
    rewards: torch.Tensor

    @property
    def has_signal(self) -> bool:
        """Rewards not all equal (the exact test `group_advantages` uses for advantage 0)."""
        return bool(self.rewards.max() != self.rewards.min())


def _groups(prompts: list[Prompt], samples: list[RolloutSample], rewards: torch.Tensor, first_order: int,
            group_size: int) -> list[_Group]:
    by_prompt: dict[int, list[int]] = {}
    for j, s in enumerate(samples):
        by_prompt.setdefault(s.prompt_index, []).append(j)
    assert sorted(by_prompt) == list(range(len(prompts))), sorted(by_prompt)
    out = []
    for p, rows in sorted(by_prompt.items()):
        assert len(rows) == group_size, (p, len(rows))
        out.append(_Group(first_order + p, prompts[p], [samples[j] for j in rows], rewards[rows]))
    return out


def select_groups(drawn: list[_Group], num_groups: int, dynamic: bool) -> tuple[list[_Group], int]:
    """The batch's groups in draw order and the number of all-equal fillers among them: without dynamic
    sampling every drawn group; with it the first `num_groups` with signal, filled up with the earliest
    all-equal ones when there are too few."""
    if not dynamic:
        return drawn, 0
    kept = [g for g in drawn if g.has_signal][:num_groups]
    fillers = [g for g in drawn if not g.has_signal][:num_groups - len(kept)]
    return sorted(kept + fillers, key=lambda g: g.order), len(fillers)


def collect_batch(policy: Policy, task: Task, cfg: Config, info: ParallelInfo, step: int, consumed: int,
                  timer: PhaseTimer) -> StepBatch:
    """Generate and score the step's batch (collective: every rank calls it; see the module docstring).
    `consumed` = the run's `state.prompts_consumed`; time goes to the phases `rollout` and `score`."""
    num, group_size = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    dynamic, bound = cfg.algo.dynamic_sampling, cfg.algo.num_gen_batches_bound()
    drawn: list[_Group] = []
    rounds = 0
    while rounds < bound:
        with timer("rollout"):
            prompts = task.prompts(consumed + rounds * num, num, cfg.train.seed)
            samples = steps.rollout(policy, prompts, cfg, info, step, round_index=rounds)
        with timer("score"):
            rewards = steps.score(policy, task, prompts, samples)
            steps.check_rewards_agree(rewards, prompts, samples)  # every rank scored the same samples
            drawn += _groups(prompts, samples, rewards, rounds * num, group_size)
        rounds += 1
        if not dynamic or sum(g.has_signal for g in drawn) >= num:
            break
    batch, num_fillers = select_groups(drawn, num, dynamic)
    out_samples = []
    for index, g in enumerate(batch):
        for s in g.samples:
            s.prompt_index = index
            out_samples.append(s)
    all_rewards = torch.cat([g.rewards for g in drawn])
    metrics = {"sampling/num_gen_batches": float(rounds), "sampling/num_prompts_drawn": float(rounds * num),
               "sampling/first_prompt_index": float(consumed),
               "sampling/num_groups_with_signal": float(sum(g.has_signal for g in drawn)),
               "sampling/num_filler_groups": float(num_fillers),
               "sampling/reward_mean_drawn": all_rewards.mean().item()}
    return StepBatch(prompts=[g.prompt for g in batch], samples=out_samples,
                     rewards=torch.cat([g.rewards for g in batch]), num_prompts_drawn=rounds * num, metrics=metrics)
