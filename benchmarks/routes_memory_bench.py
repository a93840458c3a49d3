"""Benchmark: host memory of a step's routes at Qwen3-30B-A3B geometry, measured on synthetic arrays.

`python -m benchmarks.routes_memory_bench [--seqs 32] [--seq-len 8192] [--target-seqs 512]
[--target-seq-len 32768] [--json OUT]` builds `--seqs` synthetic samples of `--seq-len` tokens (48 MoE
layers, 128 experts, top-8: uint8 ids as vLLM returns them; prompt = 1/8 of the tokens) and runs, one stage
at a time, the host-side code of an RL step that touches the routes, measuring each stage's peak RSS above
the RSS at its start (Linux `VmHWM` after resetting it through `/proc/self/clear_refs`) and what it
leaves held (RSS), plus `tracemalloc`'s peak (numpy allocations only; torch's are not traced):

- `learner_record_microbatch` (first, on a clean heap): a replica of `ActivationRecorder.to_sequences`'
  host side as `moe_gspo.learner.old_pass.logprob_pass` runs it per micro-batch (one sequence here, as the shipped configs'
  `train.micro_batch_size: 1`): the int64 ids from the device and their uint8 copy, then the fp32
  probabilities' and the stats' `.cpu()` stack and `astype` copy (per-sequence arrays: views at one sequence);
- `samples`: the `RolloutSample` list with its uint8 `routes_TLK` (what every rank holds after the gather);
- `gather`: `all_gather_object`'s host side for one rank's share at world 8 (torch's own
  `_object_to_tensor` / `_tensor_to_object`; a clone stands for the GPU-to-host copy of each received
  tensor), unpickling all 8 shares;
- `packed_batch`: `PackedBatch.from_samples` (its routes are the samples' arrays: checked, no copy);
- `route_checks`: `moe_gspo.routing.replay_checks` as `learner_update` runs it under R3 (`check_routes`,
  `usable_prefix`, `merge_fallback_routes`; no fallback row, so views);
- `learner_record`: a replica of the host side of the end of `moe_gspo.learner.old_pass.logprob_pass` with `record_routes`
  (the pass `learner_update` runs every step): the gathered batch as uint8 ids (the device dtype up to 256
  experts), fp32 probabilities and fp32 margin/entropy, then the per-sequence unpadded copies it keeps
  (`LogprobResult`: `astype` / `.copy()`), the whole-batch arrays freed when it returns;
- `metrics_compare`, `metrics_router`: the real `moe_gspo.routing.drift_metrics.rollout_vs_learner` and
  `moe_gspo.routing.router_diag.router_diagnostics` on those routes (whole-batch concatenations, float64 copies
  of the router stats; MaxVio counts per layer in the ids' dtype);
- `drift_metrics`: the real `moe_gspo.routing.drift_metrics.policy_update_drift` (the drift probe's metrics) between
  that learner set and another (5% of the rows moved);
- `replay_microbatch`: `moe_gspo.routing.align.build_replay_topk` for one micro-batch of one sequence;
- `int64_whole_batch`: what converting every route to int64 at once would cost (no code does it now);
- `next_step_kept` / `next_step_freed`: the next step's samples built while the previous step's samples and
  learner set are still referenced (the loop before `moe_gspo.train.loop` dropped them: the plan's pre-fix
  `peak_not_freed`) / after they were dropped (the loop now).

It prints bytes per token (peak / tokens of the stage; the peak is the larger of the RSS peak, which also
holds torch's allocations and the allocator's slack, and the numpy peak, which is exactly the arrays alive)
next to the memory plan's count (`moe_gspo.plan.host_routes`), and the figures extrapolated linearly to
`--target-seqs` x `--target-seq-len` tokens (every stage's bytes are proportional to the tokens it covers;
the `*_microbatch` stages to one sequence's length). Defaults: 32 x 8192 tokens (1/64 of 512 x 32768),
< 3 GiB and ~25 s on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import pickle
import sys
import time
import tracemalloc
from dataclasses import dataclass, field

import numpy as np

L_MOE, TOP_K, NUM_EXPERTS = 48, 8, 128
WORLD = 8
GIB = float(1 << 30)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc `malloc_trim`), so that RSS counts live data only."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not possible here."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class Stage:
    name: str
    tokens: int
    peak_rss: int = 0
    held_rss: int = 0
    traced_peak: int = 0
    logical: int = 0
    """Bytes of the arrays the stage keeps, by `nbytes` (what the plan counts as held)."""
    seconds: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)


class Meter:
    def __init__(self):
        self.stages: list[Stage] = []
        self.hwm_ok = reset_peak_rss()
        gc.collect()
        trim_heap()
        self.baseline = rss_bytes()
        """RSS before any route exists (imports done)."""

    def above_baseline(self) -> int:
        gc.collect()
        trim_heap()
        return rss_bytes() - self.baseline

    @contextlib.contextmanager
    def stage(self, name: str, tokens: int, note: str = ""):
        gc.collect()
        trim_heap()
        st = Stage(name=name, tokens=tokens, note=note)
        base = rss_bytes()
        traced0 = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        reset_peak_rss()
        t0 = time.perf_counter()
        yield st
        st.seconds = time.perf_counter() - t0
        st.traced_peak = tracemalloc.get_traced_memory()[1] - traced0
        st.peak_rss = (_status_kib("VmHWM") * 1024 - base) if self.hwm_ok else 0
        gc.collect()
        trim_heap()
        st.held_rss = rss_bytes() - base
        self.stages.append(st)


def distinct_topk(rng, rows: int, num_layers: int, k: int, num_experts: int) -> np.ndarray:
    """uint8 [rows, L, k] ids, distinct within each (row, layer): offset + odd stride x slot, mod E."""
    offset = rng.integers(0, num_experts, (rows, num_layers), dtype=np.uint16)
    stride = (2 * rng.integers(0, 8, (rows, num_layers), dtype=np.uint16) + 1)
    ids = (offset[..., None] + stride[..., None] * np.arange(k, dtype=np.uint16)) % num_experts
    return ids.astype(np.uint8)


def perturb(rng, ids: np.ndarray, frac: float) -> np.ndarray:
    """A copy with the last slot of `frac` of the (row, layer) pairs moved to an expert not in the set."""
    out = ids.copy()
    pick = rng.random(ids.shape[:2]) < frac
    stride = (ids[..., 1].astype(np.int16) - ids[..., 0].astype(np.int16)) % NUM_EXPERTS
    moved = (ids[..., 0].astype(np.int16) + stride * ids.shape[2]) % NUM_EXPERTS
    out[..., -1] = np.where(pick, moved, ids[..., -1]).astype(ids.dtype)
    return out


def make_samples(rng, num_seqs: int, seq_len: int, *, group: int = 8):
    from moe_gspo.rollout.base import RolloutSample

    prompt = max(2, seq_len // 8)
    resp = seq_len - prompt
    return [RolloutSample(prompt_index=i // group, prompt_ids=rng.integers(3, 150000, prompt),
                          response_ids=rng.integers(3, 150000, resp),
                          response_logprobs=np.full(resp, -1.0, np.float32), finish_reason="length",
                          routes_TLK=distinct_topk(rng, seq_len - 1, L_MOE, TOP_K, NUM_EXPERTS))
            for i in range(num_seqs)]


def learner_record_replica(routes_src: list[np.ndarray], seq_len: int):
    """The host side of the end of `moe_gspo.learner.old_pass.logprob_pass` with record_routes (moe_gspo/learner/old_pass.py):
    the gathered batch copied to the host as uint8 ids (the device dtype up to 256 experts), fp32 probs,
    fp32 stats, then the per-sequence copies it keeps; the whole-batch arrays go when it returns."""
    B, S = len(routes_src), seq_len
    all_ids = np.empty((B, S, L_MOE, TOP_K), np.uint8)         # _gather_rows(ids_local).cpu().numpy()
    for b, r in enumerate(routes_src):
        all_ids[b, :len(r)] = r
        all_ids[b, len(r):] = r[-1]
    all_probs = np.full((B, S, L_MOE, TOP_K), 0.05, np.float32)  # _gather_rows(probs_local)
    all_stats = np.full((B, S, L_MOE, 2), 0.5, np.float32)       # _gather_rows(stats_local)
    lens = [S] * B
    routes = [np.ascontiguousarray(all_ids[b, :n].astype(np.uint8)) for b, n in enumerate(lens)]
    probs = [all_probs[b, :n].copy() for b, n in enumerate(lens)]
    stats = [all_stats[b, :n].copy() for b, n in enumerate(lens)]
    return routes, probs, stats


def record_microbatch_replica(rng, seqs: int, seq_len: int) -> None:
    """The host side of one micro-batch's recording in `moe_gspo.learner.old_pass.logprob_pass`
    (`ActivationRecorder.to_sequences` + `np.stack`, moe_gspo/learner/router_hooks.py): ids, then probs, then
    stats, each as `[S, B, L, *]` from the device (`.cpu()`), `astype`, per-sequence copies; the previous
    kind's per-sequence list lives until the next kind's returns."""
    import torch

    S, B = seq_len, seqs
    seqs_prev = None
    for what, tail, dtype in (("ids", TOP_K, np.uint8), ("probs", TOP_K, np.float32), ("stats", 2, np.float32)):
        if what == "ids":  # torch.stack(per_layer, dim=2).cpu(): the device's int64 topk indices
            stacked = torch.from_numpy(rng.integers(0, NUM_EXPERTS, (S, B, L_MOE, tail), dtype=np.int64))
        else:
            stacked = torch.full((S, B, L_MOE, tail), 0.5, dtype=torch.float32)
        arr = stacked.numpy().astype(dtype)
        out = [np.ascontiguousarray(arr[:S, b]) for b in range(B)]
        del stacked, arr
        seqs_prev = out
        torch.from_numpy(np.stack(seqs_prev))  # .to(device): the stack is the host part
    del seqs_prev


def nbytes(*lists) -> int:
    return int(sum(a.nbytes for arrays in lists for a in arrays if a is not None))


def run(args) -> dict:
    import torch

    from moe_gspo.learner.batch import PackedBatch
    from moe_gspo.plan.host_routes import bytes_per_token, record_microbatch_bytes, replay_microbatch_bytes
    from moe_gspo.plan.params import Geometry
    from moe_gspo.routing.align import build_replay_topk
    from moe_gspo.routing.replay_checks import check_routes, merge_fallback_routes, usable_prefix
    from moe_gspo.routing.drift_metrics import policy_update_drift, rollout_vs_learner
    from moe_gspo.routing.router_diag import router_diagnostics
    from torch.distributed.distributed_c10d import _object_to_tensor, _tensor_to_object

    geom = Geometry(vocab_size=151936, hidden=2048, num_layers=L_MOE, num_heads=32, num_kv_heads=4, head_dim=128,
                    intermediate=6144, moe_intermediate=768, num_experts=NUM_EXPERTS, top_k=TOP_K,
                    moe_layers=(True,) * L_MOE, tie_embeddings=False)
    plan = bytes_per_token(geom, record_routes=True)
    N, T = args.seqs, args.seq_len
    tokens, resp = N * T, T - max(2, T // 8)
    rng = np.random.default_rng(0)
    tracemalloc.start()
    m = Meter()

    with m.stage("learner_record_microbatch", T, "replica of to_sequences' host side, 1 sequence") as st:
        record_microbatch_replica(rng, 1, T)
        st.extra["plan_bytes"] = record_microbatch_bytes(geom, seqs=1, seq_len=T)
    with m.stage("samples", tokens, "RolloutSample list, uint8 routes_TLK") as st:
        samples = make_samples(rng, N, T)
        st.logical = nbytes([s.routes_TLK for s in samples])
        st.extra["plan_bytes"] = tokens * plan["rollout"]
    share = samples[:max(1, N // WORLD)]
    share_tokens = len(share) * T
    with m.stage("gather", tokens, f"all_gather_object host side: pickle 1 share, unpickle {WORLD}") as st:
        byte_tensor, size = _object_to_tensor(share, "cpu", None)
        payload = int(size.item())
        gathered = []
        for _ in range(WORLD):
            gathered.append(_tensor_to_object(byte_tensor.clone(), payload, None))  # clone: the GPU->host copy
        del byte_tensor
        st.logical = nbytes([s.routes_TLK for part in gathered for s in part])
        st.extra.update(payload_bytes=payload, share_tokens=share_tokens)
    del gathered
    with m.stage("packed_batch", tokens, "PackedBatch.from_samples (routes shared)") as st:
        batch = PackedBatch.from_samples(samples, np.zeros(N, np.float32), pad_id=0)
        shared = all(np.shares_memory(a, s.routes_TLK) for a, s in zip(batch.rollout_routes, samples))
        st.extra["routes_shared_with_samples"] = bool(shared)
        st.logical = sum(t.numel() * t.element_size() for t in (batch.input_ids_BS, batch.response_mask_BS,
                                                                 batch.rollout_logp_BS))
    dims = dict(num_layers=L_MOE, top_k=TOP_K, num_experts=NUM_EXPERTS)
    with m.stage("route_checks", tokens, "check_routes + usable_prefix + merge_fallback_routes (R3)") as st:
        reasons, r3_metrics = check_routes(batch.rollout_routes, batch.seq_lens_B.tolist(), **dims)
        comparable = usable_prefix(batch.rollout_routes, reasons, **dims)
        replay = merge_fallback_routes(batch.rollout_routes, reasons, None, num_experts=NUM_EXPERTS)
        st.extra["views"] = bool(all(np.shares_memory(a, b) for a, b in zip(replay, batch.rollout_routes)))
        st.extra["fallback_token_frac"] = r3_metrics["r3/fallback_token_frac"]
    learner_src = [perturb(rng, s.routes_TLK, 0.05) for s in samples]  # the learner's choices (5% moved)
    with m.stage("learner_record", tokens, "replica of old_pass.logprob_pass's end (record_routes)") as st:
        l_routes, l_probs, l_stats = learner_record_replica(learner_src, T)
        st.logical = nbytes(l_routes, l_probs, l_stats)
        st.extra["plan_bytes"] = tokens * (plan["learner_kept"] + plan["learner_gather"])
    del learner_src
    logp = torch.full((N, batch.seq_len_padded), -1.0)
    with m.stage("metrics_compare", tokens, "routing.drift_metrics.rollout_vs_learner") as st:
        out = rollout_vs_learner(rollout_logp_BS=batch.rollout_logp_BS, learner_logp_BS=logp,
                                 response_mask_BS=batch.response_mask_BS, rollout_routes=comparable,
                                 learner_routes=l_routes, num_experts=NUM_EXPERTS,
                                 group_ids=[s.prompt_index for s in samples])
        st.extra["expert_change_frac"] = out["routing/expert_change_frac"]
        st.extra["plan_bytes"] = tokens * plan["metrics_compare"]  # every row as a response row: an upper bound
    with m.stage("metrics_router", tokens, "routing.router_diag.router_diagnostics (float64 stats)") as st:
        router_diagnostics(response_mask_BS=batch.response_mask_BS, num_experts=NUM_EXPERTS, margin_threshold=0.01,
                           learner_routes=l_routes, learner_stats=l_stats,
                           rollout_routes=[s.routes_TLK for s in samples])
        st.extra["plan_bytes"] = N * resp * plan["metrics_router"]  # the response rows
    new_routes = [perturb(rng, r, 0.05) for r in l_routes]  # the probe's pass after the update
    with m.stage("drift_metrics", tokens, "routing.drift_metrics.policy_update_drift (drift probe)") as st:
        out = policy_update_drift(l_routes, new_routes, batch.response_mask_BS, num_experts=NUM_EXPERTS)
        st.extra["expert_change_frac"] = out["update/expert_change_frac"]
        st.extra["plan_bytes"] = N * resp * plan["drift_metrics"]  # the response rows
    del new_routes
    with m.stage("replay_microbatch", T, "build_replay_topk, 1 sequence (R2/R3, per micro-batch)") as st:
        topk = build_replay_topk(replay[:1], [T], T, num_experts=NUM_EXPERTS, top_k=TOP_K, order="sb")
        st.logical = topk.numel() * topk.element_size()
        del topk
        st.extra["plan_bytes"] = replay_microbatch_bytes(geom, seqs=1, seq_len=T)
    with m.stage("int64_whole_batch", tokens, "every route as int64 at once (no code does it)") as st:
        wide = [np.asarray(r).astype(np.int64) for r in batch.rollout_routes]
        st.logical = nbytes(wide)
        del wide
    kept_prev = (samples, batch, l_routes, l_probs, l_stats)  # what the loop keeps until it rebinds them
    with m.stage("next_step_kept", tokens, "next step's samples, previous step referenced (pre-fix loop)") as st:
        samples2 = make_samples(rng, N, T)
        st.logical = nbytes([s.routes_TLK for s in samples2]) + nbytes([s.routes_TLK for s in samples],
                                                                       l_routes, l_probs, l_stats)
    st.extra["rss_above_baseline"] = m.above_baseline()
    del samples2
    before_free = m.above_baseline()
    del kept_prev, samples, batch, comparable, replay, l_routes, l_probs, l_stats, share
    freed = before_free - m.above_baseline()
    with m.stage("next_step_freed", tokens, "next step's samples after `del` of the previous step (the loop)") as st:
        samples2 = make_samples(rng, N, T)
        st.logical = nbytes([s.routes_TLK for s in samples2])
        st.extra["rss_freed_by_del"] = freed
    st.extra["rss_above_baseline"] = m.above_baseline()
    del samples2
    tracemalloc.stop()
    return {"stages": m.stages, "tokens": tokens, "plan_per_token": plan, "hwm_ok": m.hwm_ok, "geom": geom}


def report(res: dict, args) -> dict:
    tokens, stages, plan = res["tokens"], res["stages"], res["plan_per_token"]
    target_tokens = args.target_seqs * args.target_seq_len
    scale = target_tokens / tokens
    print(f"Routes in host memory, Qwen3-30B-A3B geometry ({L_MOE} MoE layers x top-{TOP_K}, {NUM_EXPERTS} experts, "
          f"uint8 ids), {args.seqs} sequences x {args.seq_len} tokens = {tokens:,} tokens")
    if not res["hwm_ok"]:
        print("(peak RSS not measurable here: /proc/self/clear_refs not writable; traced numpy peaks only)")
    print(f"extrapolated linearly to {args.target_seqs} x {args.target_seq_len} = {target_tokens:,} tokens "
          f"(x{scale:g}; *_microbatch: x{args.target_seq_len / args.seq_len:g}, one sequence)\n")
    head = (f"{'stage':26s} {'held MiB':>9s} {'RSS held':>9s} {'RSS peak':>9s} {'np peak':>9s} {'held B/t':>8s} "
            f"{'peak B/t':>8s} {'plan B/t':>8s} {'peak GiB@target':>15s}  what")
    print(head)
    rows = {}
    for st in stages:
        t = st.tokens
        factor = (args.target_seq_len / args.seq_len) if st.name.endswith("microbatch") else scale
        peak = max(st.peak_rss, st.traced_peak)
        plan_b = st.extra.get("plan_bytes")
        rows[st.name] = {"tokens": t, "held_bytes": st.logical, "rss_held_bytes": st.held_rss,
                         "rss_peak_bytes": st.peak_rss, "traced_peak_bytes": st.traced_peak,
                         "peak_bytes_per_token": peak / t, "plan_bytes_per_token": plan_b / t if plan_b else None,
                         "peak_gib_at_target": peak * factor / GIB, "seconds": st.seconds, "what": st.note,
                         **{k: v for k, v in st.extra.items() if k != "plan_bytes"}}
        print(f"{st.name:26s} {st.logical / 2**20:9.1f} {st.held_rss / 2**20:9.1f} {st.peak_rss / 2**20:9.1f} "
              f"{st.traced_peak / 2**20:9.1f} {st.logical / t:8.0f} {peak / t:8.0f} "
              f"{(f'{plan_b / t:.0f}' if plan_b else '-'):>8s} {peak * factor / GIB:15.2f}  {st.note}")
    g = rows["gather"]
    gather_x = (g["rss_peak_bytes"] - g["held_bytes"]) / max(1, g["payload_bytes"])
    per_seq_tok = L_MOE * TOP_K
    print(f"\nbytes per representation at {args.target_seqs} x {args.target_seq_len} tokens (per rank; x8 per node):")
    for name, b in (("uint8 [T, L, K] (as vLLM returns them)", 1), ("uint16 (> 256 experts)", 2),
                    ("int32 (learner's device ids, > 256 experts)", 4), ("int64 (a whole-batch conversion)", 8)):
        print(f"  {name:44s} {target_tokens * per_seq_tok * b / GIB:8.2f} GiB")
    print(f"  {'fp32 router probs (learner, kept)':44s} {target_tokens * per_seq_tok * 4 / GIB:8.2f} GiB")
    print(f"gather transient beyond the unpickled samples: {gather_x:.1f} x one rank's pickled share "
          f"({g['payload_bytes'] / g['share_tokens']:.0f} B/token)")
    nk, nf = rows["next_step_kept"], rows["next_step_freed"]
    print(f"after the next step's rollout, RSS above the start: {nk['rss_above_baseline'] / 2**20:.0f} MiB when the "
          f"loop still references the previous step (its samples, batch and learner set; the pre-fix loop), "
          f"{nf['rss_above_baseline'] / 2**20:.0f} MiB after `del` of them (the loop now; the `del` freed "
          f"{nf['rss_freed_by_del'] / 2**20:.0f} MiB)")
    peak_of = lambda n: max(rows[n]["rss_peak_bytes"], rows[n]["traced_peak_bytes"])  # noqa: E731
    held = rows["samples"]["held_bytes"] + rows["packed_batch"]["held_bytes"]
    measured = {"old_logp": held + peak_of("learner_record"),
                "metrics": held + rows["learner_record"]["held_bytes"]
                + max(peak_of("metrics_compare"), peak_of("metrics_router"))}
    measured_target = {k: v * scale / GIB for k, v in measured.items()}
    from moe_gspo.plan.host_routes import route_host_bytes

    planned = route_host_bytes(res["geom"], num_seqs=args.target_seqs, seq_len=args.target_seq_len, record_routes=True)
    print(f"one step on one rank at {args.target_seqs} x {args.target_seq_len} (R3 routes recorded, no drift probe), "
          f"stages summed: old-policy pass end {measured_target['old_logp']:.1f} GiB, step metrics "
          f"{measured_target['metrics']:.1f} GiB; the plan counts {planned.total('old_logp') / GIB:.1f} and "
          f"{planned.total('metrics') / GIB:.1f} GiB (every token as a response token); x8 ranks per node")
    return {"tokens": tokens, "target_tokens": target_tokens, "scale": scale, "stages": rows,
            "plan_bytes_per_token": plan, "gather_transient_x_payload": gather_x,
            "step_per_rank_gib_at_target": {"measured": measured_target,
                                            "plan": {m: planned.total(m) / GIB for m in planned.moments}}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.routes_memory_bench",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=32, help="sequences measured (default 32)")
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence measured (default 8192)")
    ap.add_argument("--target-seqs", type=int, default=512, help="sequences to extrapolate to (default 512)")
    ap.add_argument("--target-seq-len", type=int, default=32768, help="tokens per sequence to extrapolate to")
    ap.add_argument("--json", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.seqs < 1 or args.seq_len < 16:
        ap.error("--seqs >= 1 and --seq-len >= 16")
    t0 = time.perf_counter()
    out = report(run(args), args)
    out["seconds"] = time.perf_counter() - t0
    print(f"({out['seconds']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
