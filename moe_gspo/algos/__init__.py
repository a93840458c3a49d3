"""Policy-optimisation math: group advantages, the policy losses (GSPO, GSPO-token, GRPO, GMPO, CISPO,
SAPO) with their aggregation modes and KL estimators, importance-ratio statistics, train-inference
mismatch metrics and rollout corrections (TIS / MIS / OPSM). Pure functions on torch tensors. Each
algorithm is an `AlgoSpec` in `moe_gspo.algos.registry` (`get_algo`, `register_algo`, `algo_names`)."""

from moe_gspo.algos.advantages import SCALE_REWARDS, group_advantages
from moe_gspo.algos.aggregation import LOSS_AGG_MODES
from moe_gspo.algos.collapse import COLLAPSE_KEYS, group_signal_metrics, mean_token_entropy
from moe_gspo.algos.kl import KL_ESTIMATORS
from moe_gspo.algos.mismatch import MISMATCH_KEYS, mismatch_metrics
from moe_gspo.algos.policy_loss import AGGREGATIONS, ALGOS, policy_loss
from moe_gspo.algos.ratios import RATIO_KEYS, ratio_stats
from moe_gspo.algos.registry import AlgoOption, AlgoSpec, algo_names, get_algo, register_algo
from moe_gspo.algos.rollout_correction import opsm_mask, rollout_correction, rollout_is_weights, rollout_rs_mask

__all__ = [
    "AGGREGATIONS",
    "ALGOS",
    "AlgoOption",
    "AlgoSpec",
    "COLLAPSE_KEYS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "MISMATCH_KEYS",
    "RATIO_KEYS",
    "SCALE_REWARDS",
    "algo_names",
    "get_algo",
    "group_advantages",
    "group_signal_metrics",
    "mean_token_entropy",
    "mismatch_metrics",
    "opsm_mask",
    "policy_loss",
    "ratio_stats",
    "register_algo",
    "rollout_correction",
    "rollout_is_weights",
    "rollout_rs_mask",
]
