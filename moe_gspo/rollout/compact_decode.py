"""Compact prefill and decode steps for transformers' Qwen3-MoE: the same numbers in a fraction of the calls.

At the tiny model's sizes a decode step is bound by per-call overhead, not arithmetic: transformers'
`Qwen3MoeForCausalLM.forward` spends most of a step in Python (output capturing, mask building, the
`DynamicCache`, per-module dispatch, a sort-based expert dispatch), ~6 ms per step for 128 rows of a
3-layer model on this project's CPU. `CompactDecoder`, one of the engine's two decoders behind the
`moe_gspo.rollout.hf_decoders.HFDecoder` interface (the other runs transformers' forward), computes the
prefill (the prompts, once each) and each step (one new token per row) from the same modules' parameters
with ~a third of the tensor calls, and returns the same logits and routes (`DecodeStep`):

- the same operations in the same dtypes at every rounding point as the modules it replaces (RMSNorm
  in fp32 rounded to the engine dtype before its weight, rotary embedding in the engine dtype, SDPA
  attention, bf16 residual adds, router softmax in fp32, top-k weights renormalised then rounded);
- q/k/v projections as one GEMM of the concatenated weights (each output element is the same dot
  product), the q and k norms and rotary embedding applied to the q and k heads together;
- a static KV cache that holds the whole generation, `n` rows per prompt, in the attention's compute
  dtype (fp32 when bf16 GEMMs run as fp32 GEMMs, `moe_gspo.rollout.cpu_gemm`: the bf16 values, cast
  once instead of at every step); the prefill builds its attention mask with transformers' own
  `create_causal_mask` and calls SDPA as transformers' `sdpa` attention does (causal flag without a
  mask, key/value heads repeated with one);
- the experts, when there are few of them per chosen one (`num_experts <= DENSE_EXPERTS_RATIO *
  top_k`, the tiny model: 8 and 2), computed for every token as two GEMMs (all experts' gate/up
  projections, then one batched GEMM per expert for the down projection) and gathered at the chosen
  experts: more arithmetic, far fewer calls. Otherwise the model's own experts module runs.

Each output element is the same dot product of the same values as in transformers' forward; only
the order of fp32 additions inside a GEMM kernel may differ with the operand shapes, so a logit can
differ by one rounding in rare cases (tests/rollout: identical tokens, log-probs and routes on the tiny
models, bit for bit in bf16). Modules' forward hooks do not run in the compact passes; the routes they
return are what `HFRouterRecorder` records (full-softmax probabilities at the top-k experts, before
renormalisation; per-token router margin and entropy, `moe_gspo.routing.router_stats`).

The tensors derived from the parameters (concatenated q/k/v, gate/up and expert weights in the compute
dtype) are kept in the engine's `moe_gspo.tensor_cache.TensorCache` between generations and rebuilt when a
weight sync changes a parameter in place.

Supported: `Qwen3MoeForCausalLM` with `sdpa` attention (or the project's fp32 variant), no attention
bias, no sliding window, a rotary embedding that does not change with the sequence length, SiLU
activations. `unsupported_reason(model)` names what is not; the engine then decodes with transformers
(`rollout.compact_decode`: null = this choice, true = required, false = transformers' forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_gspo.rollout.cpu_gemm import ATTENTION_FP32, Fp32GemmForBf16
from moe_gspo.rollout.fp8 import activation_quantizers
from moe_gspo.rollout.hf_decoders import DecodeStep
from moe_gspo.routing.router_stats import token_router_stats
from moe_gspo.tensor_cache import TensorCache

DENSE_EXPERTS_RATIO = 4
"""Compute every expert for every token when num_experts <= this x top_k (see the module docstring)."""

_DYNAMIC_ROPE = ("dynamic", "longrope")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why `CompactDecoder` cannot decode `model` exactly as transformers does, or None if it can."""
    from transformers import Qwen3MoeForCausalLM

    if not isinstance(model, Qwen3MoeForCausalLM):
        return f"{type(model).__name__} is not a Qwen3MoeForCausalLM"
    config = model.config
    if config._attn_implementation not in ("sdpa", ATTENTION_FP32):
        return f"attention implementation {config._attn_implementation!r} (only 'sdpa')"
    if getattr(config, "attention_bias", False):
        return "attention_bias=True"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return "a sliding window"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in _DYNAMIC_ROPE:
        return f"rope_type {rope!r} (its frequencies change with the sequence length)"
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act!r} (only 'silu')"
    return None


@dataclass
class _Layer:
    """One decoder layer's tensors for a generation (resolved by `CompactDecoder.prefill`)."""

    norm1: tuple[torch.Tensor, float]
    qkv: torch.Tensor
    qk_norm: tuple[torch.Tensor, float]
    scaling: float
    o: torch.Tensor
    norm2: tuple[torch.Tensor, float]
    gate_up: torch.Tensor  # the dense MLP's, or every expert's [E * 2I, H] (dense experts)
    down: torch.Tensor  # the dense MLP's [H, I], or every expert's transposed [E, I, H] (dense experts)
    router: torch.Tensor | None = None
    top_k: int = 0
    norm_topk_prob: bool = True
    experts: nn.Module | None = None  # the model's experts module, when it runs (many experts)
    router_wide: bool = False  # the gate weight is wider than the model dtype: route in its dtype (router_dtype.py)


class CompactDecoder:
    """Decode steps of a transformers Qwen3-MoE model from its own parameters (see the module docstring); an
    `moe_gspo.rollout.hf_decoders.HFDecoder`.

    Args:
        model: the engine's `Qwen3MoeForCausalLM`; its parameters are read at every `prefill()`, so weight
            updates between generations apply.
        fp32_gemm: the engine's bf16 GEMMs run as fp32 GEMMs of the bf16 values rounded back to bf16,
            and attention in fp32 (`moe_gspo.rollout.cpu_gemm`); False: GEMMs and attention in the
            model's dtype.
        record_routes: return the routes (top-k expert ids) of the tokens fed; False: `DecodeStep` without
            routes (settable: the engine turns it off when it stops recording).
        record_probs: with them, the router probabilities of the chosen experts.
        record_stats: with them, each token's router margin and entropy per MoE layer
            (`moe_gspo.routing.router_stats.token_router_stats`).
        cache: the engine's `TensorCache`, for the tensors derived from the parameters (concatenated
            weights, their fp32 copies, the fp32 copies the experts module uses when it runs); default: its own.
        fp8_activations / fp8_router: W8A8 FP8 rollouts (`moe_gspo.rollout.fp8`): the input of every attention
            and MLP GEMM (and of the router's with fp8_router) quantized per token, as the engine's
            `Fp8ActivationQuantizer` hooks do in transformers' forward; when the model's experts module runs,
            those hooks quantize its inputs.
    """

    def __init__(self, model: nn.Module, *, fp32_gemm: bool, record_probs: bool = True,
                 cache: TensorCache | None = None, record_stats: bool = True, record_routes: bool = True,
                 fp8_activations: bool = False, fp8_router: bool = True):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"compact decoding does not support this model: {reason}; decode with "
                             "transformers instead (HFEngine(compact_decode=False); rollout.compact_decode="
                             "false or null)")
        self.model = model
        config = model.config
        self.dtype = model.model.embed_tokens.weight.dtype
        self.fp32_gemm = fp32_gemm and self.dtype == torch.bfloat16
        self.compute_dtype = torch.float32 if self.fp32_gemm else self.dtype
        self.record_routes = record_routes
        self.record_probs = record_probs
        self.record_stats = record_stats
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.id_dtype = torch.int16 if config.num_experts <= torch.iinfo(torch.int16).max else torch.int32
        self._cache = cache if cache is not None else TensorCache()
        self._qa, self._qr = activation_quantizers(fp8_activations, fp8_router)  # identities without W8A8
        self.dial = None
        """The engine's `moe_gspo.rollout.routing_dial.RoutingDial`, or None: the routers select through it."""
        self._layers: list[_Layer] = []
        self._K: list[torch.Tensor] = []
        self._V: list[torch.Tensor] = []
        self._slot = 0

    # ----------------------------------------------------------------------------- numerics
    @staticmethod
    def _rms(x: torch.Tensor, weight_eps: tuple[torch.Tensor, float]) -> torch.Tensor:
        """transformers' Qwen3MoeRMSNorm: fp32 statistics, rounded to the input dtype, times the weight."""
        weight, eps = weight_eps
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def _gemm(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T (+ bias) in the model dtype; with fp32_gemm an fp32 GEMM of the bf16 values, rounded once."""
        if self.fp32_gemm:
            return F.linear(x.float(), w, bias).to(self.dtype)
        return F.linear(x, w, bias)

    # ----------------------------------------------------------------------------- weights
    def _weight(self, key: str, sources: list[torch.Tensor]) -> torch.Tensor:
        """The concatenation of `sources` (dim 0) in the GEMMs' compute dtype (cached)."""
        dtype = self.compute_dtype
        if len(sources) == 1 and sources[0].dtype == dtype:
            return sources[0].detach()
        return self._cache(key, sources, lambda *ts: torch.cat([t.to(dtype) for t in ts]))

    def _resolve_layer(self, index: int, layer: nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        norm = lambda m: (m.weight.detach(), m.variance_epsilon)  # noqa: E731
        qk_norm = self._cache(f"{index}.qk_norm", [attn.q_norm.weight, attn.k_norm.weight],
                                lambda q, k: torch.cat([q.expand(nh, hd), k.expand(nkv, hd)]))
        common = dict(norm1=norm(layer.input_layernorm),
                      qkv=self._weight(f"{index}.qkv", [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                      qk_norm=(qk_norm, attn.q_norm.variance_epsilon), scaling=attn.scaling,
                      o=self._weight(f"{index}.o", [attn.o_proj.weight]), norm2=norm(layer.post_attention_layernorm))
        if not hasattr(mlp, "experts"):
            return _Layer(**common, gate_up=self._weight(f"{index}.gate_up", [mlp.gate_proj.weight, mlp.up_proj.weight]),
                          down=self._weight(f"{index}.down", [mlp.down_proj.weight]))
        router, experts = mlp.gate, mlp.experts
        wide = router.weight.dtype != self.dtype  # model.router_dtype (moe_gspo/rollout/router_dtype.py)
        moe = dict(router=router.weight.detach() if wide else self._weight(f"{index}.router", [router.weight]),
                   top_k=router.top_k, norm_topk_prob=router.norm_topk_prob, router_wide=wide)
        if experts.num_experts > DENSE_EXPERTS_RATIO * router.top_k:
            empty = torch.empty(0)
            return _Layer(**common, **moe, gate_up=empty, down=empty, experts=experts)
        dtype = self.compute_dtype
        gate_up = self._cache(f"{index}.experts_gate_up", [experts.gate_up_proj],
                                lambda w: w.to(dtype).reshape(-1, w.shape[-1]))
        down = self._cache(f"{index}.experts_down", [experts.down_proj],
                             lambda w: w.to(dtype).transpose(1, 2).contiguous())
        return _Layer(**common, **moe, gate_up=gate_up, down=down)

    # ----------------------------------------------------------------------------- prefill
    def prefill(self, input_ids_PT: torch.Tensor, attention_mask_PT: torch.Tensor, positions_PT: torch.Tensor,
                repeat: int, max_new_tokens: int) -> DecodeStep:
        """The prefill forward of the left-padded prompts (each distinct prompt once), as transformers runs
        it (its own causal-mask builder and attention dispatch, so the same kernel calls), writing the keys
        and values into a static cache of `repeat` rows per prompt with room for `max_new_tokens` more
        positions. Returns the `DecodeStep` of the last position's logits, repeated to [P * repeat, V], and
        the routes [P, T, L, K] of the prompt tokens. The weights are read here, once per generation."""
        from transformers import DynamicCache
        from transformers.masking_utils import create_causal_mask

        model = self.model
        self._layers = [self._resolve_layer(i, layer)
                        for i, layer in enumerate(model.model.layers[: model.config.num_hidden_layers])]
        self._embed = model.model.embed_tokens.weight.detach()
        self._final_norm = (model.model.norm.weight.detach(), model.model.norm.variance_epsilon)
        head = model.lm_head
        self._head = self._weight("lm_head", [head.weight])
        self._head_bias = None if head.bias is None else self._weight("lm_head.bias", [head.bias])

        num_prompts, num_prompt = input_ids_PT.shape
        num_rows, total, device = num_prompts * repeat, num_prompt + max_new_tokens, input_ids_PT.device
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        shape = (num_rows, nkv, total, hd)
        self._K = [torch.empty(shape, dtype=self.compute_dtype, device=device) for _ in self._layers]
        self._V = [torch.empty(shape, dtype=self.compute_dtype, device=device) for _ in self._layers]
        self._slot = num_prompt
        self._mask_B11T = None
        if not bool(attention_mask_PT.all()):  # prompt padding stays masked; generated positions are attended
            keep_BT = torch.ones((num_rows, total), dtype=torch.bool, device=device)
            keep_BT[:, :num_prompt] = attention_mask_PT.bool().repeat_interleave(repeat, dim=0)
            self._mask_B11T = keep_BT[:, None, None, :]
        positions = torch.arange(total, device=device)[None]
        cos, sin = model.model.rotary_emb(torch.empty(0, dtype=self.dtype, device=device), positions)
        self._cos_TD, self._sin_TD = cos[0], sin[0]

        h = F.embedding(input_ids_PT, self._embed)  # [P, T, H]
        mask = create_causal_mask(config=model.config, inputs_embeds=h, attention_mask=attention_mask_PT,
                                  past_key_values=DynamicCache(config=model.config), position_ids=positions_PT)
        cos_P1TD, sin_P1TD = (x[:, None] for x in model.model.rotary_emb(h, positions_PT))
        rms, gemm, qa = self._rms, self._gemm, self._qa
        ids, probs, stats = [], [], []
        for layer, K, V in zip(self._layers, self._K, self._V):
            qkv = gemm(qa(rms(h, layer.norm1)), layer.qkv)
            qk = rms(qkv[..., : (nh + nkv) * hd].view(num_prompts, num_prompt, nh + nkv, hd), layer.qk_norm)
            qk = self._rope(qk.transpose(1, 2), cos_P1TD, sin_P1TD)  # [P, heads, T, hd], as transformers' attention
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[..., (nh + nkv) * hd:].view(num_prompts, num_prompt, nkv, hd).transpose(1, 2)
            K.view(num_prompts, repeat, *shape[1:])[:, :, :, :num_prompt] = k[:, None]
            V.view(num_prompts, repeat, *shape[1:])[:, :, :, :num_prompt] = v[:, None]
            q, k, v = (t.to(self.compute_dtype) for t in (q, k, v))
            if mask is None:  # transformers' sdpa dispatch: causal flag and grouped-query kernel without a mask
                out = F.scaled_dot_product_attention(q, k, v, scale=layer.scaling, is_causal=num_prompt > 1,
                                                     enable_gqa=nh != nkv)
            else:  # with a mask: the key/value heads repeated, the mask as given
                k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask.float() if mask.is_floating_point() else mask, scale=layer.scaling)
            out = out.to(self.dtype).transpose(1, 2).reshape(num_prompts, num_prompt, nh * hd)
            h = h + gemm(qa(out), layer.o)
            h = h + self._ffn(layer, rms(h, layer.norm2), ids, probs, stats)
        logits_PV = gemm(rms(h[:, -1], self._final_norm), self._head, self._head_bias).float()
        return self._decode_step(logits_PV.repeat_interleave(repeat, dim=0), ids, probs, stats,
                                 (num_prompts, num_prompt))

    # ----------------------------------------------------------------------------- one step
    def step(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> DecodeStep:
        """Feed one token per row at its position: `DecodeStep` of the next-token logits and the routes [B, 1, L, K]
        of the fed tokens (top-k expert ids int16, their full-softmax probabilities and the router margin and
        entropy of every MoE layer, float32, as recorded)."""
        assert self._K, "call prefill() first"
        slot = self._slot
        assert slot < self._K[0].shape[2], "more decode steps than prefill() made room for"
        num_rows = tokens_B.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        gqa, rms, gemm, qa = nh != nkv, self._rms, self._gemm, self._qa
        h_BH = F.embedding(tokens_B, self._embed)
        cos_B1D = self._cos_TD[positions_B][:, None]
        sin_B1D = self._sin_TD[positions_B][:, None]
        mask = None if self._mask_B11T is None else self._mask_B11T[..., : slot + 1]
        ids, probs, stats = [], [], []
        for layer, K, V in zip(self._layers, self._K, self._V):
            qkv = gemm(qa(rms(h_BH, layer.norm1)), layer.qkv)
            # q and k heads together: their norms (each head its own weight) and rotary embedding
            qk_BND = rms(qkv[:, : (nh + nkv) * hd].view(num_rows, nh + nkv, hd), layer.qk_norm)
            qk_BND = self._rope(qk_BND, cos_B1D, sin_B1D)
            K[:, :, slot] = qk_BND[:, nh:]
            V[:, :, slot] = qkv[:, (nh + nkv) * hd:].view(num_rows, nkv, hd)
            out = F.scaled_dot_product_attention(
                qk_BND[:, :nh, None].to(self.compute_dtype), K[:, :, : slot + 1], V[:, :, : slot + 1],
                attn_mask=mask, scale=layer.scaling, enable_gqa=gqa)
            h_BH = h_BH + gemm(qa(out.to(self.dtype).reshape(num_rows, nh * hd)), layer.o)
            h_BH = h_BH + self._ffn(layer, rms(h_BH, layer.norm2), ids, probs, stats)
        self._slot = slot + 1
        logits_BV = gemm(rms(h_BH, self._final_norm), self._head, self._head_bias).float()
        return self._decode_step(logits_BV, ids, probs, stats, (num_rows, 1))

    def _decode_step(self, logits_BV: torch.Tensor, ids: list, probs: list, stats: list, rows_tokens: tuple
                     ) -> DecodeStep:
        """The `DecodeStep` of a forward whose MoE layers appended their [N*T, K] routes to `ids` / `probs` and
        their [N*T, E] router logits to `stats` (made margin and entropy here)."""
        if not self.record_routes:
            return DecodeStep(logits_BV)
        L = len(ids)
        ids_NTLK = torch.stack(ids, dim=1).to(self.id_dtype).view(*rows_tokens, L, -1)
        probs_NTLK = torch.stack(probs, dim=1).view(*rows_tokens, L, -1) if self.record_probs else None
        stats_NTL2 = None
        if self.record_stats:  # the MoE layers' router logits [N*T, E], one `token_router_stats` call for all
            top_k = next(layer.top_k for layer in self._layers if layer.router is not None)
            logits_NLE = torch.stack(stats, dim=1)
            stats_NTL2 = token_router_stats(logits_NLE.view(-1, logits_NLE.shape[-1]), top_k).view(*rows_tokens, L, 2)
        return DecodeStep(logits_BV, ids_NTLK, probs_NTLK, stats_NTL2)

    def end(self) -> None:
        """Release the generation's KV cache (the derived weights stay in the cache)."""
        self._K, self._V, self._mask_B11T = [], [], None

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """transformers' `apply_rotary_pos_emb` on one tensor: `x * cos + rotate_half(x) * sin`."""
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def _ffn(self, layer: _Layer, x: torch.Tensor, ids: list, probs: list, stats: list) -> torch.Tensor:
        """The layer's MLP (dense, or the MoE block on the flattened tokens, whose routes go to `ids` / `probs`
        and router logits to `stats`)."""
        if layer.router is None:
            gate, up = self._gemm(self._qa(x), layer.gate_up).chunk(2, dim=-1)
            return self._gemm(self._qa(F.silu(gate) * up), layer.down)
        y, ids_NK, probs_NK, logits_NE = self._moe(layer, x.reshape(-1, x.shape[-1]))
        ids.append(ids_NK)
        probs.append(probs_NK)
        stats.append(logits_NE)
        return y.view_as(x)

    def _moe(self, layer: _Layer, x_BH: torch.Tensor):
        """The sparse MoE block: router as transformers' `Qwen3MoeTopKRouter`, then the experts."""
        if self.dial is not None:  # the routing-drift dial: as its hook on transformers' router (routing_dial.py)
            if layer.router_wide:
                logits_BE, out_dtype = F.linear(x_BH.to(layer.router.dtype), layer.router), x_BH.dtype
            else:
                logits_BE = self._gemm(self._qr(x_BH), layer.router)
                out_dtype = logits_BE.dtype
            weights_BK, ids_BK, recorded = self.dial.route(logits_BE, layer.top_k, layer.norm_topk_prob, out_dtype)
            stat_logits_BE = logits_BE if self.record_stats else None
            recorded = recorded if self.record_probs else None
        elif layer.router_wide:  # model.router_dtype: gate GEMM, softmax and top-k in the gate weight's dtype
            from moe_gspo.rollout.router_dtype import route_in_dtype

            logits_BE, weights_BK, ids_BK = route_in_dtype(x_BH, layer.router, layer.top_k, layer.norm_topk_prob)
            stat_logits_BE = logits_BE if self.record_stats else None  # statistics of all layers at once: _decode_step
            recorded = (torch.softmax(logits_BE, dim=-1, dtype=torch.float32).gather(1, ids_BK)  # as HFRouterRecorder
                        if self.record_probs else None)
        else:
            logits_BE = self._gemm(self._qr(x_BH), layer.router)
            stat_logits_BE = logits_BE if self.record_stats else None  # statistics of all layers at once: _decode_step
            probs_BE = torch.softmax(logits_BE, dim=-1, dtype=torch.float32)
            top_BK, ids_BK = torch.topk(probs_BE, layer.top_k, dim=-1)
            recorded = top_BK if self.record_probs else None
            weights_BK = top_BK / top_BK.sum(dim=-1, keepdim=True) if layer.norm_topk_prob else top_BK
            weights_BK = weights_BK.to(logits_BE.dtype)
        if layer.experts is not None:
            if self.fp32_gemm:
                with Fp32GemmForBf16(self._cache):
                    return layer.experts(x_BH, ids_BK, weights_BK), ids_BK, recorded, stat_logits_BE
            return layer.experts(x_BH, ids_BK, weights_BK), ids_BK, recorded, stat_logits_BE
        num_rows, num_experts = x_BH.shape[0], layer.down.shape[0]
        gate, up = self._gemm(self._qa(x_BH), layer.gate_up).view(num_rows, num_experts, -1).chunk(2, dim=-1)
        act_BEI = self._qa(F.silu(gate) * up)  # W8A8: per (token, expert) row, as the experts' down_proj input
        out_EBH = torch.bmm(act_BEI.transpose(0, 1).to(self.compute_dtype), layer.down).to(self.dtype)
        hidden = out_EBH.shape[-1]
        chosen_BKH = out_EBH.transpose(0, 1).gather(1, ids_BK[:, :, None].expand(-1, -1, hidden))
        y_BH = (chosen_BKH * weights_BK[..., None]).sum(dim=1).to(x_BH.dtype)
        return y_BH, ids_BK, recorded, stat_logits_BE
