"""Ablation runner: train every arm of an algorithm × routing-replay [× variant] × seed matrix, then compare.

    python -m moe_gspo.ablate --config configs/ablation_tiny.yaml [--out DIR] [--dry-run] [section.key=value ...]

(The spec may also be the first positional argument, as in earlier versions.)

The ablation YAML:

    base_config: configs/tiny_cpu.yaml   # required; training config every arm starts from
    algos: [gspo, gspo_token, grpo]      # required; values of the train CLI's --algo
    routing_replay: [none, r2, r3]       # required; values of --routing-replay
    seeds: [0, 1]                        # required; each arm runs once per seed (train.seed=...)
    seed_keys: [train.seed]              # optional; the config keys each seed sets (default train.seed;
                                         # [train.seed, model.init_seed]: every seed a new initial model too)
    overrides: {train.steps: 40}         # optional; dotted config overrides given to every arm
    nproc: 2                             # optional (default 1); processes per arm (torchrun)
    out_dir: runs/ablation_tiny          # optional (default runs/ablation); --out overrides it
    variants:                            # optional; named override sets, one more matrix axis
      none: {}
      tis: {algo.rollout_is: token}
    algo_overrides:                      # optional; per-algorithm overrides (e.g. each method's tuned
      gspo: {train.lr: 2.0e-3}           # lr), after `overrides`, before the variant's
    exclude:                             # optional; drop arms matching all given fields
      - {algo: gspo_token, routing_replay: r2}
    extra_args: []                       # optional; extra train CLI flags, placed before overrides
    arm_timeout_s: null                  # optional; kill an arm (its process group) after this long
    parallel_arms: 1                     # optional; arms run at a time (each gets OMP_NUM_THREADS =
                                         # cores // (parallel_arms * nproc), at least 1)
    reward_threshold: 0.8                # optional; the comparison report's "steps to threshold" level

Dotted overrides on the command line (anywhere among the flags) are added to `overrides`.
Relative paths are resolved against the current directory (run from the repository root).
Before any arm runs (and in `--dry-run`), every arm's full train command line is validated like the
train CLI does it (config file, overrides, flags): an invalid arm stops the matrix with exit code 2
and one line per bad arm; the output directory is checked too.
Each arm runs, in a subprocess, with stdout and stderr going to `{run_dir}/train.log`:

    python -m moe_gspo.launch --standalone --nproc-per-node {nproc} -m moe_gspo.train \
        --config {base_config} --algo {algo} --routing-replay {replay} \
        --run-dir {out_dir}/{algo}-{replay}[-{variant}]-s{seed} [--resume] {extra_args} train.seed={seed} \
        {overrides} {variant overrides}

With `variants`, every algo x replay arm runs once per variant (its overrides come last, so they win);
arm names gain `-{variant}` and `exclude` rules may name a `variant`. `--dry-run` also builds every
arm's config (base file + flags + overrides) and reports the ones that do not validate.

Resuming a matrix: an arm whose `done.json` exists is skipped; an unfinished arm with a checkpoint
(`checkpoints/step_*`) is rerun with `--resume`; an unfinished arm without one is started afresh
after its old directory is moved aside to `<run_dir>.prev<k>` (nothing is deleted). A failing arm is
reported with its log path and the others still run; the exit code is 1 when any arm failed.
At the end `analysis.compare.build_comparison` writes `{out_dir}/comparison/report.html`.

Implementation: the arm runner is a parameter of `run_ablation` so tests can replace the subprocess.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from moe_gspo.algos.registry import algo_names
from moe_gspo.config import REPLAYS
from moe_gspo.run.arm_runner import SubprocessArmRunner, run_concurrently
from moe_gspo.run.rundir import move_aside

_SPEC_KEYS = {"base_config", "algos", "routing_replay", "seeds", "overrides", "nproc", "out_dir",
              "exclude", "extra_args", "arm_timeout_s", "variants", "parallel_arms", "reward_threshold",
              "algo_overrides", "seed_keys"}
_VARIANT_RE = re.compile(r"^[A-Za-z0-9_.]+$")
_AXIS_OVERRIDES = {"algo.name": "list it under 'algos'", "algo.routing_replay": "list it under 'routing_replay'"}
_REQUIRED = ("base_config", "algos", "routing_replay", "seeds")
_OVERRIDE_KEY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_RESERVED_OVERRIDES = {"train.seed": "list seeds under 'seeds'"}


@dataclass
class AblationSpec:
    base_config: Path
    algos: list[str]
    routing_replay: list[str]
    seeds: list[int]
    overrides: dict[str, Any] = field(default_factory=dict)
    nproc: int = 1
    parallel_arms: int = 1
    reward_threshold: float = 0.8
    out_dir: Path = Path("runs/ablation")
    exclude: list[dict[str, Any]] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)
    arm_timeout_s: float | None = None
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    algo_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-algorithm dotted overrides, applied after `overrides` and before the variant's."""
    seed_keys: list[str] = field(default_factory=lambda: ["train.seed"])
    """The dotted config keys each seed sets (train.seed always; e.g. model.init_seed too, so that the seeds
    also draw the initial model: no answer then belongs to one initialisation)."""


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


# --------------------------------------------------------------------------- spec

def _str_list(raw: dict, key: str, known: tuple[str, ...] | None) -> list[str]:
    val = raw[key]
    if isinstance(val, str):
        val = [val]
    if not isinstance(val, list) or not val or not all(isinstance(v, str) for v in val):
        raise ValueError(f"ablation spec: '{key}' must be a non-empty list of names, got {val!r}")
    if known is not None:
        bad = [v for v in val if v not in known]
        if bad:
            raise ValueError(f"ablation spec: unknown {key} {bad}; choose from {list(known)}")
    if len(set(val)) != len(val):
        raise ValueError(f"ablation spec: '{key}' lists a name twice: {val}")
    return val


def parse_spec(raw: Any, out_dir: str | Path | None = None) -> AblationSpec:
    """Validate the YAML mapping of an ablation spec (see the module docstring)."""
    if not isinstance(raw, dict):
        raise ValueError("ablation spec must be a YAML mapping with keys " + ", ".join(_REQUIRED))
    unknown = set(raw) - _SPEC_KEYS
    if unknown:
        raise ValueError(f"ablation spec: unknown keys {sorted(unknown)}; allowed: {sorted(_SPEC_KEYS)}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"ablation spec: missing required keys {missing}")
    seeds = raw["seeds"]
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        seeds = [seeds]
    if (not isinstance(seeds, list) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
            or len(set(seeds)) != len(seeds)):
        raise ValueError("ablation spec: 'seeds' must be a list of distinct non-negative ints, "
                         f"got {seeds!r}")
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise ValueError("ablation spec: 'overrides' must be a mapping of dotted keys to values")
    for k, v in overrides.items():
        if not isinstance(k, str) or not _OVERRIDE_KEY_RE.match(k):
            raise ValueError(f"ablation spec: override key {k!r} must be dotted, like 'train.steps'")
        if k in _RESERVED_OVERRIDES:
            raise ValueError(f"ablation spec: override {k!r} is set per arm; {_RESERVED_OVERRIDES[k]}")
    nproc, parallel = raw.get("nproc", 1), raw.get("parallel_arms", 1)
    for key, val in (("nproc", nproc), ("parallel_arms", parallel)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"ablation spec: '{key}' must be a positive int, got {val!r}")
    variants = _parse_variants(raw.get("variants"))
    algo_overrides = _parse_variants(raw.get("algo_overrides"), what="algo_overrides")
    algos = _str_list(raw, "algos", algo_names())
    stray = sorted(set(algo_overrides) - set(algos))
    if stray:
        raise ValueError(f"ablation spec: 'algo_overrides' names {stray}, not in 'algos' {algos}")
    exclude = raw.get("exclude") or []
    fields = {"algo", "routing_replay", "seed"} | ({"variant"} if variants else set())
    if not isinstance(exclude, list) or not all(isinstance(e, dict) and e and set(e) <= fields
                                                for e in exclude):
        raise ValueError(f"ablation spec: 'exclude' must be a list of mappings using keys {sorted(fields)}")
    seed_keys = raw.get("seed_keys", ["train.seed"])
    if (not isinstance(seed_keys, list) or "train.seed" not in seed_keys or len(set(seed_keys)) != len(seed_keys)
            or not all(isinstance(k, str) and _OVERRIDE_KEY_RE.match(k) for k in seed_keys)):
        raise ValueError("ablation spec: 'seed_keys' must be a list of distinct dotted config keys that includes "
                         f"train.seed (e.g. [train.seed, model.init_seed]), got {seed_keys!r}")
    clash = sorted(set(seed_keys) & set(overrides))
    if clash:
        raise ValueError(f"ablation spec: {clash} are set per seed ('seed_keys'); drop them from 'overrides'")
    extra = raw.get("extra_args") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise ValueError("ablation spec: 'extra_args' must be a list of strings")
    timeout = raw.get("arm_timeout_s")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"ablation spec: 'arm_timeout_s' must be a positive number, got {timeout!r}")
    threshold = raw.get("reward_threshold", 0.8)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ValueError(f"ablation spec: 'reward_threshold' must be a number, got {threshold!r}")
    if not isinstance(raw["base_config"], str):
        raise ValueError("ablation spec: 'base_config' must be a path string")
    return AblationSpec(
        base_config=_base_config_path(raw["base_config"]),
        algos=algos,
        routing_replay=_str_list(raw, "routing_replay", REPLAYS),
        seeds=list(seeds), overrides=dict(overrides), nproc=nproc, parallel_arms=parallel,
        out_dir=Path(out_dir if out_dir is not None else raw.get("out_dir", "runs/ablation")),
        exclude=list(exclude), extra_args=list(extra),
        arm_timeout_s=float(timeout) if timeout is not None else None, variants=variants,
        reward_threshold=float(threshold), algo_overrides=algo_overrides, seed_keys=list(seed_keys))


def _parse_variants(raw: Any, what: str = "variants") -> dict[str, dict[str, Any]]:
    """`variants` or `algo_overrides`: names mapped to dotted override mappings."""
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"ablation spec: '{what}' must be a mapping of names to override mappings, "
                         "e.g. {none: {}, tis: {algo.rollout_is: token}}")
    out = {}
    entry = "variant" if what == "variants" else f"{what} entry"
    for name, overrides in raw.items():
        if not isinstance(name, str) or not _VARIANT_RE.match(name):
            raise ValueError(f"ablation spec: {entry} name {name!r} must use letters, digits, '_' or '.'")
        overrides = overrides or {}
        if not isinstance(overrides, dict):
            raise ValueError(f"ablation spec: {entry} {name!r} must map dotted keys to values, got {overrides!r}")
        for k in overrides:
            if not isinstance(k, str) or not _OVERRIDE_KEY_RE.match(k):
                raise ValueError(f"ablation spec: {entry} {name!r}: override key {k!r} must be dotted, like "
                                 "'algo.rollout_is'")
            reserved = {**_RESERVED_OVERRIDES, **_AXIS_OVERRIDES}
            if k in reserved:
                raise ValueError(f"ablation spec: {entry} {name!r} sets {k!r}, an axis of the matrix; {reserved[k]}")
        out[name] = dict(overrides)
    return out


def _base_config_path(text: str) -> Path:
    """The spec's base_config: a file, or a shipped run config by name (`configs/NAME.yaml`, `NAME`) from
    any directory; as written when neither (`validate_arms` then names it)."""
    from moe_gspo.config_load import resolve_config_path

    try:
        return resolve_config_path(text, flag="base_config")
    except ValueError:
        return Path(text)


def load_spec(path: str | Path, out_dir: str | Path | None = None, overrides: list[str] = ()) -> AblationSpec:
    """Read and validate an ablation YAML; `overrides` (`section.key=value`) extend its `overrides`."""
    from moe_gspo.config_load import load_yaml_file, parse_override

    from moe_gspo.config_load import resolve_config_path

    path = resolve_config_path(path, kind="ablation")  # a file, or a shipped spec by name from anywhere
    raw = load_yaml_file(path, what="ablation spec")
    if overrides and isinstance(raw, dict) and isinstance(raw.get("overrides") or {}, dict):
        raw = dict(raw, overrides=dict(raw.get("overrides") or {}))
        for text in overrides:
            sec, key, value = parse_override(text)
            raw["overrides"][f"{sec}.{key}"] = value
    return parse_spec(raw, out_dir)


def _matches(arm: Arm, rule: dict[str, Any]) -> bool:
    values = {"algo": arm.algo, "routing_replay": arm.routing_replay, "seed": arm.seed, "variant": arm.variant}
    return all(values[k] == v for k, v in rule.items())


def expand_arms(spec: AblationSpec, *, warn: bool = True) -> list[Arm]:
    """All arms of the matrix (algo-major, then replay, then variant, then seed) minus the excluded ones."""
    variants = list(spec.variants) or [""]
    arms = [Arm(a, r, s, spec.out_dir / (f"{a}-{r}-{v}-s{s}" if v else f"{a}-{r}-s{s}"), v)
            for a in spec.algos for r in spec.routing_replay for v in variants for s in spec.seeds]
    for rule in spec.exclude:
        if warn and not any(_matches(arm, rule) for arm in arms):
            print(f"warning: exclude rule {rule} matches no arm", file=sys.stderr)
    return [arm for arm in arms if not any(_matches(arm, rule) for rule in spec.exclude)]


# --------------------------------------------------------------------------- one arm

def arm_state(arm: Arm) -> str:
    """"done" (done.json exists), "resume" (a checkpoint exists), or "fresh"."""
    if (arm.run_dir / "done.json").is_file():
        return "done"
    ckpt = arm.run_dir / "checkpoints"
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


def arm_config_error(spec: AblationSpec, arm: Arm) -> str | None:
    """Why the arm's training config would not validate (None when it does), without running it."""
    import warnings

    from moe_gspo.config_load import load_config

    overrides = [f"algo.name={arm.algo}", f"algo.routing_replay={arm.routing_replay}", *arm_overrides(spec, arm)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(spec.base_config, overrides)
    except ValueError as e:
        return str(e)
    return None


def run_arm(spec: AblationSpec, arm: Arm, arm_runner: ArmRunner) -> ArmResult:
    """Run (or skip, or resume) one arm; never raises for a failing arm."""
    log_path = arm.run_dir / "train.log"
    state = arm_state(arm)
    if state == "done":
        return ArmResult(arm, "skipped", log_path, "done.json exists")
    note = ""
    if state == "fresh" and arm.run_dir.exists() and any(arm.run_dir.iterdir()):
        note = f"previous partial run moved to {move_aside(arm.run_dir)}; "
    arm.run_dir.mkdir(parents=True, exist_ok=True)
    command = build_command(spec, arm, resume=(state == "resume"))
    try:
        code = arm_runner(arm, command, log_path)
    except Exception as e:  # a broken launcher fails this arm, not the matrix
        return ArmResult(arm, "failed", log_path, f"{note}runner raised {type(e).__name__}: {e}")
    if code != 0:
        return ArmResult(arm, "failed", log_path, f"{note}exit code {code}")
    if not (arm.run_dir / "done.json").is_file():
        return ArmResult(arm, "failed", log_path, f"{note}exited 0 but wrote no done.json")
    return ArmResult(arm, "finished", log_path, note + ("resumed" if state == "resume" else ""))


# --------------------------------------------------------------------------- matrix

def run_ablation(spec: AblationSpec, arm_runner: ArmRunner | None = None, progress: bool = True,
                 compare: bool = True, progress_log: dict[str, list[str]] | None = None) -> list[ArmResult]:
    """Run every arm (`spec.parallel_arms` at a time), then (if `compare`) write `{out_dir}/comparison/`.
    Arms run seed by seed (every arm's first seed, then every arm's second, ...), so a matrix stopped
    midway has whole seeds of every arm; results come in `expand_arms` order."""
    if arm_runner is None:
        threads = max(1, (os.cpu_count() or 1) // (spec.parallel_arms * spec.nproc))
        arm_runner = SubprocessArmRunner(spec.arm_timeout_s,
                                         env={"OMP_NUM_THREADS": str(threads)} if spec.parallel_arms > 1 else None)
    arms = expand_arms(spec)
    bar = tqdm(total=len(arms), desc="ablation", unit="arm", file=sys.stderr, disable=not progress)

    log = progress_log if progress_log is not None else {}

    def one(arm: Arm) -> ArmResult:  # `log`: arm names "started", "ended", "finished_now" (for an interruption)
        log.setdefault("started", []).append(arm.name)
        res = run_arm(spec, arm, arm_runner)
        log.setdefault("ended", []).append(arm.name)
        if res.status == "finished":
            log.setdefault("finished_now", []).append(arm.name)
        bar.set_postfix_str(arm.name)
        bar.update()
        if res.status == "failed" and not getattr(arm_runner, "stopping", False):  # not when Ctrl-C ended it
            tqdm.write(f"[ablate] {arm.name} FAILED ({res.message}); log: {res.log_path}", file=sys.stderr)
        return res

    seed_rank = {s: i for i, s in enumerate(spec.seeds)}
    order = sorted(range(len(arms)), key=lambda i: (seed_rank[arms[i].seed], i))
    try:
        ran = run_concurrently(one, [arms[i] for i in order], spec.parallel_arms,
                               stop=getattr(arm_runner, "stop_all", None))
    finally:
        bar.close()
    results = [res for _, res in sorted(zip(order, ran))]
    if compare:
        write_comparison(spec, arms)
    return results


def write_comparison(spec: AblationSpec, arms: list[Arm]) -> Path | None:
    """Build the comparison report; returns its HTML path, or None when there is nothing to compare."""
    from analysis.compare import ArmRun, build_comparison  # heavy (matplotlib); only when needed
    from analysis.load import ReportInputError
    try:
        paths = build_comparison([ArmRun(a.group, a.seed, a.run_dir) for a in arms],
                                 spec.out_dir / "comparison", reward_threshold=spec.reward_threshold)
    except ReportInputError as e:
        print(f"[ablate] no comparison report: {e}", file=sys.stderr)
        return None
    print(f"comparison report: {paths.html}")
    return paths.html


def validate_arms(spec: AblationSpec) -> list[str]:
    """One message per arm whose train command line would be refused (config, overrides, flags)."""
    from moe_gspo.run.cli import check_train_args
    from moe_gspo.files import check_output_dir

    problems = []
    try:
        check_output_dir(spec.out_dir, "out_dir")
        if not spec.base_config.is_file():
            from moe_gspo.config_load import resolve_config_path

            resolve_config_path(spec.base_config, flag="base_config")  # raises, listing the shipped configs
    except ValueError as e:
        return [str(e)]
    for arm in expand_arms(spec):
        cmd = build_command(spec, arm, resume=arm_state(arm) == "resume")
        try:
            check_train_args(cmd[cmd.index("moe_gspo.train") + 1:])
        except ValueError as e:
            problems.append(f"arm {arm.name}: {e}")
    return problems


def dry_run(spec: AblationSpec) -> list[tuple[Arm, str, list[str]]]:
    """(arm, action, command) for every arm, printing them; touches nothing. An arm whose config does
    not validate gets the action "invalid config" (and the reason printed under it)."""
    rows = []
    actions = {"done": "skip (done)", "resume": "resume", "fresh": "run"}
    check = spec.base_config.is_file()
    for arm in expand_arms(spec):
        state = arm_state(arm)
        cmd = build_command(spec, arm, resume=(state == "resume"))
        error = arm_config_error(spec, arm) if check else None
        action = "invalid config" if error else actions[state]
        rows.append((arm, action, cmd))
        print(f"{arm.name:<24} {action:<12} {shlex.join(cmd)}")
        if error:
            print(f"    error: {error}")
    print(f"{len(rows)} arms, {sum(r[1] in ('run', 'resume') for r in rows)} to run"
          + (f", {sum(r[1] == 'invalid config' for r in rows)} with an invalid config" if check else
             " (configs not checked: base_config missing)"))
    return rows


def main(argv: list[str] | None = None, arm_runner: ArmRunner | None = None) -> int:
    """CLI entry point; `arm_runner` replaces the torchrun subprocess (tests). Exit codes: 0 all arms
    finished or skipped, 1 an arm failed, 2 a bad spec, override or arm config (nothing ran), 130 / 143
    interrupted by Ctrl-C (SIGINT) / SIGTERM (one line saying how to resume; the running arm is stopped)."""
    from moe_gspo.run.cli import OnceArgumentParser, add_config_arguments, take_config

    parser = OnceArgumentParser(prog="python -m moe_gspo.ablate", description=__doc__.split("\n\nImplementation:")[0],
                                raise_errors=True)
    add_config_arguments(parser, default=None, what="ablation spec YAML, in the format above", positional_file=True)
    parser.add_argument("--out", default=None, help="output directory (overrides out_dir)")
    parser.add_argument("--dry-run", action="store_true", help="validate every arm and list the commands only")
    try:
        args = parser.parse_intermixed_args(argv)
        take_config(args, default=None, positional_file=True)
        if args.config is None:
            raise ValueError("give the ablation spec: python -m moe_gspo.ablate --config FILE "
                             "(e.g. configs/ablation_tiny.yaml)")
        spec = load_spec(args.config, args.out, args.overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problems = validate_arms(spec)
    if args.dry_run:  # every arm listed, an invalid one with its reason under it
        rows = dry_run(spec)
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2 if problems or any(action == "invalid config" for _, action, _ in rows) else 0
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2
    from moe_gspo.run.rundir import lock_dir

    try:  # one ablation per output directory: a second one started on it stops here (exit code 2)
        out_lock = lock_dir(spec.out_dir, "out_dir")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with out_lock:
        return _run_locked(spec, argv, arm_runner)


def _run_locked(spec: AblationSpec, argv: list[str] | None, arm_runner: ArmRunner | None) -> int:
    results: list[ArmResult] = []
    command = shlex.join(["python", "-m", "moe_gspo.ablate", *(sys.argv[1:] if argv is None else argv)])

    progress: dict[str, list[str]] = {"started": [], "ended": [], "finished_now": []}

    def how_to_resume() -> str:
        arms = expand_arms(spec, warn=False)
        done = [a.name for a in arms if arm_state(a) == "done"]  # the run directories' own record
        now = [n for n in progress["finished_now"] if n in done]
        cut = [n for n in progress["started"] if n not in progress["ended"] and n not in done]
        return (f"{len(done)} of {len(arms)} arms finished ({len(now)} in this run, {len(done) - len(now)} before it)"
                + (f"; interrupted: {', '.join(cut)}" if cut else "")
                + f". Rerun `{command}` to continue: finished arms are skipped, the interrupted ones resume from "
                "their newest checkpoint (or, without one, restart with their partial run moved aside)")

    from moe_gspo.run.errors import run_entry

    code = run_entry(lambda: results.extend(run_ablation(spec, arm_runner, progress_log=progress)),
                     how_to_resume=how_to_resume)
    if code:  # interrupted (Ctrl-C / SIGTERM): the line above says how to resume
        return code
    counts = {s: sum(r.status == s for r in results) for s in ("finished", "skipped", "failed")}
    print(f"arms: {counts['finished']} finished, {counts['skipped']} skipped (already done), "
          f"{counts['failed']} failed")
    for r in results:
        if r.status == "failed":
            print(f"  FAILED {r.arm.name}: {r.message}; log: {r.log_path}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
