"""What one SLURM job of an ablation runs (`ArmJob`, pickled by submitit and called on the job's nodes).

The job runs the run's `moe_gspo.launch` command line, the one it runs locally, with its output appended to
`{run_dir}/train.log` (node k > 0: `{node_log_dir}/{run}.node{k}.log`). It decides at its start, from the run directory,
whether to resume (a checkpoint exists: `--resume`), to skip (done.json exists) or to start afresh (a
partial run without a checkpoint is moved aside first), so a job requeued by SLURM after a time-out or a
preemption resumes from the newest checkpoint (submitit's `Checkpointable`: the same call, requeued).

Each task (node) of the job ends by writing its exit record, `{result_dir}/<job id>_<task>.json`
(`moe_gspo.run.slurm_record`): the command's exit code, or the last line of what the job raised. The
submitting side (`--status`, a rerun waiting for the job) reads that JSON, never submitit's result pickle.
A requeued attempt (SLURM's time-out or preemption signal) writes none: the attempt that ends does.

On several nodes (one task per node) every node runs torchrun with the rendezvous taken from the job
(submitit's `JobEnvironment`, from SLURM's variables): `--standalone` becomes `--nnodes N --rdzv-backend c10d
--rdzv-endpoint <first node>:<port> --rdzv-id <job id>` (docs/multinode.md), the port derived from the job id.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from submitit.helpers import Checkpointable

from moe_gspo.run.ablation_arms import arm_state, done_problem, prepare_run_dir
from moe_gspo.run.arm_runner import SubprocessArmRunner
from moe_gspo.run.slurm_record import write_exit_record


def rendezvous_port(job_id: str) -> int:
    """The c10d rendezvous port of a multi-node job: 20000-39999, fixed by the job id (arms of one array
    sharing a first node get different ports)."""
    return 20000 + zlib.crc32(job_id.encode()) % 20000


def multinode_command(command: list[str], *, num_nodes: int, first_host: str, job_id: str) -> list[str]:
    """`command` (a `moe_gspo.launch --standalone ...` line) with the multi-node rendezvous in place of
    `--standalone`; unchanged on one node."""
    if num_nodes <= 1:
        return list(command)
    i = command.index("--standalone")
    rdzv = ["--nnodes", str(num_nodes), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{first_host}:{rendezvous_port(job_id)}", "--rdzv-id", f"moe-gspo-{job_id}"]
    return command[:i] + rdzv + command[i + 1:]


@dataclass
class ArmJob(Checkpointable):
    """One run of the matrix as a SLURM job; `__call__` returns the exit code of the run's command."""

    command: list[str]
    """The fresh run's command line."""
    resume_command: list[str]
    """The same with `--resume`."""
    run_dir: str
    cwd: str
    """The submitting process's working directory (the commands' relative paths are relative to it)."""
    env: dict[str, str] = field(default_factory=dict)
    """Added to the job's environment (W&B grouping, OMP_NUM_THREADS)."""
    node_log_dir: str = ""
    """Where nodes other than the first append their output (the run directory is the first node's)."""
    timeout_s: float | None = None
    """The spec's arm_timeout_s: the command is stopped after this long."""
    result_dir: str = ""
    """Where each task writes its exit record (`moe_gspo.run.slurm_record`); "" writes none."""

    def __call__(self) -> int:
        import submitit

        env = submitit.JobEnvironment()
        try:
            code = self._run(env)
        except Exception as e:  # submitit's "not requeued" error included; a requeue (SystemExit) writes nothing
            if self.result_dir:
                write_exit_record(Path(self.result_dir), str(env.job_id), env.global_rank, None,
                                  f"{type(e).__name__}: {e}")
            raise
        if self.result_dir:
            write_exit_record(Path(self.result_dir), str(env.job_id), env.global_rank, code)
        return code

    def _run(self, env) -> int:
        os.chdir(self.cwd)
        run_dir = Path(self.run_dir)
        if env.node == 0:
            state, note = prepare_run_dir(run_dir)
            log = run_dir / "train.log"
        else:  # the first node prepares the directory (moving a partial run aside); the others only read it
            state, note = arm_state(run_dir), ""
            log = Path(self.node_log_dir) / f"{run_dir.name}.node{env.node}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
        if state == "done":
            return 0
        if state == "damaged":  # not counted as done, not overwritten: the user decides
            with open(log, "a") as f:
                f.write(f"[ablate] SLURM job {env.job_id}: {done_problem(run_dir)}; not run (move done.json aside "
                        "to run it again)\n")
            return 2
        command = self.resume_command if state == "resume" else self.command
        command = multinode_command(command, num_nodes=env.num_nodes, first_host=env.hostnames[0],
                                    job_id=str(env.job_id))
        if note:
            with open(log, "a") as f:
                f.write(f"[ablate] SLURM job {env.job_id}: {note.rstrip('; ')}\n")
        return SubprocessArmRunner(self.timeout_s, env=self.env)(None, command, log)
