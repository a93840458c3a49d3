"""Peer benchmark: TRL's `GRPOTrainer` in GSPO mode vs this project's main job, on the same work.

`python -m benchmarks.trl_peer_bench [--config configs/tiny_cpu.yaml] [--seeds 0 1 2 3 4] [--target 0.8]
[--full] [section.key=value ...]`

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
   default 1: on this model a second data-parallel rank costs more than it saves).

Timing: by default the two sides of a seed run together, **taking turns of `--steps-per-turn` RL steps**
(default 5, a few seconds) — the side whose turn it is runs while the other is stopped (`SIGSTOP`), and
each is charged only the wall time of its own turns (`benchmarks.interleave`). This machine's speed
drifts by tens of percent within minutes, more than the per-step difference being measured; turns of a
few seconds put both sides under the same drift. Each side's first RL step (start-up) runs alone and is
charged as the side itself timed it.
`--sequential` runs the sides one after the other instead (wall time; also where there are no Linux
`/proc` process trees, and with `--only`).

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
CI over the seeds (`bootstrap_median_ci`: 10,000 resamples; the ratio resamples seeds in pairs, both sides
of a seed together). With few seeds the CI is wide and coarse (5 seeds: a median is one of 5 values).
"""

from __future__ import annotations

import argparse
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

from benchmarks.interleave import Job, JsonLinesTail, alternate, supported
from benchmarks.race_common import (ROOT, Curve, comparison_problem, first_crossing, phase_split, subprocess_env,
                                    train_cmd, trl_worker_cmd)
from moe_gspo.run.timing import PHASES

DEFAULT_CONFIG = "configs/tiny_cpu.yaml"
STEPS_PER_TURN = 5
"""RL steps of a side per turn when the sides take turns (see the module docstring)."""


def tail_mean(values: list[float], n: int) -> float:
    """Mean of the last `n` values (NaN when there are none)."""
    tail = values[-n:] if n > 0 else []
    return sum(tail) / len(tail) if tail else float("nan")


def summarize(curve: Curve, target: float, window: int, *, last: int = 40) -> dict:
    hit = first_crossing(curve.rewards, target, window)
    n = len(curve.rewards) if hit is None else hit + 1
    t = curve.times_s[n - 1] if n else float("nan")
    return {"name": curve.name, "reached": hit is not None, "step": hit, "time_s": t if hit is not None else None,
            "steps_run": len(curve.rewards), "time_run_s": curve.times_s[-1] if curve.times_s else float("nan"),
            "s_per_step": t / n if n else float("nan"), "setup_s": curve.setup_s, "note": curve.note,
            f"reward_last{last}": tail_mean(curve.rewards, last), f"entropy_last{last}": tail_mean(curve.entropy, last),
            f"frac_zero_std_last{last}": tail_mean(curve.frac_zero_std, last)}


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
          window: int, stop_at_target: bool, first_step_s, record_to_point, record_to_phases) -> Side:
    """Launch `cmd` (a new session, output to `log`) as a job whose records (JSON lines appended to
    `records`) become curve points through `record_to_point(record) -> (reward, entropy, frac_zero_std)`
    and `record_to_phases(record) -> {phase: seconds}`."""
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
        proc = subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    job = Job(name=name, proc=proc, records=JsonLinesTail(records), first_step_s=first_step_s, on_step=on_step)
    return Side(job=job, curve=curve, log=log, what=what, done=done)


def ours_side(config: str, *, nproc: int, max_steps: int, target: float, window: int, out_dir: Path,
              overrides: list[str], stop_at_target: bool = True) -> Side:
    """`torchrun -m moe_gspo.train` in a subprocess; its records are the rows of its metrics.jsonl."""
    run_dir = out_dir / "moe_gspo_run"
    cmd = train_cmd(config, nproc=nproc, run_dir=run_dir, steps=max_steps, overrides=overrides)

    def point(row: dict):  # the policy's reward: with algo.dynamic_sampling, reward/mean is the kept groups'
        return (row.get("sampling/reward_mean_drawn", row["reward/mean"]), row.get("actor/entropy", math.nan),
                row.get("reward/frac_zero_std", math.nan))

    return _side(f"moe-gspo ({nproc} processes, torchrun)", "moe_gspo.train", cmd, out_dir / "moe_gspo_train.log",
                 run_dir / "metrics.jsonl", max_steps=max_steps, target=target, window=window,
                 stop_at_target=stop_at_target, first_step_s=lambda row: row["perf/step_time_s"], record_to_point=point,
                 record_to_phases=lambda row: {p: row[f"perf/{p}_s"] for p in PHASES if f"perf/{p}_s" in row})


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
        sides = [build() for build in builders]
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
    return (f"{s['name']:<36} {head}; {s['s_per_step']:.3f} s/RL step; setup {s['setup_s']:.1f} s; last 40 of "
            f"{s['steps_run']} RL steps: reward {s['reward_last40']:.3f}, entropy {s['entropy_last40']:.3f}, "
            f"zero-std groups {s['frac_zero_std_last40']:.2f}")


def _time_or_bound(s: dict) -> float:
    """Time to target; a side that did not reach it counts with the time it ran (a lower bound)."""
    return s["time_s"] if s["reached"] else s["time_run_s"]


def compare_seeds(per_seed: list[dict]) -> dict:
    """Median over seeds of each side's time to target and the ratio ours / peer of those medians.
    A miss counts as its run time, a lower bound of its time; the median is then `median_exact` when
    it does not depend on the misses (the same with them at +inf), else a lower bound."""
    import statistics

    out = {}
    for side in ("trl", "ours"):
        rows = [r[side] for r in per_seed if side in r]
        if rows:
            median = statistics.median(_time_or_bound(x) for x in rows)
            out[side] = {"median_time_s": median,
                         "median_exact": statistics.median(x["time_s"] if x["reached"] else math.inf
                                                           for x in rows) == median,
                         "all_reached": all(x["reached"] for x in rows),
                         "median_steps": statistics.median((x["step"] + 1) if x["reached"] else x["steps_run"]
                                                           for x in rows),
                         "median_s_per_step": statistics.median(x["s_per_step"] for x in rows)}
    if "trl" in out and "ours" in out:
        out["ratio_median_time"] = out["ours"]["median_time_s"] / out["trl"]["median_time_s"]
        out["ratio_exact"] = out["ours"]["median_exact"] and out["trl"]["median_exact"]
    ci = bootstrap_median_ci(per_seed)
    for side in ("trl", "ours"):
        if side in out:
            out[side]["median_time_ci_s"] = ci[side]
    if "ratio_median_time" in out:
        out["ratio_median_time_ci"] = ci["ratio"]
        out["ci_seeds"] = ci["num_seeds"]
    return out


def bootstrap_median_ci(per_seed: list[dict], *, reps: int = 10_000, seed: int = 0,
                        confidence: float = 0.95) -> dict:
    """Percentile-bootstrap CIs over seeds of each side's median time to target (`trl`, `ours`: [lo, hi]
    seconds) and of the ratio ours / peer of the medians (`ratio`), from `reps` resamples of the seeds with
    replacement drawn from `np.random.default_rng(seed)`. The ratio resamples the seeds that ran both sides,
    the same seeds for both (the pairing by seed is kept), over `num_seeds` of them; a miss counts as its run
    time, as in `compare_seeds`. NaN ends with fewer than 2 seeds (a CI from one seed says nothing)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    q = [50 * (1 - confidence), 50 * (1 + confidence)]

    def ci(stat_R) -> list[float]:
        return [float(v) for v in np.percentile(stat_R, q)]

    out: dict = {"trl": [math.nan, math.nan], "ours": [math.nan, math.nan], "ratio": [math.nan, math.nan]}
    for side in ("trl", "ours"):
        t = np.array([_time_or_bound(r[side]) for r in per_seed if side in r], np.float64)
        if t.size >= 2:
            out[side] = ci(np.median(t[rng.integers(0, t.size, (reps, t.size))], axis=1))
    both = [r for r in per_seed if "trl" in r and "ours" in r]
    out["num_seeds"] = len(both)
    if len(both) >= 2:
        ours = np.array([_time_or_bound(r["ours"]) for r in both], np.float64)
        trl = np.array([_time_or_bound(r["trl"]) for r in both], np.float64)
        idx_RN = rng.integers(0, len(both), (reps, len(both)))
        out["ratio"] = ci(np.median(ours[idx_RN], axis=1) / np.median(trl[idx_RN], axis=1))
    return out


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
    p.add_argument("--only", choices=["trl", "ours"], help="run one side only")
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
    interleave = not args.sequential and args.only is None
    if interleave and not supported():
        print("note: this machine has no /proc process trees (Linux); the sides run one after the other", flush=True)
        interleave = False
    if args.steps_per_turn < 1:
        p.error(f"--steps-per-turn {args.steps_per_turn} must be >= 1")
    print("timing: " + (f"both sides in turn, {args.steps_per_turn} RL steps each, the other stopped (SIGSTOP); each "
                        "charged the wall time it ran" if interleave else "one side after the other, wall time"),
          flush=True)
    per_seed = []
    try:
        for seed in args.seeds:
            res, seed_out = {"seed": seed}, out / f"seed{seed}"
            seed_out.mkdir(parents=True, exist_ok=True)
            builders, names = [], []
            if args.only in (None, "trl"):
                names.append("trl")
                builders.append(lambda seed=seed, seed_out=seed_out: trl_side(
                    config, seed=seed, max_steps=args.max_steps, target=args.target, window=args.window,
                    out_dir=seed_out / "trl", overrides=args.overrides, stop_at_target=not args.full,
                    router_aux_loss=args.trl_router_aux_loss))
            if args.only in (None, "ours"):
                names.append("ours")
                builders.append(lambda seed=seed, seed_out=seed_out: ours_side(
                    config, nproc=args.nproc, max_steps=args.max_steps, target=args.target, window=args.window,
                    out_dir=seed_out, overrides=[*args.overrides, f"train.seed={seed}"],
                    stop_at_target=not args.full))
            how = (f"{args.steps_per_turn} RL step{'s' if args.steps_per_turn > 1 else ''} each in turn"
                   if interleave and len(builders) > 1 else "one after the other")
            print(f"seed {seed}: running {' and '.join('TRL' if n == 'trl' else 'moe-gspo' for n in names)} "
                  f"({how}) ...", flush=True)
            for name, curve in zip(names, race(builders, interleave=interleave, steps_per_turn=args.steps_per_turn)):
                res[name] = summarize(curve, args.target, args.window)
                res[f"{name}_curve"] = dataclasses.asdict(curve)
                res[f"{name}_split"] = phase_split(curve, steps_per_turn=args.steps_per_turn
                                                   if interleave and len(builders) > 1 else None)
                print("  " + _fmt(res[name], args.target, args.window), flush=True)
                if res[f"{name}_split"]:
                    print("    s/RL step by phase (steps run without a stop inside): " + ", ".join(
                        f"{k} {v:.3f}" for k, v in res[f"{name}_split"].items() if abs(v) >= 5e-4), flush=True)
            if "trl" in res and "ours" in res:
                res["ratio_time"] = _time_or_bound(res["ours"]) / _time_or_bound(res["trl"])
                exact = res["ours"]["reached"] and res["trl"]["reached"]
                print(f"  seed {seed} ratio ours/peer, time to target: {res['ratio_time']:.2f}x"
                      + ("" if exact else " (a side missed the target: its run time stands in)"), flush=True)
            per_seed.append(res)
    finally:
        if tmp is not None:
            tmp.cleanup()
    summary = compare_seeds(per_seed)
    for side in ("trl", "ours"):
        if side in summary:
            x = summary[side]
            bound = ("" if x["all_reached"] else " (a seed missed; the median does not depend on it)"
                     if x["median_exact"] else " (a seed missed: a lower bound)")
            lo, hi = x["median_time_ci_s"]
            print(f"median over seeds, {side:<4}: {x['median_time_s']:.1f} s to target{bound} "
                  f"(95% bootstrap CI {lo:.1f}-{hi:.1f} s), "
                  f"{x['median_steps']:.0f} RL steps, {x['median_s_per_step']:.3f} s/RL step")
    if "ratio_median_time" in summary:
        lo, hi = summary["ratio_median_time_ci"]
        print(f"ratio ours/peer of the median times to target: {summary['ratio_median_time']:.2f}x "
              f"(95% bootstrap CI {lo:.2f}-{hi:.2f}x over {summary['ci_seeds']} seeds, resampled in pairs)"
              + ("" if summary["ratio_exact"] else " (a median is a bound: raise --max-steps)"))
    if args.json:
        Path(args.json).write_text(json.dumps({"per_seed": per_seed, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
