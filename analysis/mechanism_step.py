"""One training step of an RL run replayed on a transformers Qwen3-MoE model, measured (issue 58: "how much does
routing volatility corrupt my gradient?"; the command is `analysis.mechanism`).

The step's structure is the learner's (`moe_gspo.run.learner_passes`): rollouts sampled by the policy (through the
routing-drift dial when `dose` > 0: `moe_gspo.rollout.routing_dial.RoutingDial`, the rollout engine's own), the
old-policy pass with the learner's natural routing (π_old of GRPO / GSPO / TIS; R3's π_old replays the rollout's
routes), then N mini-batch updates on the same rollout. Before each update k the current policy θ_k is measured
against π_old on the whole batch, and every method's gradient is taken on mini-batch k:

- ratios (natural routing at θ_k vs π_old): variance over tokens of the per-token log-ratio, variance over sequences
  of its sum and of its mean (the sequence log-ratio, length-normalised as GSPO's), the share of tokens whose ratio
  leaves GRPO's clip range and of sequences whose length-normalised ratio leaves GSPO's (`AlgoSpec.default_clip`);
- experts changed: per MoE layer, the share of the response-producing (token, layer) rows whose top-k set at θ_k
  differs from π_old's;
- per method (`METHODS`) its loss's gradient (`moe_gspo.algos.policy_loss.policy_loss`, the training loss) and the
  **gradient error due to routing**: against the same loss with the old policy's natural routes replayed in the
  update (R2's routes: the routing change since π_old removed), ‖g − g_ref‖ / ‖g_ref‖ and the cosine. For GRPO+R3
  that reference removes the rollout's routes (the dial's flips) too, so its error is the dial's part; GRPO+R2 is
  its own reference. TIS is also compared with plain GRPO (what its weights change).
- at k = 0 the gradient's signal-to-noise ratio across the N mini-batches: ‖mean g‖ over its standard error;
- per mini-batch k, the token-layers of its rows whose expert set differs between the rollout's recorded routes
  and π_old's natural routes (`route_flips` of `route_token_layers`) and π_old's largest router margin among them
  (`route_flip_margin_max`): the dial's flips at a dose > 0; at dose 0 in fp32 only router ties, which KV-cached
  decoding and the full forward can round apart (experiment 5's check C2 failed on one);
- per setting, the rollout–learner mismatch (`mismatch_metrics`' k3 of the sampler's log-probs against π_old's):
  `mismatch_k3` for the learner's natural routing (GRPO, GSPO, R2, TIS), `mismatch_k3_r3` for R3's π_old, which
  replays the rollout's routes (the drift part R3 removes); and the rollout's mean negative log-prob per token
  (`rollout_nll_mean`: how sharp the policy is).

The update itself follows one method's gradient (`driver`, GRPO by default) with Adam. Rewards: the fraction of the
response's tokens that copy the prompt's (cyclically), a deterministic function of prompt and response, so the
advantages (`moe_gspo.algos.advantages.group_advantages`) carry a real, if arbitrary, signal; every sequence has
exactly `length` response tokens (sampling does not stop), so response length is a controlled variable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from moe_gspo.algos.advantages import group_advantages
from moe_gspo.algos.mismatch import mismatch_metrics
from moe_gspo.algos.policy_loss import policy_loss
from moe_gspo.algos.registry import get_algo
from moe_gspo.algos.rollout_correction import rollout_is_weights
from moe_gspo.rollout.hf_router_hooks import HFRouterRecorder, find_routers
from moe_gspo.rollout.routing_dial import RoutingDial

METHODS = {
    # name: (loss, routes of the update's passes, routes of pi_old, TIS weights, clipped)
    "grpo": ("grpo", "natural", "natural", False, True),
    "gspo": ("gspo", "natural", "natural", False, True),
    "grpo+r2": ("grpo", "old", "natural", False, True),
    "grpo+r3": ("grpo", "rollout", "rollout", False, True),
    "grpo+tis": ("grpo", "natural", "natural", True, True),
    "grpo-noclip": ("grpo", "natural", "natural", False, False),
    "gspo-noclip": ("gspo", "natural", "natural", False, False),
}
"""The methods measured: (the loss's algorithm, which routes the update's forward uses: the learner's own
('natural'), π_old's natural routes ('old', R2) or the rollout engine's ('rollout', R3), π_old's routes, token TIS,
whether the algorithm's default clip range applies). The `-noclip` pair is GRPO's token ratio and GSPO's sequence
ratio with the clip range opened (`UNCLIPPED`): every token and sequence contributes, so the two ratios are compared on
the same samples whatever share of them the clip would take away (at lr 5e-4 GSPO's 3e-4 / 4e-4 range takes ~97%
of the sequences, leaving its clipped gradient mostly zero)."""
TIS_THRESHOLD = 2.0
UNCLIPPED = (1.0 - 1e-9, math.inf)
"""The `-noclip` methods' (clip_low, clip_high): the ratio range [1e-9, inf), which no finite ratio here leaves."""


@dataclass(kw_only=True)
class StepSetting:
    """One measured setting."""

    length: int = 16
    """Response tokens per sequence (every sequence has exactly this many)."""
    dose: float = 0.0
    """The routing-drift dial's flip probability in the rollout (`rollout.router_flip_prob`)."""
    minibatches: int = 4
    """N: mini-batch updates per rollout (`train.num_minibatches`); the staleness index k runs 0..N-1."""
    groups: int = 8
    """Prompts per rollout."""
    group_size: int = 4
    """Samples per prompt (GRPO's group)."""
    prompt_len: int = 8
    """Prompt tokens (random symbols of the model's vocabulary)."""
    lr: float = 5e-4
    """Adam's learning rate for the updates."""
    driver: str = "grpo"
    """The method whose gradient the updates follow (a key of `METHODS`)."""
    seed: int = 0
    """Seeds the prompts, the sampling and the dial."""
    warm_steps: int = 0
    """Training steps before the measured one (the policy state: 0 = the checkpoint as given): each a rollout at
    dose 0 and N mini-batch updates of the driver's gradient, with the optimizer the measured step then uses
    (warmed, as in a run)."""
    task: str | None = None
    """None: random prompts of `prompt_len` tokens, rewarded for copying them. A synthetic task's name (`copy`,
    `reverse`): its prompts as the trained states saw them (`length` - 1 symbols of `task_symbols`, padded, so
    that the answer and EOS are exactly `length` tokens), written with the shipped tokenizer, and its reward on
    the response up to its first EOS (`prompt_len` is then the prompt's own)."""
    task_symbols: int = 4
    """With `task`: the task's alphabet (`task.num_symbols`)."""


class RouteReplay:
    """Forward hooks on every MoE router of a transformers model that replace its top-k ids by given ones (per
    layer [N, K], N = batch x sequence flattened) with the gate weights from the current logits gathered at them
    (softmax over all experts, renormalised when `norm_topk_prob`), as Megatron's replay and the dial compute them;
    inactive while `routes` is None. Prepended, so a recorder registered later records the replayed routes."""

    def __init__(self, model: nn.Module):
        self.routes: list[torch.Tensor] | None = None
        self._handles = [router.register_forward_hook(self._hook(pos), prepend=True)
                         for pos, (_, router) in enumerate(find_routers(model))]

    def _hook(self, pos: int):
        def hook(module, args, output):
            if self.routes is None:
                return None
            logits, scores, _ = output
            ids = self.routes[pos].to(logits.device).long()
            weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), ids
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@dataclass
class Rollout:
    seqs: torch.Tensor
    """int64 [B, P + L]: prompt then response."""
    rollout_logp: torch.Tensor
    """float32 [B, L]: the sampling policy's log-probs of the response tokens (through the dial)."""
    routes: torch.Tensor
    """[B, P + L - 1, num MoE layers, K]: the rollout's routes at every input position of a learner pass."""
    advantages: torch.Tensor
    """float32 [B]."""
    prompt_len: int
    extra: dict = field(default_factory=dict)


def _calls_routes(calls, batch: int) -> torch.Tensor:
    return torch.cat([c.topk_ids_NLK.reshape(batch, -1, *c.topk_ids_NLK.shape[1:]) for c in calls], dim=1)


class TaskPrompts:
    """A synthetic task's prompts and reward at response length L (`StepSetting.task`): L - 1 symbols, padded, so
    that the exact answer and EOS are L tokens, as `analysis.mechanism_states` trains the states."""

    def __init__(self, s: StepSetting):
        from moe_gspo.tasks.synthetic import PADDED_TASKS, SyntheticTask
        from moe_gspo.tokenizer import load_tiny_tokenizer

        if s.task not in PADDED_TASKS:
            raise ValueError(f"task={s.task!r}: the measured tasks are {', '.join(PADDED_TASKS)}")
        if s.length < 2:
            raise ValueError(f"length={s.length}: a task's response needs >= 2 tokens (a symbol and EOS)")
        self.task = SyntheticTask(s.task, prompt_len=s.length - 1, num_symbols=s.task_symbols, pad_prompts=True)
        self.tok = load_tiny_tokenizer()
        self.prompts = self.task.prompts(0, s.groups, s.seed)
        self.ids = torch.tensor([self.tok(p.text, add_special_tokens=False)["input_ids"] for p in self.prompts])

    def rewards(self, resp: torch.Tensor, group_size: int) -> torch.Tensor:
        """The task's reward of each response [B, L], read up to its first EOS (as the trainer stops there)."""
        from moe_gspo.run.steps import response_text

        eos, out = self.tok.eos_token_id, []
        for i, row in enumerate(resp.tolist()):
            ids = row[:row.index(eos) + 1] if eos in row else row
            out.append(self.task.reward(response_text(self.tok, ids), self.prompts[i // group_size]))
        return torch.tensor(out, dtype=torch.float32)


def sample_rollout(model: nn.Module, s: StepSetting, vocab: int) -> Rollout:
    """B = groups x group_size sequences of exactly `s.length` sampled tokens after random prompts or the task's
    (KV-cached decoding, temperature 1), with the dial at `s.dose` and the routes the rollout used recorded."""
    gen = torch.Generator().manual_seed(s.seed)
    b = s.groups * s.group_size
    task = TaskPrompts(s) if s.task else None
    prompts = (task.ids if task else torch.randint(3, vocab, (s.groups, s.prompt_len), generator=gen))
    prompts = prompts.repeat_interleave(s.group_size, 0)
    dial = RoutingDial(noise_std=0.0, flip_prob=s.dose) if s.dose > 0 else None
    rec = HFRouterRecorder(model, record_probs=False, record_stats=False)
    if dial is not None:
        dial.attach(model)
        dial.begin(s.seed)
    toks, logps = [], []
    try:
        with torch.no_grad():
            out = model(input_ids=prompts, use_cache=True)
            for t in range(s.length):
                lp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
                tok = torch.multinomial(lp.exp(), 1, generator=gen)
                toks.append(tok)
                logps.append(lp.gather(-1, tok))
                if dial is not None:
                    dial.pop_changed()
                if t < s.length - 1:
                    out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
        routes = _calls_routes(rec.pop(), b)
    finally:
        rec.remove()
        if dial is not None:
            dial.detach()
    resp = torch.cat(toks, dim=1)
    if task is not None:
        rewards = task.rewards(resp, s.group_size)
    else:
        target = prompts.repeat(1, math.ceil(s.length / s.prompt_len))[:, :s.length]
        rewards = (resp == target).float().mean(dim=1)
    adv = group_advantages(rewards, s.group_size).float()
    return Rollout(torch.cat([prompts, resp], dim=1), torch.cat(logps, dim=1), routes, adv, prompts.shape[1],
                   {"reward_mean": float(rewards.mean())})


def logprobs(model, replay: RouteReplay, ro: Rollout, idx: torch.Tensor, routes: torch.Tensor | None, *,
             grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [b, L] of the response tokens of rows `idx`, the natural-or-replayed routes the pass used
    [b, P + L - 1, layers, K]); `routes`: replay these ([B, P + L - 1, layers, K], rows `idx` taken) or None."""
    lp, used, _ = _pass(model, replay, ro, idx, routes, grad=grad, margins=False)
    return lp, used


def _pass(model, replay: RouteReplay, ro: Rollout, idx: torch.Tensor, routes: torch.Tensor | None, *, grad: bool,
          margins: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`logprobs`, and with `margins` the router margin of every token-layer the pass routed (logits, K-th minus
    (K+1)-th: `moe_gspo.routing.router_stats.token_router_stats`), float32 [b, P + L - 1, layers]."""
    seqs = ro.seqs[idx]
    b, p = seqs.shape[0], ro.prompt_len
    replay.routes = None if routes is None else [routes[idx][:, :, i].reshape(b * (seqs.shape[1] - 1), -1)
                                                 for i in range(routes.shape[2])]
    rec = HFRouterRecorder(model, record_probs=False, record_stats=margins)
    try:
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=seqs[:, :-1], use_cache=False).logits[:, p - 1:]
            lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, seqs[:, p:, None]).squeeze(-1)
        calls = rec.pop()
        used = _calls_routes(calls, b)
        margin = torch.cat([c.stats_NL2[..., 0].reshape(b, -1, c.stats_NL2.shape[1]) for c in calls], dim=1) \
            if margins else None
    finally:
        rec.remove()
        replay.routes = None
    return lp, used, margin


def _flat_grad(loss: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).double() for g, p in zip(grads, params)])


class StepReplay:
    """The old-policy pass of a rollout and what every method's loss needs from it (module docstring)."""

    def __init__(self, model: nn.Module, ro: Rollout):
        self.model, self.ro = model, ro
        self.replay = RouteReplay(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        everyone = torch.arange(ro.seqs.shape[0])
        self.old_logp, self.old_routes, self.old_margin_BTL = _pass(model, self.replay, ro, everyone, None,
                                                                    grad=False, margins=True)
        # token-layers whose expert set differs between the rollout (KV-cached decoding, the dial) and pi_old's
        # full forward, and pi_old's router margin there: at dose 0 in fp32 only float ties differ
        self.flips_BTL = (ro.routes.long().sort(-1).values != self.old_routes.long().sort(-1).values).any(-1)
        self.old_logp_r3, _ = logprobs(model, self.replay, ro, everyone, ro.routes, grad=False)
        self.mask = torch.ones_like(self.old_logp, dtype=torch.bool)
        self.tis, _ = rollout_is_weights(self.old_logp, ro.rollout_logp, self.mask, level="token",
                                         threshold=TIS_THRESHOLD)

    def close(self) -> None:
        self.replay.remove()

    def route_flips(self, idx: torch.Tensor) -> dict[str, float]:
        """Rows `idx`: the token-layers of their learner pass whose expert set differs between the rollout and
        π_old's natural routing (`route_flips` of `route_token_layers`), and π_old's largest router margin among
        them (`route_flip_margin_max`, NaN when none): at dose 0 a tie (a margin at float resolution) or nothing."""
        flips = self.flips_BTL[idx]
        top = float(self.old_margin_BTL[idx][flips].max()) if bool(flips.any()) else math.nan
        return {"route_flips": int(flips.sum()), "route_token_layers": int(flips.numel()),
                "route_flip_margin_max": top}

    def _routes(self, which: str) -> torch.Tensor | None:
        return {"natural": None, "old": self.old_routes, "rollout": self.ro.routes}[which]

    def gradient(self, method: str, idx: torch.Tensor, *, routes: str | None = None) -> torch.Tensor:
        """The flattened gradient of `method`'s loss on rows `idx` at the current parameters; `routes` overrides
        the method's update routes ('old': R2's, the routing change removed)."""
        algo, upd, old, tis, clipped = METHODS[method]
        lp, _ = logprobs(self.model, self.replay, self.ro, idx, self._routes(routes or upd), grad=True)
        old_lp = (self.old_logp_r3 if old == "rollout" else self.old_logp)[idx]
        low, high = get_algo(algo).default_clip if clipped else UNCLIPPED
        loss, _ = policy_loss(algo, lp, old_lp, self.ro.advantages[idx], self.mask[idx], clip_low=low,
                              clip_high=high, is_weights_BT=self.tis[idx] if tis else None)
        return _flat_grad(loss, self.params)


def _rel(g: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    n = float(ref.norm())
    if n == 0 or float(g.norm()) == 0:
        return math.nan, math.nan
    return float((g - ref).norm()) / n, float(torch.dot(g, ref)) / (float(g.norm()) * n)


def experts_changed(model, step: StepReplay) -> dict[str, float]:
    """Per MoE layer, the share of response-producing (token, layer) rows whose top-k set under the current
    parameters (natural routing) differs from π_old's, on the whole batch; and their mean."""
    everyone = torch.arange(step.ro.seqs.shape[0])
    _, used = logprobs(model, step.replay, step.ro, everyone, None, grad=False)
    p, L = step.ro.prompt_len, step.old_logp.shape[1]
    rows = slice(p - 1, p - 1 + L)  # the input positions whose logits give the response's log-probs
    old_sets = step.old_routes[:, rows].long().sort(dim=-1).values
    new_sets = used[:, rows].long().sort(dim=-1).values
    changed = (old_sets != new_sets).any(dim=-1).double().mean(dim=(0, 1))  # [layers]
    return {"experts_changed": float(changed.mean()),
            **{f"experts_changed_layer{i}": float(c) for i, c in enumerate(changed)}}


def ratio_stats(model, step: StepReplay, method: str) -> dict[str, float]:
    """The method's ratio at the current parameters (its update's routes) against its π_old, on the whole batch
    (module docstring)."""
    _, upd, old, _, _ = METHODS[method]
    everyone = torch.arange(step.ro.seqs.shape[0])
    lp, _ = logprobs(model, step.replay, step.ro, everyone, step._routes(upd), grad=False)
    lr = (lp - (step.old_logp_r3 if old == "rollout" else step.old_logp)).double()
    g_low, g_high = get_algo("grpo").default_clip
    s_low, s_high = get_algo("gspo").default_clip
    tok_ratio, seq_ratio = lr.exp(), lr.mean(dim=1).exp()
    return {
        "token_logratio_var": float(lr.reshape(-1).var(unbiased=False)),
        "seq_logratio_sum_var": float(lr.sum(dim=1).var(unbiased=False)),
        "seq_logratio_mean_var": float(lr.mean(dim=1).var(unbiased=False)),
        "clipped_token_frac": float(((tok_ratio < 1 - g_low) | (tok_ratio > 1 + g_high)).double().mean()),
        "clipped_seq_frac": float(((seq_ratio < 1 - s_low) | (seq_ratio > 1 + s_high)).double().mean()),
    }


def _apply(opt: torch.optim.Optimizer, params: list[torch.Tensor], flat_grad: torch.Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat_grad[offset:offset + n].reshape(p.shape).to(p.dtype)
        offset += n
    opt.step()


def _minibatches(b: int, n: int, seed: int) -> list[torch.Tensor]:
    return list(torch.randperm(b, generator=torch.Generator().manual_seed(seed)).reshape(n, -1))


def train_steps(model: nn.Module, s: StepSetting, opt: torch.optim.Optimizer, *, vocab: int) -> list[float]:
    """`s.warm_steps` training steps (rollouts at dose 0 on their own seeds, N mini-batch updates of the driver's
    gradient each) with `opt`; each step's mean reward."""
    rewards = []
    for i in range(s.warm_steps):
        seed = s.seed + 100_003 * (i + 1)
        ro = sample_rollout(model, replace(s, dose=0.0, seed=seed), vocab)
        step = StepReplay(model, ro)
        try:
            for idx in _minibatches(ro.seqs.shape[0], s.minibatches, seed + 1):
                _apply(opt, step.params, step.gradient(s.driver, idx))
        finally:
            step.close()
        rewards.append(ro.extra["reward_mean"])
    return rewards


def measure_step(model: nn.Module, s: StepSetting, *, vocab: int, methods=tuple(METHODS)) -> list[dict]:
    """Rows of one setting: one per (k, method) with the ratio statistics at θ_k, the method's gradient error due to
    routing on mini-batch k (and TIS vs GRPO), and at k = 0 its SNR across the N mini-batches. Updates the model."""
    if s.driver not in METHODS:
        raise ValueError(f"driver={s.driver!r} is not a measured method; use one of {sorted(METHODS)}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods {unknown} are not measured; use some of {sorted(METHODS)}")
    b = s.groups * s.group_size
    if s.minibatches < 1 or b % s.minibatches:
        raise ValueError(f"minibatches={s.minibatches} must divide groups x group_size = {b}")
    if s.warm_steps < 0:
        raise ValueError(f"warm_steps={s.warm_steps} must be >= 0")
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    warm = train_steps(model, s, opt, vocab=vocab)
    ro = sample_rollout(model, s, vocab)
    step = StepReplay(model, ro)
    mbs = _minibatches(b, s.minibatches, s.seed + 1)
    mismatch = {"mismatch_k3": mismatch_metrics(ro.rollout_logp, step.old_logp, step.mask)["mismatch/k3_kl"],
                "mismatch_k3_r3": mismatch_metrics(ro.rollout_logp, step.old_logp_r3, step.mask)["mismatch/k3_kl"]}
    ro.extra["rollout_nll_mean"] = float(-ro.rollout_logp.mean())
    rows: list[dict] = []
    try:
        snr = {}
        if s.minibatches >= 2:
            for m in methods:
                g = torch.stack([step.gradient(m, idx) for idx in mbs])
                se = float(((g - g.mean(0)).pow(2).sum(1).sum() / (len(mbs) - 1) / len(mbs)).sqrt())
                snr[m] = float(g.mean(0).norm()) / se if se > 0 else math.nan
        for k, idx in enumerate(mbs):
            changed = {**experts_changed(model, step), **step.route_flips(idx)}
            ratios = {m: ratio_stats(model, step, m) for m in methods}
            grads = {m: step.gradient(m, idx) for m in methods}
            driver = grads[s.driver] if s.driver in grads else step.gradient(s.driver, idx)
            for m in methods:
                ref = step.gradient(m, idx, routes="old") if METHODS[m][1] != "old" else grads[m]
                err, cos = _rel(grads[m], ref)
                row = {"k": k, "method": m, **changed, **ratios[m], "grad_norm": float(grads[m].norm()),
                       "grad_err_routing": err, "grad_cos_routing": cos,
                       "grad_snr": snr.get(m, math.nan) if k == 0 else math.nan}
                if METHODS[m][3] and "grpo" in grads:
                    row["grad_err_tis_vs_grpo"], row["grad_cos_tis_vs_grpo"] = _rel(grads[m], grads["grpo"])
                rows.append(row)
            _apply(opt, step.params, driver)
    finally:
        step.close()
    base = {"length": s.length, "dose": s.dose, "minibatches": s.minibatches, "seed": s.seed,
            "warm_steps": s.warm_steps, "warm_reward_last": warm[-1] if warm else math.nan, **ro.extra, **mismatch}
    return [{**base, **r} for r in rows]
