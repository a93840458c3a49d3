"""Tests of policy_loss: hand values for GSPO / GSPO-token / GRPO / KL, the GSPO == GSPO-token
identity, GRPO == per-token PPO-clip, masking and numerical safety (every algorithm), argument errors.
GMPO, CISPO, SAPO, the aggregation modes and the KL estimators: test_policy_loss_variants.py."""

import pytest
import torch

from algos._cases import INF, LN, NAN, PPO_CLIP, default_mode, loss_kwargs, mean_as, on_policy_value_BT
from algos._cases import hand_batch as _hand_batch
from algos._cases import mixed_sign_batch as _mixed_sign_batch
from moe_gspo.algos import ALGOS, policy_loss

CLIP = dict(clip_low=0.2, clip_high=0.2)


def _grad(loss, logp):
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


@pytest.mark.parametrize("algo", ["gspo", "gspo_token"])
def test_gspo_hand_values(algo):
    logp, old, adv, mask = _hand_batch()
    loss, m = policy_loss(algo, logp, old, adv, mask, **CLIP)
    # terms min(sA, clip(s)A): seq 0 min(1.5, 1.2) = 1.2; seq 1 min(-0.5, -0.8) = -0.8;
    # seq 2 min(2.2, 2.2) = 2.2 -> objective (1.2 - 0.8 + 2.2) / 3, loss = -2.6/3
    assert loss.item() == pytest.approx(-2.6 / 3)
    # only seq 2 has gradient: d(-obj)/dlogp_{2,0} = -(1/3) * A * s / |y| = -(1/3) * 2 * 1.1
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[2, 0] = -2.2 / 3
    torch.testing.assert_close(_grad(loss, logp), expected)
    assert m["loss/policy"].item() == pytest.approx(-2.6 / 3)
    assert m["loss/total"].item() == pytest.approx(-2.6 / 3)
    assert "loss/kl" not in m
    # binding clips: seq 0 (2 tokens, high, A > 0) and seq 1 (2 tokens, low, A < 0) of 5 tokens;
    # sequences 2 of 3; here every out-of-range sequence binds
    assert m["clip/token_frac"].item() == pytest.approx(4 / 5)
    assert m["clip/seq_frac"].item() == pytest.approx(2 / 3)
    assert m["clip/token_frac_low"].item() == pytest.approx(2 / 5)
    assert m["clip/token_frac_high"].item() == pytest.approx(2 / 5)
    assert m["clip/out_of_range_frac"].item() == pytest.approx(4 / 5)


def test_grpo_hand_values_seq_mean():
    logp, old, adv, mask = _hand_batch()
    loss, m = policy_loss("grpo", logp, old, adv, mask, **CLIP)
    # token ratios w: [1.5, 1.5 | 1, 0.25 | 1.1], A: [1, 1 | -1, -1 | 2]
    # terms: [min(1.5, 1.2)=1.2, 1.2 | min(-1, -1)=-1, min(-0.25, -0.8)=-0.8 | 2.2]
    # sequence means [1.2, -0.9, 2.2] -> objective 2.5/3
    assert loss.item() == pytest.approx(-2.5 / 3)
    # gradients of -obj: token (1,0): -(1/3)(1/2) * w A = -(1/6)(-1) = 1/6; token (2,0): -(1/3) 2 * 1.1;
    # clipped tokens (0,0), (0,1), (1,1): 0
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[1, 0], expected[2, 0] = 1 / 6, -2.2 / 3
    torch.testing.assert_close(_grad(loss, logp), expected)
    assert m["clip/token_frac_low"].item() == pytest.approx(1 / 5)  # 0.25 with A < 0
    assert m["clip/token_frac_high"].item() == pytest.approx(2 / 5)  # 1.5, 1.5 with A > 0
    assert m["clip/token_frac"].item() == pytest.approx(3 / 5)
    assert m["clip/out_of_range_frac"].item() == pytest.approx(3 / 5)
    assert m["clip/seq_frac"].item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("algo", PPO_CLIP)
def test_binding_clip_fraction_on_mixed_signs(algo):
    logp, old, adv, mask = _mixed_sign_batch()
    loss, m = policy_loss(algo, logp, old, adv, mask, **CLIP)
    if algo == "grpo":
        # token ratios [1.5 1.5 | 1.5 1.5 | .5 .5 | .25 1]: binding (0,0) (0,1) high, (3,0) low
        expected = dict(token_frac=3 / 8, token_frac_low=1 / 8, token_frac_high=2 / 8, seq_frac=2 / 4,
                        out_of_range_frac=7 / 8, out_of_range_frac_low=3 / 8, out_of_range_frac_high=4 / 8)
        # seq terms: [1.2, -1.5, 0.5, (-0.8 + -1)/2]: objective (1.2 - 1.5 + 0.5 - 0.9) / 4
        assert loss.item() == pytest.approx(0.7 / 4)
    else:
        # sequence ratios [1.5, 1.5, 0.5, 0.5]: seqs 0 and 3 bind (4 tokens), all 8 tokens out of range
        expected = dict(token_frac=4 / 8, token_frac_low=2 / 8, token_frac_high=2 / 8, seq_frac=2 / 4,
                        out_of_range_frac=1.0, out_of_range_frac_low=4 / 8, out_of_range_frac_high=4 / 8)
        # terms min(sA, clip(s)A): [1.2, -1.5, 0.5, -0.8] -> objective -0.6 / 4
        assert loss.item() == pytest.approx(0.6 / 4)
    for key, value in expected.items():
        assert m[f"clip/{key}"].item() == pytest.approx(value), key
    # the non-binding out-of-range sequences (1, 2) are exactly the ones with gradient
    grad = _grad(loss, logp)
    assert (grad[0] == 0).all() and (grad[1] != 0).all() and (grad[2] != 0).all()


def test_grpo_hand_values_token_mean():
    logp, old, adv, mask = _hand_batch()
    loss, _ = policy_loss("grpo", logp, old, adv, mask, aggregation="token_mean", **CLIP)
    # DAPO token mean: (1.2 + 1.2 - 1 - 0.8 + 2.2) / 5 = 0.56
    assert loss.item() == pytest.approx(-0.56)
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[1, 0], expected[2, 0] = 1 / 5, -2.2 / 5
    torch.testing.assert_close(_grad(loss, logp), expected)


@pytest.mark.parametrize("algo", ALGOS)
def test_kl_hand_values(algo):
    """Every algorithm at ratio 1 with A = 0 (cispo under seq-mean-token-mean, like the others)."""
    # ratio 1 and A = 0: the policy term is 0; ref - logp = [ln2, 0 | -ln2, pad]
    # k3(d) = e^d - d - 1: k3(ln2) = 1 - ln2, k3(0) = 0, k3(-ln2) = ln2 - 1/2
    # sequence mean: ((1 - ln2)/2 + (ln2 - 1/2)) / 2
    logp = torch.tensor([[-1.0, -2.0], [-0.5, NAN]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0 + LN(2), -2.0], [-0.5 - LN(2), NAN]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    adv = torch.zeros(2, dtype=torch.float64)
    kl = ((1 - LN(2)) / 2 + (LN(2) - 0.5)) / 2
    kw = dict(loss_kwargs(algo), loss_agg_mode="seq-mean-token-mean")
    loss, m = policy_loss(algo, logp, logp.detach(), adv, mask, ref_logp_BT=ref, kl_coef=0.1, **kw)
    assert m["loss/kl"].item() == pytest.approx(kl)
    assert m["loss/policy"].item() == 0.0
    assert loss.item() == pytest.approx(0.1 * kl)
    assert m["loss/total"].item() == pytest.approx(0.1 * kl)
    # d k3 / d logp = 1 - e^d; weight kl_coef / (|y_i| * B)
    expected = torch.tensor([[0.1 * (1 - 2) / 4, 0.0], [0.1 * (1 - 0.5) / 2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(_grad(loss, logp), expected)
    # reference given but kl_coef = 0: reported, not added
    loss0, m0 = policy_loss(algo, logp, logp.detach(), adv, mask, ref_logp_BT=ref, **kw)
    assert m0["loss/kl"].item() == pytest.approx(kl) and loss0.item() == 0.0


def _random_batch(seed, num_seqs=5, num_cols=6, noise=0.3, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(num_seqs, num_cols, generator=gen, dtype=dtype)
    logp = old + noise * torch.randn(num_seqs, num_cols, generator=gen, dtype=dtype)
    lengths = torch.randint(1, num_cols + 1, (num_seqs,), generator=gen)
    mask = torch.arange(num_cols)[None, :] < lengths[:, None]
    adv = torch.randn(num_seqs, generator=gen, dtype=dtype)
    logp = torch.where(mask, logp, torch.full_like(logp, NAN))  # garbage padding
    return logp.requires_grad_(True), old, adv, mask


@pytest.mark.parametrize("algo", ALGOS)
def test_all_algos_shapes_finite_grad_and_ratio_one(algo):
    logp, old, adv, mask = _random_batch(1)
    loss, metrics = policy_loss(algo, logp, old, adv, mask, **loss_kwargs(algo))
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.requires_grad
    grad = _grad(loss, logp)
    assert grad.shape == logp.shape and torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all() and (grad[mask] != 0).any()
    assert all(v.dim() == 0 and not v.requires_grad and torch.isfinite(v) for v in metrics.values())
    # ratio 1: loss = -mean A (sapo: -mean 2A/tau), aggregated as the algorithm's default mode; every
    # algorithm's gradient there is REINFORCE's, -A_i grad log pi weighted as the mode weights the token:
    # 1 / (B |y_i|) for seq-mean-token-mean, 1 / (number of tokens) for token-mean (cispo)
    same = logp.detach().clone().requires_grad_(True)
    loss1, m1 = policy_loss(algo, same, logp.detach(), adv, mask, **loss_kwargs(algo))
    mode, adv_BT = default_mode(algo), adv[:, None].expand_as(mask)
    assert loss1.item() == pytest.approx(-mean_as(mode, on_policy_value_BT(algo, adv_BT), mask).item())
    lengths = mask.sum(-1, keepdim=True).double()
    weight = 1.0 / mask.sum() if mode == "token-mean" else 1.0 / (len(adv) * lengths)
    expected = torch.where(mask, -adv[:, None] * weight, 0.0)
    torch.testing.assert_close(_grad(loss1, same), expected)
    assert m1["ratio/token_mean"].item() == 1.0
    if algo == "sapo":
        assert m1["gate/weight_mean"].item() == 1.0 and m1["gate/token_frac_below_half"].item() == 0.0
    else:
        assert m1["clip/token_frac"].item() == 0.0 and m1["clip/out_of_range_frac"].item() == 0.0


@pytest.mark.parametrize("max_log_ratio", [20.0, 0.25])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_gspo_token_equals_gspo_in_value_and_gradient(max_log_ratio, per_token_adv):
    logp, old, adv, mask = _random_batch(2, num_seqs=8, num_cols=7, noise=0.5)
    kwargs = dict(clip_low=0.05, clip_high=0.08, max_log_ratio=max_log_ratio)
    loss_seq, m_seq = policy_loss("gspo", logp, old, adv, mask, **kwargs)
    tok_adv = adv[:, None].expand_as(logp).clone() if per_token_adv else adv
    loss_tok, m_tok = policy_loss("gspo_token", logp, old, tok_adv, mask, **kwargs)
    # clipping binds on some sequences and not on others, so both branches are exercised
    assert 0.0 < m_seq["clip/seq_frac"].item() < 1.0
    torch.testing.assert_close(loss_tok, loss_seq, rtol=0, atol=1e-12)
    torch.testing.assert_close(_grad(loss_tok, logp), _grad(loss_seq, logp), rtol=0, atol=1e-12)
    assert m_tok["clip/seq_frac"].item() == m_seq["clip/seq_frac"].item()
    assert m_tok["clip/token_frac"].item() == m_seq["clip/token_frac"].item()


def test_is_weights_hand_values():
    """Rollout-correction weights multiply each token's clipped term (gspo: its sequence term by the
    mean weight of its tokens). Hand batch terms: grpo [1.2, 1.2 | -1, -0.8 | 2.2], gspo [1.2 | -0.8 | 2.2]."""
    logp, old, adv, mask = _hand_batch()
    w = torch.tensor([[2.0, 0.5, NAN], [1.0, 3.0, INF], [0.5, NAN, NAN]], dtype=torch.float64)
    loss, m = policy_loss("grpo", logp, old, adv, mask, is_weights_BT=w, **CLIP)
    # seq means [(2.4 + 0.6)/2, (-1 - 2.4)/2, 1.1] = [1.5, -1.7, 1.1] -> objective 0.9/3
    assert loss.item() == pytest.approx(-0.9 / 3)
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[1, 0], expected[2, 0] = 1 / 6, -(1 / 3) * 0.5 * 2 * 1.1  # token (1,0) weight 1; (2,0) weight 0.5
    torch.testing.assert_close(_grad(loss, logp), expected)
    assert m["clip/token_frac"].item() == pytest.approx(3 / 5)  # the weights do not change clipping
    for algo in ("gspo", "gspo_token"):
        loss, _ = policy_loss(algo, logp, old, adv, mask, is_weights_BT=w, **CLIP)
        # [1.2 * mean(2, 0.5), -0.8 * mean(1, 3), 2.2 * 0.5] = [1.5, -1.6, 1.1] -> 1.0 / 3
        assert loss.item() == pytest.approx(-1.0 / 3), algo


def test_gspo_token_equals_gspo_with_sequence_weights_only():
    logp, old, adv, mask = _random_batch(8, num_seqs=6, num_cols=5, noise=0.3)
    kwargs = dict(clip_low=0.05, clip_high=0.08)
    gen = torch.Generator().manual_seed(0)
    seq_w = (0.5 + torch.rand(6, 1, generator=gen, dtype=torch.float64)).expand(6, 5)
    tok_w = 0.5 + torch.rand(6, 5, generator=gen, dtype=torch.float64)
    l_seq, _ = policy_loss("gspo", logp, old, adv, mask, is_weights_BT=seq_w, **kwargs)
    l_tok, _ = policy_loss("gspo_token", logp, old, adv, mask, is_weights_BT=seq_w, **kwargs)
    torch.testing.assert_close(l_tok, l_seq, rtol=0, atol=1e-12)
    torch.testing.assert_close(_grad(l_tok, logp), _grad(l_seq, logp), rtol=0, atol=1e-12)
    # token-level weights: same value, but GSPO-token gives token t's gradient its own weight
    l_seq, _ = policy_loss("gspo", logp, old, adv, mask, is_weights_BT=tok_w, **kwargs)
    l_tok, _ = policy_loss("gspo_token", logp, old, adv, mask, is_weights_BT=tok_w, **kwargs)
    torch.testing.assert_close(l_tok, l_seq, rtol=0, atol=1e-12)
    assert not torch.allclose(_grad(l_tok, logp), _grad(l_seq, logp))


def _ppo_clip_reference(logp, old, adv, mask, clip_low, clip_high, token_mean):
    """Per-token PPO-clip written out with python loops (Schulman et al. 2017, eq. 7)."""
    seq_objectives, token_terms = [], []
    for i in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if mask[i, t]:
                w = torch.exp(logp[i, t] - old[i, t])
                clipped = torch.clamp(w, 1 - clip_low, 1 + clip_high)
                terms.append(torch.min(w * adv[i], clipped * adv[i]))
        if terms:
            seq_objectives.append(sum(terms) / len(terms))
            token_terms.extend(terms)
    if token_mean:
        return -sum(token_terms) / len(token_terms)
    return -sum(seq_objectives) / len(seq_objectives)


@pytest.mark.parametrize("aggregation", ["seq_mean", "token_mean"])
def test_grpo_equals_per_token_ppo_clip(aggregation):
    logp, old, adv, mask = _random_batch(3, noise=0.4)
    loss, m = policy_loss("grpo", logp, old, adv, mask, clip_low=0.1, clip_high=0.15, aggregation=aggregation)
    assert 0.0 < m["clip/token_frac"].item() < 1.0
    ref = _ppo_clip_reference(logp, old, adv, mask, 0.1, 0.15, aggregation == "token_mean")
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(_grad(loss, logp), torch.nan_to_num(_grad(ref, logp)))


def test_all_zero_mask_gives_zero_loss_connected_to_logp():
    logp = torch.full((2, 3), NAN, dtype=torch.float32, requires_grad=True)
    for algo in ALGOS:
        loss, metrics = policy_loss(algo, logp, logp.detach(), torch.full((2,), NAN), torch.zeros(2, 3),
                                    ref_logp_BT=torch.full((2, 3), INF), kl_coef=0.5, **loss_kwargs(algo))
        assert loss.item() == 0.0 and loss.grad_fn is not None
        assert torch.equal(_grad(loss, logp), torch.zeros(2, 3))
        assert all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize("algo", ALGOS)
def test_empty_row_is_left_out_of_the_mean(algo):
    logp, old, adv, mask = _random_batch(4, num_seqs=3)
    loss_3, _ = policy_loss(algo, logp[:3], old[:3], adv[:3], mask[:3], **loss_kwargs(algo))
    # add a fourth sequence with no valid token and garbage everywhere
    logp4 = torch.cat([logp.detach(), torch.full((1, logp.shape[1]), NAN, dtype=logp.dtype)]).requires_grad_(True)
    old4 = torch.cat([old, torch.full((1, old.shape[1]), -INF, dtype=old.dtype)])
    adv4 = torch.cat([adv, torch.tensor([NAN], dtype=adv.dtype)])
    mask4 = torch.cat([mask, torch.zeros(1, mask.shape[1], dtype=torch.bool)])
    loss_4, metrics = policy_loss(algo, logp4, old4, adv4, mask4, **loss_kwargs(algo))
    torch.testing.assert_close(loss_4, loss_3)
    grad4 = _grad(loss_4, logp4)
    torch.testing.assert_close(grad4[:3], _grad(loss_3, logp))
    assert (grad4[3] == 0).all()
    assert metrics["ratio/num_seqs"].item() == 3


def test_extreme_ratios_stay_finite():
    # log ratios of +-1000 are clamped to +-20: s = e^20 with A < 0 gives a finite, large loss
    logp = torch.tensor([[1000.0, 0.0], [-1000.0, 0.0]], requires_grad=True)
    old = torch.zeros(2, 2)
    adv = torch.tensor([-1.0, 1.0])
    for algo in ALGOS:
        loss, metrics = policy_loss(algo, logp, old, adv, torch.ones(2, 2), **loss_kwargs(algo))
        assert torch.isfinite(loss) and torch.isfinite(_grad(loss, logp)).all()
        assert all(torch.isfinite(v) for v in metrics.values())


def test_low_precision_logp_is_computed_in_float32():
    logp, old, adv, mask = _random_batch(5, dtype=torch.float32)
    bf16 = logp.detach().bfloat16().requires_grad_(True)
    loss, _ = policy_loss("grpo", bf16, old, adv, mask, **CLIP)
    assert loss.dtype == torch.float32
    grad = _grad(loss, bf16)
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all()


def test_float_mask_equals_bool_mask():
    logp, old, adv, mask = _random_batch(6)
    for algo in ALGOS:
        a, _ = policy_loss(algo, logp, old, adv, mask, **loss_kwargs(algo))
        b, _ = policy_loss(algo, logp, old, adv, mask.double(), **loss_kwargs(algo))
        assert a.item() == b.item()


def test_old_logp_and_advantages_are_constants():
    logp, old, adv, mask = _random_batch(7)
    old = old.clone().requires_grad_(True)
    adv = adv.clone().requires_grad_(True)
    loss, _ = policy_loss("gspo", logp, old, adv, mask, **CLIP)
    grads = torch.autograd.grad(loss, [logp, old, adv], allow_unused=True)
    assert grads[0] is not None and grads[1] is None and grads[2] is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(algo="ppo"), r"algo.name='ppo' is not one of \['gspo'"),
        (dict(algo="gspo", aggregation="token_mean"), "token_mean"),
        (dict(algo="gspo_token", aggregation="token_mean"), "token_mean"),
        (dict(algo="gmpo", loss_agg_mode="seq-mean-token-sum"), "sequence-level method"),
        (dict(algo="grpo", aggregation="sum"), "aggregation"),
        (dict(algo="grpo", loss_agg_mode="token_mean"), "loss_agg_mode must be one of"),
        (dict(algo="grpo", aggregation="seq_mean", loss_agg_mode="token-mean"), "contradicts"),
        (dict(algo="grpo", loss_agg_mode="seq-mean-token-sum-norm"), "needs loss_scale_factor"),
        (dict(algo="grpo", kl_estimator="k4"), "kl_estimator"),
        (dict(algo="sapo"), "no clip range"),
        (dict(algo="sapo", clip_low=None, clip_high=None, options={"tau_neg": 0.0}), r"options.tau_neg=0.0 must be > 0"),
        (dict(algo="sapo", clip_low=None, clip_high=None, options={"tau": 1.0}),
         r"options.tau is not an option of sapo \(its options: tau_pos, tau_neg\)"),
        (dict(algo="grpo", options={"tau_pos": 1.0}), r"options.tau_pos is not an option of grpo \(it has no options\)"),
        (dict(algo="cispo", clip_low=None), "needs clip_low and clip_high"),
        (dict(algo="gspo", advantages=torch.zeros(2, 3)), "one advantage per sequence"),
        (dict(algo="gmpo", advantages=torch.zeros(2, 3)), "one advantage per sequence"),
        (dict(algo="grpo", advantages=torch.zeros(2, 4)), "per-token advantages"),
        (dict(algo="grpo", advantages=torch.zeros(3)), "advantages must have shape"),
        (dict(algo="grpo", kl_coef=0.1), "ref_logp_BT"),
        (dict(algo="grpo", clip_low=1.0), "clip_low"),
        (dict(algo="grpo", clip_high=-0.1), "clip_high"),
        (dict(algo="grpo", old_logp_BT=torch.zeros(3, 2)), "old_logp_BT"),
        (dict(algo="grpo", ref_logp_BT=torch.zeros(2, 2), kl_coef=0.1), "ref_logp_BT"),
        (dict(algo="grpo", max_log_ratio=-1.0), "max_log_ratio"),
    ],
)
def test_errors(kwargs, match):
    args = dict(algo="grpo", logp_BT=torch.zeros(2, 3), old_logp_BT=torch.zeros(2, 3),
                advantages=torch.zeros(2), mask_BT=torch.ones(2, 3), clip_low=0.2, clip_high=0.2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        policy_loss(**args)
