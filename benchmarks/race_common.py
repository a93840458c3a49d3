"""What the race benchmarks share: `trl_peer_bench` (TRL against the main job), its TRL side `trl_worker`
and `step_profile` (where a step's time goes, on both sides).

The curve a side's RL steps build (`Curve`), the target crossing and phase split read from it, the check
that a config suits both sides, TRL's phase names, and the commands that start each side: `train_cmd`
(the main job under torchrun, the only place a benchmark builds it) and `trl_worker_cmd`, run from the
checkout root with `subprocess_env` — or from a checkout of another commit (`rev_checkout`, the main job
of `trl_peer_bench --ours-rev`). This module imports no other benchmark, so none imports it back.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
"""The checkout root: the benchmarks' subprocesses run from it (`python -m benchmarks.X`)."""

TRL_PHASES = ("generate", "old_logp", "score", "update")
"""Where TRL's RL step goes, timed by `trl_worker.TrlPhaseTimer` (wall seconds, no profiler):
generate = `GRPOTrainer._generate` (sampling with `model.generate`, decoding);
old_logp = the no-grad `_get_per_token_logps_and_entropies` passes of `_generate_and_score_completions` (pi_old);
score = the rest of `_generate_and_score_completions` (rewards, advantages, batching);
update = `training_step` without the generation (per optimizer step: the loss forward and its backward).
The rest of an RL step (gradient clipping, `optimizer.step`, the scheduler, callbacks, logging) is what the
Trainer's loop does outside `training_step`."""


@dataclass(kw_only=True)
class Curve:
    """Reward per RL step with the wall time (s since the loop started) at which each step ended."""

    name: str
    rewards: list[float] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    """Mean token entropy of the policy over the RL step's response tokens (ours: `actor/entropy`, the
    old-policy pass; TRL: its `entropy`, averaged over the RL step's optimizer steps)."""
    frac_zero_std: list[float] = field(default_factory=list)
    """Share of prompt groups whose rewards are all equal (ours: `reward/frac_zero_std`; TRL:
    `frac_reward_zero_std`)."""
    phases: list[dict] = field(default_factory=list)
    """Seconds of each RL step in each phase the side times itself (ours: `perf/<phase>_s`,
    `moe_gspo.run.timing.PHASES`; TRL: `TRL_PHASES`); wall times, so a step during which the
    side was stopped carries the stop (`phase_split` leaves those steps out)."""
    setup_s: float = 0.0
    """Wall time before the training loop (process start, model build, engine setup)."""
    note: str = ""

    def add(self, reward: float, t_s: float, *, entropy: float = math.nan, frac_zero_std: float = math.nan) -> None:
        self.rewards.append(float(reward))
        self.times_s.append(float(t_s))
        self.entropy.append(float(entropy))
        self.frac_zero_std.append(float(frac_zero_std))


def first_crossing(rewards: list[float], target: float, window: int) -> int | None:
    """Index of the first RL step whose trailing `window`-step mean reward is >= target (full window)."""
    total = 0.0
    for i, r in enumerate(rewards):
        total += r
        if i >= window:
            total -= rewards[i - window]
        if i >= window - 1 and total / window >= target - 1e-12:
            return i
    return None


def phase_split(curve: Curve, *, steps_per_turn: int | None, skip: int = 1) -> dict[str, float]:
    """Mean seconds per RL step of each of the side's phases, and `rest` (charged time not in a phase),
    over its RL steps from `skip` on (at least 1: a step's time is the difference of consecutive times) in
    which it was not stopped: in turns of `steps_per_turn` (None: the side ran alone) the stop after a turn
    lands in the next turn's first step (RL steps 1, 1 + k, ...). Empty when no step qualifies."""
    steps = [i for i in range(max(skip, 1), len(curve.phases))
             if steps_per_turn is None or (i - 1) % steps_per_turn != 0]
    if not steps:
        return {}
    names = list(dict.fromkeys(p for i in steps for p in curve.phases[i]))  # in the order the side logs them
    out = {p: sum(curve.phases[i].get(p, 0.0) for i in steps) / len(steps) for p in names}
    charged = sum(curve.times_s[i] - curve.times_s[i - 1] for i in steps) / len(steps)
    out["rest"] = charged - sum(out.values())
    return out


def comparison_problem(cfg) -> str | None:
    """What in `cfg` the two sides cannot both run (the message names the field and the fix), or None."""
    if cfg.model.path is not None:
        return f"model.path={cfg.model.path}: the comparison runs on the tiny random model (model.path=null)"
    if cfg.train.micro_batch_size:
        return (f"train.micro_batch_size={cfg.train.micro_batch_size}: the comparison takes a whole mini-batch "
                "per pass, as TRL does here; set train.micro_batch_size=0")
    if cfg.algo.routing_replay != "none" or cfg.algo.name not in ("gspo", "grpo"):
        return (f"algo.name={cfg.algo.name}, algo.routing_replay={cfg.algo.routing_replay}: TRL has gspo "
                "(importance_sampling_level=sequence) and grpo, without routing replay")
    if cfg.algo.resolved_loss_agg_mode() not in ("seq-mean-token-mean", "token-mean") or cfg.algo.kl_coef:
        return (f"algo.loss_agg_mode={cfg.algo.resolved_loss_agg_mode()}, algo.kl_coef={cfg.algo.kl_coef}: the "
                "comparison maps seq-mean-token-mean and token-mean onto TRL's loss types, without a KL term")
    return None


# ---------------------------------------------------------------------------------------- commands
def train_cmd(config: str, *, nproc: int, run_dir: Path, steps: int, overrides: list[str]) -> list[str]:
    """`torchrun --standalone --nproc-per-node N -m moe_gspo.train` on `config` for `steps` RL steps in
    `run_dir` (no wandb, no progress bar, no HF export), then `overrides`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "moe_gspo.train", "--config", config, "--run-dir", str(run_dir), f"train.steps={steps}",
            "logging.wandb_mode=disabled", "logging.progress=false", "train.export_hf=false", *overrides]


def trl_worker_cmd(config: str, *, seed: int, max_steps: int, out_dir: Path, records: Path, overrides: list[str],
                   router_aux_loss: bool = False) -> list[str]:
    """`python -m benchmarks.trl_worker`: TRL's side for `max_steps` RL steps, one JSON line per RL step
    appended to `records`."""
    return [sys.executable, "-m", "benchmarks.trl_worker", "--config", config, "--seed", str(seed),
            "--max-steps", str(max_steps), "--out", str(out_dir), "--records", str(records),
            *(["--router-aux-loss"] if router_aux_loss else []), *overrides]


def subprocess_env(root: Path = ROOT) -> dict[str, str]:
    """This environment with `root` (default: this checkout's root) first on PYTHONPATH, so that `-m
    benchmarks.X` and `-m moe_gspo.train` import from that checkout in a subprocess wherever it runs."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))


# ------------------------------------------------------------------------------- another commit's code
def resolve_rev(rev: str, repo: Path = ROOT) -> str | None:
    """The full hash of the commit `rev` names in the git repository at `repo` (None: not a commit there)."""
    proc = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else None


@contextlib.contextmanager
def rev_checkout(rev: str, parent: Path, repo: Path = ROOT) -> Iterator[Path]:
    """A checkout of commit `rev` of `repo` in `parent/rev_<hash>` (`git worktree add --detach`), for a
    subprocess to run that commit's code (cwd the checkout, `subprocess_env(checkout)`); removed again
    (`git worktree remove --force`) when the block ends, however it ends. A checkout left by a killed
    process goes with `git worktree prune` once its directory is gone."""
    sha = resolve_rev(rev, repo)
    if sha is None:
        raise ValueError(f"{rev!r} is not a commit of {repo}")
    tree = Path(parent) / f"rev_{sha[:12]}"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-q", str(tree), sha], check=True,
                   capture_output=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], check=False,
                       capture_output=True)
