"""Robust reading of training run directories and probe JSON files, and the headline numbers.

Everything the report and the ablation comparison know about a run comes through this module:
- `load_run(run_dir)` reads what `python -m moe_gspo.train` writes: `metrics.jsonl` (skipping lines
  that are not JSON objects with an integer `step`, e.g. the last line cut by a kill, with a
  `RunDataWarning` naming the line number), `eval.jsonl` (the same way), `config.yaml` (optional: an
  unreadable one is a warning; one past the YAML caps of `moe_gspo.yaml_limits`, crafted or broken, is a
  `ReportInputError`, one line and exit 2 in the tools), `done.json`,
  `run.json` (learner dtype, device, world size of the last (re)start), and the list of
  `traces/step_XXXXXX_{rollout,learner,updated,logprobs}[_rank{r}].npz` files (one per rank when
  the run had several processes).
- `series` / `matrix_series` turn the per-step records into step-indexed numpy arrays.
- `headline_numbers(records)` and `probe_headline(probe)` compute the numbers of the report's top
  table; their definitions are in `HEADLINE_LABELS` and in the docstrings (tests recompute them).
- Trace files are read with plain `np.load` (fields as documented in `moe_gspo.routing.trace`), so
  the report does not depend on the trace writer's classes; `ratio_variance_by_length` measures
  the GSPO variance argument on the logged learner/rollout log-probs.

User errors (missing run dir, nothing to report on) raise `ReportInputError` (a `ValueError`).
"""

from __future__ import annotations

import json
import math
import re
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import yaml

from moe_gspo.yaml_limits import YamlLimitError, load_capped


class ReportInputError(ValueError):
    """The run directory / probe file given to the report cannot be used (message says why)."""


class RunDataWarning(UserWarning):
    """Something in a run directory was skipped (bad JSONL line, duplicate step, bad trace)."""


TRACE_READ_ERRORS = (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile)
"""What reading a damaged trace file (`np.load` of an .npz cut short, not a zip, lacking an array) raises."""
MAX_STEP = 2**63 - 1
"""The largest `step` a metrics line may carry (the step arrays are int64); a larger one is a damaged line."""

TRACE_KINDS = ("rollout", "learner", "updated", "logprobs")
_TRACE_RE = re.compile(r"^step_(\d+)_(rollout|learner|updated|logprobs)(?:_rank(\d+))?\.npz$")


@dataclass
class RunData:
    """What a run directory holds, read leniently."""

    source: Path
    """The run directory."""
    records: list[dict[str, Any]]
    """Per-step metric records, sorted by step, one per step (the last one wins on duplicates)."""
    traces: dict[int, dict[str, list[Path]]]
    """step -> {kind: npz paths} for kind in TRACE_KINDS that exist; one path per rank when a
    multi-process run wrote `step_XXXXXX_{kind}_rank{r}.npz` (each rank traces its own samples)."""
    config: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    run_info: dict[str, Any] | None = None
    """run.json: what the last (re)start actually used (`learner_dtype`, `device`, `world_size`); None
    for runs that predate it."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """eval.jsonl records sorted by step (one per evaluation; `eval/policy_step` = updates the evaluated
    policy had); empty when the run has no eval.jsonl."""
    warnings: list[str] = field(default_factory=list)
    """Human-readable notes about what was skipped while reading (also emitted as warnings)."""

    @property
    def name(self) -> str:
        return self.source.name


def _warn(msg: str, sink: list[str]) -> None:
    sink.append(msg)
    warnings.warn(msg, RunDataWarning, stacklevel=3)


def iter_step_records(path: Path, skipped) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(line number, integer step, record) for each line of a JSONL run file that is a JSON object with
    an integer `step`; every other non-blank line is passed to `skipped(message)` naming its line."""
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                skipped(f"{path.name}: skipped line {lineno}: not valid JSON ({e.msg})")
                continue
            except RecursionError:
                skipped(f"{path.name}: skipped line {lineno}: JSON nested too deep")
                continue
            if not isinstance(rec, dict):
                skipped(f"{path.name}: skipped line {lineno}: not a JSON object")
                continue
            step = rec.get("step")
            if (isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step)
                    or step != int(step)):  # NaN / Infinity (JSON accepts them) crashed int()
                skipped(f"{path.name}: skipped line {lineno}: no integer 'step' field")
                continue
            if abs(step) > MAX_STEP:
                skipped(f"{path.name}: skipped line {lineno}: 'step' {step:.3g} is out of range (|step| <= 2**63 - 1)")
                continue
            rec["step"] = int(step)
            yield lineno, int(step), rec


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Read a metrics.jsonl file: returns (records sorted by step, warnings).

    Blank lines are ignored. A line that is not a JSON object with an integer `step` is skipped
    with a `RunDataWarning` naming its (1-based) line number. When a step occurs twice (a resumed
    run re-logs steps after its last checkpoint) the later line wins.
    """
    path = Path(path)
    notes: list[str] = []
    by_step: dict[int, dict[str, Any]] = {}
    for lineno, step, rec in iter_step_records(path, lambda m: _warn(m, notes)):
        if step in by_step:
            _warn(f"{path.name}: line {lineno} repeats step {step}; keeping the later line", notes)
        by_step[step] = rec
    return [by_step[s] for s in sorted(by_step)], notes


def list_traces(traces_dir: Path) -> dict[int, dict[str, list[Path]]]:
    """step -> {kind: paths} for the `step_XXXXXX_{kind}[_rank{r}].npz` files in `traces_dir`
    (which may not exist); paths of one kind are ordered by rank."""
    found: dict[int, dict[str, list[tuple[int, Path]]]] = {}
    if not traces_dir.is_dir():
        return {}
    for p in traces_dir.iterdir():
        m = _TRACE_RE.match(p.name)
        if m and p.is_file():
            rank = int(m.group(3)) if m.group(3) is not None else -1
            found.setdefault(int(m.group(1)), {}).setdefault(m.group(2), []).append((rank, p))
    return {step: {kind: [p for _, p in sorted(paths)] for kind, paths in kinds.items()}
            for step, kinds in sorted(found.items())}


def _read_config(f) -> Any:
    return load_capped(f.read(), what="config.yaml")


def _read_optional(path: Path, loader, notes: list[str]) -> Any:
    if not path.is_file():
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            return loader(f)
    except YamlLimitError:
        raise
    except (OSError, ValueError, yaml.YAMLError, RecursionError) as e:
        _warn(f"could not read {path.name}: {e}", notes)
        return None


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory. Raises `ReportInputError` when it is missing or holds neither a
    `metrics.jsonl` with at least one valid record nor any trace file."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReportInputError(f"run directory {str(run_dir)!r} does not exist; pass the RUN_DIR "
                               "a training run wrote (it holds metrics.jsonl and traces/)")
    if not run_dir.is_dir():
        raise ReportInputError(f"{str(run_dir)!r} is not a directory (a probe report needs a .json file)")
    notes: list[str] = []
    metrics_path = run_dir / "metrics.jsonl"
    records: list[dict[str, Any]] = []
    if metrics_path.is_file():
        records, notes = read_jsonl(metrics_path)
    traces = list_traces(run_dir / "traces")
    if not records and not traces:
        what = ("metrics.jsonl has no valid records" if metrics_path.is_file()
                else "there is no metrics.jsonl")
        raise ReportInputError(f"nothing to report in {str(run_dir)!r}: {what} and there are no "
                               "traces/step_*.npz files; is this a training run directory?")
    try:  # a config.yaml past the YAML caps is crafted or broken: refused (one line, exit 2), never expanded
        config = _read_optional(run_dir / "config.yaml", _read_config, notes)
    except YamlLimitError as e:
        raise ReportInputError(f"{str(run_dir / 'config.yaml')!r}: {e}; this run directory's config.yaml is not one "
                               "a training run writes: remove or replace it") from None
    done = _read_optional(run_dir / "done.json", json.load, notes)
    run_info = _read_optional(run_dir / "run.json", json.load, notes)
    evals: list[dict[str, Any]] = []
    if (run_dir / "eval.jsonl").is_file():
        evals, eval_notes = read_jsonl(run_dir / "eval.jsonl")
        notes += eval_notes
    return RunData(source=run_dir, records=records, traces=traces,
                   config=config if isinstance(config, dict) else None,
                   done=done if isinstance(done, dict) else None,
                   run_info=run_info if isinstance(run_info, dict) else None, evals=evals, warnings=notes)


def load_probe(path: str | Path) -> dict[str, Any]:
    """Read a probe JSON (`python -m moe_gspo.probe --out drift.json`)."""
    path = Path(path)
    if not path.is_file():
        raise ReportInputError(f"probe file {str(path)!r} does not exist")
    try:
        with open(path, "r", encoding="utf-8") as f:
            probe = json.load(f)
    except OSError as e:
        raise ReportInputError(f"cannot read probe file {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ReportInputError(f"probe file {str(path)!r} is not UTF-8 text (a compressed file?); pass the JSON "
                               "that python -m moe_gspo.probe --out wrote") from None
    except (json.JSONDecodeError, RecursionError) as e:
        why = (f"{e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError)
               else "nested too deep")
        raise ReportInputError(f"probe file {str(path)!r} is not valid JSON: {why}") from None
    if not isinstance(probe, dict):
        raise ReportInputError(f"probe file {str(path)!r} must hold a JSON object")
    return probe


# --------------------------------------------------------------------------- series

def _as_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


def has_key(records: list[dict[str, Any]], key: str) -> bool:
    """True when at least one record carries `key`."""
    return any(key in r for r in records)


def series(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps int64 [S], values float64 [S]) over the records that carry the scalar `key`;
    non-numeric values become NaN."""
    pairs = [(r["step"], _as_float(r[key])) for r in records if key in r]
    if not pairs:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    steps, vals = zip(*pairs)
    return np.asarray(steps, np.int64), np.asarray(vals, np.float64)


def matrix_series(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S], values [S, ...]) for a list-valued `key` (e.g. per-layer); records whose value
    does not have the shape of the first well-formed one are left out."""
    steps: list[int] = []
    rows: list[np.ndarray] = []
    shape = None
    for r in records:
        if key not in r:
            continue
        try:
            arr = np.asarray(r[key], dtype=np.float64)
        except (TypeError, ValueError):
            continue
        if arr.ndim == 0:
            continue
        if shape is None:
            shape = arr.shape
        if arr.shape != shape:
            continue
        steps.append(r["step"])
        rows.append(arr)
    if not rows:
        return np.zeros(0, np.int64), np.zeros((0, 0), np.float64)
    return np.asarray(steps, np.int64), np.stack(rows)


def finite_mean(values: np.ndarray) -> float:
    """Mean of the finite entries; NaN when there are none."""
    values = np.asarray(values, np.float64)
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else math.nan


# --------------------------------------------------------------------------- traces

def load_logprobs(path: str | Path) -> dict[str, np.ndarray]:
    """Read a `step_*_logprobs.npz`: rollout_logp, learner_logp [sum_R], response_lens [N], rewards [N]."""
    with np.load(path, allow_pickle=False) as z:
        out = {k: np.asarray(z[k]) for k in ("rollout_logp", "learner_logp", "response_lens") if k in z}
        if "rewards" in z:
            out["rewards"] = np.asarray(z["rewards"])
    missing = {"rollout_logp", "learner_logp", "response_lens"} - set(out)
    if missing:
        raise ValueError(f"{Path(path).name} lacks arrays {sorted(missing)}")
    total = int(out["response_lens"].sum())
    if out["rollout_logp"].shape != (total,) or out["learner_logp"].shape != (total,):
        raise ValueError(f"{Path(path).name}: logp arrays have shapes {out['rollout_logp'].shape}, "
                         f"{out['learner_logp'].shape}, expected ({total},) = sum(response_lens)")
    return out


def load_topk(path: str | Path | list) -> tuple[np.ndarray, int, np.ndarray]:
    """Read a RoutingTrace npz (or the per-rank files of one, concatenated along tokens):
    (topk_ids [sum_T, L, K], num_experts, layer_ids [L])."""
    if isinstance(path, (list, tuple)):
        parts = [load_topk(p) for p in path]
        if not parts:
            raise ValueError("no trace files given")
        return (np.concatenate([p[0] for p in parts]), max(p[1] for p in parts), parts[0][2])
    with np.load(path, allow_pickle=False) as z:
        topk_TLK = np.asarray(z["topk_ids"])
        num_experts = int(z["num_experts"]) if "num_experts" in z else int(topk_TLK.max()) + 1
        layer_ids = (np.asarray(z["layer_ids"]) if "layer_ids" in z
                     else np.arange(topk_TLK.shape[1]))
    if topk_TLK.ndim != 3:
        raise ValueError(f"{Path(path).name}: topk_ids has shape {topk_TLK.shape}, expected [T, L, K]")
    return topk_TLK, num_experts, layer_ids


def trace_layer_ids(run: RunData) -> list[int] | None:
    """Model layer ids of the MoE layers, from the first routing trace of the run (None if none)."""
    for kinds in run.traces.values():
        for kind in ("rollout", "learner", "updated"):
            for path in kinds.get(kind, []):
                try:
                    with np.load(path, allow_pickle=False) as z:
                        if "layer_ids" in z:
                            return np.asarray(z["layer_ids"]).astype(int).tolist()
                except TRACE_READ_ERRORS:
                    continue
    return None


def _sequence_log_ratios(logprob_sets: list[dict[str, np.ndarray]]) -> tuple[np.ndarray, list[np.ndarray]]:
    """(response lengths [N], per-sequence d_t = learner − rollout log-prob arrays) of the non-empty
    responses, pooled over the given trace steps."""
    lens, groups = [], []
    for lp in logprob_sets:
        d = lp["learner_logp"].astype(np.float64) - lp["rollout_logp"].astype(np.float64)
        offsets = np.concatenate([[0], np.cumsum(lp["response_lens"].astype(np.int64))])
        for i, n in enumerate(lp["response_lens"].astype(np.int64)):
            if n > 0:
                lens.append(int(n))
                groups.append(d[offsets[i]:offsets[i + 1]])
    return np.asarray(lens, np.int64), groups


def length_bin_edges(logprob_sets: list[dict[str, np.ndarray]], num_bins: int = 6) -> np.ndarray:
    """Edges of up to `num_bins` response-length bins (quantiles of the non-empty responses' lengths,
    duplicates merged). Pass the result as `edges` to bin several sets of traces alike."""
    lens, _ = _sequence_log_ratios(logprob_sets)
    if lens.size == 0:
        raise ValueError("no non-empty responses in the logprob traces")
    edges = np.unique(np.quantile(lens, np.linspace(0, 1, num_bins + 1)))
    if edges.size < 2:
        edges = np.asarray([lens.min(), lens.max() + 1], np.float64)
    return edges


def ratio_variance_by_length(logprob_sets: list[dict[str, np.ndarray]], num_bins: int = 6,
                             edges: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The GSPO variance argument, measured on learner/rollout log-ratios d_t = learner − rollout.

    Sequences (pooled over the given trace steps) are grouped into bins of response length: the
    given `edges` (bin b holds lengths in [edges[b], edges[b+1]), the last bin also its right edge;
    lengths outside the edges go to the first / last bin), or up to `num_bins` quantile bins of these
    sets (`length_bin_edges`). Per bin: `token_var` = variance of the token ratios exp(d_t);
    `seq_norm_var` = variance over sequences of the length-normalised ratio exp(mean_t d_t);
    `seq_logprod_var` = variance over sequences of the unnormalised log product Σ_t d_t.
    Bins with fewer than 2 sequences get NaN. Returns those arrays plus `len_mid` (mean length
    per bin, NaN when empty), `num_seqs` per bin and the `edges`.
    """
    lens_a, tok_groups = _sequence_log_ratios(logprob_sets)
    if lens_a.size == 0:
        raise ValueError("no non-empty responses in the logprob traces")
    edges = length_bin_edges(logprob_sets, num_bins) if edges is None else np.asarray(edges, np.float64)
    assert edges.ndim == 1 and edges.size >= 2, edges
    bin_idx = np.clip(np.searchsorted(edges, lens_a, side="right") - 1, 0, edges.size - 2)
    nb = edges.size - 1
    out = {k: np.full(nb, np.nan) for k in ("len_mid", "token_var", "seq_norm_var", "seq_logprod_var")}
    out["num_seqs"] = np.zeros(nb, np.int64)
    out["edges"] = edges
    sums_a = np.asarray([g.sum() for g in tok_groups])
    means_a = np.asarray([g.mean() for g in tok_groups])
    for b in range(nb):
        sel = np.flatnonzero(bin_idx == b)
        out["num_seqs"][b] = sel.size
        if sel.size == 0:
            continue
        out["len_mid"][b] = lens_a[sel].mean()
        if sel.size < 2:
            continue
        toks = np.concatenate([tok_groups[i] for i in sel])
        out["token_var"][b] = np.var(np.exp(toks))
        out["seq_norm_var"][b] = np.var(np.exp(means_a[sel]))
        out["seq_logprod_var"][b] = np.var(sums_a[sel])
    return out


# --------------------------------------------------------------------------- headline numbers

FINAL_REWARD_LABEL = "final reward (mean reward/mean over the last 10% of steps)"
"""The one definition of a run's final reward, in the run report, the comparison report, the seed
statistics and the training's done.json summary (`reward_last10`)."""

HEADLINE_LABELS: dict[str, str] = {
    "num_steps": "training steps logged",
    "reward_last10_mean": FINAL_REWARD_LABEL,
    "reward_first10_mean": "reward/mean, mean over the first 10% of steps",
    "reward_last_step": "reward/mean at the last logged step (one batch)",
    "any_layer_flip_mean": "rollout vs learner (natural routing): response tokens routed differently in ≥1 layer",
    "k3_kl_mean": "rollout vs learner k3 KL, natural routing (mismatch/k3_kl, nats/token)",
    "k3_kl_replayed_mean": "rollout vs learner k3 KL, pass replaying the rollout routes (mismatch_replayed/k3_kl, R3)",
    "mismatch_token_var_mean": "rollout/learner token-ratio variance, natural routing (mismatch_ratio/token_var)",
    "mismatch_seq_var_mean": "rollout/learner sequence-ratio variance, natural routing (mismatch_ratio/seq_var)",
    "mismatch_token_seq_var_ratio": "rollout/learner: mean mismatch_ratio/token_var ÷ mean mismatch_ratio/seq_var",
    "flipped_var_share_mean": "share of rollout/learner token-ratio variance on routing-flipped tokens",
    "update_token_var_mean": "new/old policy token-ratio variance, inside the update (ratio/token_var)",
    "update_seq_var_mean": "new/old policy sequence-ratio variance, inside the update (ratio/seq_var)",
    "update_token_seq_var_ratio": "new/old policy: mean ratio/token_var ÷ mean ratio/seq_var",
    "clip_token_frac_mean": "tokens whose clip binds (clip/token_frac)",
    "clip_out_of_range_frac_mean": "tokens with a ratio outside the clip range, either sign of A (clip/out_of_range_frac)",
    "update_expert_change_mean": "old→new expert change after the first optimizer step (update/expert_change_frac), "
                                 "mean over the steps that measured it",
    "update_all_expert_change_mean": "old→new expert change after all mini-batches "
                                     "(update_all_minibatches/expert_change_frac), mean over the same steps",
    "num_update_steps": "steps that measured the old→new change (one every logging.update_drift_every steps)",
}
"""Per-step metrics are means over the steps that logged a finite value, except where a label says otherwise."""


def _edge_window(n: int) -> int:
    """Number of entries in a 10% window of n (at least one; as train.learning_summary)."""
    return max(1, n // 10)


def _mean_of(records: list[dict[str, Any]], key: str) -> float:
    return finite_mean(series(records, key)[1])


def ratio_of_means(num: float, den: float) -> float:
    """num / den when both are finite and den > 0, else NaN."""
    return num / den if math.isfinite(num) and math.isfinite(den) and den > 0 else math.nan


def headline_numbers(records: list[dict[str, Any]]) -> dict[str, float]:
    """The report's headline numbers (keys of HEADLINE_LABELS); NaN where the metric is absent.

    Means are over the steps whose value is finite (a null / NaN step, e.g. a variance share of an
    empty subset, is left out rather than counted as 0). The 10% windows hold max(1, n // 10) of
    the n finite reward/mean values, first or last by step (as in the training's done.json summary);
    the last 10% mean is the run's final reward everywhere. The variance ratios are ratios of means
    (not means of per-step ratios) so a near-zero seq_var on one step cannot dominate them.
    """
    _, reward = series(records, "reward/mean")
    reward = reward[np.isfinite(reward)]
    w = _edge_window(reward.size)
    var = {k: _mean_of(records, k) for k in ("ratio/token_var", "ratio/seq_var", "mismatch_ratio/token_var",
                                             "mismatch_ratio/seq_var")}
    return {
        "num_steps": float(len(records)),
        "reward_last10_mean": float(reward[-w:].mean()) if reward.size else math.nan,
        "reward_first10_mean": float(reward[:w].mean()) if reward.size else math.nan,
        "reward_last_step": float(reward[-1]) if reward.size else math.nan,
        "any_layer_flip_mean": _mean_of(records, "routing/any_layer_flip"),
        "k3_kl_mean": _mean_of(records, "mismatch/k3_kl"),
        "k3_kl_replayed_mean": _mean_of(records, "mismatch_replayed/k3_kl"),
        "mismatch_token_var_mean": var["mismatch_ratio/token_var"],
        "mismatch_seq_var_mean": var["mismatch_ratio/seq_var"],
        "mismatch_token_seq_var_ratio": ratio_of_means(var["mismatch_ratio/token_var"], var["mismatch_ratio/seq_var"]),
        "flipped_var_share_mean": _mean_of(records, "mismatch_ratio/token_var_share_flipped"),
        "update_token_var_mean": var["ratio/token_var"],
        "update_seq_var_mean": var["ratio/seq_var"],
        "update_token_seq_var_ratio": ratio_of_means(var["ratio/token_var"], var["ratio/seq_var"]),
        "clip_token_frac_mean": _mean_of(records, "clip/token_frac"),
        "clip_out_of_range_frac_mean": _mean_of(records, "clip/out_of_range_frac"),
        "update_expert_change_mean": _mean_of(records, "update/expert_change_frac"),
        "update_all_expert_change_mean": _mean_of(records, "update_all_minibatches/expert_change_frac"),
        "num_update_steps": float(np.isfinite(series(records, "update/expert_change_frac")[1]).sum()),
    }


PROBE_LABELS: dict[str, str] = {
    "num_tokens": "response tokens probed (sampled tokens, each with a rollout and a learner log-prob)",
    "num_sequences": "sequences probed (prompts × samples per prompt)",
    "num_routed_tokens": "token positions routed by both engine and learner (prompt and response rows, each "
                         "sequence's prompt included: more than the response tokens)",
    "routing/any_layer_flip": "tokens routed differently in ≥1 layer (fraction)",
    "routing/mean_layers_differing": "mean number of layers routed differently per token",
    "routing/topk_overlap": "top-k overlap (fraction of experts shared)",
    "mismatch/k1_kl": "k1 KL (nats/token)",
    "mismatch/k3_kl": "k3 KL (nats/token)",
    "mismatch/logp_abs_diff_mean": "mean |Δ log p|",
    "mismatch/logp_abs_diff_max": "max |Δ log p|",
    "mismatch/extreme_frac_ln2": "tokens with |Δ log p| > ln 2 (fraction)",
    "mismatch/extreme_frac_ln5": "tokens with |Δ log p| > ln 5 (fraction)",
    "mismatch/ppl_ratio_mean": "mean PPL ratio",
    "mismatch_ratio/token_var": "token-ratio variance (learner/rollout)",
    "mismatch_ratio/seq_var": "sequence-ratio variance (length-normalised)",
    "mismatch_ratio/seq_prod_logvar": "variance of the log ratio product",
    "mismatch_ratio/token_var_share_flipped": "share of the token-ratio variance on tokens with a routing flip",
    "mismatch_ratio/token_var_share_agreed": "share of the token-ratio variance on tokens routed identically",
    "mismatch_ratio/token_var_flipped": "token-ratio variance within tokens with a routing flip",
    "mismatch_ratio/token_var_agreed": "token-ratio variance within tokens routed identically",
    "routing_prompt/any_layer_flip": "prompt rows (each prompt once) routed differently in ≥1 layer (fraction)",
    "mismatch_ratio/flipped_token_frac": "response tokens with a routing flip (fraction)",
}


def probe_value(probe: dict[str, Any], key: str) -> float:
    """A scalar of the probe; a `mismatch_ratio/*` key is also read under `ratio/*`, the name probe files written
    before issue 43 gave the learner/rollout ratio statistics (a probe has no new/old policy ratio)."""
    if key in probe:
        return _as_float(probe[key])
    old = key.replace("mismatch_ratio/", "ratio/", 1)
    if key.startswith("mismatch_ratio/") and old in probe:
        return _as_float(probe[old])
    return math.nan


def probe_headline(probe: dict[str, Any]) -> dict[str, float]:
    """Scalar numbers of a probe JSON for the keys of PROBE_LABELS (NaN where absent)."""
    return {k: probe_value(probe, k) for k in PROBE_LABELS}
