"""Host memory of the routes of an RL step, per rank (pure arithmetic): the memory plan's `host_routes`.

Every rank holds the step's global batch after `moe_gspo.run.steps.gather_samples` (the learner takes the
same global batch on every rank), so a rank counts all `N = rollout.prompts_per_step x
rollout.samples_per_prompt` sequences, each taken at the plan's sequence length `T` (`rollout.max_model_len`,
else prompt + `rollout.max_new_tokens`): `tokens = N x T`, an upper bound (responses that stop early hold
fewer rows; the metrics' rows are counted as if every row were a response row). A node holds that times its
ranks. `L` MoE layers, top-`K`, `b` bytes per expert id as routes are kept (1 = uint8 when
`num_experts <= 256`, else 2 = uint16; `moe_gspo.routing.trace.ids_dtype`), `g` bytes per id of the
learner's whole-batch ids (1 = uint8 up to 256 experts, else 4 = int32: gloo has no int16).

Bytes per token (read in the code that allocates them):
- **rollout** (`rollout_bytes_per_token`, with `rollout.record_routes`): the samples' `routes_TLK`
  `L K b` as vLLM returns them (uint8/uint16; `moe_gspo.rollout.vllm_outputs` keeps that dtype, dropping
  dense layers' columns), plus with the transformers engine and `rollout.record_probs` the router
  probabilities `L K x 2` (fp16) and the router margin and entropy `2 L x 2` (fp16). `PackedBatch.
  rollout_routes`, `usable_prefix`, `merge_fallback_routes` and the traces' views share these arrays (no copy).
- **learner, kept** (`learner_kept_bytes_per_token`): the old-policy pass of `moe_gspo.run.learner_passes.
  learner_update` always records the learner's routing (`Learner.compute_logprobs(record_routes=True)`);
  the step keeps (`LogprobResult`) per sequence, unpadded, copies of its routes `L K b`
  (`all_ids[b, :n].astype(...)`), router probabilities `L K x 4` and margin / entropy `2 L x 4`
  (`all_probs[b, :n].copy()`, `all_stats[b, :n].copy()`): `L K (b + 4) + 8 L`.
- **learner, transient** (`learner_gather_bytes_per_token`): at the end of `moe_gspo.learner.old_pass.logprob_pass` the
  gathered whole batch comes to the host, `all_ids` (the device dtype: `L K g`), `all_probs` fp32 `4 L K`
  and `all_stats` fp32 `8 L`, `[B, S_max, ...]`, all alive while the per-sequence copies are made and
  freed when the pass returns: `L K (g + 4) + 8 L`. During the pass, each micro-batch's recording comes to
  the host in `ActivationRecorder.to_sequences` (`record_microbatch_bytes`: the int64 ids `8 L K`, their
  uint8/uint16 copy and per-sequence copies `2 b L K`; then the fp32 probabilities, the `.cpu()` stack, its
  `astype` copy and per-sequence copies `12 L K`, next to the ids' `b L K`; then the stats `24 L` next to
  the probabilities' `4 L K`; with one sequence per micro-batch the per-sequence arrays are views:
  `max((8 + b) L K, 4 L K + 16 L)`), per micro-batch token (padded rows included); it never coexists with
  the pass-end arrays (counted as the larger of the two, an upper bound).
- **metrics, transient** (`metrics_bytes_per_token`, the larger of the two, which run one after the other):
  - `moe_gspo.routing.drift_metrics.rollout_vs_learner` (`compare_bytes_per_token`; only with rollout routes): both
    sides' response rows and, for `routing_prompt/*`, the first group member's prompt rows, concatenated
    (`stack_rows`, `2 L K b`, in the ids' dtype), kept until it returns; `routing_drift` adds its `[n, L]`
    int32 intersection, the bool difference, `2 K - inter` (int32) and the float64 Jaccard ratio (`17 L`)
    or, counting expert load per layer (`expert_load`), one layer's ravelled ids and `np.bincount`'s intp
    copy of them (`K (b + 8)`); `flipped_response_mask` then stacks both sides' rows of every position
    again (`2 L K b`) with its bool `[B, S]` output (1), its int64 row and column indices (16; 32 while
    the columns are computed) and `per_token_flip_mask`'s int32 intersection and bool difference (`5 L`):
    `max(2 L K b + max(17 L, K (b + 8)), 4 L K b + 1 + max(32, 16 + 5 L))`.
  - `moe_gspo.routing.router_diag.router_diagnostics` (`router_bytes_per_token`): both sides' rows concatenated
    (`L K b` each; the learner's only without rollout routes) and the learner's stats (fp32, `8 L`), then
    `router_summary` makes float64 copies of the margin, of the small-margin indicator and of the entropy
    (`24 L`; the transformers engine's rollout side does the same on its fp16 rows, less); MaxVio
    (`moe_gspo.routing.router_stats.max_vio` through `expert_load`) counts one layer at a time in the ids'
    dtype: `K (b + 8)`, no whole-batch int64 copy: `sides L K b + 8 L + max(24 L, K (b + 8))`.
  Not per token: wherever two routings are compared (`routing_drift`, `flipped_response_mask`,
  `flip_by_margin`'s layer difference), `moe_gspo.routing.drift._intersection`'s chunk of at most 4096 rows,
  a bool `[4096, L, K, K]` and its int64 sum (14 MiB at L = 48, K = 8).
- **drift probe** (`logging.update_drift_every` steps): each of its passes (two; one with
  `train.num_minibatches = 1`) keeps another learner set until the step's metrics are computed, its last
  pass has the pass-end transient next to them, and its metrics (`policy_update_drift`, one call at a time)
  stack both sides' response rows and run `routing_drift`: `drift_bytes_per_token`,
  `2 L K b + max(17 L, K (b + 8))`.
- **R2**: the update replays the old-policy pass's routes (`OldPolicyPass.natural.routes`, the learner set
  itself, no copy); nothing of R2 outlives the step.
- **R3**: `merge_fallback_routes` copies a sequence that has fallback rows: counted as one more copy of
  the routes (`L K b`, every sequence; none is made when no row falls back). R2 / R3 replay build
  `build_replay_topk`'s int64 `[L, S, B_mb, K]` per micro-batch (its clone, the sort's values and
  indices, the duplicate check: `(3 x 8 + 1) L K` per micro-batch token, `B_mb x T` tokens;
  `replay_microbatch_bytes`).
- **dynamic sampling** (`algo.dynamic_sampling`): `moe_gspo.run.sampling.collect_batch` keeps every drawn
  group until the batch is cut, so the rollout holds up to `algo.max_num_gen_batches` rounds of samples.
- **gather**: `all_gather_object` pickles this rank's samples (a `BytesIO`, its `getvalue()` and the byte
  storage) and unpickles each rank's from a host copy of its byte tensor and its `tobytes()`: `3 x` one
  engine's pickled samples (`transients.sample_payload_bytes`; 3.5 x measured on CPU, where the own byte
  tensor also stays on the host) besides the unpickled samples themselves; the gathered list holds each
  engine's samples once per rank of the engine until they are deduplicated.
Not counted: the engines' own buffers (vLLM's routed-experts capture, the transformers engine's whole-share
arrays inside `generate`), the GPU side of the learner's recording (its uint8 / int32 / fp32 `[rows, S, L,
K]` tensors and their all-gather), which is GPU memory, the metrics' `[B, S]` log-prob tensors, and the
traces `moe_gspo.run.steps.save_step_traces` writes on rank 0 every `logging.trace_every` steps.

Moments (bytes per rank), the peak is the largest:
- `rollout`: (rounds - 1 + copies) x tokens x rollout + gather, `copies` = the engine's TP (each of its
  ranks sends the same samples; 1 at TP = 1, which routes need); nothing of the previous step;
- `old_logp`: tokens x (rollout + learner kept + learner transient) (+ R2's token ids);
- `metrics`: tokens x (rollout + learner kept + metrics transient) (+ R3 copy, R2's token ids);
- `update`: tokens x (rollout + learner kept x (1 + drift passes)) (+ R3 copy, R2's token ids) + the largest
  of the replay micro-batch (R2 / R3) and, on a probe step, its last pass's transient and its metrics.
The count assumes what `moe_gspo.train.loop` does: it drops the step's samples, batch and passes at the end
of an iteration (`del drawn, samples, batch, passes`). `RouteHostBytes.previous_step` and `peak_not_freed`
are the pre-fix figure, kept because the plan still notes it (`moe_gspo.plan.memory`): a loop without that
`del`, which keeps them until the next iteration rebinds them, also holds the previous step's learner sets
through the next step's rollout and learner passes, and its rollout routes through the next rollout.

Measured against this count (synthetic arrays, the real code where it is host-only, a replica of the
learner's host side): `python -m benchmarks.routes_memory_bench` (docs/gpu.md, "Memory plan").
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_gspo.learner.replay_plan import replay_spec
from moe_gspo.plan.params import Geometry
from moe_gspo.routing.trace import ids_dtype

def id_bytes(num_experts: int) -> int:
    """Bytes of one expert id as engines, traces and the learner's kept routes store it
    (`moe_gspo.routing.trace.ids_dtype`: uint8 up to 256 experts, else uint16)."""
    return ids_dtype(num_experts).itemsize


def learner_id_bytes(num_experts: int) -> int:
    """Bytes of one expert id in the learner pass's whole-batch `all_ids` (its device dtype,
    `ids_dtype(collective=True)`: uint8 up to 256 experts, else int32, gloo having no int16)."""
    return ids_dtype(num_experts, collective=True).itemsize


def rollout_bytes_per_token(geom: Geometry, *, record_routes: bool, record_probs: bool = False) -> int:
    """Host bytes of one token's rollout routes in a `RolloutSample` (0 when routes are not recorded)."""
    if not record_routes or not geom.num_moe_layers:
        return 0
    lk, L = geom.num_moe_layers * geom.top_k, geom.num_moe_layers
    return lk * id_bytes(geom.num_experts) + ((lk * 2 + 2 * L * 2) if record_probs else 0)


def learner_kept_bytes_per_token(geom: Geometry) -> int:
    """The old-policy pass's per-sequence copies kept for the step: routes, fp32 router probabilities and
    fp32 margin/entropy."""
    lk, L = geom.num_moe_layers * geom.top_k, geom.num_moe_layers
    return lk * (id_bytes(geom.num_experts) + 4) + 2 * L * 4


def learner_gather_bytes_per_token(geom: Geometry) -> int:
    """The whole-batch arrays a learner pass brings to the host at its end (`all_ids` in the device dtype,
    fp32 `all_probs` and `all_stats`), freed when it returns."""
    lk, L = geom.num_moe_layers * geom.top_k, geom.num_moe_layers
    return lk * (learner_id_bytes(geom.num_experts) + 4) + 2 * L * 4


def _drift_transient(geom: Geometry) -> int:
    """`routing_drift`'s own arrays per compared row: the larger of its `[n, L]` int32 / bool / int32 /
    float64 arrays (17 L) and one layer's `expert_load` count (ravelled ids + `np.bincount`'s intp copy)."""
    L, K, b = geom.num_moe_layers, geom.top_k, id_bytes(geom.num_experts)
    return max(17 * L, K * (b + 8))


def compare_bytes_per_token(geom: Geometry, *, record_routes: bool = True) -> int:
    """`rollout_vs_learner`'s peak (0 without rollout routes: it compares log-probs only): the stacked rows
    with `routing_drift`'s arrays, or `flipped_response_mask`'s second stack of every row with its indices
    and intersection."""
    if not record_routes or not geom.num_moe_layers:
        return 0
    L, lkb = geom.num_moe_layers, geom.num_moe_layers * geom.top_k * id_bytes(geom.num_experts)
    return max(2 * lkb + _drift_transient(geom), 4 * lkb + 1 + max(32, 16 + 5 * L))


def router_bytes_per_token(geom: Geometry, *, record_routes: bool = True) -> int:
    """`router_diagnostics`' peak: both sides' rows (the learner's only without rollout routes), the
    learner's fp32 stats, and the larger of `router_summary`'s three float64 copies and one layer's
    MaxVio count."""
    L, K, b = geom.num_moe_layers, geom.top_k, id_bytes(geom.num_experts)
    return (2 if record_routes else 1) * L * K * b + 8 * L + max(24 * L, K * (b + 8))


def metrics_bytes_per_token(geom: Geometry, *, record_routes: bool = True) -> int:
    """The step metrics' whole-batch copies: the larger of `rollout_vs_learner`'s and `router_diagnostics`'
    (they run one after the other)."""
    return max(compare_bytes_per_token(geom, record_routes=record_routes),
               router_bytes_per_token(geom, record_routes=record_routes))


def drift_bytes_per_token(geom: Geometry) -> int:
    """The drift probe's metrics (`policy_update_drift`): both sides' stacked rows and `routing_drift`'s."""
    return 2 * geom.num_moe_layers * geom.top_k * id_bytes(geom.num_experts) + _drift_transient(geom)


def record_microbatch_bytes(geom: Geometry, *, seqs: int, seq_len: int) -> float:
    """`ActivationRecorder.to_sequences`' host arrays for one micro-batch of a recording learner pass
    (`seqs` sequences padded to `seq_len`), the largest of: the ids (int64 from the device, their
    uint8/uint16 copy, per-sequence copies), the fp32 probabilities (the same three) next to the ids'
    per-sequence arrays, the stats (the same three) next to the probabilities'. With one sequence the
    per-sequence arrays are views (`arr[:n, 0]` is contiguous), one copy fewer of each."""
    L, K, b = geom.num_moe_layers, geom.top_k, id_bytes(geom.num_experts)
    seqs = max(1, int(seqs))
    if seqs == 1:
        per = max((8 + b) * L * K, 4 * L * K + 16 * L)
    else:
        per = max((8 + 2 * b) * L * K, (b + 12) * L * K, 4 * L * K + 24 * L)
    return float(per * seqs * int(seq_len))


def replay_microbatch_bytes(geom: Geometry, *, seqs: int, seq_len: int) -> float:
    """`build_replay_topk`'s host allocations for one micro-batch of `seqs` sequences padded to `seq_len`:
    the int64 `[L, S, B, K]` clone, the sort's int64 values and indices, the duplicate check's bool."""
    return float((3 * 8 + 1) * geom.num_moe_layers * geom.top_k * max(1, int(seqs)) * int(seq_len))


@dataclass(frozen=True, kw_only=True)
class RouteHostBytes:
    """Host bytes of the routes on one rank (see the module docstring)."""

    tokens: int
    """Tokens of the step's global batch the plan counts (N x T)."""
    moments: dict[str, dict[str, float]]
    """Per moment (`rollout`, `old_logp`, `metrics`, `update`) its parts: `rollout` (the rollout routes
    the samples hold), `learner` (the learner's recorded sets kept, R2's token ids, R3's merged copy),
    `transient` (the moment's short-lived copies)."""
    previous_step: dict[str, float]
    """The pre-fix figure (`moe_gspo.train.loop` now drops the step's objects; `moe_gspo.plan.memory` still
    notes it): per moment, what a loop that keeps a step's objects until the next iteration rebinds them
    adds: the previous step's learner sets (`passes.old` and the probe's last pass, held until
    `learner_update` returns) and, at the rollout, its rollout routes (`samples`, `batch`)."""
    per_token: dict[str, int]
    """Bytes per token of each kind (`rollout`, `learner_kept`, `learner_gather`, `metrics`, and the parts
    `metrics_compare`, `metrics_router`, `drift_metrics`)."""

    def total(self, moment: str) -> float:
        return sum(self.moments[moment].values())

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.total) if self.moments else "none"

    @property
    def peak(self) -> float:
        return self.total(self.peak_moment) if self.moments else 0.0

    @property
    def peak_not_freed(self) -> float:
        """The pre-fix peak, when the loop keeps the previous step's objects (an upper bound: it assumes
        both steps are probe steps)."""
        return max((self.total(m) + self.previous_step[m] for m in self.moments), default=0.0)

    def part(self, name: str) -> float:
        """Part `name` at the peak moment."""
        return self.moments[self.peak_moment][name] if self.moments else 0.0


def bytes_per_token(geom: Geometry, *, record_routes: bool, record_probs: bool = False) -> dict[str, int]:
    """Bytes per token of each kind the count uses (`rollout`, `learner_kept`, `learner_gather`, `metrics`
    and its parts `metrics_compare` / `metrics_router`, `drift_metrics`)."""
    per_rollout = rollout_bytes_per_token(geom, record_routes=record_routes, record_probs=record_probs)
    with_routes = per_rollout > 0
    return {"rollout": per_rollout,
            "learner_kept": learner_kept_bytes_per_token(geom),
            "learner_gather": learner_gather_bytes_per_token(geom),
            "metrics": metrics_bytes_per_token(geom, record_routes=with_routes),
            "metrics_compare": compare_bytes_per_token(geom, record_routes=with_routes),
            "metrics_router": router_bytes_per_token(geom, record_routes=with_routes),
            "drift_metrics": drift_bytes_per_token(geom)}


def route_host_bytes(geom: Geometry, *, num_seqs: int, seq_len: int, record_routes: bool,
                     record_probs: bool = False, gen_rounds: int = 1, drift_passes: int = 0,
                     replay: str = "none", replay_mb_seqs: int = 1, gather_bytes: float = 0.0,
                     gather_copies: int = 1) -> RouteHostBytes:
    """Host bytes of the routes on one rank for a step of `num_seqs` sequences of `seq_len` tokens.

    `gen_rounds`: generation rounds held at once (dynamic sampling's bound, else 1); `drift_passes`: the
    routing-drift probe's learner passes on a probe step (0 when off); `replay`: "none", "r2" or "r3";
    `replay_mb_seqs`: sequences per learner micro-batch of the log-prob passes (the recording's and the
    replay tensors' micro-batch); `gather_bytes`: the sample gather's host transient (bytes);
    `gather_copies`: how many ranks send each engine's samples (a vLLM engine's TP: the gathered list holds
    that many copies of a round until they are deduplicated)."""
    if not geom.num_moe_layers:
        return RouteHostBytes(tokens=0, moments={}, previous_step={}, per_token={})
    tokens = int(num_seqs) * int(seq_len)
    lkb = geom.num_moe_layers * geom.top_k * id_bytes(geom.num_experts)
    per = bytes_per_token(geom, record_routes=record_routes, record_probs=record_probs)
    rollout = float(tokens * per["rollout"])
    kept = float(tokens * per["learner_kept"])
    record_mb = record_microbatch_bytes(geom, seqs=replay_mb_seqs, seq_len=seq_len)
    pass_t = max(float(tokens * per["learner_gather"]), record_mb)  # the pass end, or one micro-batch's
    metrics_t = float(tokens * per["metrics"])
    spec = replay_spec(replay)  # the merged copy of the checked rollout routes, the replay micro-batch tensors
    r3_copy = float(tokens * lkb) if spec.replays_rollout else 0.0
    replay_mb = replay_microbatch_bytes(geom, seqs=replay_mb_seqs, seq_len=seq_len) if spec.replays else 0.0
    drift = max(0, int(drift_passes))
    drift_t = float(tokens * per["drift_metrics"])
    moments = {
        "rollout": {"rollout": (max(1, int(gen_rounds)) - 1 + max(1, int(gather_copies))) * rollout, "learner": 0.0,
                    "transient": float(gather_bytes)},
        "old_logp": {"rollout": rollout, "learner": kept, "transient": pass_t},
        "metrics": {"rollout": rollout, "learner": kept + r3_copy, "transient": metrics_t},
        "update": {"rollout": rollout, "learner": kept * (1 + drift) + r3_copy,
                   "transient": max(replay_mb, pass_t, drift_t) if drift else replay_mb},
    }
    prev_kept = kept * (2 if drift else 1)
    previous = {m: prev_kept + (rollout if m == "rollout" else 0.0) for m in moments}
    return RouteHostBytes(tokens=tokens, moments=moments, previous_step=previous, per_token=per)
