"""Ablation runner: train every run of an algorithm × routing-replay [× variant] × seed matrix, then compare.

    python -m moe_gspo.ablate --config configs/ablation_tiny.yaml [--out DIR] [--dry-run] [--status]
        [--executor local|slurm] [--on-interrupt leave|cancel] [--seeds S[,S...]] [--only ARM[,ARM...]]
        [section.key=value ...]

(The spec may also be the first positional argument, as in earlier versions.) An arm is one algorithm ×
replay [× variant]; a run is an arm at one seed (ablation_tiny: 6 arms × 2 seeds = 12 runs).

The ablation YAML:

    base_config: configs/tiny_cpu.yaml   # required; training config every arm starts from
    algos: [gspo, gspo_token, grpo]      # required; values of the train CLI's --algo
    routing_replay: [none, r2, r3]       # required; values of --routing-replay
    seeds: [0, 1]                        # required; each arm runs once per seed (train.seed=...)
    seed_keys: [train.seed]              # optional; the config keys each seed sets (default train.seed;
                                         # [train.seed, model.init_seed]: every seed a new initial model too)
    overrides: {train.steps: 40}         # optional; dotted config overrides given to every arm
    nproc: 2                             # optional (default 1, see below); processes per arm (torchrun; per node)
    out_dir: runs/ablation_tiny          # optional (default runs/ablation); --out overrides it
    variants:                            # optional; named override sets, one more matrix axis
      none: {}
      tis: {algo.rollout_is: token}
    algo_overrides:                      # optional; per-algorithm overrides (e.g. each method's tuned
      gspo: {train.lr: 2.0e-3}           # lr), after `overrides`, before the variant's
    exclude:                             # optional; drop arms matching all given fields
      - {algo: gspo_token, routing_replay: r2}
    extra_args: []                       # optional; extra train CLI flags, placed before overrides
    arm_timeout_s: null                  # optional; kill a run (its process group) after this long
    parallel_arms: 2                     # optional (default: see below); executor local: runs at a time (each gets
                                         # OMP_NUM_THREADS = cores // (parallel_arms * nproc), at least 1)
    reward_threshold: 0.8                # optional; the comparison report's "steps to threshold" level
    executor: local                      # optional; local (subprocesses here) or slurm (one SLURM job per run,
                                         # through submitit; docs/cluster.md); --executor overrides it
    slurm: {partition: gpu, time: "04:00:00", gpus_per_node: 8}
                                         # executor slurm: sbatch parameters of every job (time required; keys:
                                         # moe_gspo/run/slurm_spec.py)

Dotted overrides on the command line (anywhere among the flags) are added to `overrides`.
The defaults of `nproc` and `parallel_arms` are `DEFAULT_NPROC` and `default_parallel_arms(nproc)` of
moe_gspo/run/ablation_spec.py (one rank per core, as many runs as the memory available holds), to follow the
fastest layout `python -m benchmarks.matrix_throughput` measures (2 one-rank runs at a time on 2 cores).
`--seeds` and `--only` shrink the matrix without editing the spec: only those seeds (of `seeds`) and arms
(`<algo>-<replay>[-<variant>]`, as the run directories name them); the runs keep the full matrix's directories.
A variant that sets the routing-drift dial is named by the dose-naming rule (`moe_gspo/run/dose_names.py`):
`p0` (zero drift), `p<N>` (rollout.router_flip_prob = N/100), `s<X>` (rollout.router_noise_std = X), with an
optional `_<fix>` suffix (`p10_tis`); a variant named against it is refused.
The spec and base_config may name shipped files from any directory (`ablation_tiny`, `configs/tiny_cpu.yaml`);
other relative paths, out_dir among them, are resolved against the current directory.
Before any arm runs (and in `--dry-run`), every arm's full train command line is validated like the
train CLI does it (config file, overrides, flags): an invalid arm stops the matrix with exit code 2
and one line per bad arm; the output directory is checked too.
Each run runs, in a subprocess, with stdout and stderr going to `{run_dir}/train.log`:

    python -m moe_gspo.launch --standalone --nproc-per-node {nproc} -m moe_gspo.train \
        --config {base_config} --algo {algo} --routing-replay {replay} \
        --run-dir {out_dir}/{algo}-{replay}[-{variant}]-s{seed} [--resume] {extra_args} train.seed={seed} \
        {overrides} {variant overrides}

With `variants`, every algo x replay arm runs once per variant (its overrides come last, so they win);
arm names gain `-{variant}` and `exclude` rules may name a `variant`. `--dry-run` also builds every
arm's config (base file + flags + overrides) and reports the ones that do not validate.
Every run is grouped in W&B: group = the ablation's name (out_dir's), job type = the arm, tags algo /
replay / variant / seed (W&B's WANDB_RUN_GROUP / WANDB_JOB_TYPE / WANDB_TAGS in the run's environment).

Resuming a matrix: a run whose `done.json` exists is skipped (a damaged one, not a JSON object, fails the
run without running it: move it aside); an unfinished run with a checkpoint
(`checkpoints/step_*`) is rerun with `--resume`; an unfinished run without one is started afresh
after its old directory is moved aside to `<run_dir>.prev<k>` (nothing is deleted). A failing run is
reported with its log path and the others still run; the exit code is 1 when any run failed.
At the end `analysis.compare.build_comparison` writes `{out_dir}/comparison/report.html`.

executor: slurm (moe_gspo/run/slurm_executor.py, docs/cluster.md): every run is one job of one SLURM array,
running the same command line (on several nodes with the rendezvous from the job); job ids go to
`{out_dir}/slurm/jobs.json`; a rerun waits for jobs still queued or running and submits the rest; `--status`
shows each run's state; Ctrl-C leaves the jobs running unless `--on-interrupt cancel`.

Implementation: the arm runner is a parameter of `run_ablation` so tests can replace the subprocess.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from moe_gspo.run.ablation_arms import (  # noqa: F401  (re-exported: the ablation's API, used by tests)
    Arm, ArmResult, ArmRunner, arm_overrides, arm_state, build_command, count_runs, expand_arms, format_override,
    run_arm, seed_order, select_runs, wandb_env,
)
from moe_gspo.run.ablation_spec import AblationSpec, load_spec, parse_spec, usable_cores  # noqa: F401
from moe_gspo.run.arm_runner import SubprocessArmRunner, run_concurrently


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


# --------------------------------------------------------------------------- matrix

def local_threads_env(parallel_arms: int, nproc: int, cores: int | None = None) -> dict[str, str] | None:
    """The environment `executor: local` adds to every arm: with arms in parallel, OMP_NUM_THREADS =
    cores // (parallel_arms * nproc), at least 1 (`cores`: this process's, `usable_cores`, by default); None for
    one arm at a time (the arm inherits this process's OMP_NUM_THREADS; unset: torch's default, its cores, for one rank,
    and torchrun's 1 for several). `benchmarks.matrix_throughput` measures these layouts (P:R) against
    explicit thread counts (P:R:T); the defaults of `parallel_arms` and `nproc` follow its fastest
    (`default_parallel_arms`, `DEFAULT_NPROC` of `moe_gspo.run.ablation_spec`)."""
    if parallel_arms <= 1:
        return None
    return {"OMP_NUM_THREADS": str(max(1, (cores or usable_cores()) // (parallel_arms * nproc)))}


def run_ablation(spec: AblationSpec, arm_runner: ArmRunner | None = None, progress: bool = True,
                 compare: bool = True, progress_log: dict[str, Any] | None = None, *,
                 on_interrupt: str = "leave", poll_s: float = 10.0) -> list[ArmResult]:
    """Run every run of the matrix, then (if `compare`) write `{out_dir}/comparison/`. `executor: local`:
    `spec.parallel_arms` at a time through `arm_runner` (default: torchrun subprocesses); `executor: slurm`:
    one SLURM job each (`moe_gspo.run.slurm_executor`; `on_interrupt`, `poll_s`). Runs start seed by seed
    (every arm's first seed, then every arm's second, ...), so a matrix stopped midway has whole seeds of
    every arm; results come in `expand_arms` order."""
    if arm_runner is None and spec.executor == "local":
        arm_runner = SubprocessArmRunner(spec.arm_timeout_s, arm_env=lambda arm: wandb_env(spec, arm),
                                         env=local_threads_env(spec.parallel_arms, spec.nproc))
    arms = expand_arms(spec)
    bar = tqdm(total=len(arms), desc="ablation", unit="run", file=sys.stderr, disable=not progress)
    log = progress_log if progress_log is not None else {}

    def ended(res: ArmResult) -> None:
        bar.set_postfix_str(res.arm.name)
        bar.update()
        if res.status == "failed" and not getattr(arm_runner, "stopping", False):  # not when Ctrl-C ended it
            tqdm.write(f"[ablate] {res.arm.name} FAILED ({res.message}); log: {res.log_path}", file=sys.stderr)

    try:
        if spec.executor == "slurm":
            from moe_gspo.run.slurm_executor import run_on_slurm

            results = run_on_slurm(spec, arms, on_result=ended, log=log, on_interrupt=on_interrupt, poll_s=poll_s)
        else:
            results = _run_local(spec, arms, arm_runner, log, ended)
    finally:
        bar.close()
    if compare:
        write_comparison(spec, arms)
    return results


def _run_local(spec: AblationSpec, arms: list[Arm], arm_runner: ArmRunner, log: dict[str, Any],
               ended: Callable[[ArmResult], None]) -> list[ArmResult]:
    def one(arm: Arm) -> ArmResult:  # `log`: arm names "started", "ended", "finished_now" (for an interruption)
        log.setdefault("started", []).append(arm.name)
        res = run_arm(spec, arm, arm_runner)
        log.setdefault("ended", []).append(arm.name)
        if res.status == "finished":
            log.setdefault("finished_now", []).append(arm.name)
        ended(res)
        return res

    order = seed_order(spec, arms)
    ran = run_concurrently(one, [arms[i] for i in order], spec.parallel_arms, stop=getattr(arm_runner, "stop_all", None))
    return [res for _, res in sorted(zip(order, ran))]


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
    actions = {"done": "skip (done)", "damaged": "skip (damaged done.json)", "resume": "resume", "fresh": "run"}
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
        elif state == "damaged":  # not done, not run: the user moves it aside
            from moe_gspo.run.ablation_arms import done_problem

            print(f"    note: {done_problem(arm.run_dir)}; a run fails it without running: move it aside to run it")
    print(f"{count_runs([r[0] for r in rows])}, {sum(r[1] in ('run', 'resume') for r in rows)} to run"
          + (f", {sum(r[1] == 'invalid config' for r in rows)} with an invalid config" if check else
             " (configs not checked: base_config missing)"))
    if spec.executor == "slurm":  # the sbatch script of each job (the same for all: one job array)
        from moe_gspo.run.slurm_executor import sbatch_preview

        n = sum(r[1] in ("run", "resume") for r in rows)
        print(f"executor: slurm: each of the {n} runs to run is one job of one array, submitted seed by seed; "
              "every job gets this sbatch script:")
        print("\n".join(f"    {line}".rstrip() for line in sbatch_preview(spec, n).strip().splitlines()))
    return rows


def main(argv: list[str] | None = None, arm_runner: ArmRunner | None = None) -> int:
    """CLI entry point; `arm_runner` replaces the torchrun subprocess of `executor: local` (tests). Exit codes:
    0 all runs finished or skipped, 1 a run failed, 2 a bad spec, override or arm config (nothing ran), 130 /
    143 interrupted by Ctrl-C (SIGINT) / SIGTERM (one line saying how to resume; running local runs are
    stopped, SLURM jobs left or cancelled as --on-interrupt says)."""
    from moe_gspo.run.cli import OnceArgumentParser, add_config_arguments, take_config
    from moe_gspo.run.slurm_executor import ON_INTERRUPT

    parser = OnceArgumentParser(prog="python -m moe_gspo.ablate", description=__doc__.split("\n\nImplementation:")[0],
                                raise_errors=True)
    add_config_arguments(parser, default=None, what="ablation spec YAML, in the format above", positional_file=True)
    parser.add_argument("--out", default=None, help="output directory (overrides out_dir)")
    parser.add_argument("--dry-run", action="store_true", help="validate every arm and list the commands only "
                        "(with executor: slurm also the sbatch parameters of the jobs)")
    parser.add_argument("--status", action="store_true", help="show each run's state (done, running, pending, "
                        "failed with its log's last line, ...) and exit; touches nothing")
    parser.add_argument("--executor", choices=("local", "slurm"), default=None, help="overrides the spec's executor")
    parser.add_argument("--seeds", default=None, metavar="S[,S...]", help="run only these of the spec's seeds "
                        "(e.g. 1000 or 1000,1001), without editing it")
    parser.add_argument("--only", default=None, metavar="ARM[,ARM...]", help="run only these arms of the spec, named "
                        "<algo>-<replay>[-<variant>] as the run directories are (e.g. grpo-none-p0,grpo-none-p10)")
    parser.add_argument("--on-interrupt", choices=ON_INTERRUPT, default=None,
                        help="executor: slurm: what Ctrl-C / SIGTERM of this process does with the submitted jobs: "
                             "leave them queued and running (the default; rerun to wait for them) or cancel them")
    try:
        args = parser.parse_intermixed_args(argv)
        take_config(args, default=None, positional_file=True)
        if args.config is None:
            raise ValueError("give the ablation spec: python -m moe_gspo.ablate --config FILE "
                             "(e.g. configs/ablation_tiny.yaml)")
        spec = load_spec(args.config, args.out, args.overrides, executor=args.executor)
        spec = select_runs(spec, args.seeds, args.only)
        if args.on_interrupt is not None and spec.executor != "slurm":
            raise ValueError("--on-interrupt is for executor: slurm (local runs are always stopped by Ctrl-C)")
        if spec.executor == "slurm":
            from moe_gspo.run.slurm_executor import check_paths, read_jobs
            from moe_gspo.run.slurm_spec import sbatch_parameters

            sbatch_parameters(spec.slurm, spec.name)  # slurm.time is required, every value one line
            check_paths(spec)
            read_jobs(spec)  # a malformed jobs.json stops here, before anything starts
        if args.status:
            from moe_gspo.run.ablation_status import print_status

            print_status(spec, expand_arms(spec, warn=False))
            return 0
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
        if spec.executor == "slurm":
            from moe_gspo.run.slurm_executor import require_slurm

            require_slurm()
        out_lock = lock_dir(spec.out_dir, "out_dir")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with out_lock:
        return _run_locked(spec, argv, arm_runner, args.on_interrupt or "leave")


def _run_locked(spec: AblationSpec, argv: list[str] | None, arm_runner: ArmRunner | None, on_interrupt: str) -> int:
    results: list[ArmResult] = []
    command = shlex.join(["python", "-m", "moe_gspo.ablate", *(sys.argv[1:] if argv is None else argv)])
    arms = expand_arms(spec, warn=False)
    progress: dict[str, Any] = {"started": [], "ended": [], "finished_now": [],
                                "done_at_start": {a.name for a in arms if arm_state(a) == "done"}}

    def how_to_resume() -> str:
        done = [a.name for a in arms if arm_state(a) == "done"]  # the run directories' own record
        before = sum(n in progress["done_at_start"] for n in done)  # a run finished as Ctrl-C came is this run's
        cut = [n for n in progress["started"] if n not in progress["ended"] and n not in done]
        head = f"{len(done)} of {len(arms)} runs finished ({len(done) - before} in this run, {before} before it)"
        if spec.executor == "slurm":
            return (head + (f"; {progress['slurm']}" if "slurm" in progress else "") + f". Rerun `{command}` to "
                    "continue: finished runs are skipped, jobs still queued or running are waited for, the others are "
                    "submitted again (resuming from their newest checkpoint)")
        return (head + (f"; interrupted: {', '.join(cut)}" if cut else "")
                + f". Rerun `{command}` to continue: finished runs are skipped, the interrupted ones resume from "
                "their newest checkpoint (or, without one, restart with their partial run moved aside)")

    from moe_gspo.run.errors import run_entry

    code = run_entry(lambda: results.extend(run_ablation(spec, arm_runner, progress_log=progress,
                                                         on_interrupt=on_interrupt)),
                     how_to_resume=how_to_resume)
    if code:  # interrupted (Ctrl-C / SIGTERM): the line above says how to resume
        return code
    counts = {s: sum(r.status == s for r in results) for s in ("finished", "skipped", "failed")}
    print(f"runs: {counts['finished']} finished, {counts['skipped']} skipped (already done), "
          f"{counts['failed']} failed")
    for r in results:
        if r.status == "failed":
            print(f"  FAILED {r.arm.name}: {r.message}; log: {r.log_path}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
