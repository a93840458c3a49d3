"""Routing traces, routing-drift metrics and R3 replay plumbing.

- `moe_gspo.routing.trace`: the compact on-disk `RoutingTrace` format (numpy only).
- `moe_gspo.routing.drift`: drift metrics between two routings of the same tokens.
- `moe_gspo.routing.align`: rollout routes -> Megatron `RouterReplay` tensors (imports torch; not
  re-exported here).
"""

from moe_gspo.routing.drift import (
    common_rows,
    expert_load,
    per_token_flip_mask,
    per_token_layer_diff,
    routing_drift,
    topk_prob_l1,
    trace_drift,
)
from moe_gspo.routing.trace import (
    FORMAT_VERSION,
    RoutingTrace,
    bytes_per_token,
    ids_dtype,
    load_trace,
    save_trace,
)

__all__ = [
    "FORMAT_VERSION", "RoutingTrace", "bytes_per_token", "common_rows", "expert_load",
    "ids_dtype", "load_trace", "per_token_flip_mask", "per_token_layer_diff", "routing_drift", "save_trace",
    "topk_prob_l1", "trace_drift",
]
