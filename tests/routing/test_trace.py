"""Tests for moe_gspo.routing.trace: the on-disk routing-trace format."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from moe_gspo.rollout.base import RolloutSample
from moe_gspo.rollout.traces import from_rollout_samples
from moe_gspo.routing.trace import (
    FORMAT_VERSION,
    RoutingTrace,
    bytes_per_token,
    ids_dtype,
    load_trace,
    save_trace,
)


def _random_routes(rng, lens, num_layers, k, num_experts):
    # distinct ids per (token, layer): the first k of a random permutation of the experts
    return [np.argsort(rng.random((t, num_layers, num_experts)), axis=-1)[..., :k] for t in lens]


def _trace(rng, *, num_experts=8, probs=True, lens=(5, 0, 3), prompt=(3, 2, 2), resp=(3, 1, 2)):
    num_layers, k = 2, 2
    routes = _random_routes(rng, lens, num_layers, k, num_experts)
    p = [rng.random((t, num_layers, k)).astype(np.float32) for t in lens] if probs else None
    return RoutingTrace.from_samples(routes, list(prompt), list(resp), num_experts, [1, 2], probs=p,
                                     meta={"source": "rollout", "step": 7, "dtype": "bf16"}), routes, p


def test_ids_dtype_selection():
    assert ids_dtype(8) == np.uint8
    assert ids_dtype(256) == np.uint8
    assert ids_dtype(257) == np.uint16
    assert ids_dtype(65536) == np.uint16
    with pytest.raises(ValueError, match="65536"):
        ids_dtype(65537)


def test_from_samples_layout_and_seq():
    rng = np.random.default_rng(0)
    tr, routes, probs = _trace(rng)
    assert tr.topk_ids.dtype == np.uint8 and tr.router_probs.dtype == np.float16
    assert tr.num_sequences == 3 and tr.num_tokens == 8 and tr.num_layers == 2 and tr.top_k == 2
    assert tr.seq_offsets.tolist() == [0, 5, 5, 8]
    for i in range(3):
        ids, pr = tr.seq(i)
        np.testing.assert_array_equal(ids, routes[i])
        np.testing.assert_array_equal(pr, probs[i].astype(np.float16))
    assert tr.seq(1)[0].shape == (0, 2, 2)
    big = RoutingTrace.from_samples([np.array([[[300, 1]]])], [1], [0], 512, [0])
    assert big.topk_ids.dtype == np.uint16 and int(big.topk_ids[0, 0, 0]) == 300


def test_from_samples_validation():
    good = [np.zeros((2, 1, 2), dtype=np.int64)]
    with pytest.raises(ValueError, match="outside"):
        RoutingTrace.from_samples([np.full((2, 1, 2), 8)], [2], [0], 8, [0])
    with pytest.raises(ValueError, match="prompt_lens"):
        RoutingTrace.from_samples(good, [2, 3], [0], 8, [0])
    with pytest.raises(ValueError, match=r"sequence 0 has 2 routed rows"):
        RoutingTrace.from_samples(good, [1], [0], 8, [0])
    with pytest.raises(ValueError, match="L=2"):
        RoutingTrace.from_samples(good, [2], [0], 8, [0, 1])
    with pytest.raises(ValueError, match="JSON"):
        RoutingTrace.from_samples(good, [2], [0], 8, [0], meta={"x": object()})


def test_empty_trace_roundtrip(tmp_path):
    tr = RoutingTrace.from_samples([], [], [], 128, list(range(48)), top_k=8)
    assert tr.topk_ids.shape == (0, 48, 8) and tr.num_sequences == 0
    back = load_trace(save_trace(tmp_path / "e.npz", tr))
    assert back.topk_ids.shape == (0, 48, 8) and back.seq_offsets.tolist() == [0]


@pytest.mark.parametrize("with_probs", [True, False])
def test_roundtrip_exact(tmp_path, with_probs):
    rng = np.random.default_rng(1)
    tr, _, _ = _trace(rng, probs=with_probs)
    path = save_trace(tmp_path / "sub" / "t.npz", tr)
    back = load_trace(path)
    np.testing.assert_array_equal(back.topk_ids, tr.topk_ids)
    assert back.topk_ids.dtype == tr.topk_ids.dtype
    np.testing.assert_array_equal(back.seq_offsets, tr.seq_offsets)
    np.testing.assert_array_equal(back.prompt_lens, tr.prompt_lens)
    np.testing.assert_array_equal(back.response_lens, tr.response_lens)
    np.testing.assert_array_equal(back.layer_ids, tr.layer_ids)
    assert back.num_experts == 8 and back.meta == {"source": "rollout", "step": 7, "dtype": "bf16"}
    if with_probs:
        np.testing.assert_array_equal(back.router_probs, tr.router_probs)
    else:
        assert back.router_probs is None
    # atomic write leaves only the target file behind
    assert os.listdir(tmp_path / "sub") == ["t.npz"]


def test_plain_numpy_reader_matches_docstring(tmp_path):
    rng = np.random.default_rng(2)
    tr, routes, _ = _trace(rng)
    path = save_trace(tmp_path / "t.npz", tr)
    z = np.load(path)  # no allow_pickle: the format must not need it
    assert int(z["format_version"]) == FORMAT_VERSION
    off = z["seq_offsets"]
    np.testing.assert_array_equal(z["topk_ids"][off[2]:off[3]], routes[2])
    assert json.loads(str(z["meta"]))["step"] == 7


def test_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    tr, _, _ = _trace(np.random.default_rng(3))

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", boom)
    with pytest.raises(OSError, match="disk full"):
        save_trace(tmp_path / "t.npz", tr)
    assert os.listdir(tmp_path) == []


def test_overwrite_replaces_atomically(tmp_path):
    rng = np.random.default_rng(4)
    a, _, _ = _trace(rng)
    b, _, _ = _trace(rng, lens=(1,), prompt=(1,), resp=(1,))
    save_trace(tmp_path / "t.npz", a)
    save_trace(tmp_path / "t.npz", b)
    assert load_trace(tmp_path / "t.npz").num_sequences == 1
    assert os.listdir(tmp_path) == ["t.npz"]


def test_corrupt_and_foreign_files(tmp_path):
    tr, _, _ = _trace(np.random.default_rng(5))
    good = save_trace(tmp_path / "good.npz", tr)
    data = good.read_bytes()
    (tmp_path / "trunc.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="trunc.npz"):
        load_trace(tmp_path / "trunc.npz")
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(ValueError, match="text.npz"):
        load_trace(tmp_path / "text.npz")
    np.savez(tmp_path / "foreign.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match=r"foreign.npz.*missing field.*topk_ids"):
        load_trace(tmp_path / "foreign.npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(ValueError, match="single"):
        load_trace(tmp_path / "single.npy")
    # a field with a wrong value is named
    z = dict(np.load(good))
    z["seq_offsets"] = z["seq_offsets"][:-1]
    np.savez(tmp_path / "badoff.npz", **z)
    with pytest.raises(ValueError, match=r"badoff.npz.*seq_offsets"):
        load_trace(tmp_path / "badoff.npz")
    z = dict(np.load(good))
    z["format_version"] = np.asarray(FORMAT_VERSION + 1)
    np.savez(tmp_path / "future.npz", **z)
    with pytest.raises(ValueError, match="format_version"):
        load_trace(tmp_path / "future.npz")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.npz")


def test_bytes_per_token_qwen3_30b_geometry():
    num_layers, k, num_experts = 48, 8, 128
    ids = np.zeros((1, num_layers, k), dtype=np.int64)
    ids[:] = np.arange(k)
    tr = RoutingTrace.from_samples([ids], [1], [0], num_experts, list(range(num_layers)))
    b = bytes_per_token(tr)
    assert b == {"ids": 384, "probs": 0, "margin": 0, "total": 384}
    trp = RoutingTrace.from_samples([ids], [1], [0], num_experts, list(range(num_layers)),
                                    probs=[np.full((1, num_layers, k), 0.125)])
    assert bytes_per_token(trp) == {"ids": 384, "probs": 768, "margin": 0, "total": 1152}
    trm = RoutingTrace.from_samples([ids], [1], [0], num_experts, list(range(num_layers)),
                                    margins=[np.full((1, num_layers), 0.5)])
    assert bytes_per_token(trm) == {"ids": 384, "probs": 0, "margin": 96, "total": 480}
    big = RoutingTrace.from_samples([ids], [1], [0], 300, list(range(num_layers)))
    assert bytes_per_token(big)["ids"] == 768


def test_from_rollout_samples():
    def sample(i, p, r, routes, probs=None):
        return RolloutSample(prompt_index=i, prompt_ids=np.arange(p), response_ids=np.arange(r),
                             response_logprobs=np.zeros(r, np.float32), finish_reason="stop",
                             routes_TLK=routes, router_probs_TLK=probs)

    r0 = np.array([[[0, 1]], [[2, 3]], [[4, 5]]], dtype=np.uint8)      # P=2, R=2 -> T=3
    r1 = np.array([[[7, 6]]], dtype=np.uint8)                          # P=1, R=1 -> T=1
    tr = from_rollout_samples([sample(0, 2, 2, r0), sample(0, 1, 1, r1)], 8, [1], meta={"source": "rollout"})
    assert tr.prompt_lens.tolist() == [2, 1] and tr.response_lens.tolist() == [2, 1]
    assert tr.seq_offsets.tolist() == [0, 3, 4] and tr.router_probs is None
    np.testing.assert_array_equal(tr.seq(1)[0], r1)
    with pytest.raises(ValueError, match=r"samples \[1\] have no routes_TLK"):
        from_rollout_samples([sample(0, 2, 2, r0), sample(0, 1, 1, None)], 8, [1])
    with pytest.raises(ValueError, match="router_probs_TLK"):
        from_rollout_samples([sample(0, 2, 2, r0, np.ones((3, 1, 2))), sample(0, 1, 1, r1)], 8, [1])


def test_router_margin_round_trip_and_old_files(tmp_path):
    """The optional per-token router margin [sum_T, L] is stored as float16 and read back; a file without
    it (every file written before it existed) reads as router_margin=None."""
    r0 = np.array([[[0, 1]], [[2, 3]], [[4, 5]]], dtype=np.uint8)
    r1 = np.array([[[7, 6]]], dtype=np.uint8)
    m0, m1 = np.array([[0.5], [0.004], [np.inf]]), np.array([[0.25]])
    tr = RoutingTrace.from_samples([r0, r1], [2, 1], [2, 1], 8, [1], margins=[m0, m1])
    assert tr.router_margin.dtype == np.float16 and tr.router_margin.shape == (4, 1)
    back = load_trace(save_trace(tmp_path / "m.npz", tr))
    np.testing.assert_array_equal(back.router_margin, np.float16([[0.5], [0.004], [np.inf], [0.25]]))
    plain = load_trace(save_trace(tmp_path / "plain.npz", RoutingTrace.from_samples([r0, r1], [2, 1], [2, 1], 8, [1])))
    assert plain.router_margin is None and "router_margin" not in np.load(tmp_path / "plain.npz").files
    with pytest.raises(ValueError, match=r"margins\[1\] must have shape"):
        RoutingTrace.from_samples([r0, r1], [2, 1], [2, 1], 8, [1], margins=[m0, np.zeros((2, 1))])
    with pytest.raises(ValueError, match="router_margin must have shape"):
        RoutingTrace(topk_ids=r0, seq_offsets=[0, 3], prompt_lens=[2], response_lens=[2], num_experts=8,
                     layer_ids=[1], router_margin=np.zeros((3, 2)))
    # rollout samples: stored when every sample carries router_margin_TL
    samples = [RolloutSample(prompt_index=0, prompt_ids=np.arange(p), response_ids=np.arange(r),
                             response_logprobs=np.zeros(r, np.float32), finish_reason="stop", routes_TLK=routes,
                             router_margin_TL=m)
               for p, r, routes, m in ((2, 2, r0, m0), (1, 1, r1, m1))]
    assert from_rollout_samples(samples, 8, [1]).router_margin.shape == (4, 1)
    samples[1].router_margin_TL = None
    assert from_rollout_samples(samples, 8, [1]).router_margin is None
