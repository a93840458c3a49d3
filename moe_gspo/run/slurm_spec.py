"""The `slurm:` section of an ablation spec: the sbatch parameters of every job under `executor: slurm`,
validated here and mapped to submitit's `SlurmExecutor` parameters (`sbatch_parameters`).

    slurm:
      partition: gpu            # sbatch --partition
      account: my_project       # --account
      time: "04:00:00"          # --time, required: minutes, MM:SS, HH:MM:SS, D-HH or D-HH:MM:SS. A run still
                                # going near it is requeued and resumes from its newest checkpoint (3 times)
      nodes: 1                  # --nodes; one torchrun per node, rendezvous from the job's node list
      gpus_per_node: 8          # --gpus-per-node
      cpus_per_task: 32         # --cpus-per-task (one task per node; OMP_NUM_THREADS = this // nproc)
      mem: 256G                 # --mem (per node)
      array_parallelism: 16     # at most this many of the matrix's jobs run at a time (default 256)
      sbatch_flags: {qos: high, constraint: h100}   # any other sbatch flag, without the dashes
      setup: ["module load cuda/12.4"]              # shell lines run before the job's command
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

SLURM_KEYS = ("partition", "account", "time", "nodes", "gpus_per_node", "cpus_per_task", "mem",
              "array_parallelism", "sbatch_flags", "setup")
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
# flags that submitit sets itself, or that the section names
_RESERVED_FLAGS = {"array", "output", "error", "open_mode", "signal", "job_name", "ntasks_per_node", "ntasks",
                   "chdir", "parsable"}


@dataclass(kw_only=True)
class SlurmSpec:
    """The sbatch parameters of an ablation's jobs (None: the cluster's default)."""

    partition: str | None = None
    """sbatch --partition."""
    account: str | None = None
    """sbatch --account."""
    time: str | None = None
    """sbatch --time (required under executor: slurm), as written in the spec."""
    nodes: int = 1
    """sbatch --nodes: one torchrun of `nproc` processes per node."""
    gpus_per_node: int | None = None
    """sbatch --gpus-per-node."""
    cpus_per_task: int | None = None
    """sbatch --cpus-per-task (one task per node)."""
    mem: str | None = None
    """sbatch --mem (per node), e.g. 64G."""
    array_parallelism: int | None = None
    """At most this many jobs of the matrix's array run at a time (None: submitit's 256)."""
    sbatch_flags: dict[str, Any] = field(default_factory=dict)
    """Other sbatch flags (`qos`, `constraint`, `exclusive: true`, ...), names without the dashes."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the job runs before its command (module loads, a venv's activate)."""


def time_minutes(text: str) -> int:
    """sbatch's --time formats (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in whole minutes, rounded up."""
    m = _TIME_RE.match(text)
    if m is None:
        raise ValueError(f"ablation spec: slurm.time {text!r} is not a SLURM time; write minutes (240) or "
                         "HH:MM:SS ('04:00:00') or D-HH:MM:SS ('1-00:00:00')")
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # HH:MM:SS
        seconds = a * 3600 + b * 60 + c
    elif b is not None:  # MM:SS
        seconds = a * 60 + b
    else:  # minutes
        seconds = a * 60
    if seconds <= 0:
        raise ValueError(f"ablation spec: slurm.time {text!r} must be longer than 0")
    return -(-seconds // 60)


def _positive_int(raw: dict, key: str) -> int | None:
    val = raw.get(key)
    if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
        raise ValueError(f"ablation spec: slurm.{key} must be a positive int, got {val!r}")
    return val


def _text(raw: dict, key: str) -> str | None:
    val = raw.get(key)
    if val is None:
        return None
    if isinstance(val, bool) or not isinstance(val, (str, int)) or str(val).strip() == "":
        raise ValueError(f"ablation spec: slurm.{key} must be a string, got {val!r}")
    return str(val)


def parse_slurm(raw: Any) -> SlurmSpec:
    """Validate the spec's `slurm:` mapping (absent: all defaults)."""
    if raw is None:
        return SlurmSpec()
    if not isinstance(raw, dict):
        raise ValueError("ablation spec: 'slurm' must be a mapping of sbatch parameters, e.g. "
                         "{partition: gpu, time: '04:00:00', gpus_per_node: 8}")
    unknown = sorted(set(raw) - set(SLURM_KEYS))
    if unknown:
        raise ValueError(f"ablation spec: unknown slurm keys {unknown}; allowed: {list(SLURM_KEYS)} (other sbatch "
                         "flags go under slurm.sbatch_flags)")
    time = _text(raw, "time")
    if time is not None:
        time_minutes(time)
    flags = raw.get("sbatch_flags") or {}
    if not isinstance(flags, dict) or not all(isinstance(k, str) and re.match(r"^[a-z][a-z0-9_-]*$", k)
                                              for k in flags):
        raise ValueError("ablation spec: slurm.sbatch_flags must map sbatch flag names (without the dashes, e.g. "
                         f"qos) to values, got {flags!r}")
    for k, v in flags.items():
        key = k.replace("-", "_")
        if key in SLURM_KEYS or key in _RESERVED_FLAGS:
            hint = f"use slurm.{key}" if key in SLURM_KEYS else "moe_gspo.ablate sets it for every job"
            raise ValueError(f"ablation spec: slurm.sbatch_flags.{k}: {hint}")
        if v is None or isinstance(v, (list, dict)) or v is False:
            raise ValueError(f"ablation spec: slurm.sbatch_flags.{k} must be a string, a number or true, got {v!r}")
    setup = raw.get("setup") or []
    if not isinstance(setup, list) or not all(isinstance(s, str) for s in setup):
        raise ValueError("ablation spec: slurm.setup must be a list of shell lines, e.g. ['module load cuda']")
    nodes = _positive_int(raw, "nodes")
    return SlurmSpec(partition=_text(raw, "partition"), account=_text(raw, "account"), time=time,
                     nodes=1 if nodes is None else nodes, gpus_per_node=_positive_int(raw, "gpus_per_node"),
                     cpus_per_task=_positive_int(raw, "cpus_per_task"), mem=_text(raw, "mem"),
                     array_parallelism=_positive_int(raw, "array_parallelism"),
                     sbatch_flags={k.replace("-", "_"): v for k, v in flags.items()}, setup=list(setup))


def sbatch_parameters(slurm: SlurmSpec, job_name: str) -> dict[str, Any]:
    """submitit `SlurmExecutor.update_parameters` keywords for every job of the matrix (one task per node)."""
    if slurm.time is None:
        raise ValueError("ablation spec: executor: slurm needs slurm.time, the time limit of one run's job (e.g. "
                         "time: '04:00:00'); a run still going near it is requeued and resumes from its newest "
                         "checkpoint")
    params: dict[str, Any] = {"job_name": job_name, "time": time_minutes(slurm.time), "nodes": slurm.nodes,
                              "ntasks_per_node": 1}
    for key in ("partition", "account", "gpus_per_node", "cpus_per_task", "mem", "array_parallelism"):
        if getattr(slurm, key) is not None:
            params[key] = getattr(slurm, key)
    if slurm.sbatch_flags:
        params["additional_parameters"] = dict(slurm.sbatch_flags)
    if slurm.setup:
        params["setup"] = list(slurm.setup)
    return params
