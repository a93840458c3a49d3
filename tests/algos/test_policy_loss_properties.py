"""Property tests (hypothesis) of policy_loss: ratio 1 and padding invariance (every algorithm),
clipping bounds (the ratio-range clips)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from algos._cases import PPO_CLIP, default_mode, loss_kwargs, mean_as, on_policy_value_BT
from moe_gspo.algos import ALGOS, policy_loss
from moe_gspo.algos.registry import get_algo

SETTINGS = settings(max_examples=50, deadline=None)
GARBAGE = [float("nan"), float("inf"), -float("inf"), 0.0, 1e30, -7.5]


@st.composite
def batches(draw, min_len=0):
    """(logp, old, ref, adv_B, mask) as float64 tensors; lengths in [min_len, T], left-aligned."""
    num_seqs = draw(st.integers(1, 4))
    num_cols = draw(st.integers(1, 6))
    shape = (num_seqs, num_cols)
    old = draw(hnp.arrays(np.float64, shape, elements=st.floats(-6.0, 0.0)))
    log_ratio = draw(hnp.arrays(np.float64, shape, elements=st.floats(-1.5, 1.5)))
    ref = draw(hnp.arrays(np.float64, shape, elements=st.floats(-6.0, 0.0)))
    adv = draw(hnp.arrays(np.float64, (num_seqs,), elements=st.floats(-3.0, 3.0)))
    lengths = draw(st.lists(st.integers(min_len, num_cols), min_size=num_seqs, max_size=num_seqs))
    mask = np.arange(num_cols)[None, :] < np.asarray(lengths)[:, None]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return t(old + log_ratio), t(old), t(ref), t(adv), t(mask)


@SETTINGS
@given(batch=batches(), algo=st.sampled_from(ALGOS), clip=st.floats(0.0, 0.5))
def test_ratio_one_gives_minus_mean_advantage(batch, algo, clip):
    logp, _, _, adv, mask = batch
    loss, metrics = policy_loss(algo, logp, logp, adv, mask, **loss_kwargs(algo, clip, clip))
    values = on_policy_value_BT(algo, adv[:, None].expand_as(logp))  # A (sapo: 2A / tau)
    expected = mean_as(default_mode(algo), values, mask).item()
    assert loss.item() == pytest.approx(-expected, abs=1e-12)
    assert metrics.get("clip/token_frac", 0.0) == 0.0
    if algo == "grpo":
        loss_tok, _ = policy_loss(algo, logp, logp, adv, mask, clip_low=clip, clip_high=clip,
                                  aggregation="token_mean")
        token_adv = adv[:, None].expand_as(logp)[mask]
        expected_tok = -token_adv.mean().item() if mask.any() else 0.0
        assert loss_tok.item() == pytest.approx(expected_tok, abs=1e-12)


@SETTINGS
@given(batch=batches(), algo=st.sampled_from(PPO_CLIP),
       narrow=st.tuples(st.floats(0.0, 0.3), st.floats(0.0, 0.3)),
       widen=st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 1.0)))
def test_clipping_never_raises_the_objective(batch, algo, narrow, widen):
    logp, old, _, adv, mask = batch
    low, high = narrow
    wide_low, wide_high = min(low + widen[0], 0.99), high + widen[1]
    loss_narrow, m = policy_loss(algo, logp, old, adv, mask, clip_low=low, clip_high=high)
    loss_wide, _ = policy_loss(algo, logp, old, adv, mask, clip_low=wide_low, clip_high=wide_high)
    # ratios are within [e^-1.5, e^1.5] = [0.22, 4.5]: this range never clips
    loss_free, m_free = policy_loss(algo, logp, old, adv, mask, clip_low=0.99, clip_high=10.0)
    assert loss_narrow.item() >= loss_wide.item() - 1e-12
    assert loss_wide.item() >= loss_free.item() - 1e-12
    assert m_free["clip/token_frac"].item() == 0.0 and m_free["clip/seq_frac"].item() == 0.0
    # unclipped objective = mean of ratio * A, aggregated per sequence
    valid = mask.any(-1)
    lengths = mask.sum(-1).clamp(min=1)
    lr = torch.where(mask, logp - old, 0.0)
    if algo == "gspo" or algo == "gspo_token":
        unclipped = torch.exp(lr.sum(-1) / lengths) * adv
    else:
        unclipped = torch.where(mask, torch.exp(lr), 0.0).sum(-1) / lengths * adv
    expected_free = -unclipped[valid].mean().item() if valid.any() else 0.0
    assert loss_free.item() == pytest.approx(expected_free, abs=1e-9)
    # the clip metrics are consistent with the ratios: per valid token (for gspo / gspo_token the
    # sequence ratio of its sequence), binding = outside the range on the side where A pushes
    tok_ratio = torch.exp(lr) if algo == "grpo" else torch.exp(lr.sum(-1) / lengths)[:, None].expand_as(lr)
    tok_adv = adv[:, None].expand_as(lr)
    units, adv_t = tok_ratio[mask], tok_adv[mask]
    count = max(units.numel(), 1)
    below, above = units < 1 - low, units > 1 + high
    assert m["clip/out_of_range_frac_low"].item() == pytest.approx(below.sum().item() / count)
    assert m["clip/out_of_range_frac_high"].item() == pytest.approx(above.sum().item() / count)
    assert m["clip/token_frac_low"].item() == pytest.approx((below & (adv_t < 0)).sum().item() / count)
    assert m["clip/token_frac_high"].item() == pytest.approx((above & (adv_t > 0)).sum().item() / count)
    assert m["clip/token_frac"].item() <= m["clip/out_of_range_frac"].item() + 1e-12
    assert m["clip/token_frac"].item() == pytest.approx(m["clip/token_frac_low"].item()
                                                        + m["clip/token_frac_high"].item())
    assert (m["clip/token_frac"].item() == 0.0) == (m["clip/seq_frac"].item() == 0.0)


@SETTINGS
@given(batch=batches(), algo=st.sampled_from(ALGOS), num_pad=st.integers(1, 3),
       garbage=st.lists(st.sampled_from(GARBAGE), min_size=4, max_size=4),
       per_token=st.booleans(), float_mask=st.booleans())
def test_padding_with_garbage_changes_nothing(batch, algo, num_pad, garbage, per_token, float_mask):
    logp, old, ref, adv, mask = batch
    num_seqs = logp.shape[0]
    if per_token and get_algo(algo).per_token_advantages:
        adv = adv[:, None] * torch.linspace(0.5, 1.5, logp.shape[1], dtype=torch.float64)[None, :]
    kwargs = dict(loss_kwargs(algo, 0.1, 0.2), kl_coef=0.05)

    logp_a = logp.clone().requires_grad_(True)
    loss_a, metrics_a = policy_loss(algo, logp_a, old, adv, mask, ref_logp_BT=ref, **kwargs)
    (grad_a,) = torch.autograd.grad(loss_a, logp_a)

    def pad(x, value):
        return torch.cat([x, torch.full((num_seqs, num_pad), value, dtype=x.dtype)], dim=1)

    logp_b = pad(logp, garbage[0]).requires_grad_(True)
    adv_b = pad(adv, garbage[3]) if adv.dim() == 2 else adv
    mask_b = pad(mask, False)
    if float_mask:
        mask_b = mask_b.double()
    loss_b, metrics_b = policy_loss(algo, logp_b, pad(old, garbage[1]), adv_b, mask_b,
                                    ref_logp_BT=pad(ref, garbage[2]), **kwargs)
    (grad_b,) = torch.autograd.grad(loss_b, logp_b)

    assert torch.isfinite(loss_b)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_b[:, : logp.shape[1]], grad_a, rtol=1e-12, atol=1e-12)
    assert torch.equal(grad_b[:, logp.shape[1]:], torch.zeros(num_seqs, num_pad, dtype=torch.float64))
    assert metrics_b.keys() == metrics_a.keys()
    for key in metrics_a:
        torch.testing.assert_close(metrics_b[key], metrics_a[key], rtol=1e-12, atol=1e-12)


@SETTINGS
@given(batch=batches(min_len=1), algo=st.sampled_from(("gspo", "gspo_token", "grpo", "gmpo", "cispo")),
       clip=st.tuples(st.floats(0.05, 0.5), st.floats(0.05, 0.5)), sign=st.lists(st.booleans(), min_size=4, max_size=4))
def test_binding_fraction_is_the_share_of_tokens_without_gradient(batch, algo, clip, sign):
    """`clip/token_frac` is defined as the tokens whose clip takes the gradient away: with |A| >= 0.1 on
    every sequence it equals the share of valid tokens whose gradient is exactly 0 (cispo: none)."""
    logp, old, _, _, mask = batch
    num_seqs = logp.shape[0]
    adv = torch.tensor([(0.5 if s else -0.5) for s in sign[:num_seqs]], dtype=torch.float64)
    logp = logp.clone().requires_grad_(True)
    loss, m = policy_loss(algo, logp, old, adv, mask, clip_low=clip[0], clip_high=clip[1])
    (grad,) = torch.autograd.grad(loss, logp)
    no_grad = ((grad == 0) & mask).sum().item() / mask.sum().item()
    assert m["clip/token_frac"].item() == pytest.approx(no_grad, abs=1e-12)
    if algo == "cispo":
        assert no_grad == 0.0
