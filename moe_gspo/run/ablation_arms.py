"""The runs of an ablation: the matrix (`expand_arms`), each run's state on disk, its training command line
and environment, and running one run with resume / skip / move-aside (`run_arm`). Shared by the local
executor (`moe_gspo.ablate`) and the SLURM one (`moe_gspo.run.slurm_executor`, whose job calls
`prepare_run_dir` and `command_for` itself when it starts)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from moe_gspo.run.rundir import move_aside

if TYPE_CHECKING:  # (the SLURM job imports this module: it stays light, without torch)
    from moe_gspo.run.ablation_spec import AblationSpec


@dataclass(frozen=True)
class Arm:
    algo: str
    routing_replay: str
    seed: int
    run_dir: Path
    variant: str = ""
    """Name of the spec's `variants` entry ("" without variants)."""

    @property
    def group(self) -> str:
        """The arm without its seed: `{algo}-{routing_replay}[-{variant}]`."""
        return f"{self.algo}-{self.routing_replay}" + (f"-{self.variant}" if self.variant else "")

    @property
    def name(self) -> str:
        return f"{self.group}-s{self.seed}"


@dataclass
class ArmResult:
    arm: Arm
    status: str
    """"skipped" (already done), "finished", or "failed"."""
    log_path: Path
    message: str = ""


ArmRunner = Callable[[Arm, list[str], Path], int]
"""(arm, command, log_path) -> exit code. Must leave `{arm.run_dir}/done.json` when it succeeds."""


def _matches(arm: Arm, rule: dict[str, Any]) -> bool:
    values = {"algo": arm.algo, "routing_replay": arm.routing_replay, "seed": arm.seed, "variant": arm.variant}
    return all(values[k] == v for k, v in rule.items())


def expand_arms(spec: AblationSpec, *, warn: bool = True) -> list[Arm]:
    """All arms of the matrix (algo-major, then replay, then variant, then seed) minus the excluded ones (and
    those not in `spec.only` when it names some)."""
    variants = list(spec.variants) or [""]
    arms = [Arm(a, r, s, spec.out_dir / (f"{a}-{r}-{v}-s{s}" if v else f"{a}-{r}-s{s}"), v)
            for a in spec.algos for r in spec.routing_replay for v in variants for s in spec.seeds]
    for rule in spec.exclude:
        if warn and not any(_matches(arm, rule) for arm in arms):
            print(f"warning: exclude rule {rule} matches no arm", file=sys.stderr)
    return [arm for arm in arms if not any(_matches(arm, rule) for rule in spec.exclude)
            and (not spec.only or arm.group in spec.only)]  # `ablate --only`


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text}: give comma-separated integers, e.g. {flag} 1000,1001") from None


def select_runs(spec: AblationSpec, seeds: str | None = None, only: str | None = None) -> AblationSpec:
    """The spec shrunk without editing it (`ablate --seeds S[,S...] --only ARM[,ARM...]`): only those of its seeds
    and arms (`Arm.group`: `<algo>-<replay>[-<variant>]`). Run directories stay those of the whole matrix, so a
    shrunk run is the same run as the full spec's. ValueError (one line) for a seed or an arm not in the spec."""
    from dataclasses import replace

    if seeds is not None:
        wanted = _int_list(seeds, "--seeds")
        bad = [s for s in wanted if s not in spec.seeds]
        if bad:
            raise ValueError(f"--seeds: {', '.join(map(str, bad))} not among the spec's seeds "
                             f"{', '.join(map(str, spec.seeds))}")
        kept = [s for s in spec.seeds if s in wanted]  # exclude rules of the other seeds match nothing now: dropped
        spec = replace(spec, seeds=kept, exclude=[r for r in spec.exclude if r.get("seed", kept[0]) in kept])
    if only is not None:
        names = [n.strip() for n in only.split(",") if n.strip()]
        groups = list(dict.fromkeys(a.group for a in expand_arms(spec, warn=False)))
        bad = [n for n in names if n not in groups]
        if bad or not names:
            raise ValueError(f"--only: {', '.join(bad) or repr(only)} not an arm of the spec (<algo>-<replay>"
                             f"[-<variant>]); its arms: {', '.join(groups)}")
        spec = replace(spec, only=names)
    return spec


def seed_order(spec: AblationSpec, arms: list[Arm]) -> list[int]:
    """Indices of `arms` seed by seed (every arm's first seed, then every arm's second, ...), the order in
    which runs start, so that a matrix stopped midway has whole seeds of every arm."""
    seed_rank = {s: i for i, s in enumerate(spec.seeds)}
    return sorted(range(len(arms)), key=lambda i: (seed_rank[arms[i].seed], i))


_MAX_DONE_BYTES = 1 << 20


def done_problem(run_dir: Path) -> str:
    """Why the run's done.json does not say "finished" ("" when it does; "no done.json" when it is absent). A
    done.json counts when it is a JSON object (as training writes it) whose `step`, if present, is an int >= 0."""
    path = Path(run_dir) / "done.json"
    if not path.is_file():
        return "no done.json"
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_DONE_BYTES + 1)
        if len(raw) > _MAX_DONE_BYTES:
            return f"done.json is damaged: larger than {_MAX_DONE_BYTES} bytes"
        done = json.loads(raw)
    except OSError as e:
        return f"done.json is unreadable: {e.strerror or e}"
    except ValueError as e:  # UnicodeDecodeError included
        return f"done.json is damaged: not JSON ({str(e)[:100]})"
    if not isinstance(done, dict):
        return f"done.json is damaged: not a JSON object (a {type(done).__name__})"
    step = done.get("step", 0)
    if type(step) is not int or step < 0:
        return f"done.json is damaged: step {str(step)[:40]!r} is not a step number"
    return ""


def arm_state(arm: Arm | Path) -> str:
    """"done" (a valid done.json), "damaged" (a done.json that is not: `done_problem` says why; never counted
    as done, never overwritten), "resume" (a checkpoint exists), or "fresh" (of an arm or a run directory)."""
    run_dir = arm.run_dir if isinstance(arm, Arm) else Path(arm)
    if (run_dir / "done.json").is_file():
        return "damaged" if done_problem(run_dir) else "done"
    ckpt = run_dir / "checkpoints"
    if ckpt.is_dir() and any(p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")
                             for p in ckpt.iterdir()):
        return "resume"
    return "fresh"


def format_override(key: str, value: Any) -> str:
    """`key=value` with the value as YAML would read it back (bools lower-case, lists as JSON)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None:
        text = "null"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value)
    else:
        text = str(value)
    return f"{key}={text}"


def build_command(spec: AblationSpec, arm: Arm, resume: bool) -> list[str]:
    """The training command of one arm: torchrun (through `sys.executable` and `moe_gspo.launch`, so
    that the arm's exit code is the worker's: 2 for a user error, 3 for a rank failure)."""
    cmd = [sys.executable, "-m", "moe_gspo.launch", "--standalone",  # torchrun, exiting with the worker's code
           "--nproc-per-node", str(spec.nproc), "-m", "moe_gspo.train",
           "--config", str(spec.base_config), "--algo", arm.algo,
           "--routing-replay", arm.routing_replay, "--run-dir", str(arm.run_dir)]
    if resume:
        cmd.append("--resume")
    cmd += spec.extra_args
    cmd += arm_overrides(spec, arm)
    return cmd


def arm_overrides(spec: AblationSpec, arm: Arm) -> list[str]:
    """The dotted overrides of one arm, in the order the command passes them (later ones win)."""
    out = [f"train.seed={arm.seed}"] + [f"{k}={arm.seed}" for k in spec.seed_keys if k != "train.seed"]
    out += [format_override(k, v) for k, v in spec.overrides.items()]
    out += [format_override(k, v) for k, v in spec.algo_overrides.get(arm.algo, {}).items()]
    out += [format_override(k, v) for k, v in spec.variants.get(arm.variant, {}).items()]
    return out


def wandb_env(spec: AblationSpec, arm: Arm) -> dict[str, str]:
    """The environment that groups the run in W&B: group = the ablation's name, job type = the arm (its
    seeds together), tags algo / replay / variant / seed. These are W&B's own variables
    (WANDB_RUN_GROUP, WANDB_JOB_TYPE, WANDB_TAGS), read by `wandb.init`, so the arm's command line and
    config stay those of a plain run."""
    tags = [f"algo={arm.algo}", f"replay={arm.routing_replay}"] + ([f"variant={arm.variant}"] if arm.variant else [])
    return {"WANDB_RUN_GROUP": spec.name, "WANDB_JOB_TYPE": arm.group,
            "WANDB_TAGS": ",".join(tags + [f"seed={arm.seed}"])}


def prepare_run_dir(run_dir: Path) -> tuple[str, str]:
    """Before a run starts: (its state, a note). A fresh run's non-empty directory (a partial run without a
    checkpoint) is first moved aside to `<run_dir>.prev<k>` (nothing is deleted); the directory exists after."""
    state = arm_state(run_dir)
    note = ""
    if state == "fresh" and run_dir.exists() and any(run_dir.iterdir()):
        note = f"previous partial run moved to {move_aside(run_dir)}; "
    if state not in ("done", "damaged"):
        run_dir.mkdir(parents=True, exist_ok=True)
    return state, note


def finish(arm: Arm, code: int | None, note: str, resumed: bool, why: str = "") -> ArmResult:
    """The result of a run that ended with exit code `code` (None: `why` says how it ended)."""
    log_path = arm.run_dir / "train.log"
    if code is None:
        return ArmResult(arm, "failed", log_path, note + why)
    if code != 0:
        return ArmResult(arm, "failed", log_path, f"{note}exit code {code}")
    problem = done_problem(arm.run_dir)
    if problem:
        return ArmResult(arm, "failed", log_path, f"{note}exited 0 but " + (
            "wrote no done.json" if problem == "no done.json" else f"its {problem}"))
    return ArmResult(arm, "finished", log_path, note + ("resumed" if resumed else ""))


def damaged_result(arm: Arm) -> ArmResult:
    """A run whose done.json is damaged: failed, not run (its files are the user's to move aside)."""
    return ArmResult(arm, "failed", arm.run_dir / "train.log", f"{done_problem(arm.run_dir)}; not run: move "
                     f"{arm.run_dir / 'done.json'} aside to run it again (it resumes from its newest checkpoint)")


def run_arm(spec: AblationSpec, arm: Arm, arm_runner: ArmRunner) -> ArmResult:
    """Run (or skip, or resume) one arm; never raises for a failing arm."""
    state, note = prepare_run_dir(arm.run_dir)
    if state == "done":
        return ArmResult(arm, "skipped", arm.run_dir / "train.log", "done.json exists")
    if state == "damaged":
        return damaged_result(arm)
    command = build_command(spec, arm, resume=(state == "resume"))
    try:
        code = arm_runner(arm, command, arm.run_dir / "train.log")
    except Exception as e:  # a broken launcher fails this arm, not the matrix
        return finish(arm, None, note, False, f"runner raised {type(e).__name__}: {e}")
    return finish(arm, code, note, state == "resume")


def _n(k: int, word: str) -> str:
    return f"{k} {word}" + ("s" if k != 1 else "")


def count_runs(arms: list[Arm]) -> str:
    """"12 runs (6 arms x 2 seeds)"; "N runs of A arms" when not every arm has every seed."""
    groups, seeds = {a.group for a in arms}, {a.seed for a in arms}
    if len(groups) * len(seeds) == len(arms):
        return f"{_n(len(arms), 'run')} ({_n(len(groups), 'arm')} x {_n(len(seeds), 'seed')})"
    return f"{_n(len(arms), 'run')} of {_n(len(groups), 'arm')}"


def last_line(path: Path) -> str:
    """The last non-empty line of a log ("" when there is none), for one-line status reports."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            lines = [l.strip() for l in f.read().decode(errors="replace").replace("\r", "\n").splitlines()]
    except OSError:
        return ""
    lines = [l for l in lines if l]
    return lines[-1][:300] if lines else ""
