"""moe_gspo.routing.localize: the pure comparison of the divergence localiser, on hand values."""

import math

import numpy as np
import pytest
import torch

from moe_gspo.routing.localize import localize, logp_diff_stats, topk_flip_frac


def _layers(n=4, T=3, H=4, E=5):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        d = {"attn_out": torch.randn(T, H, generator=g), "hidden_after_attn": torch.randn(T, H, generator=g)}
        if i > 0:  # layer 0 dense: no router
            d["router_logits"] = torch.randn(T, E, generator=g)
            d["topk_ids"] = torch.tensor([[0, 1], [2, 3], [4, 0]])
        d["mlp_out"] = torch.randn(T, H, generator=g)
        d["hidden_after_mlp"] = torch.randn(T, H, generator=g)
        out.append(d)
    return out


def _copy(layers):
    return [{k: v.clone() for k, v in d.items()} for d in layers]


def test_first_difference_at_layer_2_router_logits_is_named():
    a = _layers()
    b = _copy(a)
    b[2]["router_logits"][1, 3] += 0.5  # layer 2's router logits differ first ...
    for d in b[3:]:  # ... and everything after them
        for k in ("attn_out", "mlp_out"):
            d[k] = d[k] + 1e-3
    res = localize(a, b, tol=1e-5)
    for key in ("first_divergence", "first_difference"):
        assert res[key]["layer"] == 2 and res[key]["tensor"] == "router_logits"
        assert res[key]["max_abs"] == pytest.approx(0.5)
        assert res[key]["rel_err"] == pytest.approx(0.5 / float(b[2]["router_logits"].abs().max()))
    assert res["rel_err"]["router_logits"][0] is None  # the dense layer has none
    assert res["rel_err"]["router_logits"][1] == 0.0
    assert res["rel_err"]["attn_out"][:3] == [0.0, 0.0, 0.0] and res["rel_err"]["attn_out"][3] > 0
    assert res["rel_err"]["topk_ids"] == [None, 0.0, 0.0, 0.0]


def test_tolerance_separates_first_difference_from_first_divergence():
    a = _layers()
    b = _copy(a)
    b[1]["mlp_out"][0, 0] += 1e-7  # a rounding: differs, below tol
    b[3]["hidden_after_attn"][2, 1] += 1.0  # above tol
    res = localize(a, b, tol=1e-5, layer_ids=[10, 11, 12, 13])
    assert (res["first_difference"]["layer"], res["first_difference"]["tensor"]) == (11, "mlp_out")
    assert (res["first_divergence"]["layer"], res["first_divergence"]["tensor"]) == (13, "hidden_after_attn")
    assert res["layer_ids"] == [10, 11, 12, 13]


def test_identical_tensors_name_nothing_and_flips_count_as_divergence():
    a = _layers()
    res = localize(a, _copy(a), tol=1e-5)
    assert res["first_divergence"] is None and res["first_difference"] is None
    b = _copy(a)
    b[1]["topk_ids"] = torch.tensor([[1, 0], [2, 4], [4, 0]])  # row 0 reordered (same set), row 1 flipped
    res = localize(a, b, tol=1e-5)
    assert res["first_divergence"]["tensor"] == "topk_ids" and res["first_divergence"]["layer"] == 1
    assert res["rel_err"]["topk_ids"][1] == pytest.approx(1 / 3)


def test_final_tensors_and_growth():
    a = _layers(n=3)
    b = _copy(a)
    for i, d in enumerate(b):
        d["hidden_after_mlp"] = a[i]["hidden_after_mlp"] * (1 + 1e-6 * 10 ** i)
    fa = {"final_norm": torch.ones(3, 4), "logits": torch.ones(3, 7)}
    fb = {"final_norm": torch.ones(3, 4), "logits": torch.full((3, 7), 2.0)}
    res = localize(a, b, fa, fb, tol=1e-3)
    assert res["final"]["logits"] == {"max_abs": 1.0, "rel_err": 0.5}
    assert res["first_divergence"] == {"layer": "final", "tensor": "logits", "max_abs": 1.0, "rel_err": 0.5}
    assert res["growth"]["hidden_after_mlp"] == pytest.approx(10.0, rel=1e-2)
    assert res["growth"]["attn_out"] is None


def test_topk_flip_frac_ignores_order():
    assert topk_flip_frac(torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 0], [2, 5]])) == 0.5
    assert topk_flip_frac(torch.zeros(0, 2), torch.zeros(0, 2)) == 0.0


def test_logp_diff_stats_names_the_maximum():
    a = [np.array([0.0, -1.0, -2.0]), np.array([-0.5])]
    b = [np.array([0.0, -1.25, -2.0]), np.array([-1.5])]
    s = logp_diff_stats(a, b)
    assert s["max"] == 1.0 and s["argmax"] == {"sequence": 1, "token": 0} and s["num_tokens"] == 4
    assert s["p95"] == pytest.approx(np.percentile([0, 0.25, 0, 1.0], 95))
    assert s["mean"] == pytest.approx(1.25 / 4)
    assert logp_diff_stats([], [])["max"] is None
    assert not math.isnan(s["p99"])
