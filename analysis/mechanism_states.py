"""The policy's state for `analysis.mechanism` (issue 58: "at initialisation, partly trained and solved"): `--states
init,steps:100,steps:300` trains the tiny model with the project's own trainer (`python -m moe_gspo.train`, a
subprocess) at the setting's MoE depth on the synthetic task at the setting's response length, and measures the
exported checkpoint of each state (`train.export_hf`, the run's `hf_export/`, which `--model` reads).

A state's checkpoint is cached under the output folder, `OUT/states/<task>_d<depth>_L<length>_seed<seed>/`:
- `run/`: one training run (its `train.log` beside it), resumed from its last checkpoint to reach the next state
  (`train.steps` raised; a constant learning rate, `train.lr_decay=none`, so the state at 100 steps is the first
  100 steps of the run at 300);
- `step_<N>/`: the HF export after N steps and `state.json` (the trainer's arguments, the mean reward and entropy
  of the last 10 training steps before N), copied to a temporary folder and renamed.
A later call with the same arguments reuses `step_<N>/`; a cached state trained with other arguments is an error
(never overwritten), as is a state below the cached run's step that was not exported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"
"""The states' training config: the project's default CPU run (GSPO, lr 5e-4, entropy bonus 0.01, 16 prompts x 8
samples, 4 mini-batches), changed only by `state_train_args`."""
LAST = 10
"""Training steps whose mean reward and entropy a state records."""


class StateError(ValueError):
    """A bad `--states` value or a cache that cannot be used (one line naming the flag or folder)."""


@dataclass(frozen=True)
class State:
    """A policy state: `init` (0 training steps, the tiny model's initialisation) or `steps:N`."""

    steps: int

    @property
    def name(self) -> str:
        return "init" if self.steps == 0 else f"steps:{self.steps}"


def parse_states(text: str) -> list[State]:
    """`init,steps:100,steps:300` -> the states, sorted by steps, duplicates dropped."""
    out = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "init":
            out.add(State(0))
            continue
        head, _, num = part.partition(":")
        if head != "steps" or not num.isdigit() or int(num) < 1:
            raise StateError(f"--states: {part!r} is not a state; give init or steps:N (N >= 1 training steps), "
                             "e.g. --states init,steps:100,steps:300")
        out.add(State(int(num)))
    if not out:
        raise StateError("--states: give at least one state, e.g. --states init,steps:100,steps:300")
    return sorted(out, key=lambda s: s.steps)


def state_train_args(*, depth: int, length: int, seed: int, task: str = "copy", symbols: int = 4,
                     extra: tuple[str, ...] = ()) -> list[str]:
    """The trainer's overrides of `CONFIG` for a state (the steps apart): depth MoE layers after the dense one, the
    task's prompts of length - 1 symbols (the answer and EOS: `length` tokens), the seed of the run and of the init,
    then `extra` (`--state-overrides`, e.g. algo.name=grpo)."""
    return [f"model.tiny={{num_hidden_layers: {depth + 1}, mlp_only_layers: [0], "
            f"max_position_embeddings: {max(256, 2 * length + 2)}}}",
            f"model.init_seed={seed}", f"train.seed={seed}", f"task.name={task}", f"task.num_symbols={symbols}",
            f"task.prompt_len={length - 1}", f"task.prompt_len_max={length - 1}", "task.pad_prompts=true",
            f"rollout.max_new_tokens={length}", "train.lr_decay=none", "eval.every=0", "train.checkpoint_every=0",
            "train.export_hf=true", "logging.wandb_mode=disabled", "logging.progress=false",
            "logging.progress_every=50", "logging.trace_every=0", *extra]


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _summary(rows: list[dict], steps: int) -> dict:
    last = rows[max(0, steps - LAST):steps]
    mean = lambda k: sum(r[k] for r in last) / len(last) if last and all(k in r for r in last) else None  # noqa: E731
    return {"steps": steps, "reward_last10": mean("reward/mean"), "entropy_last10": mean("actor/entropy")}


def _train(run: Path, steps: int, args: list[str], progress) -> None:
    resume = ["--resume"] if (run / "checkpoints").exists() else []
    cmd = [sys.executable, "-m", "moe_gspo.train", "--config", str(CONFIG), "--run-dir", str(run), *resume,
           *args, f"train.steps={steps}"]
    if progress:
        progress(f"training {run.parent.name} to step {steps}")
    run.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(run / "train.log", "a") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise StateError(f"training the state at {steps} steps failed (exit {proc.returncode}); see {run / 'train.log'}")


def state_checkpoint(out: Path, state: State, *, depth: int, length: int, seed: int, task: str = "copy",
                     extra: tuple[str, ...] = (), progress=None) -> tuple[Path, dict]:
    """(the HF checkpoint folder of `state`, its state.json) for the tiny model at `depth` on `task` at `length`,
    trained now or taken from the cache under `out` (module docstring). `state` must not be `init`."""
    assert state.steps >= 1, state
    args = state_train_args(depth=depth, length=length, seed=seed, task=task, extra=extra)
    home = out / "states" / f"{task}_d{depth}_L{length}_seed{seed}"
    dest = home / f"step_{state.steps:06d}"
    if (dest / "state.json").exists():
        info = json.loads((dest / "state.json").read_text())
        if info.get("train_args") != args:
            raise StateError(f"{dest} holds a state trained with other arguments; choose another --out (the cache "
                             "is never overwritten)")
        return dest, info
    run = home / "run"
    done = len(_metrics(run))
    if done > state.steps:
        raise StateError(f"{run} is already trained to step {done}, past --states steps:{state.steps}, whose "
                         "checkpoint it did not export; choose another --out, or list every state in one call")
    recorded = home / "train_args.json"
    if recorded.exists() and json.loads(recorded.read_text()) != args:
        raise StateError(f"{run} was trained with other arguments; choose another --out (the cache is never "
                         "overwritten)")
    home.mkdir(parents=True, exist_ok=True)
    recorded.write_text(json.dumps(args))
    if done < state.steps:
        _train(run, state.steps, args, progress)
    info = {"state": state.name, "train_args": args, "config": str(CONFIG.name), **_summary(_metrics(run), state.steps)}
    tmp = home / f".{dest.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # our own half-copied folder from an interrupted call
    shutil.copytree(run / "hf_export", tmp)
    (tmp / "state.json").write_text(json.dumps(info, indent=1))
    os.replace(tmp, dest)
    return dest, info
