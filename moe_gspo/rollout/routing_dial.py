"""The routing-drift dial inside the transformers rollout engine (`rollout.router_noise_std`,
`rollout.router_flip_prob`; the maths: `moe_gspo.routing.dial`).

`RoutingDial` owns the dial's random stream and the record of which (token, MoE layer) routes it changed.
Both of the engine's decoders route through it, drawing from the stream in the same order (one call per MoE
layer per forward, the same rows), so they give the same samples, log-probs and routes bit for bit:
- `TransformersDecoder`: `attach(model)` puts a forward hook on every MoE router (`Qwen3MoeTopKRouter`, or a
  gate whose forward `model.router_dtype` replaced) that replaces the router's `(logits, weights, ids)` by the
  dialled ones; prepended, so `HFRouterRecorder`'s hook records the dialled routes;
- `CompactDecoder`: calls `route` where it would take the top-k.

The recorded routes are the perturbed ones (the routes the engine used): R3 replays them.
The engine calls `begin(seed)` at the start of every generation (the stream is then a function of the
sampling seed: resume-exact), and `pop_changed()` after every forward.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_gspo.routing.dial import check_dial, dial_topk

DIAL_SEED_SALT = 0x5D1A1
"""Mixed into the sampling seed so that the dial's stream is not the token sampler's."""


class RoutingDial:
    """The dial's settings, random stream and per-forward record (module docstring)."""

    def __init__(self, *, noise_std: float, flip_prob: float, device: torch.device | str = "cpu"):
        check_dial(noise_std, flip_prob)
        self.noise_std = float(noise_std)
        self.flip_prob = float(flip_prob)
        self._generator = torch.Generator(device=torch.device(device))
        self._changed: list[torch.Tensor] = []
        self._handles: list = []

    def begin(self, seed: int) -> None:
        """Start a generation: the stream seeded from the sampling seed, the record emptied."""
        self._generator.manual_seed((int(seed) * 1_000_003 + DIAL_SEED_SALT) % (2**63 - 1))
        self._changed.clear()

    def route(self, logits_NE: torch.Tensor, top_k: int, norm_topk_prob: bool, out_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One router call: `(weights_NK out_dtype, ids_NK int64, probs_NK float32)` (`dial_topk`); records
        which tokens' expert sets changed."""
        logits_NE = logits_NE.reshape(-1, logits_NE.shape[-1])
        weights, ids, probs, changed = dial_topk(logits_NE, top_k, norm_topk_prob=norm_topk_prob,
                                                 out_dtype=out_dtype, noise_std=self.noise_std,
                                                 flip_prob=self.flip_prob, generator=self._generator)
        self._changed.append(changed)
        return weights, ids, probs

    def pop_changed(self) -> torch.Tensor | None:
        """bool [N, L]: which (token, MoE layer) routes of the last forward the dial changed (layers in call
        order); None when no router ran since the last pop."""
        if not self._changed:
            return None
        out = torch.stack(self._changed, dim=1)
        self._changed.clear()
        return out

    def attach(self, model: nn.Module) -> int:
        """Hook every MoE router of the transformers `model` (prepended: recorders see the dialled routes).
        Returns the number of routers hooked."""
        from moe_gspo.rollout.hf_router_hooks import find_routers

        routers = find_routers(model)
        for _, router in routers:
            self._handles.append(router.register_forward_hook(self._hook, prepend=True))
        return len(routers)

    def _hook(self, module: nn.Module, args, output):
        logits_NE, scores_NK, _ = output
        weights, ids, _ = self.route(logits_NE, module.top_k, module.norm_topk_prob, scores_NK.dtype)
        return logits_NE, weights, ids

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
