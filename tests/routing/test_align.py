"""Tests for moe_gspo.routing.align: rollout routes -> Megatron router-replay tensors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_gspo.routing.align import build_replay_topk, filler_topk

E, K = 8, 2


def _routes():
    # sequence 0: 3 routed positions (real length 4); sequence 1: 1 routed position (real length 2)
    r0 = np.array([[[7, 6], [5, 4]], [[3, 2], [1, 0]], [[6, 1], [2, 5]]], dtype=np.uint8)   # [T=3, L=2, K=2]
    r1 = np.array([[[4, 7], [6, 3]]], dtype=np.uint8)                                       # [T=1, L=2, K=2]
    return [r0, r1], [4, 2]


def test_exact_placement_sb_order_and_filler():
    routes, lens = _routes()
    s_pad, b_num = 5, 2
    out = build_replay_topk(routes, lens, s_pad, num_experts=E, top_k=K)
    assert out.dtype == torch.long and out.shape == (2, s_pad * b_num, K) and out.is_contiguous()
    for layer in range(2):
        for s in range(s_pad):
            for b in range(b_num):
                row = out[layer, s * b_num + b].tolist()
                if s < routes[b].shape[0]:
                    assert row == routes[b][s, layer].tolist(), (layer, s, b)
                else:
                    assert row == [0, 1], (layer, s, b)
    # spot checks written out by hand
    assert out[0, 0].tolist() == [7, 6]      # s=0, b=0
    assert out[0, 1].tolist() == [4, 7]      # s=0, b=1
    assert out[1, 2].tolist() == [1, 0]      # s=1, b=0, layer 1
    assert out[0, 3].tolist() == [0, 1]      # s=1, b=1: filler (sequence 1 has one routed row)
    assert list(out[0].shape) == [10, 2] and len(list(out)) == 2     # per-layer list for set_replay_data


def test_bs_order():
    routes, lens = _routes()
    out = build_replay_topk(routes, lens, 5, num_experts=E, top_k=K, order="bs")
    assert out[0, 0 * 5 + 2].tolist() == [6, 1]    # b=0, s=2
    assert out[1, 1 * 5 + 0].tolist() == [6, 3]    # b=1, s=0, layer 1
    assert out[1, 1 * 5 + 1].tolist() == [0, 1]    # b=1, s=1: filler
    sb = build_replay_topk(routes, lens, 5, num_experts=E, top_k=K)
    np.testing.assert_array_equal(sb.view(2, 5, 2, K).permute(0, 2, 1, 3).reshape(2, 10, K).numpy(), out.numpy())


def test_filler_is_a_valid_distinct_set():
    f = filler_topk(8)
    assert f.tolist() == list(range(8)) and len(set(f.tolist())) == 8


def test_validation_errors_name_the_sequence():
    routes, lens = _routes()
    with pytest.raises(ValueError, match=r"sequence 1: need route rows T=1 <= seq_len=0"):
        build_replay_topk(routes, [4, 0], 5, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match="seq_len_padded=3"):
        build_replay_topk(routes, lens, 3, num_experts=E, top_k=K)
    bad = [routes[0], np.full((1, 2, 2), 8)]
    with pytest.raises(ValueError, match=r"routes\[1\].*outside"):
        build_replay_topk(bad, lens, 5, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match=r"routes\[1\] has L=1"):
        build_replay_topk([routes[0], routes[1][:, :1]], lens, 5, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match="expected top_k=3"):
        build_replay_topk(routes, lens, 5, num_experts=E, top_k=3)
    with pytest.raises(ValueError, match="sequence 0 has no route"):
        build_replay_topk([None, routes[1]], lens, 5, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match="seq_lens"):
        build_replay_topk(routes, [4], 5, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match="order"):
        build_replay_topk(routes, lens, 5, num_experts=E, top_k=K, order="ls")
    dup = routes[0].copy()
    dup[2, 1] = [5, 5]  # row 2 of sequence 0 names expert 5 twice in layer 1: never replayed
    with pytest.raises(ValueError, match=r"routes\[0\] row 2 names an expert twice in MoE layer 1 \(\[5, 5\]\)"):
        build_replay_topk([dup, routes[1]], lens, 5, num_experts=E, top_k=K)


def test_megatron_router_replays_rows_in_s_times_b_order():
    """Run megatron-core's own `TopKRouter.routing` (which flattens [S, B, E] logits with
    `view(-1, E)`) under REPLAY_FORWARD and check every (s, b) gets sequence b's route at s."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    routes, lens = _routes()
    s_pad, b_num = 5, 2
    replay = build_replay_topk(routes, lens, s_pad, num_experts=E, top_k=K)
    rr = RouterReplay()
    try:
        rr.set_target_indices(replay[1])            # layer 1
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        cfg = SimpleNamespace(num_moe_experts=E, moe_router_pre_softmax=False, moe_router_num_groups=None,
                              moe_router_group_topk=None, moe_router_topk_scaling_factor=None,
                              moe_router_fusion=False, moe_expert_capacity_factor=None)
        fake_router = SimpleNamespace(config=cfg, apply_z_loss=lambda logits, padding_mask=None: logits,
                                      routing_type="aux_loss", topk=K, score_function="softmax",
                                      expert_bias=None, router_replay=rr, training=False,
                                      _apply_expert_bias=lambda *a, **k: None)
        logits_SBE = torch.randn(s_pad, b_num, E, generator=torch.Generator().manual_seed(0))
        probs, routing_map = TopKRouter.routing(fake_router, logits_SBE)
    finally:
        RouterReplay.global_router_replay_instances.remove(rr)
    probs_SBE = probs.view(s_pad, b_num, E)
    map_SBE = routing_map.view(s_pad, b_num, E)
    for s in range(s_pad):
        for b in range(b_num):
            want = routes[b][s, 1].tolist() if s < routes[b].shape[0] else [0, 1]
            assert sorted(torch.nonzero(map_SBE[s, b]).flatten().tolist()) == sorted(want), (s, b)
            # the gate weights come from this (s, b) position's own logits
            expect = torch.softmax(logits_SBE[s, b, want], dim=-1)
            torch.testing.assert_close(probs_SBE[s, b, want], expect)
