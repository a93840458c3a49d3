"""Forward hooks that collect the per-layer tensors `moe_gspo.routing.localize` compares: one teacher-forced
forward of the same token ids through the rollout engine's transformers model and through the Megatron
learner (`python -m moe_gspo.probe --localize`).

Per decoder layer (names as in `localize.LAYER_TENSORS`; every tensor [T, ...] of one sequence, fp32 copies):

| name | transformers Qwen3-MoE | Megatron-core GPTModel |
|---|---|---|
| `attn_out` | `layers[i].self_attn` output[0] | `decoder.layers[i].self_attention` output[0] |
| `hidden_after_attn` | input of `layers[i].post_attention_layernorm` | input of `decoder.layers[i].pre_mlp_layernorm` |
| `router_logits` | `layers[i].mlp.gate` output[0] | `decoder.layers[i].mlp.router.gating(input)` |
| `topk_ids` | `layers[i].mlp.gate` output[2] | the router's routing map (ids by descending probability) |
| `mlp_out` | `layers[i].mlp` output (MoE or dense block, before the residual add) | `decoder.layers[i].mlp` output[0] |
| `hidden_after_mlp` | `layers[i]` output | `decoder.layers[i]` output[0] |

and after the last layer `final_norm` (`model.norm` / `decoder.final_layernorm`) and `logits` (`lm_head` /
`output_layer`, cut to the true vocabulary). Dense layers have no `router_logits` / `topk_ids`.

The rollout side is a **teacher-forced** forward of the engine's own model (its weights, dtype, fp32-GEMM mode
and attention), not the engine's generation path (compact decoder, KV-cache decode steps): the localiser
reports how far that forward's log-probs are from the sampled ones (`localize/rollout_forward_vs_sampled_*`),
so a difference that comes from the decode path itself is visible. Likewise the learner side is a forward of
one sequence at a time, compared with the learner's batched pass (`localize/learner_forward_vs_pass_*`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from moe_gspo.rollout.engine_spec import engine_spec


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32).clone()


class _Capture:
    def __init__(self, num_layers: int):
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.final: dict[str, torch.Tensor] = {}
        self.handles: list = []

    def put(self, layer: int | None, name: str, t: torch.Tensor) -> None:
        (self.final if layer is None else self.layers[layer])[name] = t

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _hook(cap: _Capture, layer, name, fn):
    def hook(module, args, output):
        cap.put(layer, name, fn(module, args, output))
    return hook


def _pre_hook(cap: _Capture, layer, name, fn):
    def hook(module, args):
        cap.put(layer, name, fn(args))
    return hook


def hf_capture(model: nn.Module, input_ids_T: torch.Tensor, *, scope=None) -> tuple[list[dict], dict]:
    """(per-layer tensors, final tensors) of one teacher-forced forward of transformers' `Qwen3MoeForCausalLM`
    on `input_ids_T` (one sequence, positions 0..T-1); `scope`: a context manager to run it in (the engine's
    fp32-GEMM mode)."""
    layers = model.model.layers
    cap = _Capture(len(layers))
    h = cap.handles
    for i, layer in enumerate(layers):
        h.append(layer.self_attn.register_forward_hook(_hook(cap, i, "attn_out", lambda m, a, o: _f32(_first(o)[0]))))
        h.append(layer.post_attention_layernorm.register_forward_pre_hook(
            _pre_hook(cap, i, "hidden_after_attn", lambda a: _f32(a[0][0]))))
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):  # a MoE block (a dense MLP's gate is gate_proj)
            def gate_hook(m, a, o, i=i):
                cap.put(i, "router_logits", _f32(o[0]))
                cap.put(i, "topk_ids", o[2].detach().to("cpu", torch.long).clone())
            h.append(gate.register_forward_hook(gate_hook))
        h.append(layer.mlp.register_forward_hook(_hook(cap, i, "mlp_out", lambda m, a, o: _f32(_first(o)[0]))))
        h.append(layer.register_forward_hook(_hook(cap, i, "hidden_after_mlp", lambda m, a, o: _f32(_first(o)[0]))))
    h.append(model.model.norm.register_forward_hook(_hook(cap, None, "final_norm", lambda m, a, o: _f32(o[0]))))
    h.append(model.lm_head.register_forward_hook(_hook(cap, None, "logits", lambda m, a, o: _f32(o[0]))))
    dev = next(model.parameters()).device
    try:
        with torch.inference_mode(), (scope if scope is not None else contextlib.nullcontext()):
            model(input_ids=input_ids_T.to(dev)[None], use_cache=False)
    finally:
        cap.remove()
    return cap.layers, cap.final


def mcore_capture(model, input_ids_T: torch.Tensor) -> tuple[list[dict], dict]:
    """The same tensors from the Megatron `GPTModel` (`moe_gspo.mcore.model.forward_logits` of one sequence);
    Megatron's [S, B, H] activations are returned [T, H]."""
    from moe_gspo.mcore.model import forward_logits, unwrap

    gpt = unwrap(model)
    layers = gpt.decoder.layers
    cap = _Capture(len(layers))
    h = cap.handles
    sb = lambda t: _f32(t[:, 0])  # noqa: E731  [S, 1, ...] -> [S, ...]
    for i, layer in enumerate(layers):
        h.append(layer.self_attention.register_forward_hook(_hook(cap, i, "attn_out", lambda m, a, o: sb(_first(o)))))
        h.append(layer.pre_mlp_layernorm.register_forward_pre_hook(
            _pre_hook(cap, i, "hidden_after_attn", lambda a: sb(a[0]))))
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            def router_hook(m, a, o, i=i):
                probs_NE, map_NE = o
                with torch.no_grad():
                    cap.put(i, "router_logits", _f32(m.gating(a[0].detach()).reshape(-1, m.config.num_moe_experts)))
                    w = torch.where(map_NE, probs_NE.detach().float(), -1.0)
                    cap.put(i, "topk_ids", torch.topk(w, int(m.topk), dim=-1).indices.to("cpu", torch.long))
            h.append(router.register_forward_hook(router_hook))
        h.append(layer.mlp.register_forward_hook(_hook(cap, i, "mlp_out", lambda m, a, o: sb(_first(o)))))
        h.append(layer.register_forward_hook(_hook(cap, i, "hidden_after_mlp", lambda m, a, o: sb(_first(o)))))
    h.append(gpt.decoder.final_layernorm.register_forward_hook(_hook(cap, None, "final_norm", lambda m, a, o: sb(o))))
    vocab = getattr(model, "hf_vocab_size", None) or getattr(gpt, "hf_vocab_size", None)
    h.append(gpt.output_layer.register_forward_hook(
        _hook(cap, None, "logits", lambda m, a, o: sb(_first(o))[..., :vocab] if vocab else sb(_first(o)))))
    dev = next(gpt.parameters()).device
    was_training = gpt.training
    gpt.eval()
    try:
        with torch.no_grad():  # not inference_mode: the learner's RoPE cache stamps tensor versions
            forward_logits(model, input_ids_T.to(dev)[None])
    finally:
        cap.remove()
        gpt.train(was_training)
    return cap.layers, cap.final


def response_logp(logits_TV: torch.Tensor, input_ids_T: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """fp32 log-probs of the response tokens (positions prompt_len..T-1) from logits [T, V]."""
    lp = torch.log_softmax(logits_TV[prompt_len - 1:-1].float(), dim=-1)
    return lp.gather(-1, input_ids_T[prompt_len:].to(lp.device, torch.long)[:, None])[:, 0]


VLLM_NOTE = ("vLLM (0.32/0.33) returns per-token log-probs and the routed experts (routed_experts) but no intermediate "
             "hidden states, router logits or expert outputs without patching its model runner: only log-probs and "
             "top-k ids are compared; the first divergence is the first MoE layer whose routes differ")


def probe_localize(engine, engine_name: str, model, samples, learner_logp_BS: torch.Tensor, *, tol: float,
                   layer_ids: list[int], moe_layer_ids: list[int]) -> dict:
    """The probe's `localize` result for `samples` (this process's rollout samples, in batch order):
    `moe_gspo.routing.localize.localize` of the two sides' per-layer tensors (the transformers engine),
    or of the routes only (vLLM), plus |dlogp| statistics (`logp`: the rollout's sampled log-probs vs the
    learner's pass, as the probe's mismatch metrics; `logp_forward`: the two teacher-forced forwards)."""
    import numpy as np

    from moe_gspo.routing import localize as L

    sampled = [np.asarray(s.response_logprobs, np.float64) for s in samples]
    learner = [learner_logp_BS[b, len(s.prompt_ids):len(s.prompt_ids) + len(s.response_ids)].double().numpy()
               for b, s in enumerate(samples)]
    ids = [torch.as_tensor(np.concatenate([s.prompt_ids, s.response_ids]), dtype=torch.long) for s in samples]
    out: dict = {"engine": engine_name, "logp": L.logp_diff_stats(sampled, learner)}
    mc = [mcore_capture(model, t) for t in ids]
    mc_lp = [response_logp(f["logits"], t, len(s.prompt_ids)).double().numpy()
             for (_, f), t, s in zip(mc, ids, samples)]
    out["learner_forward_vs_pass"] = L.logp_diff_stats(mc_lp, learner)
    if engine_spec(engine_name).layer_capture:
        from moe_gspo.rollout.cpu_gemm import fp32_gemms_in

        scope = (lambda: fp32_gemms_in(engine.model, engine._cache)) if engine.fp32_gemm else (lambda: None)
        hf = [hf_capture(engine.model, t, scope=scope()) for t in ids]
        hf_lp = [response_logp(f["logits"], t, len(s.prompt_ids)).double().numpy()
                 for (_, f), t, s in zip(hf, ids, samples)]
        out["rollout_forward_vs_sampled"] = L.logp_diff_stats(hf_lp, sampled)
        out["logp_forward"] = L.logp_diff_stats(hf_lp, mc_lp)
        a_layers, a_final = L.concat_sequences(hf)
        b_layers, b_final = L.concat_sequences(mc)
        out["compared"] = list(L.LAYER_TENSORS) + list(L.FINAL_TENSORS)
        out.update(L.localize(a_layers, b_layers, a_final, b_final, tol=tol, layer_ids=layer_ids))
        return out
    # vLLM: routes only (rows 0 .. P+R-2 that both sides have), MoE layers in order
    n = len(layer_ids)
    a_layers: list[dict] = [{} for _ in range(n)]
    b_layers: list[dict] = [{} for _ in range(n)]
    for j, lid in enumerate(moe_layer_ids):
        i = layer_ids.index(lid)
        ra, rb = [], []
        for s, (lay, _) in zip(samples, mc):
            r = s.routes_TLK
            if r is None or len(r) == 0:
                continue
            rows = min(len(r), lay[i]["topk_ids"].shape[0])
            ra.append(torch.as_tensor(np.asarray(r[:rows, j], np.int64)))
            rb.append(lay[i]["topk_ids"][:rows])
        if ra:
            a_layers[i]["topk_ids"], b_layers[i]["topk_ids"] = torch.cat(ra), torch.cat(rb)
    out["compared"] = ["topk_ids"]
    out["note"] = VLLM_NOTE
    out.update(L.localize(a_layers, b_layers, tol=tol, layer_ids=layer_ids))
    return out


def check_localize_args(args) -> None:
    """Before any compute: --localize runs in one process, and its tolerance is positive."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--localize runs in one process (each sequence is recomputed alone on both sides); "
                         "run the probe without torchrun")
    if args.localize_tol is not None and not args.localize_tol > 0:
        raise ValueError(f"--localize-tol must be > 0, got {args.localize_tol}")
    if args.localize_out is not None:
        from moe_gspo.files import check_output_file

        check_output_file(args.localize_out, "--localize-out")


def probe_localize_keys(args, engine, rollout_cfg, model, samples, learner_logp_BS, hf_config, info) -> dict:
    """The probe's `localize/*` keys (world size 1; see `probe_localize`)."""
    from moe_gspo.mcore.model import moe_layer_ids
    from moe_gspo.routing import localize as L

    if info.world_size > 1:
        raise ValueError("--localize runs in one process; run the probe without torchrun")
    tol = args.localize_tol if args.localize_tol is not None else L.default_tol(rollout_cfg.dtype)
    loc = probe_localize(engine, rollout_cfg.engine, model, samples, learner_logp_BS, tol=tol,
                         layer_ids=list(range(hf_config.num_hidden_layers)), moe_layer_ids=moe_layer_ids(hf_config))
    return {f"localize/{k}": L.jsonable(v) for k, v in loc.items()}


def write_localize_outputs(res: dict, out_path, localize_out=None) -> list:
    """The depth figure beside the probe's JSON (and the `localize/*` keys alone to `localize_out`, figure
    beside it); prints the summary lines and the paths. Returns the paths written."""
    import json
    from pathlib import Path

    from moe_gspo.routing.localize import summary_lines
    from moe_gspo.files import atomic_write_text

    loc = {k[len("localize/"):]: v for k, v in res.items() if k.startswith("localize/")}
    for line in summary_lines(loc):
        print(line)
    written = []
    targets = [Path(out_path)]
    if localize_out:
        p = Path(localize_out)
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, json.dumps({k: v for k, v in res.items() if k.startswith("localize/")}, indent=1))
        written.append(p)
        targets.append(p)
    from analysis.figure_kit import SkipFigure
    from analysis.probe_figures import fig_probe_localize_depth

    try:
        fig = fig_probe_localize_depth(res)
    except SkipFigure as e:
        print(f"localiser figure skipped: {e}")
        return written
    for t in targets:
        png = t.with_name(t.stem + "_localize_depth.png")
        fig.savefig(png)
        written.append(png)
    for p in written:
        print(f"wrote {p}")
    return written
