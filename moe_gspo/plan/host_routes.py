"""Host memory of the routes of an RL step, per rank (pure arithmetic): the memory plan's `host_routes`.

Every rank holds the step's global batch after `moe_gspo.run.steps.gather_samples` (the learner takes the
same global batch on every rank), so a rank counts all `N = rollout.prompts_per_step x
rollout.samples_per_prompt` sequences, each taken at the plan's sequence length `T` (`rollout.max_model_len`,
else prompt + `rollout.max_new_tokens`): `tokens = N x T`, an upper bound (responses that stop early hold
fewer rows). A node holds that times its ranks. `L` MoE layers, top-`K`, `b` bytes per expert id (1 = uint8
when `num_experts <= 256`, else 2 = uint16; `moe_gspo.routing.trace.ids_dtype`).

Bytes per token (read in the code that allocates them):
- **rollout** (`rollout_bytes_per_token`, with `rollout.record_routes`): the samples' `routes_TLK`
  `L K b` as vLLM returns them (uint8/uint16; `moe_gspo.rollout.vllm_outputs` keeps that dtype, dropping
  dense layers' columns), plus with the transformers engine and `rollout.record_probs` the router
  probabilities `L K x 2` (fp16) and the router margin and entropy `2 L x 2` (fp16). `PackedBatch.
  rollout_routes`, `usable_prefix`, `merge_fallback_routes` and the traces' views share these arrays (no copy).
- **learner, kept** (`learner_kept_bytes_per_token`): the old-policy pass of `moe_gspo.run.learner_passes.
  learner_update` always records the learner's routing (`Learner.compute_logprobs(record_routes=True)`):
  at its end the whole gathered batch is copied to the host (`all_ids` int32, `all_probs` fp32,
  `all_stats` fp32, `[B, S_max, ...]` in `Learner._logprob_pass`) and the step keeps (`LogprobResult`) per
  sequence uint8/uint16 routes `L K b` (copies) and the router probabilities `L K x 4` and margin / entropy
  `2 L x 4` as views of `all_probs` / `all_stats` (`np.ascontiguousarray` of a leading-dimension slice is a
  view), which therefore stay alive whole, padding included.
- **learner, transient** (`learner_gather_bytes_per_token`): the int32 ids `all_ids`, `L K x 4`, until the
  pass returns.
- **metrics, transient** (`metrics_bytes_per_token`): the rollout-vs-learner and router metrics
  (`moe_gspo.run.compare.rollout_vs_learner`, `moe_gspo.run.router_diag.router_diagnostics`) concatenate
  the response rows of both sides (`2 L K b`) and the learner's stats (`2 L x 4`), and MaxVio
  (`moe_gspo.routing.router_stats.max_vio`) converts the ids to int64 and adds a layer offset: two int64
  copies `2 x 8 L K` over the whole batch.
- **drift probe** (`logging.update_drift_every` steps): each of its passes (two; one with
  `train.num_minibatches = 1`) keeps another learner set until the step's metrics are computed; its
  metrics (`policy_update_drift`) concatenate both sides' rows and build one int64 copy: `L K (2 b + 8)`.
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
arrays inside `generate`), and the GPU side of the learner's recording (its int32 / fp32 `[rows, S, L, K]`
tensors and their all-gather), which is GPU memory.

Moments (bytes per rank), the peak is the largest:
- `rollout`: (rounds - 1 + copies) x tokens x rollout + gather, `copies` = the engine's TP (each of its
  ranks sends the same samples; 1 at TP = 1, which routes need) (+ R2: the learner's `_recorded` routes of
  the previous step and its int64 copy of the token ids, `tokens x (L K b + 8)`, which it keeps until the
  next old-policy pass);
- `old_logp`: tokens x (rollout + learner kept + learner transient);
- `metrics`: tokens x (rollout + learner kept + metrics transient) (+ R3 copy);
- `update`: tokens x (rollout + learner kept x (1 + drift passes)) (+ R3 copy) + the largest of the replay
  micro-batch (R2 / R3) and, on a probe step, its last pass's transient and its metrics' copies.
The count assumes the training loop drops the step's samples, batch and passes at the end of an iteration
(`moe_gspo.train.loop`); a loop that keeps them until the next iteration rebinds them also holds the
previous step's learner sets through the next step's rollout and learner passes, and its rollout routes
through the next rollout (`RouteHostBytes.previous_step`, `peak_not_freed`).

Measured against this count (synthetic arrays, the real code where it is host-only, a replica of the
learner's host side): `python -m moe_gspo.bench.routes_memory_bench` (docs/gpu.md, "Memory plan").
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_gspo.plan.params import Geometry


def id_bytes(num_experts: int) -> int:
    """Bytes of one expert id as engines and traces store it: uint8 up to 256 experts, else uint16."""
    return 1 if num_experts <= 256 else 2


def rollout_bytes_per_token(geom: Geometry, *, record_routes: bool, record_probs: bool = False) -> int:
    """Host bytes of one token's rollout routes in a `RolloutSample` (0 when routes are not recorded)."""
    if not record_routes or not geom.num_moe_layers:
        return 0
    lk, L = geom.num_moe_layers * geom.top_k, geom.num_moe_layers
    return lk * id_bytes(geom.num_experts) + ((lk * 2 + 2 * L * 2) if record_probs else 0)


def learner_kept_bytes_per_token(geom: Geometry) -> int:
    """The old-policy pass's recorded routes, fp32 router probabilities and fp32 margin/entropy."""
    lk, L = geom.num_moe_layers * geom.top_k, geom.num_moe_layers
    return lk * (id_bytes(geom.num_experts) + 4) + 2 * L * 4


def learner_gather_bytes_per_token(geom: Geometry) -> int:
    """The whole-batch int32 ids a learner pass copies to the host at its end (freed when it returns)."""
    return geom.num_moe_layers * geom.top_k * 4


def metrics_bytes_per_token(geom: Geometry, *, record_routes: bool = True) -> int:
    """The step metrics' whole-batch copies: both sides' response rows (the learner's only without
    rollout routes), the learner's stats, MaxVio's two int64 copies."""
    lk, L = geom.num_moe_layers * geom.top_k, geom.num_moe_layers
    return lk * ((2 if record_routes else 1) * id_bytes(geom.num_experts) + 2 * 8) + 2 * L * 4


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
    the samples hold), `learner` (the learner's recorded sets kept, R2's previous routes, R3's merged copy),
    `transient` (the moment's short-lived copies)."""
    previous_step: dict[str, float]
    """Per moment, what a loop that keeps a step's objects until the next iteration rebinds them adds: the
    previous step's learner sets (`passes.old` and the probe's last pass, held until `learner_update`
    returns) and, at the rollout, its rollout routes (`samples`, `batch`)."""
    per_token: dict[str, int]
    """Bytes per token of each kind (`rollout`, `learner_kept`, `learner_gather`, `metrics`)."""

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
        """The peak when the loop keeps the previous step's objects (an upper bound: it assumes both steps
        are probe steps)."""
        return max((self.total(m) + self.previous_step[m] for m in self.moments), default=0.0)

    def part(self, name: str) -> float:
        """Part `name` at the peak moment."""
        return self.moments[self.peak_moment][name] if self.moments else 0.0


def route_host_bytes(geom: Geometry, *, num_seqs: int, seq_len: int, record_routes: bool,
                     record_probs: bool = False, gen_rounds: int = 1, drift_passes: int = 0,
                     replay: str = "none", replay_mb_seqs: int = 1, gather_bytes: float = 0.0,
                     gather_copies: int = 1) -> RouteHostBytes:
    """Host bytes of the routes on one rank for a step of `num_seqs` sequences of `seq_len` tokens.

    `gen_rounds`: generation rounds held at once (dynamic sampling's bound, else 1); `drift_passes`: the
    routing-drift probe's learner passes on a probe step (0 when off); `replay`: "none", "r2" or "r3";
    `replay_mb_seqs`: sequences per learner micro-batch (replay tensors); `gather_bytes`: the sample
    gather's host transient (bytes); `gather_copies`: how many ranks send each engine's samples (a vLLM
    engine's TP: the gathered list holds that many copies of a round until they are deduplicated)."""
    if not geom.num_moe_layers:
        return RouteHostBytes(tokens=0, moments={}, previous_step={}, per_token={})
    tokens = int(num_seqs) * int(seq_len)
    lkb = geom.num_moe_layers * geom.top_k * id_bytes(geom.num_experts)
    per_rollout = rollout_bytes_per_token(geom, record_routes=record_routes, record_probs=record_probs)
    per = {"rollout": per_rollout,
           "learner_kept": learner_kept_bytes_per_token(geom),
           "learner_gather": learner_gather_bytes_per_token(geom),
           "metrics": metrics_bytes_per_token(geom, record_routes=per_rollout > 0)}
    rollout = float(tokens * per["rollout"])
    kept = float(tokens * per["learner_kept"])
    gather_t, metrics_t = float(tokens * per["learner_gather"]), float(tokens * per["metrics"])
    r3_copy = float(tokens * lkb) if replay == "r3" else 0.0
    r2_prev = float(tokens * (lkb + 8)) if replay == "r2" else 0.0  # the routes and an int64 copy of the ids
    replay_mb = replay_microbatch_bytes(geom, seqs=replay_mb_seqs, seq_len=seq_len) if replay in ("r2", "r3") else 0.0
    drift = max(0, int(drift_passes))
    drift_t = float(tokens * geom.num_moe_layers * geom.top_k * (2 * id_bytes(geom.num_experts) + 8))
    moments = {
        "rollout": {"rollout": (max(1, int(gen_rounds)) - 1 + max(1, int(gather_copies))) * rollout, "learner": r2_prev,
                    "transient": float(gather_bytes)},
        "old_logp": {"rollout": rollout, "learner": kept, "transient": gather_t},
        "metrics": {"rollout": rollout, "learner": kept + r3_copy, "transient": metrics_t},
        "update": {"rollout": rollout, "learner": kept * (1 + drift) + r3_copy,
                   "transient": max(replay_mb, gather_t, drift_t) if drift else replay_mb},
    }
    prev_kept = kept * (2 if drift else 1)
    previous = {m: prev_kept + (rollout if m == "rollout" else 0.0) for m in moments}
    return RouteHostBytes(tokens=tokens, moments=moments, previous_step=previous, per_token=per)
