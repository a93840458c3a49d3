"""The routes' host memory in the plan (issue 34, deliverable 5): hand counts for a small config, the host
total includes them, the JSON and the table show them."""

from __future__ import annotations

import json

import pytest

from moe_gspo.plan.__main__ import main
from moe_gspo.plan.from_config import plan_for_config, resolve_hf_config, sequence_length
from moe_gspo.plan.host_routes import (compare_bytes_per_token, drift_bytes_per_token,
                                       learner_gather_bytes_per_token, learner_kept_bytes_per_token,
                                       metrics_bytes_per_token, record_microbatch_bytes, replay_microbatch_bytes,
                                       rollout_bytes_per_token, route_host_bytes, router_bytes_per_token)
from moe_gspo.plan.memory import GIB
from moe_gspo.plan.params import Geometry
from tests.plan.test_plan_memory import cfg

TINY = "configs/tiny_cpu.yaml"


def small_geometry(num_experts: int = 8) -> Geometry:
    """2 MoE layers (of 3), top-2."""
    return Geometry(vocab_size=32, hidden=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate=128, moe_intermediate=32, num_experts=num_experts, top_k=2,
                    moe_layers=(False, True, True), tie_embeddings=False)


def test_bytes_per_token_by_hand():
    g = small_geometry()  # L = 2 MoE layers, K = 2, 8 experts: uint8 ids
    assert rollout_bytes_per_token(g, record_routes=True) == 2 * 2 * 1
    assert rollout_bytes_per_token(g, record_routes=False) == 0
    # transformers engine with record_probs: + fp16 probs [L, K] + fp16 margin and entropy [L] each
    assert rollout_bytes_per_token(g, record_routes=True, record_probs=True) == 4 + 2 * 2 * 2 + 2 * 2 * 2
    # learner, kept: per-sequence copies of the uint8 routes, fp32 probs [L, K], fp32 margin/entropy [L, 2]
    assert learner_kept_bytes_per_token(g) == 4 * 1 + 4 * 4 + 2 * 2 * 4 == 36
    # the pass end's whole-batch arrays: uint8 ids (the device dtype), fp32 probs and stats
    assert learner_gather_bytes_per_token(g) == 4 * 1 + 4 * 4 + 2 * 2 * 4 == 36
    # rollout_vs_learner: stacked rows + routing_drift's [n, L] int32/bool/int32/float64 (17 L = 34 > one
    # layer's bincount K (b + 8) = 18), or flipped_response_mask's second stack + out + indices (32 while the
    # columns are computed > 16 + 5 L = 26)
    assert compare_bytes_per_token(g) == max(2 * 4 + 34, 4 * 4 + 1 + 32) == 49
    assert compare_bytes_per_token(g, record_routes=False) == 0
    # router_diagnostics: both sides' rows, fp32 stats (8 L), three float64 [M, L] copies (24 L)
    assert router_bytes_per_token(g) == 2 * 4 + 16 + 48 == 72
    assert router_bytes_per_token(g, record_routes=False) == 4 + 16 + 48
    assert metrics_bytes_per_token(g) == 72 and metrics_bytes_per_token(g, record_routes=False) == 68
    assert drift_bytes_per_token(g) == 2 * 4 + 34
    big = small_geometry(num_experts=512)  # > 256 experts: uint16 ids kept, int32 on the device
    assert rollout_bytes_per_token(big, record_routes=True) == 2 * 2 * 2
    assert learner_kept_bytes_per_token(big) == 4 * 2 + 4 * 4 + 16
    assert learner_gather_bytes_per_token(big) == 4 * 4 + 4 * 4 + 16
    assert replay_microbatch_bytes(g, seqs=2, seq_len=10) == 25 * 4 * 2 * 10
    # one micro-batch's recording: one sequence (views) / several (per-sequence copies)
    assert record_microbatch_bytes(g, seqs=1, seq_len=10) == max(9 * 4, 4 * 4 + 16 * 2) * 10
    assert record_microbatch_bytes(g, seqs=2, seq_len=10) == max(10 * 4, 13 * 4, 4 * 4 + 24 * 2) * 2 * 10
    qwen30 = Geometry(vocab_size=151936, hidden=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                      intermediate=6144, moe_intermediate=768, num_experts=128, top_k=8, moe_layers=(True,) * 48,
                      tie_embeddings=False)
    assert record_microbatch_bytes(qwen30, seqs=1, seq_len=1) == 9 * 384
    assert record_microbatch_bytes(qwen30, seqs=2, seq_len=1) == 2 * 13 * 384
    assert compare_bytes_per_token(qwen30) == 4 * 384 + 1 + 16 + 5 * 48 == 1793
    assert router_bytes_per_token(qwen30) == 2 * 384 + 32 * 48 == 2304
    # no int64 copy of the whole batch left (MaxVio and expert load count one layer at a time): the former
    # count with MaxVio's two int64 copies was 384 (2 + 16) + 8 x 48 = 7296
    assert metrics_bytes_per_token(qwen30) == 2304 < 384 * 2 * 8


def test_moments_by_hand():
    g = small_geometry()
    tok = 8 * 16  # 8 sequences of 16 tokens
    r = route_host_bytes(g, num_seqs=8, seq_len=16, record_routes=True, gather_bytes=100.0)
    assert r.tokens == tok
    assert r.total("rollout") == tok * 4 + 100
    assert r.total("old_logp") == tok * (4 + 36 + 36)
    assert r.total("metrics") == tok * (4 + 36 + 72)
    assert r.total("update") == tok * (4 + 36)
    assert r.peak_moment == "metrics" and r.peak == tok * 112
    assert r.part("rollout") == tok * 4 and r.part("learner") == tok * 36 and r.part("transient") == tok * 72
    assert r.per_token == {"rollout": 4, "learner_kept": 36, "learner_gather": 36, "metrics": 72,
                           "metrics_compare": 49, "metrics_router": 72, "drift_metrics": 42}
    # the pre-fix loop (kept for the plan's note): the previous step's learner set through the next step,
    # its rollout routes through the next rollout
    assert r.previous_step == {"rollout": tok * (36 + 4), "old_logp": tok * 36, "metrics": tok * 36,
                               "update": tok * 36}
    assert r.peak_not_freed == tok * (112 + 36)
    # drift probe (2 passes): three learner sets at its last pass, with the larger of its transients
    d = route_host_bytes(g, num_seqs=8, seq_len=16, record_routes=True, drift_passes=2)
    assert d.total("update") == tok * (4 + 3 * 36 + max(36, 42))
    assert d.peak_moment == "update" and d.previous_step["old_logp"] == tok * 2 * 36
    # dynamic sampling: every drawn round's samples until the batch is cut; a TP engine's duplicates
    small = dict(num_seqs=8, seq_len=16, record_routes=True)
    assert route_host_bytes(g, **small, gen_rounds=3).total("rollout") == 3 * tok * 4
    assert route_host_bytes(g, **small, gather_copies=2).total("rollout") == 2 * tok * 4
    # a micro-batch of the whole batch: its recording (64 B per token here) outgrows the pass end's arrays
    whole = route_host_bytes(g, **small, replay_mb_seqs=8)
    assert whole.moments["old_logp"]["transient"] == tok * 64
    # R2: its routes are the learner set's (the old-policy pass hands them to the update); nothing of the
    # previous step at the rollout
    r2 = route_host_bytes(g, num_seqs=8, seq_len=16, record_routes=True, replay="r2", replay_mb_seqs=2)
    assert r2.total("rollout") == tok * 4
    assert r2.total("old_logp") == tok * (4 + 36 + 36)
    assert r2.total("metrics") == tok * (4 + 36 + 72)
    assert r2.total("update") == tok * (4 + 36) + replay_microbatch_bytes(g, seqs=2, seq_len=16)
    # R3 may copy the routes (fallback rows)
    r3 = route_host_bytes(g, num_seqs=8, seq_len=16, record_routes=True, replay="r3")
    assert r3.total("metrics") == r.total("metrics") + tok * 4
    # no MoE layer: nothing
    dense = Geometry(**{**g.__dict__, "moe_layers": (False, False, False)})
    assert route_host_bytes(dense, num_seqs=8, seq_len=16, record_routes=True).peak == 0


def tiny_plan(*overrides, gpus=2, gpus_per_node=8):
    c = cfg(TINY, *overrides)
    hf = resolve_hf_config(c)[0]
    return c, plan_for_config(c, num_gpus=gpus, gpu_mem_gib=80.0, hf_config=hf, model_source="test",
                              attention="flash", gpus_per_node=gpus_per_node)


def test_tiny_config_hand_count_and_host_total():
    """tiny_cpu: 16 prompts x 8 samples, hf engine with routes and probs, 2 MoE layers x top-2 of 8 experts;
    every rank holds all 128 sequences; no drift probe here."""
    c, res = tiny_plan("logging.update_drift_every=0")
    seq_len, _ = sequence_length(c)
    tok = 16 * 8 * seq_len
    rollout, kept, metrics = 4 + 8 + 8, 36, 2 * 4 + 16 + 48  # metrics: router_diagnostics' copies
    h = res.host_routes
    assert h["tokens_per_step"] == tok and h["peak_moment"] == "metrics"
    assert h["per_rank_gib"] == pytest.approx(tok * (rollout + kept + metrics) / GIB)
    assert h["rollout_gib"] == pytest.approx(tok * rollout / GIB)
    assert h["ranks_per_node"] == 2 and h["per_node_gib"] == pytest.approx(2 * h["per_rank_gib"])
    # nothing else on the host in this config: the host total is the routes
    assert res.components_gib["optimizer_host_gib"] == 0
    assert res.host_per_node_gib == pytest.approx(h["per_node_gib"])
    assert res.components_gib["host_routes_gib"] == pytest.approx(h["per_rank_gib"])
    # ranks per node: at most gpus_per_node of the 4 ranks share a node's memory
    _, res4 = tiny_plan("logging.update_drift_every=0", gpus=4, gpus_per_node=2)
    assert res4.host_routes["per_node_gib"] == pytest.approx(2 * h["per_rank_gib"])
    # without rollout routes the learner's own recording remains
    _, off = tiny_plan("logging.update_drift_every=0", "rollout.record_routes=false", "rollout.record_probs=false")
    assert off.host_routes["rollout_gib"] == 0
    assert off.host_routes["per_rank_gib"] == pytest.approx(tok * (kept + 4 + 16 + 48) / GIB)


def test_host_total_adds_routes_to_the_offloaded_optimizer():
    c, res = tiny_plan("train.precision_aware_optimizer=true", "train.optimizer_cpu_offload=true",
                       "train.distributed_optimizer=true", "model.params_dtype=bfloat16")
    opt = res.components_gib["optimizer_host_gib"]
    assert opt > 0
    assert res.host_per_node_gib == pytest.approx(2 * opt + res.host_routes["per_node_gib"])


def test_host_limit_names_the_routes():
    c = cfg(TINY, "rollout.max_new_tokens=2000", "rollout.prompts_per_step=64")
    hf = resolve_hf_config(c)[0]
    res = plan_for_config(c, num_gpus=2, gpu_mem_gib=80.0, hf_config=hf, model_source="test", attention="flash",
                          host_mem_gib=0.1)
    assert not res.fits
    assert any("host memory per node" in p and "the step's routes" in p for p in res.problems)


def test_json_and_table_of_the_30b_config(capsys):
    assert main(["configs/qwen3_30b_a3b.yaml", "--json", "--attention", "flash"]) == 0
    out = json.loads(capsys.readouterr().out)
    h = out["host_routes"]
    assert {"host_routes_gib", "host_routes_per_node_gib", "host_routes"} <= set(out)
    # 64 prompts x 8 samples x 5120 tokens, 48 MoE layers x top-8 of 128 experts; vLLM TP=8 without routes:
    # the learner's recording (routes uint8, fp32 probs and stats; the pass end's uint8 ids, fp32 probs and
    # stats) on a drift-probe step: three learner sets and the last probe pass's whole-batch arrays
    tok = 512 * 5120
    per = h["bytes_per_token"]
    assert h["tokens_per_step"] == tok and per["rollout"] == 0
    assert per["learner_kept"] == per["learner_gather"] == 48 * 8 * 5 + 48 * 2 * 4 == 2304
    assert per["metrics"] == per["metrics_router"] == 48 * 8 + 32 * 48 and per["metrics_compare"] == 0
    assert per["drift_metrics"] == 2 * 48 * 8 + 17 * 48
    assert h["peak_moment"] == "update"
    assert h["per_rank_gib"] == pytest.approx(tok * (3 * 2304 + 2304) / GIB)
    assert h["moments_gib"]["metrics"]["transient"] == pytest.approx(tok * 1920 / GIB, abs=1e-3)
    assert out["host_routes_per_node_gib"] == pytest.approx(8 * h["per_rank_gib"], abs=1e-3)
    assert out["host_per_node_gib"] == pytest.approx(8 * out["optimizer_host_gib"] + out["host_routes_per_node_gib"],
                                                     abs=1e-2)
    assert main(["configs/qwen3_30b_a3b.yaml", "--attention", "flash"]) == 0
    table = capsys.readouterr().out
    assert "host memory per node (offloaded optimizer state, sleeping engines' weights, routes)" in table
    assert f"routes: {h['per_rank_gib']:.2f} GiB per rank x 8 ranks" in table
