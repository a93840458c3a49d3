"""GMPO, CISPO, SAPO, the loss aggregation modes and the KL estimators: hand-computed values and
gradients, and the identities between the methods (GMPO == GSPO without clipping and == GRPO on one-token
responses, CISPO == GRPO where no ratio leaves the range, SAPO -> unclipped GRPO as tau -> 0, the
aggregation modes' relations and the old `aggregation` aliases)."""

import math

import pytest
import torch

from algos._cases import LN, NAN, hand_batch, mixed_sign_batch
from moe_gspo.algos import LOSS_AGG_MODES, policy_loss
from moe_gspo.algos.registry import get_algo

SIG = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
TOKEN_LEVEL = ("grpo", "cispo", "sapo")


def _grad(loss, logp):
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def _random_batch(seed, num_seqs=6, num_cols=5, noise=0.4, equal_lengths=False):
    gen = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(num_seqs, num_cols, generator=gen, dtype=torch.float64)
    logp = old + noise * torch.randn(num_seqs, num_cols, generator=gen, dtype=torch.float64)
    lengths = (torch.full((num_seqs,), num_cols) if equal_lengths
               else torch.randint(1, num_cols + 1, (num_seqs,), generator=gen))
    mask = torch.arange(num_cols)[None, :] < lengths[:, None]
    adv = torch.randn(num_seqs, generator=gen, dtype=torch.float64)
    logp = torch.where(mask, logp, torch.full_like(logp, NAN))
    return logp.requires_grad_(True), old, adv, mask


def _kw(algo, low=0.2, high=0.2):
    return {} if algo == "sapo" else dict(clip_low=low, clip_high=high)


# ------------------------------------------------------------------ GMPO
def test_gmpo_hand_values():
    """Log-space bounds 0.2 / 0.2 (ratio range (e^-0.2, e^0.2) = (0.819, 1.221)) on the hand batch:
    seq 0 (A = +1): l = [ln1.5, ln1.5] > 0.2: both bind -> l~ = [0.2, 0.2], term e^0.2, no gradient;
    seq 1 (A = -1): l = [0, ln0.25]: token 1 < -0.2 binds -> l~ = [0, -0.2], term -e^-0.1;
    seq 2 (A = +2): l = [ln1.1] inside -> term 2 * 1.1."""
    logp, old, adv, mask = hand_batch()
    loss, m = policy_loss("gmpo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-(math.exp(0.2) - math.exp(-0.1) + 2.2) / 3)
    # d(-obj)/dlogp_t = -(1/B) A s~ / |y| for unclipped tokens: (1,0): -(1/3)(-1)e^-0.1/2; (2,0): -(1/3) 2 * 1.1
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[1, 0], expected[2, 0] = math.exp(-0.1) / 6, -2.2 / 3
    torch.testing.assert_close(_grad(loss, logp), expected)
    for key, value in dict(token_frac=3 / 5, token_frac_low=1 / 5, token_frac_high=2 / 5, seq_frac=2 / 3,
                           out_of_range_frac=3 / 5).items():
        assert m[f"clip/{key}"].item() == pytest.approx(value), key


def test_gmpo_clips_one_sided_per_advantage_sign():
    """Mixed-sign batch (log bounds ln1.2 / -ln0.8 = the ratio range [0.8, 1.2]): only seq 0 (high, A > 0)
    and token (3, 0) (low, A < 0) bind; seqs 1 and 2 are out of range on the other side and keep their
    gradient. Terms: [1.2, -1.5, 0.5, -exp((ln0.8 + 0) / 2)]."""
    logp, old, adv, mask = mixed_sign_batch()
    loss, m = policy_loss("gmpo", logp, old, adv, mask, clip_low=-LN(0.8), clip_high=LN(1.2))
    assert loss.item() == pytest.approx(-(1.2 - 1.5 + 0.5 - math.sqrt(0.8)) / 4)
    grad = _grad(loss, logp)
    assert (grad[0] == 0).all() and grad[3, 0] == 0 and (grad[1:3] != 0).all() and grad[3, 1] != 0
    assert m["clip/token_frac"].item() == pytest.approx(3 / 8)
    assert m["clip/out_of_range_frac"].item() == pytest.approx(7 / 8)


def test_gmpo_without_clipping_equals_gspo_without_clipping():
    """GSPO's sequence ratio is the geometric mean of the token ratios: with bounds that never bind
    (|l| <= 2 here) the two losses agree in value and gradient."""
    logp, old, adv, mask = _random_batch(11, noise=0.5)
    l_gmpo, m = policy_loss("gmpo", logp, old, adv, mask, clip_low=50.0, clip_high=50.0)
    l_gspo, _ = policy_loss("gspo", logp, old, adv, mask, clip_low=0.999, clip_high=1e6)
    assert m["clip/out_of_range_frac"].item() == 0.0
    torch.testing.assert_close(l_gmpo, l_gspo, rtol=0, atol=1e-12)
    torch.testing.assert_close(_grad(l_gmpo, logp), _grad(l_gspo, logp), rtol=0, atol=1e-12)
    # with its default bounds some tokens bind and GMPO differs from unclipped GSPO
    l_clip, m_clip = policy_loss("gmpo", logp, old, adv, mask, clip_low=0.1, clip_high=0.1)
    assert 0 < m_clip["clip/token_frac"].item() < 1 and abs(l_clip.item() - l_gspo.item()) > 1e-3


@pytest.mark.parametrize("other", ["grpo", "gspo"])
def test_gmpo_on_one_token_responses_equals_grpo_and_gspo(other):
    logp, old, adv, mask = _random_batch(12, num_seqs=12, num_cols=1, noise=0.4)
    low, high = 0.1, 0.15
    l_gmpo, m_gmpo = policy_loss("gmpo", logp, old, adv, mask, clip_low=low, clip_high=high)
    l_other, m_other = policy_loss(other, logp, old, adv, mask, clip_low=1 - math.exp(-low),
                                   clip_high=math.exp(high) - 1)
    assert 0 < m_gmpo["clip/token_frac"].item() < 1
    torch.testing.assert_close(l_gmpo, l_other, rtol=0, atol=1e-12)
    torch.testing.assert_close(_grad(l_gmpo, logp), _grad(l_other, logp), rtol=0, atol=1e-12)
    for key in ("clip/token_frac", "clip/token_frac_low", "clip/token_frac_high", "clip/seq_frac"):
        assert m_gmpo[key].item() == m_other[key].item(), key


# ------------------------------------------------------------------ CISPO
def test_cispo_hand_values():
    """Weights r^ = clip(w, 0.8, 1.2) = [1.2, 1.2 | 1, 0.8 | 1.1], token-mean (the paper's):
    value sum r^ A / 5 = (1.2 + 1.2 - 1 - 0.8 + 2.2) / 5 = 0.56; every token has gradient -r^ A / 5,
    also the three whose GRPO clip binds."""
    logp, old, adv, mask = hand_batch()
    loss, m = policy_loss("cispo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-0.56)
    expected = torch.tensor([[-1.2, -1.2, 0.0], [1.0, 0.8, 0.0], [-2.2, 0.0, 0.0]], dtype=torch.float64) / 5
    torch.testing.assert_close(_grad(loss, logp), expected)
    assert m["clip/token_frac"].item() == 0.0 and m["clip/seq_frac"].item() == 0.0
    assert m["clip/out_of_range_frac"].item() == pytest.approx(3 / 5)
    assert m["clip/out_of_range_frac_low"].item() == pytest.approx(1 / 5)
    assert m["clip/out_of_range_frac_high"].item() == pytest.approx(2 / 5)
    # GRPO with the same mode: the same value here (no ratio is out of range on its non-binding side),
    # gradient only on the two tokens whose clip does not bind
    l_grpo, _ = policy_loss("grpo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2, loss_agg_mode="token-mean")
    assert l_grpo.item() == pytest.approx(loss.item())
    g_grpo = _grad(l_grpo, logp)
    assert (g_grpo[0] == 0).all() and g_grpo[1, 1] == 0 and g_grpo[1, 0] == expected[1, 0]


def test_cispo_value_differs_from_grpo_where_a_ratio_is_out_of_range_on_the_free_side():
    """Mixed-sign batch, seq 1: w = 1.5 with A = -1: GRPO keeps w A = -1.5, CISPO takes 1.2 A = -1.2."""
    logp, old, adv, mask = mixed_sign_batch()
    l_c, _ = policy_loss("cispo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2, loss_agg_mode="token-mean")
    l_g, _ = policy_loss("grpo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2, loss_agg_mode="token-mean")
    # CISPO terms [1.2, 1.2, -1.2, -1.2, 0.8, 0.8, -0.8, -1]; GRPO's [1.2, 1.2, -1.5, -1.5, 0.5, 0.5, -0.8, -1]
    assert l_c.item() == pytest.approx(-(2.4 - 2.4 + 1.6 - 1.8) / 8)
    assert l_g.item() == pytest.approx(-(2.4 - 3.0 + 1.0 - 1.8) / 8)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_equals_grpo_where_every_ratio_is_in_range(mode):
    logp, old, adv, mask = _random_batch(13, noise=0.05)
    kw = dict(clip_low=0.5, clip_high=0.5, loss_agg_mode=mode, loss_scale_factor=7.0)
    l_c, m_c = policy_loss("cispo", logp, old, adv, mask, **kw)
    l_g, _ = policy_loss("grpo", logp, old, adv, mask, **kw)
    assert m_c["clip/out_of_range_frac"].item() == 0.0
    torch.testing.assert_close(l_c, l_g, rtol=0, atol=1e-12)
    torch.testing.assert_close(_grad(l_c, logp), _grad(l_g, logp), rtol=0, atol=1e-12)


def test_cispo_keeps_the_gradient_of_clamped_tokens():
    logp = torch.tensor([[100.0, 0.0]], dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss("cispo", logp, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64),
                          torch.ones(1, 2), clip_low=1.0, clip_high=0.27)
    # weights [1.27 (w = e^20 capped), 1]; token-mean; both tokens keep -weight * A / 2
    torch.testing.assert_close(_grad(loss, logp), torch.tensor([[-1.27 / 2, -0.5]], dtype=torch.float64))
    assert m["clip/out_of_range_frac_high"].item() == 0.5


# ------------------------------------------------------------------ SAPO
def test_sapo_hand_values():
    """f(w) = (4/tau) sigmoid(tau (w - 1)), tau = 1 for A > 0, 1.05 for A <= 0; gate g = 4 s (1 - s)."""
    logp, old, adv, mask = hand_batch()
    loss, m = policy_loss("sapo", logp, old, adv, mask)
    f = lambda w, tau: 4 / tau * SIG(tau * (w - 1))  # noqa: E731
    g = lambda w, tau: 4 * SIG(tau * (w - 1)) * (1 - SIG(tau * (w - 1)))  # noqa: E731
    seq = [f(1.5, 1.0), -(f(1.0, 1.05) + f(0.25, 1.05)) / 2, 2 * f(1.1, 1.0)]
    assert loss.item() == pytest.approx(-sum(seq) / 3)
    # d(-obj)/dlogp_t = -(1/B)(1/|y|) A g(w) w
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[0, 0] = expected[0, 1] = -g(1.5, 1.0) * 1.5 / 6
    expected[1, 0], expected[1, 1] = g(1.0, 1.05) * 1.0 / 6, g(0.25, 1.05) * 0.25 / 6
    expected[2, 0] = -2 * g(1.1, 1.0) * 1.1 / 3
    torch.testing.assert_close(_grad(loss, logp), expected)
    gates = [g(1.5, 1.0), g(1.5, 1.0), g(1.0, 1.05), g(0.25, 1.05), g(1.1, 1.0)]
    assert m["gate/weight_mean"].item() == pytest.approx(sum(gates) / 5)
    assert m["gate/token_frac_below_half"].item() == 0.0
    assert not any(k.startswith("clip/") for k in m)


def test_sapo_gate_below_half_and_temperatures():
    """w = 4 with A > 0: g = sech^2(1.5) = 0.18 at tau = 1 (below half); tau_pos = 0.1: 0.98."""
    logp = torch.tensor([[LN(4.0), 0.0]], dtype=torch.float64, requires_grad=True)
    args = (torch.zeros(1, 2, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2))
    _, m = policy_loss("sapo", logp, *args)
    assert m["gate/token_frac_below_half"].item() == 0.5
    assert m["gate/weight_mean"].item() == pytest.approx((1 / math.cosh(1.5) ** 2 + 1) / 2)
    _, m = policy_loss("sapo", logp, *args, options={"tau_pos": 0.1})
    assert m["gate/token_frac_below_half"].item() == 0.0
    assert m["gate/weight_mean"].item() == pytest.approx((1 / math.cosh(0.15) ** 2 + 1) / 2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_sapo_tends_to_unclipped_grpo_as_the_temperature_goes_to_zero(mode):
    """f(w) = 2/tau + (w - 1) + O(tau^2): the gradient tends to w A grad log pi, the value to
    GRPO's plus the constant (2/tau - 1) A."""
    logp, old, adv, mask = _random_batch(14, noise=0.5)
    tau = 1e-4
    kw = dict(loss_agg_mode=mode, loss_scale_factor=7.0)
    l_s, _ = policy_loss("sapo", logp, old, adv, mask, options={"tau_pos": tau, "tau_neg": tau}, **kw)
    l_g, _ = policy_loss("grpo", logp, old, adv, mask, clip_low=0.999, clip_high=1e6, **kw)
    offset, _ = policy_loss("grpo", old.clone(), old, adv * (2 / tau - 1), mask, clip_low=0.2, clip_high=0.2, **kw)
    assert l_s.item() == pytest.approx(l_g.item() + offset.item(), rel=1e-6)
    torch.testing.assert_close(_grad(l_s, logp), _grad(l_g, logp), rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ aggregation modes
@pytest.mark.parametrize("mode, value, grad_10, grad_20", [
    # GRPO terms on the hand batch: [1.2, 1.2 | -1, -0.8 | 2.2] (lengths 2, 2, 1); tokens (1,0) and (2,0)
    # are the only unclipped ones, their terms w A = -1 and 2.2
    ("token-mean", 2.8 / 5, 1 / 5, -2.2 / 5),
    ("seq-mean-token-mean", 2.5 / 3, 1 / 6, -2.2 / 3),
    ("seq-mean-token-sum", 2.8 / 3, 1 / 3, -2.2 / 3),
    ("seq-mean-token-sum-norm", 2.8 / 12, 1 / 12, -2.2 / 12),  # L = 4
])
def test_aggregation_mode_hand_values(mode, value, grad_10, grad_20):
    logp, old, adv, mask = hand_batch()
    loss, _ = policy_loss("grpo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2, loss_agg_mode=mode,
                          loss_scale_factor=4.0 if mode.endswith("norm") else None)
    assert loss.item() == pytest.approx(-value)
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[1, 0], expected[2, 0] = grad_10, grad_20
    torch.testing.assert_close(_grad(loss, logp), expected)


@pytest.mark.parametrize("algo", TOKEN_LEVEL)
def test_aggregation_aliases_and_relations(algo):
    logp, old, adv, mask = _random_batch(15)

    def run(**kw):
        loss, _ = policy_loss(algo, logp, old, adv, mask, **_kw(algo), **kw)
        return loss, _grad(loss, logp)

    # the old names are aliases
    for alias, mode in (("seq_mean", "seq-mean-token-mean"), ("token_mean", "token-mean")):
        a, b = run(aggregation=alias), run(loss_agg_mode=mode)
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
    # sum-norm = sum / L
    s, n = run(loss_agg_mode="seq-mean-token-sum"), run(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8.0)
    torch.testing.assert_close(n[0], s[0] / 8, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(n[1], s[1] / 8, rtol=1e-12, atol=1e-12)
    # with unequal lengths token-mean and seq-mean-token-mean differ
    assert abs(run(loss_agg_mode="token-mean")[0] - run(loss_agg_mode="seq-mean-token-mean")[0]) > 1e-6


@pytest.mark.parametrize("algo", TOKEN_LEVEL)
def test_aggregation_modes_agree_on_equal_lengths(algo):
    """All responses of length L: token-mean == seq-mean-token-mean == seq-mean-token-sum / L."""
    logp, old, adv, mask = _random_batch(16, equal_lengths=True)
    out = {}
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        loss, _ = policy_loss(algo, logp, old, adv, mask, loss_agg_mode=mode, **_kw(algo))
        out[mode] = (loss, _grad(loss, logp))
    for mode, scale in (("seq-mean-token-mean", 1.0), ("seq-mean-token-sum", 1 / 5)):
        torch.testing.assert_close(out[mode][0] * scale, out["token-mean"][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out[mode][1] * scale, out["token-mean"][1], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ KL estimators
@pytest.mark.parametrize("estimator, kl, grad", [
    # d = logp - ref = [-ln2, 0 | ln2, pad], seq-mean-token-mean; k1 = d, k2 = d^2/2, k3 = e^-d + d - 1;
    # gradient of kl_coef * mean: 0.1 * dk/dd / (|y| B): dk1 = 1, dk2 = d, dk3 = 1 - e^-d
    ("k1", LN(2) / 4, [[0.1 / 4, 0.1 / 4], [0.1 / 2, 0.0]]),
    ("k2", 3 / 8 * LN(2) ** 2, [[-0.1 * LN(2) / 4, 0.0], [0.1 * LN(2) / 2, 0.0]]),
    ("k3", ((1 - LN(2)) / 2 + (LN(2) - 0.5)) / 2, [[0.1 * (1 - 2) / 4, 0.0], [0.1 * (1 - 0.5) / 2, 0.0]]),
])
def test_kl_estimator_hand_values(estimator, kl, grad):
    logp = torch.tensor([[-1.0, -2.0], [-0.5, NAN]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0 + LN(2), -2.0], [-0.5 - LN(2), NAN]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    loss, m = policy_loss("grpo", logp, logp.detach(), torch.zeros(2, dtype=torch.float64), mask, ref_logp_BT=ref,
                          kl_coef=0.1, kl_estimator=estimator, clip_low=0.2, clip_high=0.2)
    assert m["loss/kl"].item() == pytest.approx(kl)
    assert loss.item() == pytest.approx(0.1 * kl)
    torch.testing.assert_close(_grad(loss, logp), torch.tensor(grad, dtype=torch.float64))


def test_kl_is_aggregated_like_the_policy_term():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, NAN]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0 + LN(2), -2.0], [-0.5 - LN(2), NAN]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    _, m = policy_loss("cispo", logp, logp.detach(), torch.zeros(2, dtype=torch.float64), mask, ref_logp_BT=ref,
                       kl_estimator="k1", clip_low=1.0, clip_high=0.27)  # token-mean: (-ln2 + 0 + ln2) / 3
    assert m["loss/kl"].item() == pytest.approx(0.0, abs=1e-15)
    _, m = policy_loss("gmpo", logp, logp.detach(), torch.zeros(2, dtype=torch.float64), mask, ref_logp_BT=ref,
                       kl_estimator="k1", clip_low=0.4, clip_high=0.4)  # sequence-level: ln2 / 4
    assert m["loss/kl"].item() == pytest.approx(LN(2) / 4)


@pytest.mark.parametrize("algo", ["gspo", "grpo", "cispo"])
def test_entropy_bonus_by_hand(algo):
    """loss = policy loss - coef * entropy aggregated like the policy term (gspo: per-sequence token
    mean, then mean over sequences; cispo: token mean), with d loss / d entropy = -coef / units."""
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    ent = torch.tensor([[1.0, 2.0, 9.0], [0.5, 0.5, 0.5]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    clip = dict(zip(("clip_low", "clip_high"), get_algo(algo).default_clip))
    base, _ = policy_loss(algo, logp, logp.detach(), adv, mask, **clip)
    loss, m = policy_loss(algo, logp, logp.detach(), adv, mask, entropy_BT=ent, entropy_coef=0.1, **clip)
    expected_ent = (1.5 + 0.5) / 2 if algo != "cispo" else (1 + 2 + 1.5) / 5
    assert float(m["loss/entropy"]) == pytest.approx(expected_ent)
    assert float(loss) == pytest.approx(float(base) - 0.1 * expected_ent)
    loss.backward()
    if algo == "cispo":
        expected_grad = torch.tensor([[-0.02, -0.02, 0.0], [-0.02, -0.02, -0.02]])
    else:
        expected_grad = torch.tensor([[-0.025, -0.025, 0.0], [-0.1 / 6, -0.1 / 6, -0.1 / 6]])
    assert torch.allclose(ent.grad, expected_grad)
    with pytest.raises(ValueError, match="entropy_BT"):
        policy_loss(algo, logp, logp.detach(), adv, mask, entropy_coef=0.1, **clip)
