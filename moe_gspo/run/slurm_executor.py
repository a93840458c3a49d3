"""`executor: slurm` for `moe_gspo.ablate`: every run of the matrix is one SLURM job, submitted through
submitit as one job array (at most `slurm.array_parallelism` running at a time), each running the
`moe_gspo.launch` command line it runs locally (`moe_gspo.run.slurm_job.ArmJob`).

- Job ids are recorded in `{out_dir}/slurm/jobs.json` (run name -> its jobs, newest last) as soon as
  sbatch answers; submitit's files (pickles, the job wrapper's stdout / stderr) are in
  `{out_dir}/slurm/submitted-<time>-<random>/<job id>/`, a new folder per submission;
  each job's exit record (JSON, written by the job: `moe_gspo.run.slurm_record`) in `{out_dir}/slurm/results/`.
- Data only: jobs.json is checked entry by entry (a job id is a SLURM id, never a path), and a job's outcome is
  read from its exit record; nothing in the directory is unpickled (it may come from someone else).
- Rerunning the matrix skips finished runs, waits for a recorded job still queued or running instead of
  submitting it again, and submits the rest (a job resumes its run from the newest checkpoint itself).
- Waiting polls `squeue` (one call for all jobs) and the jobs' exit records; it needs no `sacct` (no
  accounting database). A job that left the queue without a result failed (cancelled, killed, node failure):
  its run is reported failed with its log's last line.
- Ctrl-C / SIGTERM while waiting: `on_interrupt="leave"` (the default) leaves the submitted jobs queued and
  running (rerun to wait for them), `"cancel"` cancels them (`scancel`).
"""

from __future__ import annotations

import getpass
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from moe_gspo.files import atomic_write_text
from moe_gspo.run.ablation_arms import (
    Arm, ArmResult, arm_state, build_command, damaged_result, finish, last_line, seed_order, wandb_env,
)
from moe_gspo.run.ablation_spec import AblationSpec
from moe_gspo.run.slurm_record import check_job_id, exit_record_path, read_exit_record
from moe_gspo.run.slurm_spec import check_one_line, sbatch_parameters

ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
          "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
"""squeue states of a job that has not ended (its run may still finish)."""
ON_INTERRUPT = ("leave", "cancel")
_GRACE_POLLS = 3
"""Polls a job may be out of the queue before its exit record appears (a shared filesystem's delay)."""
_SQUEUE_TRIES = 6
"""Failed squeue calls in a row (one per poll) before the wait gives up (the jobs go on)."""


def slurm_dir(spec: AblationSpec) -> Path:
    return spec.out_dir / "slurm"


def jobs_file(spec: AblationSpec) -> Path:
    return slurm_dir(spec) / "jobs.json"


def results_dir(spec: AblationSpec) -> Path:
    """Where the jobs write their exit records (`moe_gspo.run.slurm_record`)."""
    return slurm_dir(spec) / "results"


def read_jobs(spec: AblationSpec) -> dict[str, list[dict[str, Any]]]:
    """The recorded jobs: run name -> [{job_id, submitted}, ...], oldest first; every entry checked (a
    ValueError naming the file and what is wrong)."""
    path = jobs_file(spec)
    fix = ("; fix it or move it aside to submit every unfinished run again (check `squeue` first for jobs still "
           "running)")
    try:
        jobs = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({str(e)[:200]}){fix}") from e
    if not isinstance(jobs, dict):
        raise ValueError(f"{path}: expected a JSON object of run name -> list of jobs, got a {type(jobs).__name__}"
                         + fix)
    for name, records in jobs.items():
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise ValueError(f"{path}: run {name[:80]!r}: expected a list of jobs ({{\"job_id\": ...}}), got "
                             f"{str(records)[:60]}" + fix)
        for k, record in enumerate(records):
            if "job_id" not in record:
                raise ValueError(f"{path}: run {name[:80]!r} job {k} has no job_id" + fix)
            try:
                check_job_id(record["job_id"], f"{path}: run {name[:80]!r} job {k}")
            except ValueError as e:
                raise ValueError(f"{e}{fix}") from None
    return jobs


def record_jobs(spec: AblationSpec, new: dict[str, dict[str, Any]]) -> None:
    jobs = read_jobs(spec)
    for name, job in new.items():
        jobs.setdefault(name, []).append(job)
    jobs_file(spec).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(jobs_file(spec), json.dumps(jobs, indent=1) + "\n")


def require_slurm() -> None:
    missing = [c for c in ("sbatch", "squeue", "scancel") if shutil.which(c) is None]
    if missing:
        raise ValueError(f"executor: slurm needs SLURM's {', '.join(missing)} on PATH (run ablate on a node that "
                         "submits jobs, e.g. the cluster's login node); --dry-run works without them")


def queue_states(job_ids: list[str]) -> dict[str, str]:
    """job id -> its squeue state, for those of `job_ids` the controller still knows (one squeue call)."""
    if not job_ids:
        return {}
    cmd = ["squeue", "--noheader", "--array", "--states=all", "--format=%i|%T", "--user", getpass.getuser()]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        err = getattr(e, "stderr", "") or str(e)
        raise ValueError(f"`{' '.join(cmd)}` failed ({err.strip()[-300:]}); is the SLURM controller reachable?") from e
    wanted, states = set(job_ids), {}
    for line in out.splitlines():
        jid, _, state = line.strip().partition("|")
        if jid in wanted:
            states[jid] = state.split()[0] if state else "UNKNOWN"
    return states


def job_result(spec: AblationSpec, job_id: str) -> tuple[int | None, str] | None:
    """(exit code, "") once every task of the job wrote its exit record, (None, why) when the job raised or a
    record is damaged; None before. Reads JSON only (`moe_gspo.run.slurm_record`)."""
    check_job_id(job_id, str(jobs_file(spec)))
    code = 0
    for task in range(spec.slurm.nodes):
        outcome = read_exit_record(exit_record_path(results_dir(spec), job_id, task), job_id, task)
        if outcome is None or outcome[0] is None:
            return outcome
        if code == 0 and outcome[0]:
            code = outcome[0]
    return code, ""


def job_env(spec: AblationSpec, arm: Arm) -> dict[str, str]:
    env = wandb_env(spec, arm)
    if spec.slurm.cpus_per_task:
        env["OMP_NUM_THREADS"] = str(max(1, spec.slurm.cpus_per_task // spec.nproc))
    return env


def check_paths(spec: AblationSpec) -> None:
    """The paths the job script carries (out_dir, this Python) hold no newline or other control character."""
    check_one_line("out_dir", str(slurm_dir(spec).resolve()))
    check_one_line("the Python running ablate", sys.executable)


def new_submission_dir(spec: AblationSpec) -> Path:
    """A folder of its own for one submission's submitit files, named by the time and 8 random hex digits and
    created here (never one that exists): a job loads its submitted pickle from it, so no file planted in a copied
    or shared directory (at a job id the scheduler is about to hand out) can be where a new job looks."""
    import secrets

    path = slurm_dir(spec) / f"submitted-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(4)}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def make_executor(spec: AblationSpec, folder: Path):
    """submitit's executor, its files in `folder`/<job id>/."""
    import submitit

    check_paths(spec)
    executor = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=3)
    executor.update_parameters(**sbatch_parameters(spec.slurm, f"ablate-{spec.name}"))
    return executor


def sbatch_preview(spec: AblationSpec, num_jobs: int) -> str:
    """The sbatch script every job of the array gets (as submitit writes it), for `--dry-run`."""
    from submitit.slurm.slurm import _make_sbatch_string  # the text SlurmExecutor submits

    check_paths(spec)
    params = sbatch_parameters(spec.slurm, f"ablate-{spec.name}")
    folder = slurm_dir(spec) / "submitted-<time>-<random>" / "%j"  # made at submission (`new_submission_dir`)
    command = f"{sys.executable} -u -m submitit.core._submit {folder}"
    return _make_sbatch_string(command=command, folder=folder, map_count=max(1, num_jobs), **params)


def run_on_slurm(spec: AblationSpec, arms: list[Arm], *, on_result: Callable[[ArmResult], None],
                 log: dict[str, Any], on_interrupt: str = "leave", poll_s: float = 10.0,
                 sleep: Callable[[float], None] = time.sleep) -> list[ArmResult]:
    """Submit (or attach to) one job per unfinished run and wait for all of them; results in `arms` order.
    `log` gets "started" / "ended" run names and, when interrupted, "slurm" (what happened to the jobs)."""
    require_slurm()
    results: dict[int, ArmResult] = {}
    records = read_jobs(spec)
    recorded = {a.name: records[a.name][-1]["job_id"] for a in arms if records.get(a.name)}
    live = queue_states(list(recorded.values()))
    pending: dict[int, str] = {}  # arm index -> job id
    resumed: dict[int, bool] = {}
    to_submit: list[int] = []
    for i in seed_order(spec, arms):
        arm = arms[i]
        state = arm_state(arm)
        if state in ("done", "damaged"):  # a damaged done.json: failed, not submitted (the user moves it aside)
            results[i] = (ArmResult(arm, "skipped", arm.run_dir / "train.log", "done.json exists") if state == "done"
                          else damaged_result(arm))
            on_result(results[i])
        elif live.get(recorded.get(arm.name, ""), "") in ACTIVE:
            pending[i], resumed[i] = recorded[arm.name], state == "resume"
        else:
            to_submit.append(i)
            resumed[i] = state == "resume"
    attached = len(pending)
    try:
        if to_submit:
            _submit(spec, arms, to_submit, pending)
        if pending:
            print(f"[ablate] {len(to_submit)} runs submitted to SLURM" + (f", {attached} already queued or running"
                  if attached else "") + f"; job ids in {jobs_file(spec)}; waiting (`python -m moe_gspo.ablate ... "
                  "--status` shows them)", file=sys.stderr, flush=True)
        log.setdefault("started", []).extend(arms[i].name for i in pending)
        _wait(spec, arms, pending, resumed, results, on_result, log, poll_s, sleep)
    except ValueError as e:  # squeue kept failing: the jobs go on without this process
        if pending:
            raise ValueError(f"{e}. The {len(set(pending.values()))} submitted SLURM jobs were left queued or "
                             "running: rerun the same command to wait for them") from e
        raise
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM (moe_gspo.run.errors.interrupts_as_exceptions)
        ids = sorted(set(pending.values()))
        if not ids:
            raise
        if on_interrupt == "cancel":
            subprocess.run(["scancel", *ids], capture_output=True, timeout=120)
            log["slurm"] = (f"cancelled the {len(ids)} SLURM jobs still queued or running (--on-interrupt cancel): "
                            f"{' '.join(ids)}")
        else:
            log["slurm"] = (f"left the {len(ids)} SLURM jobs still queued or running (--on-interrupt leave, the "
                            f"default; `scancel {' '.join(ids)}` cancels them)")
        raise
    return [results[i] for i in range(len(arms))]


def _submit(spec: AblationSpec, arms: list[Arm], order: list[int], pending: dict[int, str]) -> None:
    from moe_gspo.run.slurm_job import ArmJob

    executor = make_executor(spec, new_submission_dir(spec))
    jobs_ = []
    try:
        with executor.batch():
            for i in order:
                arm = arms[i]
                jobs_.append(executor.submit(ArmJob(
                    command=build_command(spec, arm, resume=False), resume_command=build_command(spec, arm, resume=True),
                    run_dir=str(arm.run_dir), cwd=str(Path.cwd()), env=job_env(spec, arm),
                    node_log_dir=str(slurm_dir(spec) / "nodes"), timeout_s=spec.arm_timeout_s,
                    result_dir=str(results_dir(spec)))))
    except Exception as e:  # sbatch refused the array (a partition that does not exist, a time over the limit)
        text = (getattr(e, "stderr", None) or getattr(e, "output", None) or str(e))
        text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
        raise ValueError(f"sbatch refused the jobs: {text.strip().splitlines()[-1] if text.strip() else e}") from e
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    record_jobs(spec, {arms[i].name: {"job_id": job.job_id, "submitted": now} for i, job in zip(order, jobs_)})
    for i, job in zip(order, jobs_):
        pending[i] = job.job_id


def _wait(spec: AblationSpec, arms: list[Arm], pending: dict[int, str], resumed: dict[int, bool],
          results: dict[int, ArmResult], on_result: Callable[[ArmResult], None], log: dict[str, Any],
          poll_s: float, sleep: Callable[[float], None]) -> None:
    gone: dict[int, int] = {}
    failures = 0
    while pending:
        try:
            states = queue_states(list(pending.values()))
            failures = 0
        except ValueError as e:  # the controller busy or restarting: try again, up to _SQUEUE_TRIES polls
            failures += 1
            if failures >= _SQUEUE_TRIES:
                raise
            print(f"warning: {e}; trying again", file=sys.stderr, flush=True)
            sleep(poll_s)
            continue
        for i, jid in list(pending.items()):
            state = states.get(jid)
            if state in ACTIVE:  # an exit record of a job SLURM requeued (time-out, preemption) is not its last
                continue
            arm, outcome = arms[i], job_result(spec, jid)
            if outcome is None:
                gone[i] = gone.get(i, 0) + 1
                if gone[i] < _GRACE_POLLS:
                    continue
                ended = f"ended ({state})" if state else "left the queue"
                line = last_line(arm.run_dir / "train.log")
                outcome = (None, f"{ended} without a result" + (f"; train.log: {line}" if line else ""))
            code, why = outcome
            res = finish(arm, code, "", resumed[i], why)
            line = last_line(arm.run_dir / "train.log") if res.status == "failed" and code is not None else ""
            res.message = f"SLURM job {jid}" + (f", {res.message}" if res.message else "") + (
                f"; train.log: {line}" if line else "")
            results[i] = res
            del pending[i]
            log.setdefault("ended", []).append(arm.name)
            if results[i].status == "finished":
                log.setdefault("finished_now", []).append(arm.name)
            on_result(results[i])
        if pending:
            sleep(poll_s)
