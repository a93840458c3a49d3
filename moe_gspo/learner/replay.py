"""Routing Replay in the Megatron learner, on upstream `megatron.core.transformer.moe.router_replay`.

Modes:
- R2 (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071, §5.3, "Routing
  Replay"): the experts each token used in the old-policy log-prob pass are recorded and replayed in
  the forward of the update, so the token ratios compare the same sub-networks.
- R3 (Ma et al. 2025, "Rollout Routing Replay", arXiv 2510.11370): the rollout engine's experts are
  replayed in the learner (old-policy pass and update).
In both, only the top-k *selection* is replayed: the gate weights are gathered from the router's
current scores (upstream `RouterReplay.get_replay_topk`), so the router keeps receiving gradients.

`RoutingReplayDriver` drives the `RouterReplay` instance of each of *its model's* routers
(`router.router_replay`, created when the model is built with `enable_routing_replay=True`) through the
upstream per-instance API (`set_target_indices`, `set_router_replay_action`, `clear_indices`,
`clear_router_replay_action`) rather than the class-level list, so a second model built in the same
process (tests, reference models) cannot be driven by mistake. Around one forward/backward:
`replaying(topk)` sets the per-layer targets and `REPLAY_FORWARD`; `ReplayHandle.backward(loss)` switches
to `REPLAY_BACKWARD` when activation recomputation is on (the recomputed router forward pops the
targets from `replay_backward_list`); on exit the indices (including `replay_backward_list`, which
`set_target_indices` appends to) and the action are always cleared, so nothing accumulates across
micro-batches. `recording()` sets `RECORD` and collects upstream's recorded indices.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from moe_gspo.mcore.model import moe_routers


class ReplayHandle:
    """Yielded by `RoutingReplayDriver.replaying`; call `backward(loss)` for the backward pass."""

    def __init__(self, driver: "RoutingReplayDriver"):
        self._driver = driver

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` with the replayed routing also used by recomputed forwards."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self._driver.recompute:
            self._driver._set_action(RouterReplayAction.REPLAY_BACKWARD)
        loss.backward()
        if self._driver.recompute:
            left = [len(r.replay_backward_list) for r in self._driver._replays]
            assert not any(left), f"recompute did not consume the replay targets: {left}"


def detach_from_global_replay(model) -> int:
    """Take `model`'s `RouterReplay` instances out of upstream's class-level list
    (`RouterReplay.global_router_replay_instances`, which `set_global_router_replay_action` /
    `set_replay_data` drive for every model of the process), so that only a `RoutingReplayDriver` of this
    model makes it replay (the frozen KL reference beside the policy). Upstream's registry, edited through its
    own list by the shim `moe_gspo.mcore.shims.detach_from_global_router_replay`: no code of Megatron is
    changed. Returns how many were taken out."""
    from moe_gspo.mcore.shims import detach_from_global_router_replay

    return detach_from_global_router_replay(r.router_replay for r in moe_routers(model) if r.router_replay is not None)


class RoutingReplayDriver:
    """Sets and clears upstream router-replay state around one forward(/backward) of `model`."""

    def __init__(self, model, *, recompute: bool = False):
        routers = moe_routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no Megatron TopKRouter; routing replay needs a MoE model")
        self._replays = [r.router_replay for r in routers]
        if any(r is None for r in self._replays):
            raise ValueError("routing replay needs the model built with enable_routing_replay=True "
                             "(moe_gspo.mcore.model.build_gpt_model(..., enable_routing_replay=True))")
        self.recompute = bool(recompute)
        self.top_k = int(routers[0].topk)
        self.num_experts = int(routers[0].config.num_moe_experts)

    @property
    def num_moe_layers(self) -> int:
        return len(self._replays)

    def _set_action(self, action) -> None:
        for r in self._replays:
            r.set_router_replay_action(action)

    def clear(self) -> None:
        """Clear targets, recordings, the backward list and the action of every layer."""
        for r in self._replays:
            r.clear_indices()
            r.clear_router_replay_action()

    @contextlib.contextmanager
    def replaying(self, topk_LNK: torch.Tensor | Sequence[torch.Tensor]) -> Iterator[ReplayHandle]:
        """Replay `topk_LNK` (per MoE layer, int64 `[S*B, K]` in Megatron's router row order, e.g. from
        `moe_gspo.routing.align.build_replay_topk`) in the forward (and recompute) inside the block."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        layers = list(topk_LNK)
        if len(layers) != self.num_moe_layers:
            raise ValueError(f"replay routing has {len(layers)} layers, the model has {self.num_moe_layers} "
                             "MoE layers")
        for t in layers:
            if t.dim() != 2 or t.shape[1] != self.top_k:
                raise ValueError(f"replay routing per layer must be [num_tokens, K={self.top_k}], got {tuple(t.shape)}")
        self.clear()
        try:
            for r, t in zip(self._replays, layers):
                r.set_target_indices(t.long())
            self._set_action(RouterReplayAction.REPLAY_FORWARD)
            yield ReplayHandle(self)
        finally:
            self.clear()

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """Upstream RECORD mode: yields a list that holds, after the block, each layer's recorded
        `[S*B, K]` top-k indices of the (last) forward run inside the block."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        out: list[torch.Tensor] = []
        self.clear()
        try:
            self._set_action(RouterReplayAction.RECORD)
            yield out
            out.extend(r.get_recorded_indices() for r in self._replays)
        finally:
            self.clear()
