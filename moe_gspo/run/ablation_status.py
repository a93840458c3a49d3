"""`python -m moe_gspo.ablate --config SPEC --status`: each run's state, read from its run directory and,
under `executor: slurm`, from the recorded job (`{out_dir}/slurm/jobs.json`, checked entry by entry), `squeue`
and the job's exit record (JSON; nothing is unpickled). Touches nothing. The local executor reads no SLURM file.

States: done (a valid done.json); damaged (a done.json that is not JSON or not an object: not counted as done,
with why); running; pending (queued, or waiting for a local matrix still running); failed
(its SLURM job ended without done.json), with its log's last line; unfinished (a local run that stopped
before done.json: interrupted or failed, resumes from its newest checkpoint); not started.
"""

from __future__ import annotations

from moe_gspo.run.ablation_arms import Arm, arm_state, count_runs, done_problem, last_line
from moe_gspo.run.ablation_spec import AblationSpec
from moe_gspo.run.rundir import lock_state

_QUEUED = {"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD"}


def _checkpoint_note(arm: Arm) -> str:
    steps = sorted(p.name for p in (arm.run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    return f"resumes from {steps[-1]}" if steps else "no checkpoint: restarts"


def status_rows(spec: AblationSpec, arms: list[Arm]) -> list[tuple[Arm, str, str]]:
    """(run, state, detail) for every run."""
    from moe_gspo.run.slurm_executor import ACTIVE, job_result, queue_states, read_jobs, require_slurm

    jobs = {name: rec[-1]["job_id"] for name, rec in read_jobs(spec).items() if rec} if spec.executor == "slurm" \
        else {}
    queue: dict[str, str] | None = None
    if jobs:
        require_slurm()
        queue = queue_states(list(jobs.values()))
    matrix_running = (lock_state(spec.out_dir) or ("",))[0] == "held"
    rows = []
    for arm in arms:
        state, job = arm_state(arm), jobs.get(arm.name)
        line = last_line(arm.run_dir / "train.log")
        if state == "done":
            rows.append((arm, "done", f"job {job}" if job else ""))
        elif state == "damaged":
            rows.append((arm, "damaged", f"{done_problem(arm.run_dir)}; not counted as done: move it aside to run it "
                         "again"))
        elif queue is not None and job is not None:
            q = queue.get(job)
            if q in _QUEUED:
                rows.append((arm, "pending", f"job {job}"))
            elif q in ACTIVE:
                rows.append((arm, "running", f"job {job}" + (f"; {line}" if line else "")))
            else:
                outcome = job_result(spec, job)
                how = ("left the queue" if q is None else f"ended {q}") if outcome is None else (
                    f"exit code {outcome[0]}" if outcome[0] is not None else outcome[1])
                rows.append((arm, "failed", f"job {job} {how}; {_checkpoint_note(arm)}" + (f"; train.log: {line}"
                                                                                         if line else "")))
        elif (lock_state(arm.run_dir) or ("",))[0] == "held":
            rows.append((arm, "running", line))
        elif arm.run_dir.is_dir() and any(arm.run_dir.iterdir()):
            rows.append((arm, "unfinished", _checkpoint_note(arm) + (f"; train.log: {line}" if line else "")))
        else:
            rows.append((arm, "pending" if matrix_running else "not started", ""))
    return rows


def print_status(spec: AblationSpec, arms: list[Arm]) -> dict[str, int]:
    """Print one line per run and a summary; returns the count per state."""
    rows = status_rows(spec, arms)
    for arm, state, detail in rows:
        print(f"{arm.name:<24} {state:<12} {detail}".rstrip())
    counts: dict[str, int] = {}
    for _, state, _ in rows:
        counts[state] = counts.get(state, 0) + 1
    order = ("done", "damaged", "running", "pending", "failed", "unfinished", "not started")
    print(f"{count_runs(arms)}: " + ", ".join(f"{counts[s]} {s}" for s in order if s in counts)
          + f" (executor: {spec.executor})")
    return counts
