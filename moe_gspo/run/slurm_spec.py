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

Every value is checked before anything is written (`parse_slurm`): no newline or other control character
(a newline in a value would end its `#SBATCH` comment line and run the rest as a shell line), numbers in range
(`LIMITS`, `MAX_TIME_MINUTES`, `MAX_MEM_MIB`). Flags submitit has parameters of its own for (`SUBMITIT_FLAGS`:
qos, constraint, exclusive, ...) are given to it as those, the others as its `additional_parameters`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

SLURM_KEYS = ("partition", "account", "time", "nodes", "gpus_per_node", "cpus_per_task", "mem",
              "array_parallelism", "sbatch_flags", "setup")
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$", re.ASCII)
_MEM_RE = re.compile(r"^(\d{1,15})([KMGT]?)B?$", re.IGNORECASE | re.ASCII)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_TIME_MINUTES = 365 * 24 * 60
"""slurm.time's upper bound: 365 days."""
MAX_MEM_MIB = 128 * 1024 * 1024
"""slurm.mem's upper bound: 128T per node."""
LIMITS = {"nodes": 10_000, "gpus_per_node": 1024, "cpus_per_task": 100_000, "array_parallelism": 1_000_000}
"""The int keys' upper bounds (their lower bound is 1)."""
SUBMITIT_FLAGS = ("qos", "constraint", "exclusive", "exclude", "comment", "gres", "mail_type", "mail_user", "nodelist",
                  "dependency", "wckey", "mem_per_gpu", "mem_per_cpu", "cpus_per_gpu", "gpus_per_task")
"""sbatch_flags that are parameters of submitit's SlurmExecutor: given to it as such."""
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
    if seconds > MAX_TIME_MINUTES * 60:
        raise ValueError(f"ablation spec: slurm.time {text!r} is over 365 days; give one run's time limit, e.g. "
                         "'04:00:00'")
    return -(-seconds // 60)


def check_one_line(field: str, value: str) -> str:
    """`value` when it holds no newline or other control character; else a ValueError naming `field` (a value
    the job script carries must stay one line of it)."""
    m = _CONTROL_RE.search(value)
    if m:
        raise ValueError(f"ablation spec: {field} holds a control character ({m.group()!r} at {m.start()}); it "
                         "goes into the job script, which takes one-line values only")
    return value


def mem_mib(text: str) -> int:
    """sbatch's --mem (a number with an optional K, M, G or T; plain numbers are MB) in MiB, checked."""
    m = _MEM_RE.match(text)
    unit_kib = {"K": 1, "": 1024, "M": 1024, "G": 1024 ** 2, "T": 1024 ** 3}
    kib = int(m.group(1)) * unit_kib[m.group(2).upper()] if m else 0
    if not 0 < kib <= MAX_MEM_MIB * 1024:
        raise ValueError(f"ablation spec: slurm.mem {text[:40]!r} is not a memory size from 1K to 128T; write e.g. "
                         "64G (suffix K, M, G or T; a plain number is MB)")
    return -(-kib // 1024)


def _positive_int(raw: dict, key: str) -> int | None:
    val = raw.get(key)
    if val is not None and (not isinstance(val, int) or isinstance(val, bool) or not 1 <= val <= LIMITS[key]):
        raise ValueError(f"ablation spec: slurm.{key} must be a positive int, at most {LIMITS[key]}, got "
                         f"{str(val)[:40]!r}")
    return val


def _text(raw: dict, key: str) -> str | None:
    val = raw.get(key)
    if val is None:
        return None
    if isinstance(val, bool) or not isinstance(val, (str, int)) or str(val).strip() == "":
        raise ValueError(f"ablation spec: slurm.{key} must be a string, got {str(val)[:40]!r}")
    return check_one_line(f"slurm.{key}", str(val))


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
        if not (v is True or (isinstance(v, (str, int, float)) and not isinstance(v, bool))) or (
                isinstance(v, float) and not math.isfinite(v)) or str(v).strip() == "":
            raise ValueError(f"ablation spec: slurm.sbatch_flags.{k} must be a string, a number or true, got "
                             f"{str(v)[:40]!r}")
        check_one_line(f"slurm.sbatch_flags.{k}", str(v))
    setup = raw.get("setup") or []
    if not isinstance(setup, list) or not all(isinstance(s, str) for s in setup):
        raise ValueError("ablation spec: slurm.setup must be a list of shell lines, e.g. ['module load cuda']")
    for i, line in enumerate(setup):
        check_one_line(f"slurm.setup[{i}]", line.replace("\t", " "))
    mem = _text(raw, "mem")
    if mem is not None:
        mem_mib(mem)
    nodes = _positive_int(raw, "nodes")
    return SlurmSpec(partition=_text(raw, "partition"), account=_text(raw, "account"), time=time,
                     nodes=1 if nodes is None else nodes, gpus_per_node=_positive_int(raw, "gpus_per_node"),
                     cpus_per_task=_positive_int(raw, "cpus_per_task"), mem=mem,
                     array_parallelism=_positive_int(raw, "array_parallelism"),
                     sbatch_flags={k.replace("-", "_"): v for k, v in flags.items()}, setup=list(setup))


def sbatch_parameters(slurm: SlurmSpec, job_name: str) -> dict[str, Any]:
    """submitit `SlurmExecutor.update_parameters` keywords for every job of the matrix (one task per node)."""
    if slurm.time is None:
        raise ValueError("ablation spec: executor: slurm needs slurm.time, the time limit of one run's job (e.g. "
                         "time: '04:00:00'); a run still going near it is requeued and resumes from its newest "
                         "checkpoint")
    params: dict[str, Any] = {"job_name": check_one_line("the job name (out_dir's name)", job_name),
                              "time": time_minutes(slurm.time), "nodes": slurm.nodes, "ntasks_per_node": 1}
    for key in ("partition", "account", "gpus_per_node", "cpus_per_task", "mem", "array_parallelism"):
        if getattr(slurm, key) is not None:
            params[key] = getattr(slurm, key)
    for key, value in slurm.sbatch_flags.items():  # submitit's own parameter where it has one
        if key in SUBMITIT_FLAGS:
            params[key] = value
        else:
            params.setdefault("additional_parameters", {})[key] = value
    if slurm.setup:
        params["setup"] = list(slurm.setup)
    return params
