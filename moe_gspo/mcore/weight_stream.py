"""Stream the Megatron learner's weights to a rollout engine as HF-named tensors, one layer at a time.

`HFWeightStream(model)` is an iterable of ``(hf_name, tensor)`` pairs in a fixed order (embedding,
then each decoder layer, then the final norm and `lm_head`), built from the learner's own
parameters. Each decoder layer is one *bucket*: its dense tensors are views of (or, for q/k/v,
small copies from) this rank's parameters; its experts are all-gathered over the expert-parallel
group into one fresh buffer ``[num_experts, 3 * I * H]`` (one `all_gather` per MoE layer), and the
buffer is dropped when the iterator moves to the next bucket. So a rank never holds more than one
layer's experts beyond its own shard, instead of the whole HF state dict (`gather_hf_state_dict`,
kept for export): at Qwen3-30B-A3B in bf16 one layer's experts are 128 x 3 x 768 x 2048 x 2 B =
1.13 GiB, the whole model 57 GiB.

Contract (the stream runs collectives inside the generator):

- every rank of the expert-parallel group iterates the stream to the end, in the same order, and
  nothing else uses that group meanwhile; a consumer that fails part-way must keep iterating
  (`drain`) so that the other ranks are not left waiting in an `all_gather`;
- a yielded tensor is valid until the iterator advances past its bucket (consumers copy it, as
  rollout engines do, or clone it);
- `specs` (names and shapes, in stream order) is known before iterating, from the config alone, so
  a consumer can validate every name before anything is written or any collective runs.

Layouts: ``"per_expert"`` (default) yields the on-disk checkpoint names
(``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``), views of the gathered buffer, no
copies; vLLM's loader and `moe_gspo.rollout.weights_sync` accept them. ``"fused"`` yields
transformers 5's in-memory ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I]
(strided views of the same buffer).

With the grouped expert layout (`model.expert_layout=grouped`: `experts.weight1`/`weight2`, see
`moe_gspo.mcore.weights`) the experts' HF tensors are transposed views of those parameters (per-expert
layout at EP=1, no copy) or go through the same gathered buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from moe_gspo.mcore.model import moe_layer_pattern, unwrap
from moe_gspo.mcore.weights import _LAYER_RENAMES, _canonical_mcore, _ep_rank_size, _geometry, _qkv_to_hf

Tensor = torch.Tensor


@dataclass(frozen=True)
class WeightSpec:
    """One tensor of the stream: its HF name and shape."""

    name: str
    shape: tuple[int, ...]


def hf_weight_specs(hf_config, *, layout: str = "per_expert") -> list[WeightSpec]:
    """Every HF tensor of a Qwen3-MoE model, in the order `HFWeightStream` yields them (pure)."""
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"layout={layout!r}; use 'per_expert' or 'fused'")
    nh, ng, hd, H = _geometry(hf_config)
    V, E, I = hf_config.vocab_size, hf_config.num_experts, hf_config.moe_intermediate_size
    specs = [WeightSpec("model.embed_tokens.weight", (V, H))]
    for l, is_moe in enumerate(moe_layer_pattern(hf_config)):
        h = f"model.layers.{l}."
        specs += [WeightSpec(h + "self_attn.q_proj.weight", (nh * hd, H)),
                  WeightSpec(h + "self_attn.k_proj.weight", (ng * hd, H)),
                  WeightSpec(h + "self_attn.v_proj.weight", (ng * hd, H))]
        shapes = {"self_attn.o_proj": (H, nh * hd), "self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,),
                  "input_layernorm": (H,), "post_attention_layernorm": (H,)}
        specs += [WeightSpec(f"{h}{hf_name}.weight", shapes[hf_name]) for hf_name, _ in _LAYER_RENAMES]
        if not is_moe:
            F = hf_config.intermediate_size
            specs += [WeightSpec(h + "mlp.gate_proj.weight", (F, H)), WeightSpec(h + "mlp.up_proj.weight", (F, H)),
                      WeightSpec(h + "mlp.down_proj.weight", (H, F))]
            continue
        specs.append(WeightSpec(h + "mlp.gate.weight", (E, H)))
        if layout == "fused":
            specs += [WeightSpec(h + "mlp.experts.gate_up_proj", (E, 2 * I, H)),
                      WeightSpec(h + "mlp.experts.down_proj", (E, H, I))]
        else:
            for e in range(E):
                p = f"{h}mlp.experts.{e}."
                specs += [WeightSpec(p + "gate_proj.weight", (I, H)), WeightSpec(p + "up_proj.weight", (I, H)),
                          WeightSpec(p + "down_proj.weight", (H, I))]
    specs.append(WeightSpec("model.norm.weight", (H,)))
    if not hf_config.tie_word_embeddings:
        specs.append(WeightSpec("lm_head.weight", (V, H)))
    return specs


@dataclass
class StreamStats:
    """What one pass over the stream moved (filled while iterating; reset by each `iter`)."""

    num_buckets: int = 0
    num_tensors: int = 0
    bytes_yielded: int = 0
    """Bytes of every yielded tensor (what the consumer reads)."""
    bucket_alloc_bytes: list[int] = field(default_factory=list)
    """Per bucket, bytes this rank allocated for it (gathered experts, own-expert staging, q/k/v)."""

    @property
    def peak_bucket_bytes(self) -> int:
        """The largest allocation of one bucket: the stream's peak extra memory on this rank."""
        return max(self.bucket_alloc_bytes, default=0)


class HFWeightStream:
    """Iterable of the learner's weights as HF-named tensors, one bucket (layer) at a time.

    Collective over the expert-parallel group: see the module docstring for the contract.
    `model` is a Megatron `GPTModel` (or a wrapper) built by `moe_gspo.mcore.model.build_gpt_model`.
    """

    def __init__(self, model, hf_config=None, *, layout: str = "per_expert"):
        m = unwrap(model)
        self.hf_config = hf_config if hf_config is not None else m.hf_config
        self.layout = layout
        self.specs = hf_weight_specs(self.hf_config, layout=layout)
        self.stats = StreamStats()
        self._model = m
        self._ep_rank, self._ep_size = _ep_rank_size(None, None)
        if self.hf_config.num_experts % self._ep_size:
            raise ValueError(f"num_experts={self.hf_config.num_experts} is not divisible by EP={self._ep_size}")

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        self.stats = StreamStats()
        specs = iter(self.specs)
        for bucket, alloc in self._buckets():
            self.stats.num_buckets += 1
            self.stats.bucket_alloc_bytes.append(alloc)
            while bucket:
                name, t = bucket.pop(0)
                spec = next(specs)
                assert (name, tuple(t.shape)) == (spec.name, spec.shape), (name, tuple(t.shape), spec)
                self.stats.num_tensors += 1
                self.stats.bytes_yielded += t.numel() * t.element_size()
                yield name, t
            name = t = None  # the last view would keep this bucket's gathered buffer alive into the next one
        assert next(specs, None) is None, "stream ended before its specs"

    def _buckets(self) -> Iterator[tuple[list[tuple[str, Tensor]], int]]:
        cfg = self.hf_config
        params = _canonical_mcore({k: p.detach() for k, p in self._model.named_parameters()},
                                  ffn=cfg.moe_intermediate_size)  # the grouped layout split per expert (views)
        V = cfg.vocab_size
        yield [("model.embed_tokens.weight", params["embedding.word_embeddings.weight"][:V])], 0
        for l, is_moe in enumerate(moe_layer_pattern(cfg)):
            yield self._layer(params, l, bool(is_moe))
        tail = [("model.norm.weight", params["decoder.final_layernorm.weight"])]
        if not cfg.tie_word_embeddings:
            tail.append(("lm_head.weight", params["output_layer.weight"][:V]))
        yield tail, 0

    def _layer(self, params: dict[str, Tensor], l: int, is_moe: bool) -> tuple[list[tuple[str, Tensor]], int]:
        cfg = self.hf_config
        h, m = f"model.layers.{l}.", f"decoder.layers.{l}."
        q, k, v = _qkv_to_hf(params[m + "self_attention.linear_qkv.weight"], cfg)
        out = [(h + "self_attn.q_proj.weight", q), (h + "self_attn.k_proj.weight", k),
               (h + "self_attn.v_proj.weight", v)]
        alloc = sum(t.numel() * t.element_size() for t in (q, k, v))
        out += [(f"{h}{hf_name}.weight", params[f"{m}{mc_name}.weight"]) for hf_name, mc_name in _LAYER_RENAMES]
        if not is_moe:
            fc1 = params[m + "mlp.linear_fc1.weight"]
            half = fc1.shape[0] // 2
            out += [(h + "mlp.gate_proj.weight", fc1[:half]), (h + "mlp.up_proj.weight", fc1[half:]),
                    (h + "mlp.down_proj.weight", params[m + "mlp.linear_fc2.weight"])]
            return out, alloc
        out.append((h + "mlp.gate.weight", params[m + "mlp.router.weight"]))
        experts, expert_alloc = self._gather_experts(params, m)
        return out + experts, alloc + expert_alloc

    def _gather_experts(self, params: dict[str, Tensor], m: str) -> tuple[list[tuple[str, Tensor]], int]:
        """This MoE layer's experts of every EP rank (global ids), as HF-named views."""
        cfg = self.hf_config
        E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        num_local = E // self._ep_size
        fc1 = [params[f"{m}mlp.experts.local_experts.{j}.linear_fc1.weight"] for j in range(num_local)]
        fc2 = [params[f"{m}mlp.experts.local_experts.{j}.linear_fc2.weight"] for j in range(num_local)]
        h = "model.layers." + m.split(".")[2] + "."
        if self._ep_size == 1 and self.layout == "per_expert":  # no collective, no copy
            return [item for e in range(E) for item in _per_expert(h, e, fc1[e], fc2[e], I)], 0
        n1 = 2 * I * H
        local = fc1[0].new_empty((num_local, n1 + H * I))
        for j in range(num_local):
            local[j, :n1].copy_(fc1[j].reshape(-1))
            local[j, n1:].copy_(fc2[j].reshape(-1))
        alloc = local.numel() * local.element_size()
        if self._ep_size == 1:
            full = local
        else:
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            full = local.new_empty((E, local.shape[1]))
            dist.all_gather(list(full.chunk(self._ep_size)), local, group=ps.get_expert_model_parallel_group())
            alloc += full.numel() * full.element_size()
            del local
        if self.layout == "fused":
            return [(h + "mlp.experts.gate_up_proj", full[:, :n1].unflatten(1, (2 * I, H))),
                    (h + "mlp.experts.down_proj", full[:, n1:].unflatten(1, (H, I)))], alloc
        return [item for e in range(E)
                for item in _per_expert(h, e, full[e, :n1].view(2 * I, H), full[e, n1:].view(H, I), I)], alloc


def _per_expert(h: str, e: int, fc1: Tensor, fc2: Tensor, I: int) -> list[tuple[str, Tensor]]:
    p = f"{h}mlp.experts.{e}."
    return [(p + "gate_proj.weight", fc1[:I]), (p + "up_proj.weight", fc1[I:]), (p + "down_proj.weight", fc2)]


def drain(iterator: Iterator) -> None:
    """Run `iterator` to its end, discarding items (keeps a stream's collectives matched after an error)."""
    for _ in iterator:
        pass
