"""`python -m analysis.mechanism_route_diff --seed S --depth D --length L [--dose P] ...`: for one setting of
`analysis.mechanism` (the same model, warm-up and rollout), every token-layer whose expert set differs between the
rollout's recorded routes (KV-cached decoding, with the dial at the dose) and π_old's natural routes (the learner's
full forward), with the mini-batch k that holds it and the router's top-(K+1) logits at that token in π_old's pass.

At dose 0 in fp32 the two passes are the same mathematics in another summation order, so a difference there is a
router tie that the two passes round apart: experiment 5's check C2 failed on one such token (docs/paper_claims.md).
At a dose > 0 the differences are the dial's flips (and any ties)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace


@dataclass(frozen=True, kw_only=True)
class RouteDiff:
    row: int
    """The sequence (rollout row)."""
    position: int
    """The token's position in the prompt + response (the pass's input positions)."""
    layer: int
    """The MoE layer (0 = the first)."""
    k: int
    """The mini-batch index whose rows hold `row`."""
    rollout: list[int]
    """The rollout's experts (sorted)."""
    old: list[int]
    """π_old's natural experts (sorted)."""
    top_logits: list[float]
    """π_old's pass: the router's K + 1 largest logits at this token, largest first (a tie: the K-th ~ the K+1-th)."""


def route_diffs(*, seed: int, depth: int, length: int, dose: float = 0.0, warm_steps: int = 5, minibatches: int = 16,
                groups: int = 8, group_size: int = 4, lr: float = 5e-4) -> tuple[list[RouteDiff], int]:
    """(the differing token-layers, the number of token-layers compared) of one setting built as `run_grid` builds
    it (the tiny model of `depth` MoE layers from `seed`, `warm_steps` training steps, then the measured rollout)."""
    import torch

    from analysis.mechanism import build_model
    from analysis.mechanism_step import StepReplay, StepSetting, _minibatches, sample_rollout, train_steps
    from moe_gspo.rollout.hf_router_hooks import find_routers

    base = StepSetting(minibatches=minibatches, groups=groups, group_size=group_size, lr=lr)
    model, vocab, _ = build_model(depth, None, seed=seed, max_positions=base.prompt_len + length)
    s = replace(base, length=length, dose=dose, seed=seed, warm_steps=warm_steps)
    torch.manual_seed(seed)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    train_steps(model, s, opt, vocab=vocab)
    ro = sample_rollout(model, s, vocab)
    step = StepReplay(model, ro)
    try:
        ro_BTLK, old_BTLK = ro.routes.sort(-1).values, step.old_routes.sort(-1).values
        where = step.flips_BTL.nonzero().tolist()  # the rows' `route_flips` (`StepReplay.route_flips`)
        mb_of = {int(r): k for k, mb in enumerate(_minibatches(ro.seqs.shape[0], s.minibatches, s.seed + 1))
                 for r in mb}
        logits = []  # per MoE layer: [B * T, E] router logits of π_old's full forward
        routers = [m for _, m in find_routers(model)]
        hooks = [m.register_forward_pre_hook(lambda m, i: logits.append(
            torch.nn.functional.linear(i[0].reshape(-1, i[0].shape[-1]), m.weight).detach())) for m in routers]
        try:
            with torch.no_grad():
                model(input_ids=ro.seqs[:, :-1], use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        num_k = ro.routes.shape[-1]
        diffs = []
        for b, t, layer in where:
            top = logits[layer].view(ro.seqs.shape[0], -1, logits[layer].shape[-1])[b, t].topk(num_k + 1).values
            diffs.append(RouteDiff(row=b, position=t, layer=layer, k=mb_of[b], rollout=ro_BTLK[b, t, layer].tolist(),
                                   old=old_BTLK[b, t, layer].tolist(), top_logits=[float(x) for x in top]))
        return diffs, int(ro_BTLK.shape[0] * ro_BTLK.shape[1] * ro_BTLK.shape[2])
    finally:
        step.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.mechanism_route_diff", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--depth", type=int, required=True, help="MoE layers of the tiny model")
    ap.add_argument("--length", type=int, required=True, help="response tokens")
    ap.add_argument("--dose", type=float, default=0.0, help="the dial's flip probability in the rollout")
    ap.add_argument("--warm-steps", type=int, default=5)
    ap.add_argument("--minibatches", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        diffs, total = route_diffs(seed=args.seed, depth=args.depth, length=args.length, dose=args.dose,
                                   warm_steps=args.warm_steps, minibatches=args.minibatches)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:  # a caller in the same process (a test) keeps its own thread count
        torch.set_num_threads(threads_before)
    print(f"{len(diffs)} of {total} token-layers route to another expert set in the rollout than in pi_old's pass")
    for d in diffs:
        gaps = [a - b for a, b in zip(d.top_logits, d.top_logits[1:])]
        print(f"  row {d.row} position {d.position} layer {d.layer} (mini-batch k = {d.k}): rollout {d.rollout}, "
              f"pi_old {d.old}; pi_old's top logits {[f'{x:.7f}' for x in d.top_logits]}, the K-th minus the next "
              f"{gaps[-1]:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
