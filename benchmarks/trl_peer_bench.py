"""Peer benchmark: TRL's `GRPOTrainer` in GSPO mode vs this project's main job, on the same work.

`python -m benchmarks.trl_peer_bench [--config configs/tiny_cpu.yaml] [--seeds 0 1 2 3 4] [--target 0.8]
[--ours-rev REV] [--nproc 1] [--full] [section.key=value ...]`

Runs when TRL is installed (it is in the `dev` extra, as the tests compare against it; the library never
imports it): without it the script says so and exits 0. Both sides start from the same tiny random Qwen3-MoE
(`moe_gspo.tiny.build_tiny_model`, same init seed and router scale), see the same prompt stream
(`moe_gspo.tasks`, in order) and are scored by the same reward function; for each seed (`train.seed`:
prompts, sampling, TRL's seed), both sides:

1. **TRL** (one process, CPU, fp32; `benchmarks.trl_worker.run_trl`, in a subprocess):
   `GRPOTrainer` with `importance_sampling_level="sequence"` for
   gspo ("token" for grpo) and `loss_type="grpo"` (per-sequence token mean, TRL's documented GSPO
   recipe; `bnpo` for algo.loss_agg_mode=token-mean), `beta=0`, `num_iterations=1`,
   `num_generations` = rollout.samples_per_prompt, `steps_per_generation` = train.num_minibatches,
   `per_device_train_batch_size` = the batch / train.num_minibatches, `gradient_accumulation_steps=1`,
   `max_completion_length` = rollout.max_new_tokens. **Ours, passed through**: the clip range
   (`epsilon`, `epsilon_high`), learning rate and its schedule (`train.lr_*` as transformers'
   warmup-stable-decay, `trl_worker.trl_lr_schedule`), Adam betas, weight decay, gradient clip, temperature,
   top-p, `entropy_coef`, `scale_rewards`. **Set here**: no router auxiliary loss (TRL's default for MoE
   models adds the model config's `router_aux_loss_coef`; the Megatron learner has none;
   `--trl-router-aux-loss` turns it on). **TRL's own defaults**: the advantage std Bessel-corrected +
   1e-4 (ours: `algo.adv_std_correction`, `algo.adv_eps`), the generation batch shuffled into its
   mini-batches (ours: `train.shuffle_minibatches`), gradient checkpointing on, sampling in fp32 with
   `model.generate` (ours: `rollout.dtype`).
2. **moe-gspo**: `torchrun --standalone --nproc-per-node N -m moe_gspo.train --config CONFIG` in a
   subprocess (the main job exactly as a user runs it, checkpoints and traces included; N = `--nproc`,
   default 1: one process on every core (torch's default threads), as TRL's side runs, and the layout of
   every race in docs/results.md; on this model a second data-parallel rank cost more than it saved,
   0.513 against 0.435 s per step in the last comparison there. `--nproc 2` races the README's
   2-process command, each rank on one thread, as torchrun sets it).
3. **moe-gspo at another commit** (`--ours-rev REV`, e.g. the commit before a speed change): the same
   command run from a temporary checkout of REV (`race_common.rev_checkout`: `git worktree add --detach`
   in a temp dir, removed at the end; the subprocess runs there with REV first on PYTHONPATH, so REV's
   `moe_gspo` is imported; a relative `--config` is read from REV's own copy, with a note when it differs).
   The three sides of a seed take turns together, so "before" (REV) and "after" (this checkout) meet the
   same drift of the machine, and the summary adds REV against TRL and this checkout against REV.
   `--only ours --only ours_rev` races before against after without TRL.

Timing: by default the sides of a seed run together, **taking turns of `--steps-per-turn` RL steps**
(default 5, a few seconds) — the side whose turn it is runs while the others are stopped (`SIGSTOP`), and
each is charged only the wall time of its own turns (`benchmarks.interleave`). This machine's speed
drifts by tens of percent within minutes, more than the per-step difference being measured; turns of a
few seconds put both sides under the same drift. Each side's first RL step (start-up) runs alone and is
charged as the side itself timed it.
`--sequential` runs the sides one after the other instead (wall time; also where there are no Linux
`/proc` process trees, and with one `--only` side).

Units: an **RL step** is one generation batch (prompts_per_step x samples_per_prompt completions)
and the optimizer steps it feeds — for TRL `steps_per_generation` of its `global_step`s. Reward per
RL step is the mean reward of its completions (ours: of every completion drawn,
`sampling/reward_mean_drawn`, which with `algo.dynamic_sampling` also counts the groups the filter
dropped). The figure of merit is the time charged to a side from the start of its training loop to the
end of the first RL step at which the moving average of the last `--window` RL steps' rewards reaches
`--target` (a full window is required). s/step is the mean time per RL step up to that point. Each
side stops once it reaches the target or after `--max-steps` RL steps. Under each side's line: its s/RL
step by phase (`phase_split`: the phases it times itself, over the steps without a stop inside). The summary is the median over
seeds of each side's time and the ratio of the medians (the steps needed vary ~2x between seeds, and a
side's trajectory changes with any change of float rounding in its code), each with a 95% percentile-bootstrap
CI over the seeds (`race_stats.bootstrap_median_ci`: 10,000 resamples; a ratio resamples seeds in pairs, both
sides of a seed together): ours/TRL, and with `--ours-rev` also REV/TRL and ours/REV (after / before). A table
at the end lists each seed's seconds (RL steps) per side, the per-seed ratios and the medians with their CIs.
With few seeds the CI is wide and coarse (5 seeds: a median is one of 5 values).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.interleave import Job, JsonLinesTail, alternate, supported, terminate_as_exit
from benchmarks.race_common import (ROOT, Curve, comparison_problem, first_crossing, phase_split,  # noqa: F401
                                    resolve_rev, rev_checkout, subprocess_env, train_cmd, trl_worker_cmd)
from benchmarks.race_stats import (SIDES, bootstrap_median_ci, compare_seeds, seed_ratios, seed_table,  # noqa: F401
                                   summarize, tail_mean, time_or_bound)
from moe_gspo.run.timing import PHASES

DEFAULT_CONFIG = "configs/tiny_cpu.yaml"
STEPS_PER_TURN = 5
"""RL steps of a side per turn when the sides take turns (see the module docstring)."""


# ------------------------------------------------------------------------------------ both sides as jobs
@dataclass(kw_only=True)
class Side:
    """One side of the race: its job (a subprocess reporting RL steps), the curve its records build, its log."""

    job: Job
    curve: Curve
    log: Path
    what: str
    done: Callable[[], bool]
    """Whether the side finished: reached the target (unless run to the end) or ran `max_steps` RL steps."""

    def result(self) -> Curve:
        """The curve with the side's setup time; a RuntimeError with the log's tail when the job ended (or
        hung) before it finished."""
        self.curve.setup_s = self.job.setup_s
        if not self.done():
            tail = self.log.read_text()[-3000:] if self.log.is_file() else ""
            raise RuntimeError(f"{self.what} ended (exit status {self.job.proc.returncode}) after "
                               f"{len(self.curve.rewards)} RL steps, before its target or --max-steps:\n{tail}")
        return self.curve


def _side(name: str, what: str, cmd: list[str], log: Path, records: Path, *, max_steps: int, target: float,
          window: int, stop_at_target: bool, first_step_s, record_to_point, record_to_phases,
          root: Path = ROOT) -> Side:
    """Launch `cmd` (a new session, output to `log`, from the checkout `root` and with it first on
    PYTHONPATH) as a job whose records (JSON lines appended to `records`) become curve points through
    `record_to_point(record) -> (reward, entropy, frac_zero_std)` and `record_to_phases(record) -> {phase:
    seconds}`."""
    curve = Curve(name=name)

    def done() -> bool:
        return len(curve.rewards) >= max_steps or (
            stop_at_target and first_crossing(curve.rewards, target, window) is not None)

    def on_step(record: dict, charged_s: float) -> bool:
        reward, entropy, zero_std = record_to_point(record)
        curve.add(reward, charged_s, entropy=entropy, frac_zero_std=zero_std)
        curve.phases.append(record_to_phases(record))
        return not done()

    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=root, env=subprocess_env(root), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    job = Job(name=name, proc=proc, records=JsonLinesTail(records), first_step_s=first_step_s, on_step=on_step)
    return Side(job=job, curve=curve, log=log, what=what, done=done)


def ours_side(config: str, *, nproc: int, max_steps: int, target: float, window: int, out_dir: Path,
              overrides: list[str], stop_at_target: bool = True, root: Path = ROOT, rev: str | None = None) -> Side:
    """`torchrun -m moe_gspo.train` in a subprocess; its records are the rows of its metrics.jsonl. `root`: the
    checkout whose code it runs (a checkout of commit `rev`, `race_common.rev_checkout`; default this one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = out_dir / "moe_gspo_run"
    cmd = train_cmd(config, nproc=nproc, run_dir=run_dir, steps=max_steps, overrides=overrides)

    def point(row: dict):  # the policy's reward: with algo.dynamic_sampling, reward/mean is the kept groups'
        return (row.get("sampling/reward_mean_drawn", row["reward/mean"]), row.get("actor/entropy", math.nan),
                row.get("reward/frac_zero_std", math.nan))

    at = "" if rev is None else f" @ {rev}"
    return _side(f"moe-gspo{at} ({nproc} processes, torchrun)", f"moe_gspo.train{at}", cmd, out_dir / "moe_gspo_train.log",
                 run_dir / "metrics.jsonl", max_steps=max_steps, target=target, window=window,
                 stop_at_target=stop_at_target, first_step_s=lambda row: row["perf/step_time_s"], record_to_point=point,
                 record_to_phases=lambda row: {p: row[f"perf/{p}_s"] for p in PHASES if f"perf/{p}_s" in row},
                 root=root)


def trl_side(config: str, *, seed: int, max_steps: int, target: float, window: int, out_dir: Path,
             overrides: list[str], stop_at_target: bool = True, router_aux_loss: bool = False) -> Side:
    """TRL's `GRPOTrainer` (`trl_worker.run_trl`) in a subprocess (`benchmarks.trl_worker`), one record per RL
    step."""
    out_dir.mkdir(parents=True, exist_ok=True)
    records = out_dir / "rl_steps.jsonl"
    records.unlink(missing_ok=True)
    cmd = trl_worker_cmd(config, seed=seed, max_steps=max_steps, out_dir=out_dir, records=records,
                         overrides=overrides, router_aux_loss=router_aux_loss)
    return _side("TRL GRPOTrainer (GSPO)", "TRL's GRPOTrainer", cmd, out_dir / "trl.log", records,
                 max_steps=max_steps, target=target, window=window, stop_at_target=stop_at_target,
                 first_step_s=lambda rec: rec["t_s"],
                 record_to_point=lambda rec: (rec["reward"], rec["entropy"], rec["frac_zero_std"]),
                 record_to_phases=lambda rec: rec["phases"])


def race(builders: list[Callable[[], Side]], *, interleave: bool, steps_per_turn: int = 1) -> list[Curve]:
    """Launch and run the sides: together, `steps_per_turn` RL steps each in turn (`interleave`), or each
    alone, one after the other (a side is launched only when its turn comes); their curves, in order."""
    if interleave:
        sides = []
        try:
            for build in builders:
                sides.append(build())
        except BaseException:  # a side that could not start: end those already launched
            for s in sides:
                s.job.kill()
            raise
        alternate([s.job for s in sides], steps_per_turn=steps_per_turn)
        return [s.result() for s in sides]
    curves = []
    for build in builders:
        side = build()
        alternate([side.job])
        curves.append(side.result())
    return curves


# ------------------------------------------------------------------------------------------- main
def _fmt(s: dict, target: float, window: int) -> str:
    if s["reached"]:
        head = f"{s['time_s']:7.1f} s to a {window}-step moving-average reward of {target} (RL step {s['step']})"
    else:
        head = f"   not reached in {s['steps_run']} RL steps ({s['time_run_s']:.1f} s)"
    return (f"{s['name']:<48} {head}; {s['s_per_step']:.3f} s/RL step; setup {s['setup_s']:.1f} s; last 40 of "
            f"{s['steps_run']} RL steps: reward {s['reward_last40']:.3f}, entropy {s['entropy_last40']:.3f}, "
            f"zero-std groups {s['frac_zero_std_last40']:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"run config of both sides (default {DEFAULT_CONFIG})")
    p.add_argument("--target", type=float, default=0.8, help="moving-average reward to reach (default 0.8)")
    p.add_argument("--window", type=int, default=50, help="moving-average window in RL steps (default 50)")
    p.add_argument("--max-steps", type=int, default=600, help="give up after this many RL steps (default 600)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                   help="train.seed of each pair of runs (default 0 1 2 3 4; the time to target varies ~2x between seeds)")
    p.add_argument("--nproc", type=int, default=1,
                   help="processes of our torchrun job (default 1: at this model size a second rank costs more than "
                        "it saves)")
    p.add_argument("--only", action="append", choices=list(SIDES), default=None,
                   help="run only this side (repeatable: --only ours --only ours_rev races before and after "
                        "without TRL)")
    p.add_argument("--ours-rev", metavar="REV", default=None,
                   help="also race the main job from commit REV (a temporary git worktree; e.g. the commit before a "
                        "speed change): three sides per seed in the same turns, before (REV), after (this checkout) "
                        "and TRL, so the box's drift meets all three; prints each against TRL and after/before")
    p.add_argument("--steps-per-turn", type=int, default=STEPS_PER_TURN,
                   help=f"RL steps of a side per turn (default {STEPS_PER_TURN}; see benchmarks.interleave)")
    p.add_argument("--sequential", action="store_true",
                   help="run the two sides of a seed one after the other instead of in turns of --steps-per-turn RL "
                        "steps (the default, which charges each side only the time it ran: see "
                        "benchmarks.interleave)")
    p.add_argument("--full", action="store_true",
                   help="run every side for --max-steps RL steps instead of stopping at the target (to compare how "
                        "well each learns: the last-40-step mean reward, entropy and zero-variance share)")
    p.add_argument("--trl-router-aux-loss", action="store_true",
                   help="let TRL add the model's router load-balancing loss (its default for MoE models, coefficient "
                        "router_aux_loss_coef of the model config); by default it is off, as the Megatron learner has none")
    p.add_argument("--out", default=None, help="keep logs and run directories here (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides for both sides")
    args = p.parse_args(argv)

    if importlib.util.find_spec("trl") is None:
        print("trl_peer_bench: TRL is not installed, nothing to compare against; "
              "install it with  pip install -e '.[dev]'  (the test extra; the library never imports TRL). Skipped.")
        return 0
    trl_version = importlib.metadata.version("trl")

    from moe_gspo.config_load import load_config
    from moe_gspo.run.setup import quiet_known_warnings

    quiet_known_warnings()
    config = str(Path(args.config) if Path(args.config).is_absolute() else ROOT / args.config)
    if any(o.startswith("train.seed=") for o in args.overrides):
        p.error("set the seeds with --seeds, not train.seed=")
    if any(o.startswith("train.steps=") for o in args.overrides):
        p.error("set the run length with --max-steps, not train.steps=")
    if args.max_steps < 1:
        p.error(f"--max-steps {args.max_steps} must be >= 1")
    if args.steps_per_turn < 1:
        p.error(f"--steps-per-turn {args.steps_per_turn} must be >= 1")
    if args.only and "ours_rev" in args.only and not args.ours_rev:
        p.error("--only ours_rev: give the commit with --ours-rev REV")
    sides = [s for s in SIDES if (s != "ours_rev" or args.ours_rev) and (not args.only or s in args.only)]
    rev_sha = None
    if args.ours_rev is not None:
        rev_sha = resolve_rev(args.ours_rev)
        if rev_sha is None:
            p.error(f"--ours-rev {args.ours_rev}: not a commit of {ROOT} (give a hash, tag or branch of this "
                    "repository)")
        if not Path(args.config).is_absolute() and subprocess.run(
                ["git", "-C", str(ROOT), "cat-file", "-e", f"{rev_sha}:./{args.config}"], capture_output=True).returncode:
            p.error(f"--config {args.config}: not in commit {args.ours_rev}, whose side reads its own copy; give an "
                    "absolute path to run that commit on this file")
    try:  # train.steps as our side runs it (the learning-rate schedule is checked against it)
        cfgs = {seed: load_config(config, [*args.overrides, f"train.seed={seed}", f"train.steps={args.max_steps}"])
                for seed in args.seeds}
    except ValueError as e:
        p.error(str(e))
    cfg = cfgs[args.seeds[0]]
    problem = comparison_problem(cfg)
    if problem:
        p.error(problem)
    tmp = None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="trl_peer_bench_")
        out = Path(tmp.name)
    print(f"work: {cfg.task.name} ({cfg.task.num_symbols} symbols), {cfg.rollout.prompts_per_step} prompts x "
          f"{cfg.rollout.samples_per_prompt} samples, {cfg.rollout.max_new_tokens} new tokens, lr {cfg.train.lr}, "
          f"{cfg.algo.name} clip {cfg.algo.clip_range()}, {cfg.train.num_minibatches} optimizer steps per RL step; "
          f"TRL {trl_version}; seeds {args.seeds}", flush=True)
    a, t = cfg.algo, cfg.train
    # the configs carry train.steps = --max-steps, the horizon both sides run
    lr_sched = (f"{t.lr_decay} decay over the last {t.resolved_lr_decay_steps()} of {t.steps} RL steps"
                if t.lr_decay != "none" else "constant")
    print(f"TRL settings: ours passed through (lr {t.lr}, {lr_sched}"
          f"{f', warm-up {t.lr_warmup_steps} RL steps' if t.lr_warmup_steps else ''}, Adam betas ({t.adam_beta1}, "
          f"{t.adam_beta2}), weight decay {t.weight_decay}, grad clip {t.grad_clip}, clip {a.clip_range()}, entropy_coef "
          f"{a.entropy_coef}, scale_rewards {a.scale_rewards}); set here: router aux loss "
          f"{'on' if args.trl_router_aux_loss else 'off'}; TRL's own: advantage std Bessel + 1e-4 (ours: correction "
          f"{a.adv_std_correction}, eps {a.adv_eps}), shuffled mini-batches (ours: {t.shuffle_minibatches}), "
          f"gradient checkpointing, fp32 sampling (ours: {cfg.rollout.dtype})", flush=True)
    interleave = not args.sequential and len(sides) > 1
    if interleave and not supported():
        print("note: this machine has no /proc process trees (Linux); the sides run one after the other", flush=True)
        interleave = False
    per_turn = f"{args.steps_per_turn} RL step{'s' if args.steps_per_turn > 1 else ''}"
    print("timing: " + (f"the {len(sides)} sides in turn, {per_turn} each, the others stopped (SIGSTOP); each "
                        "charged the wall time it ran" if interleave else "one side after the other, wall time"),
          flush=True)
    with terminate_as_exit(), contextlib.ExitStack() as stack:
        if tmp is not None:
            stack.callback(tmp.cleanup)
        rev_root = rev_config = None
        if "ours_rev" in sides:
            parent = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trl_peer_bench_rev_")))
            rev_root = stack.enter_context(rev_checkout(rev_sha, parent))
            rev_config = str(Path(args.config) if Path(args.config).is_absolute() else rev_root / args.config)
            if Path(rev_config).read_bytes() != Path(config).read_bytes():
                print(f"note: {args.config} differs between {args.ours_rev} and this checkout; each side of ours "
                      "runs its own", flush=True)
            print(f"ours @ {rev_sha[:9]}: the main job from a checkout of {args.ours_rev} ({rev_sha}) in {rev_root}",
                  flush=True)
        per_seed = run_seeds(args, sides, config=config, out=out, interleave=interleave, rev_root=rev_root,
                             rev_config=rev_config, rev_sha=rev_sha)
    summary = compare_seeds(per_seed)
    labels = side_labels(rev_sha)
    for side in SIDES:
        if side in summary:
            x = summary[side]
            bound = ("" if x["all_reached"] else " (a seed missed; the median does not depend on it)"
                     if x["median_exact"] else " (a seed missed: a lower bound)")
            lo, hi = x["median_time_ci_s"]
            print(f"median over seeds, {labels[side]}: {x['median_time_s']:.1f} s to target{bound} "
                  f"(95% bootstrap CI {lo:.1f}-{hi:.1f} s), "
                  f"{x['median_steps']:.0f} RL steps, {x['median_s_per_step']:.3f} s/RL step")
    for name, x in summary["ratios"].items():
        lo, hi = x["ci"]
        num, den = name.split("/")
        what = "ours/peer" if name == "ours/trl" else f"{labels[num]} / {labels[den]}"
        print(f"ratio {what} of the median times to target: {x['median_ratio']:.2f}x "
              f"(95% bootstrap CI {lo:.2f}-{hi:.2f}x over {x['num_seeds']} seeds, resampled in pairs)"
              + ("" if x["exact"] else " (a median is a bound: raise --max-steps)"))
    print("\nseconds to target (RL steps; * missed: its run time, a lower bound); medians [95% CI]"
          + (f"; ours_rev = {labels['ours_rev']}" if "ours_rev" in summary else "") + ":")
    print("\n".join("  " + line for line in seed_table(per_seed, summary, labels)))
    if args.json:
        Path(args.json).write_text(json.dumps({"per_seed": per_seed, "summary": summary, "labels": labels,
                                               "ours_rev": {"rev": args.ours_rev, "sha": rev_sha}}, indent=1))
    return 0


def side_labels(rev_sha: str | None) -> dict[str, str]:
    """How the summary names each side."""
    return {"trl": "TRL", "ours": "ours" if rev_sha is None else "ours (this checkout)",
            "ours_rev": f"ours @ {rev_sha[:9]}" if rev_sha else "ours @ REV"}


def run_seeds(args, sides: list[str], *, config: str, out: Path, interleave: bool, rev_root: Path | None,
              rev_config: str | None, rev_sha: str | None) -> list[dict]:
    """Race `sides` at every seed of `args.seeds` (printing each side's line); one result per seed."""
    per_seed = []
    for seed in args.seeds:
        res, seed_out, rev_label = {"seed": seed}, out / f"seed{seed}", rev_sha[:9] if rev_sha else None
        seed_out.mkdir(parents=True, exist_ok=True)
        ours = dict(nproc=args.nproc, max_steps=args.max_steps, target=args.target, window=args.window,
                    overrides=[*args.overrides, f"train.seed={seed}"], stop_at_target=not args.full)
        build = {
            "trl": lambda: trl_side(config, seed=seed, max_steps=args.max_steps, target=args.target,
                                    window=args.window, out_dir=seed_out / "trl", overrides=args.overrides,
                                    stop_at_target=not args.full, router_aux_loss=args.trl_router_aux_loss),
            "ours_rev": lambda: ours_side(rev_config, out_dir=seed_out / "ours_rev", root=rev_root, rev=rev_label,
                                          **ours),
            "ours": lambda: ours_side(config, out_dir=seed_out, **ours)}
        how = (f"{args.steps_per_turn} RL step{'s' if args.steps_per_turn > 1 else ''} each in turn"
               if interleave else "one after the other")
        names = {"trl": "TRL", "ours_rev": f"moe-gspo @ {rev_label}", "ours": "moe-gspo"}
        print(f"seed {seed}: running {' and '.join(names[s] for s in sides)} ({how}) ...", flush=True)
        curves = race([build[s] for s in sides], interleave=interleave, steps_per_turn=args.steps_per_turn)
        for name, curve in zip(sides, curves):
            res[name] = summarize(curve, args.target, args.window)
            res[f"{name}_curve"] = dataclasses.asdict(curve)
            res[f"{name}_split"] = phase_split(curve, steps_per_turn=args.steps_per_turn if interleave else None)
            print("  " + _fmt(res[name], args.target, args.window), flush=True)
            if res[f"{name}_split"]:
                print("    s/RL step by phase (steps run without a stop inside): " + ", ".join(
                    f"{k} {v:.3f}" for k, v in res[f"{name}_split"].items() if abs(v) >= 5e-4), flush=True)
        res["ratios"] = seed_ratios(res)
        if "ours/trl" in res["ratios"]:
            res["ratio_time"] = res["ratios"]["ours/trl"]
        for pair, ratio in res["ratios"].items():
            num, den = pair.split("/")
            exact = res[num]["reached"] and res[den]["reached"]
            what = "ours/peer" if pair == "ours/trl" else " / ".join(side_labels(rev_sha)[x] for x in (num, den))
            print(f"  seed {seed} ratio {what}, time to target: {ratio:.2f}x"
                  + ("" if exact else " (a side missed the target: its run time stands in)"), flush=True)
        per_seed.append(res)
    return per_seed


if __name__ == "__main__":
    sys.exit(main())
