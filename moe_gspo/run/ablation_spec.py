"""The ablation spec: the YAML of `python -m moe_gspo.ablate` read and validated into an `AblationSpec`
(its keys and their meaning: the docstring of `moe_gspo/ablate.py`), with its `slurm:` section
(`moe_gspo.run.slurm_spec`)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_gspo.algos.registry import algo_names
from moe_gspo.config import REPLAYS
from moe_gspo.run.dose_names import check_variant_names
from moe_gspo.run.slurm_spec import SlurmSpec, parse_slurm

_SPEC_KEYS = {"base_config", "algos", "routing_replay", "seeds", "overrides", "nproc", "out_dir",
              "exclude", "extra_args", "arm_timeout_s", "variants", "parallel_arms", "reward_threshold",
              "algo_overrides", "seed_keys", "executor", "slurm"}
EXECUTORS = ("local", "slurm")
_VARIANT_RE = re.compile(r"^[A-Za-z0-9_.]+$")
_AXIS_OVERRIDES = {"algo.name": "list it under 'algos'", "algo.routing_replay": "list it under 'routing_replay'"}
_REQUIRED = ("base_config", "algos", "routing_replay", "seeds")
_OVERRIDE_KEY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_RESERVED_OVERRIDES = {"train.seed": "list seeds under 'seeds'"}
# The local executor's layout when a spec does not set it. It follows the measurement of runs per hour,
# `python -m benchmarks.matrix_throughput` (docs/results.md, Benchmarks): change it there, after measuring.
# Measured idle on 2 cores, a 300-step phase arm (2026-11-29): 2 arms x 1 rank x 1 thread 73.1 runs/hour, 1 arm x 1
# rank x 2 threads 43.8, 1 arm x 2 ranks 40.4, 2 arms x 2 threads (oversubscribed) under 27 (stopped after 270 s):
# one rank per core, each on one thread, is the fastest; `default_parallel_arms` is that rule.
ARM_LAUNCHER_BYTES = 512 * 2**20
"""Memory one run's launcher holds (measured 0.41 GB RSS for a phase arm), with a margin."""
RANK_BYTES = 768 * 2**20
"""Memory one rank of a tiny-config run holds (measured 0.63 GB RSS for a phase arm), with a margin."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a cgroup's or `taskset`'s share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def default_parallel_arms(nproc: int, *, cores: int | None = None, available_bytes: int | None = None) -> int:
    """`parallel_arms` of a local spec without the key: one rank per core (`cores // nproc` runs at a time, each
    rank on one thread by `moe_gspo.ablate.local_threads_env`), fewer where the memory available now
    (`MemAvailable`) holds fewer tiny-config runs (`ARM_LAUNCHER_BYTES + nproc * RANK_BYTES` each); at least 1.
    A spec with bigger models sets `parallel_arms` itself."""
    from moe_gspo.plan.batch_bound import available_memory_bytes

    cores = cores if cores is not None else usable_cores()
    by_cores = max(1, cores // nproc)
    available = available_bytes if available_bytes is not None else available_memory_bytes()
    if available is None:
        return by_cores
    return max(1, min(by_cores, available // (ARM_LAUNCHER_BYTES + nproc * RANK_BYTES)))


DEFAULT_NPROC = 1
"""`nproc` of a spec without the key: torchrun processes (ranks) per run."""


@dataclass
class AblationSpec:
    base_config: Path
    algos: list[str]
    routing_replay: list[str]
    seeds: list[int]
    overrides: dict[str, Any] = field(default_factory=dict)
    nproc: int = DEFAULT_NPROC
    parallel_arms: int = 1
    """`parse_spec` fills a spec without the key with `default_parallel_arms(nproc)`."""
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
    executor: str = "local"
    """Where the runs go: "local" (subprocesses here, `parallel_arms` at a time) or "slurm" (one SLURM job
    per run through submitit, `moe_gspo.run.slurm_executor`)."""
    slurm: SlurmSpec = field(default_factory=SlurmSpec)
    """The sbatch parameters of every job under `executor: slurm` (`moe_gspo.run.slurm_spec`)."""
    only: list[str] = field(default_factory=list)
    """The arms (`Arm.group`, e.g. `grpo-none-p10`) kept from the matrix; empty: every arm. Not a YAML key: set
    by `ablate --only` (`moe_gspo.run.ablation_arms.select_runs`)."""

    @property
    def name(self) -> str:
        """The ablation's name: its output directory's (the SLURM job name and the W&B group of its runs)."""
        return self.out_dir.resolve().name


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
    nproc = raw.get("nproc", DEFAULT_NPROC)
    parallel = raw.get("parallel_arms", 1)  # without the key, local: `default_parallel_arms(nproc)` (below)
    for key, val in (("nproc", nproc), ("parallel_arms", parallel)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"ablation spec: '{key}' must be a positive int, got {val!r}")
    variants = _parse_variants(raw.get("variants"))
    check_variant_names(variants, overrides)  # the dose-naming rule of a phase matrix
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
    executor = raw.get("executor", "local")
    if executor not in EXECUTORS:
        raise ValueError(f"ablation spec: 'executor' must be one of {list(EXECUTORS)}, got {executor!r}")
    slurm = parse_slurm(raw.get("slurm"))
    if executor == "slurm" and parallel != 1 and "parallel_arms" in raw:
        raise ValueError("ablation spec: 'parallel_arms' is for executor: local; under executor: slurm every run is "
                         "a job and 'slurm: {array_parallelism: N}' bounds how many run at a time")
    if executor == "local" and "parallel_arms" not in raw:
        parallel = default_parallel_arms(nproc)
    return AblationSpec(
        base_config=_base_config_path(raw["base_config"]),
        algos=algos,
        routing_replay=_str_list(raw, "routing_replay", REPLAYS),
        seeds=list(seeds), overrides=dict(overrides), nproc=nproc, parallel_arms=parallel,
        out_dir=Path(out_dir if out_dir is not None else raw.get("out_dir", "runs/ablation")),
        exclude=list(exclude), extra_args=list(extra),
        arm_timeout_s=float(timeout) if timeout is not None else None, variants=variants,
        reward_threshold=float(threshold), algo_overrides=algo_overrides, seed_keys=list(seed_keys),
        executor=executor, slurm=slurm)


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


def load_spec(path: str | Path, out_dir: str | Path | None = None, overrides: list[str] = (),
              executor: str | None = None) -> AblationSpec:
    """Read and validate an ablation YAML; `overrides` (`section.key=value`) extend its `overrides`;
    `executor` (the CLI's `--executor`) replaces its `executor`."""
    from moe_gspo.config_load import load_yaml_file, parse_override, resolve_config_path

    path = resolve_config_path(path, kind="ablation")  # a file, or a shipped spec by name from anywhere
    raw = load_yaml_file(path, what="ablation spec")
    if executor is not None and isinstance(raw, dict):
        raw = dict(raw, executor=executor)
    if overrides and isinstance(raw, dict) and isinstance(raw.get("overrides") or {}, dict):
        raw = dict(raw, overrides=dict(raw.get("overrides") or {}))
        for text in overrides:
            sec, key, value = parse_override(text)
            raw["overrides"][f"{sec}.{key}"] = value
    return parse_spec(raw, out_dir)


