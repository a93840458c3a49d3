"""The `algo` section of the run configuration (`moe_gspo.config.AlgoConfig`, re-exported there): the
policy-optimisation algorithm and everything the loss, the advantages, the rollout corrections and routing
replay read. What depends on the algorithm itself (its clip range, aggregation and options) is asked of its
`AlgoSpec` (`moe_gspo.algos.registry`, imported on use: importing the config imports no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from moe_gspo.algos.algo_spec import AlgoSpec

REPLAYS = ("none", "r2", "r3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
AGGREGATION_ALIASES = {"seq_mean": "seq-mean-token-mean", "token_mean": "token-mean"}
DEFAULT_MAX_NUM_GEN_BATCHES = 10


@dataclass(kw_only=True)
class AlgoConfig:
    """Policy-optimisation algorithm: the ratio level (sequence / token) is an axis, not a fork."""

    RENAMED: ClassVar[dict[str, str]] = {"sapo_tau_pos": "options.tau_pos", "sapo_tau_neg": "options.tau_neg"}
    """Keys of older configs and what they are now (`moe_gspo.config_load`): null is accepted and dropped (a
    config.yaml of an older run), a value is refused with one line naming the new key."""

    name: str = "gspo"
    """A registered policy loss (`--help` lists them under --algo, each with its defaults;
    moe_gspo/algos/registry.py; docs/algorithms.md, "Algorithm variants"), or a loss of your own:
    `package.module:Spec` or `path/to/file.py:Spec` naming an `AlgoSpec`, loaded on every rank
    (docs/architecture.md, "Adding a loss")."""
    routing_replay: Literal["none", "r2", "r3"] = "none"
    """none; r2 = replay old-policy routing in the update (GSPO paper §5.3); r3 = replay rollout routing."""
    clip_low: float | None = None
    """Lower clip epsilon; null = the algorithm's default (`AlgoSpec.default_clip`, listed by --help under
    --algo). Its meaning is the algorithm's (`AlgoSpec.clip`): ratio = the ratio floor is 1 - clip_low (gspo,
    gspo_token, grpo); weight = the same for cispo's weight, >= 1 = no lower truncation; log = a LOG-space
    bound, ratio floor e^-clip_low (gmpo); none = no clip range (sapo): leave it null."""
    clip_high: float | None = None
    """Upper clip epsilon; null = the algorithm's default. Ratio ceiling 1 + clip_high; log clip (gmpo):
    e^clip_high. Not for algorithms without a clip range (sapo)."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to the initial policy (0 = off, as in the GSPO paper). > 0 builds
    a frozen reference model: one more copy of the parameters in the learner's dtype, expert-sharded
    like the policy, no gradients or optimizer state; one extra no-grad pass per step (it replays the
    routing the update replays: none = natural, r2 = old-policy routes, r3 = rollout routes)."""
    entropy_coef: float = 0.0
    """Entropy bonus: entropy_coef x the current policy's mean token entropy over the response tokens
    (aggregated like the policy loss) is subtracted from the loss in every update (verl's
    entropy_coeff, TRL's entropy_coef; 0 = off). Keeps the policy from collapsing onto deterministic,
    partly wrong answers whose groups then carry no signal (docs/results.md: "Learning parity with TRL")."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(pi_theta || pi_ref) for the penalty (Schulman 2020; verl/slime names):
    k1 = log ratio, k2 = squared log ratio / 2, k3 = the low-variance one (verl low_var_kl)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] | None = None
    """How per-token loss terms are averaged (verl's names; moe_gspo/algos/aggregation.py); null = the
    algorithm's paper's (`AlgoSpec.default_agg`: token-mean for cispo, seq-mean-token-mean for the others).
    Sequence-level algorithms (gspo, gspo_token, gmpo) take seq-mean-token-mean only.
    seq-mean-token-sum-norm = Dr. GRPO (constant length)."""
    aggregation: Literal["seq_mean", "token_mean"] | None = None
    """Old name of loss_agg_mode, kept for existing configs: seq_mean = seq-mean-token-mean, token_mean =
    token-mean; null = use loss_agg_mode."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm only: the constant length each sequence's token sum is divided by (verl's
    loss_scale_factor, TRL dr_grpo's max_completion_length); null = rollout.max_new_tokens (filled in when
    the config is read)."""
    adv_eps: float = 1e-6
    """Epsilon added to the reward std in the advantage denominator."""
    adv_std_correction: Literal[0, 1] = 0
    """Standard deviation of the advantage scale: 0 = population std (divide by the count), 1 =
    Bessel-corrected (divide by the count - 1, as TRL and verl; advantages smaller by sqrt((G-1)/G))."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage = (r - group mean) / scale (TRL's names): group = group reward std + adv_eps (the papers),
    batch = std of all the step's rewards + adv_eps, none = 1 (Dr. GRPO)."""
    options: dict = field(default_factory=dict)
    """The chosen algorithm's own options (its `AlgoSpec.options`) by name: `options: {tau_pos: 1.2}` under
    `algo` in YAML, `algo.options.tau_pos=1.2` on the command line. Checked against algo.name's spec at config
    time (a name it does not declare, a wrong type or a value out of bounds is an error); an option left out
    takes its default. `--help` lists the chosen algorithm's options with their values (sapo: tau_pos,
    tau_neg; the other built-ins have none)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (verl filter_groups): drop prompt groups whose rewards are all equal (no
    signal) and sample more prompts until the step has rollout.prompts_per_step groups with signal, at most
    algo.max_num_gen_batches generation rounds; see moe_gspo/run/sampling.py."""
    max_num_gen_batches: int | None = None
    """With dynamic_sampling: the most generation rounds of rollout.prompts_per_step prompts per step (the
    first included; verl's name); when they do not give enough groups with signal, the batch is filled up
    with the earliest drawn all-equal groups (advantage 0). null = 10 (verl's DAPO example)."""
    rollout_is: Literal["none", "token", "sequence"] = "none"
    """Train-inference correction (verl's name; TIS, Yao et al. 2025): multiply each token's
    policy-gradient term by the truncated importance weight pi_learner_old / pi_rollout, per token
    (token) or the product over the response (sequence); detached. Under R3 pi_learner_old is the
    pass that replays the rollout routes. See moe_gspo/algos/rollout_correction.py."""
    rollout_is_threshold: float | None = None
    """Truncation C of the rollout_is weights (min(w, C)); null = 2.0 (verl's default)."""
    rollout_rs: Literal["none", "token", "sequence", "geometric"] = "none"
    """Train-inference rejection (masked IS, verl's name): drop tokens (token), or whole sequences
    by the product (sequence) or geometric mean (geometric, IcePop/MIS-style) of their ratios
    pi_learner_old / pi_rollout, when outside [rollout_rs_threshold_lower, rollout_rs_threshold]."""
    rollout_rs_threshold: float | None = None
    """Upper bound (> 1) of the kept ratios; required when rollout_rs != none (e.g. 2.0 for token,
    1.001 for geometric)."""
    rollout_rs_threshold_lower: float | None = None
    """Lower bound (in (0, 1)) of the kept ratios; null = 1 / rollout_rs_threshold."""
    opsm: bool = False
    """Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556; slime --use-opsm): in every update,
    a response with advantage < 0 whose drift mean_t [log pi_rollout - log pi_theta] (pi_theta = the
    CURRENT policy, pi_rollout = the engine's sampling log-probs) exceeds algo.opsm_delta loses its
    policy-gradient term (it stays in the loss normalisation and the KL term). Logs
    rollout_corr/opsm_masked_seq_frac, _masked_token_frac, _kl_mean. See moe_gspo/algos/rollout_correction.py."""
    opsm_delta: float | None = None
    """OPSM's drift threshold delta (>= 0; with algo.opsm=true); null = 1e-4 (slime's default; the paper
    publishes no value)."""
    r3_fallback_warn_frac: float = 0.01
    """With routing_replay=r3: warn once (rank 0) when the share of replayed token rows whose rollout
    routes were missing or malformed, and which therefore replayed the learner's own natural routes
    (r3/fallback_token_frac), exceeds this on a step; in [0, 1] (1 = never warn). See
    moe_gspo/routing/replay_checks.py."""
    r3_max_mismatch: float | None = None
    """With routing_replay=r3: stop the run (one line naming the step and the share) when
    r3/replay_mismatch_frac, the share of replayed (token, MoE layer) rows whose experts in the learner's
    replayed forward differ from the rollout routes it replayed (rows that fell back to natural routing
    not counted), exceeds this on a step; in [0, 1]; null = never stop (the share is logged anyway; 0
    when replay works). E.g. 0 in CI, or 0.01 as Miles' replay check. Ignored without R3."""
    router_aux_loss: Literal["none", "aux_loss", "seq_aux_loss"] = "none"
    """Router load-balancing loss added in the update (Megatron-core's `moe_router_load_balancing_type`):
    none (today's behaviour, and NeMo-RL's RL recipes: "seq_aux_loss causes logprob error divergence for
    grpo"), aux_loss (GShard/Switch, per micro-batch), seq_aux_loss (DeepSeek-V2/V3, per sequence). Computed
    by Megatron's routers in the update's forward over every position of the micro-batch (prompt, response
    and right padding), scaled by 1 / micro-batches per optimizer step; the no-grad passes (old policy,
    reference, drift probes) carry none. Needs algo.router_aux_loss_coef > 0."""
    router_aux_loss_coef: float = 0.0
    """Coefficient of algo.router_aux_loss (Megatron-core's `moe_aux_loss_coeff`; Qwen3-MoE's pre-training
    `router_aux_loss_coef` is 0.001, TRL's GRPOTrainer adds it by default); > 0 needs algo.router_aux_loss
    != none, and the loss needs > 0."""

    def spec(self) -> AlgoSpec:
        """The algorithm's `AlgoSpec` (a plug-in `module:Spec` / `file.py:Spec` is loaded and registered on
        first use); ValueError naming algo.name and the choices otherwise."""
        from moe_gspo.algos.registry import get_algo  # on use: importing the config imports no torch

        return get_algo(self.name)

    def clip_range(self) -> tuple[float | None, float | None]:
        """(clip_low, clip_high) with the algorithm's defaults; (None, None) without a clip range (sapo)."""
        lo, hi = self.spec().default_clip or (None, None)
        return (lo if self.clip_low is None else self.clip_low, hi if self.clip_high is None else self.clip_high)

    def resolved_loss_agg_mode(self) -> str:
        """loss_agg_mode, else the mode the alias `aggregation` names, else the algorithm's default."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        if self.aggregation is not None:
            return AGGREGATION_ALIASES[self.aggregation]
        return self.spec().default_agg

    def algo_options(self) -> dict[str, Any]:
        """Every option of the algorithm (`AlgoSpec.options`, e.g. sapo's temperatures): `options`, checked,
        else the option's default."""
        return self.spec().resolve_options(self.options, prefix="algo.options.")

    def num_gen_batches_bound(self) -> int:
        """Generation rounds allowed per step: 1 without dynamic sampling."""
        if not self.dynamic_sampling:
            return 1
        return DEFAULT_MAX_NUM_GEN_BATCHES if self.max_num_gen_batches is None else self.max_num_gen_batches

    def loss_options(self) -> dict[str, Any]:
        """The keyword arguments of `moe_gspo.algos.policy_loss` this config selects (besides tensors)."""
        clip_low, clip_high = self.clip_range()
        return dict(clip_low=clip_low, clip_high=clip_high, kl_coef=self.kl_coef, kl_estimator=self.kl_estimator,
                    loss_agg_mode=self.resolved_loss_agg_mode(), loss_scale_factor=self.loss_scale_factor,
                    entropy_coef=self.entropy_coef, options=self.algo_options())
