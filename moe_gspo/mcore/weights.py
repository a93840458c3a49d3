"""Qwen3-MoE weights between transformers (HF) names and Megatron-core `GPTModel` names.

Pure conversion (no file I/O; see `moe_gspo.mcore.checkpoint` for safetensors). Name map, per layer
`l` (HF `model.layers.{l}.` → Megatron `decoder.layers.{l}.`):

- `self_attn.{q,k,v}_proj.weight` → `self_attention.linear_qkv.weight`, Megatron's per-query-group
  layout: for each KV group g, the rows of its `nh/ng` query heads, then its key head, then its
  value head (`[ng, nh/ng + 2, head_dim, H]` flattened);
- `self_attn.o_proj` → `self_attention.linear_proj`; `q_norm`/`k_norm` → `q_layernorm`/`k_layernorm`;
- `input_layernorm` → `input_layernorm`; `post_attention_layernorm` → `pre_mlp_layernorm`
  (with the Transformer Engine spec these norms are fused into the next linear and named
  `self_attention.linear_qkv.layer_norm_weight` / dense `mlp.linear_fc1.layer_norm_weight`; both
  spellings are read, and `load_into_megatron` writes whichever the model has);
- dense MLP `mlp.{gate,up}_proj` → `mlp.linear_fc1.weight` = cat(gate, up) [2I, H]; `down_proj` →
  `mlp.linear_fc2.weight`;
- MoE `mlp.gate.weight` [E, H] → `mlp.router.weight`; expert e (global) → local expert
  `j = e - ep_rank * E_local` on EP rank `e // E_local`:
  `mlp.experts.local_experts.{j}.linear_fc1.weight` = cat(gate_e, up_e) [2I, H] (which is exactly
  transformers 5's fused `experts.gate_up_proj[e]`), `linear_fc2.weight` = `down_e` [H, I]
  (= `experts.down_proj[e]`);
- with the grouped expert layout (`model.expert_layout=grouped`, Megatron's legacy `GroupedMLP`:
  `moe_gspo.mcore.grouped_experts`) a MoE layer's local experts are two tensors, `mlp.experts.weight1`
  [H, E_local*2I] and `mlp.experts.weight2` [E_local*I, H], whose storage reads as [E_local, H, 2I] and
  [E_local, I, H]: local expert j's `linear_fc1.weight` is `weight1.view(E_local, H, 2I)[j].T` (gate rows,
  then up rows, as above) and its `linear_fc2.weight` is `weight2.view(E_local, I, H)[j].T`. Every
  conversion goes through the per-expert names: `_canonical_mcore` splits the grouped tensors into those
  (transposed views, no copy) and `load_into_megatron` stacks them back;
- `model.embed_tokens` → `embedding.word_embeddings`, `model.norm` → `decoder.final_layernorm`,
  `lm_head` → `output_layer` (absent when `tie_word_embeddings`); vocabulary rows are zero-padded to
  a multiple of `vocab_pad_multiple` and stripped on the way back.

HF expert weights come in two layouts, detected per layer: the fused in-memory layout of
transformers 5 (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and the
per-expert on-disk layout (`mlp.experts.{e}.{gate,up,down}_proj.weight`). All conversions are exact
(reshapes, slices and concatenations; dtypes are kept).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import torch

from moe_gspo.mcore.model import check_supported, moe_layer_ids, moe_layer_pattern, padded_vocab_size

Tensor = torch.Tensor

_TE_FUSED_TO_LOCAL = (
    (re.compile(r"^(decoder\.layers\.\d+)\.self_attention\.linear_qkv\.layer_norm_weight$"),
     r"\1.input_layernorm.weight"),
    (re.compile(r"^(decoder\.layers\.\d+)\.mlp\.linear_fc1\.layer_norm_weight$"),
     r"\1.pre_mlp_layernorm.weight"),
)
# Transformer Engine's grouped experts (`TEGroupedMLP`, `moe_grouped_gemm=True`): one `linear_fc{1,2}` per MoE
# layer holding every local expert's weight as `weight{j}`, each shaped like `SequentialMLP`'s.
_TE_GROUPED_EXPERT_RE = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$")
_LOCAL_EXPERT_RE = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
# The grouped layout (Megatron's legacy `GroupedMLP`): one tensor per projection over the local experts.
_GROUPED_EXPERT_RE = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.weight([12])$")
_LOCAL_TO_TE_FUSED = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}
_MCORE_EXPERT_RE = re.compile(
    r"^decoder\.layers\.(?P<layer>\d+)\.mlp\.experts\.local_experts\.(?P<j>\d+)\.(?P<fc>linear_fc[12])\.weight$")
_HF_KNOWN_RE = re.compile(
    r"^(lm_head\.weight|model\.embed_tokens\.weight|model\.norm\.weight|"
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight|"
    r"model\.layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight|"
    r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj|gate)\.weight|"
    r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)|"
    r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight)$")



# Per-layer tensors whose HF and Megatron names differ only by a rename (both directions use it).
_LAYER_RENAMES = (("self_attn.o_proj", "self_attention.linear_proj"),
                  ("self_attn.q_norm", "self_attention.q_layernorm"),
                  ("self_attn.k_norm", "self_attention.k_layernorm"),
                  ("input_layernorm", "input_layernorm"),
                  ("post_attention_layernorm", "pre_mlp_layernorm"))

def _geometry(hf_config) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_dim, hidden)."""
    nh, ng = hf_config.num_attention_heads, hf_config.num_key_value_heads
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // nh
    if nh % ng != 0:
        raise ValueError(f"model num_attention_heads={nh} is not a multiple of num_key_value_heads={ng}")
    return nh, ng, hd, hf_config.hidden_size


def _local_experts(hf_config, ep_rank: int, ep_size: int) -> list[int]:
    """Global ids of the experts EP rank `ep_rank` holds, in local order."""
    num_experts = hf_config.num_experts
    if ep_size < 1 or num_experts % ep_size != 0:
        raise ValueError(f"model num_experts={num_experts} is not divisible by expert_parallel_size="
                         f"{ep_size}; choose an EP size that divides the number of experts")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} is outside [0, ep_size={ep_size})")
    num_local = num_experts // ep_size
    return list(range(ep_rank * num_local, (ep_rank + 1) * num_local))


def expert_keys_for_rank(hf_config, *, ep_rank: int = 0, ep_size: int = 1) -> set[str]:
    """The per-expert (on-disk) HF names that EP rank `ep_rank` needs; all other expert names are skipped."""
    experts = _local_experts(hf_config, ep_rank, ep_size)
    return {f"model.layers.{l}.mlp.experts.{e}.{p}.weight"
            for l in moe_layer_ids(hf_config) for e in experts
            for p in ("gate_proj", "up_proj", "down_proj")}


def _pad_rows(w: Tensor, rows: int) -> Tensor:
    if w.shape[0] == rows:
        return w
    if w.shape[0] > rows:
        raise ValueError(f"vocabulary tensor has {w.shape[0]} rows, more than the padded vocabulary {rows}")
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], dim=0)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" ... ({len(names)} in all)" if len(names) > 8 else "")


class _Reader:
    """Fetches HF tensors, collecting every missing name so one error lists them all."""

    def __init__(self, hf_sd: Mapping[str, Tensor]):
        self.sd = hf_sd
        self.missing: list[str] = []

    def __call__(self, name: str) -> Tensor | None:
        t = self.sd.get(name)
        if t is None:
            self.missing.append(name)
        return t

    def raise_if_missing(self, what: str) -> None:
        if self.missing:
            raise ValueError(f"{what}: the HF state dict lacks {_shown(self.missing)}; is it a Qwen3-MoE checkpoint matching "
                             "this config (num_hidden_layers, num_experts, mlp_only_layers)?")


def _qkv_to_megatron(q: Tensor, k: Tensor, v: Tensor, hf_config) -> Tensor:
    nh, ng, hd, H = _geometry(hf_config)
    for name, t, rows in (("q_proj", q, nh * hd), ("k_proj", k, ng * hd), ("v_proj", v, ng * hd)):
        if tuple(t.shape) != (rows, H):
            raise ValueError(f"self_attn.{name}.weight has shape {tuple(t.shape)}, the config implies "
                             f"({rows}, {H}) (num_attention_heads, num_key_value_heads, head_dim, hidden_size)")
    qkv = torch.cat([q.reshape(ng, nh // ng, hd, H), k.reshape(ng, 1, hd, H), v.reshape(ng, 1, hd, H)], dim=1)
    return qkv.reshape(ng * (nh // ng + 2) * hd, H)


def _qkv_to_hf(qkv: Tensor, hf_config) -> tuple[Tensor, Tensor, Tensor]:
    nh, ng, hd, H = _geometry(hf_config)
    per = nh // ng
    w = qkv.reshape(ng, per + 2, hd, H)
    return (w[:, :per].reshape(nh * hd, H).contiguous(), w[:, per].reshape(ng * hd, H).contiguous(),
            w[:, per + 1].reshape(ng * hd, H).contiguous())


def _hf_to_megatron_rows(hf_sd: Mapping[str, Tensor], hf_config, *, ep_rank: int, ep_size: int,
                         vocab_rows: int) -> dict[str, Tensor]:
    check_supported(hf_config)
    unknown = [k for k in hf_sd if not _HF_KNOWN_RE.match(k)]
    if unknown:
        raise ValueError(f"hf_to_megatron: unexpected HF weight names {unknown[:8]}; only Qwen3-MoE "
                         "(Qwen3MoeForCausalLM) state dicts are supported")
    get = _Reader(hf_sd)
    experts = _local_experts(hf_config, ep_rank, ep_size)
    I = hf_config.moe_intermediate_size
    out: dict[str, Tensor] = {}
    emb = get("model.embed_tokens.weight")
    if emb is not None:
        out["embedding.word_embeddings.weight"] = _pad_rows(emb, vocab_rows)
    for l, is_moe in enumerate(moe_layer_pattern(hf_config)):
        h, m = f"model.layers.{l}.", f"decoder.layers.{l}."
        q, k, v = (get(f"{h}self_attn.{p}_proj.weight") for p in "qkv")
        if q is not None and k is not None and v is not None:
            out[m + "self_attention.linear_qkv.weight"] = _qkv_to_megatron(q, k, v, hf_config)
        for hf_name, mc_name in _LAYER_RENAMES:
            t = get(h + hf_name + ".weight")
            if t is not None:
                out[m + mc_name + ".weight"] = t
        if not is_moe:
            g, u, d = (get(f"{h}mlp.{p}_proj.weight") for p in ("gate", "up", "down"))
            if g is not None and u is not None:
                out[m + "mlp.linear_fc1.weight"] = torch.cat([g, u], dim=0)
            if d is not None:
                out[m + "mlp.linear_fc2.weight"] = d
            continue
        r = get(h + "mlp.gate.weight")
        if r is not None:
            out[m + "mlp.router.weight"] = r
        fused_gu = hf_sd.get(h + "mlp.experts.gate_up_proj")
        if fused_gu is not None:
            fused_d = get(h + "mlp.experts.down_proj")
            if tuple(fused_gu.shape[:2]) != (hf_config.num_experts, 2 * I):
                raise ValueError(f"{h}mlp.experts.gate_up_proj has shape {tuple(fused_gu.shape)}, expected "
                                 f"[num_experts={hf_config.num_experts}, 2*moe_intermediate_size={2 * I}, H]")
            for j, e in enumerate(experts):
                out[f"{m}mlp.experts.local_experts.{j}.linear_fc1.weight"] = fused_gu[e]
                if fused_d is not None:
                    out[f"{m}mlp.experts.local_experts.{j}.linear_fc2.weight"] = fused_d[e]
            continue
        for j, e in enumerate(experts):
            p = f"{h}mlp.experts.{e}."
            g, u, d = get(p + "gate_proj.weight"), get(p + "up_proj.weight"), get(p + "down_proj.weight")
            if g is not None and u is not None:
                out[f"{m}mlp.experts.local_experts.{j}.linear_fc1.weight"] = torch.cat([g, u], dim=0)
            if d is not None:
                out[f"{m}mlp.experts.local_experts.{j}.linear_fc2.weight"] = d
    norm = get("model.norm.weight")
    if norm is not None:
        out["decoder.final_layernorm.weight"] = norm
    if not hf_config.tie_word_embeddings:
        head = get("lm_head.weight")
        if head is not None:
            out["output_layer.weight"] = _pad_rows(head, vocab_rows)
    get.raise_if_missing("hf_to_megatron")
    return out


def hf_to_megatron(hf_sd: Mapping[str, Tensor], hf_config, *, ep_rank: int = 0, ep_size: int = 1,
                   vocab_pad_multiple: int = 1) -> dict[str, Tensor]:
    """Megatron state dict (local spec names) of EP rank `ep_rank`: all dense weights, its experts only.

    `hf_sd` may hold the fused or the per-expert expert layout (detected per layer) and may omit the
    experts of other EP ranks. `lm_head.weight` is ignored when the embeddings are tied. Tensors are
    views of or concatenations of the inputs (no dtype change).
    """
    rows = padded_vocab_size(hf_config.vocab_size, vocab_pad_multiple)
    return _hf_to_megatron_rows(hf_sd, hf_config, ep_rank=ep_rank, ep_size=ep_size, vocab_rows=rows)


def _split_grouped(prefix: str, which: str, w: Tensor, ffn: int | None) -> dict[str, Tensor]:
    """The local per-expert names of a grouped-layout tensor `{prefix}.weight{which}` (module docstring):
    transposed views of `w`, no copy (`w` is a parameter, its gradient, ...)."""
    if ffn is None:
        raise ValueError(f"{prefix}.weight{which}: splitting the grouped expert layout needs the config's "
                         "moe_intermediate_size")
    if which == "1":
        (H, n), per, fc = w.shape, 2 * ffn, "linear_fc1"
        w_E = w.reshape(n // per, H, per)
    else:
        (n, H), per, fc = w.shape, ffn, "linear_fc2"
        w_E = w.reshape(n // per, per, H)
    assert n % per == 0, (prefix, which, tuple(w.shape), ffn)
    return {f"{prefix}.local_experts.{j}.{fc}.weight": w_E[j].t() for j in range(w_E.shape[0])}


def _canonical_mcore(sd: Mapping[str, Tensor], *, ffn: int | None = None) -> dict[str, Tensor]:
    """Drop `_extra_state` and rename TE-fused norm weights and TE's grouped expert weights to their
    local-spec names; split the grouped layout's `experts.weight{1,2}` into them (needs `ffn`, the
    config's `moe_intermediate_size`)."""
    out = {}
    for k, v in sd.items():
        if k.endswith("_extra_state") or v is None:
            continue
        for pat, repl in _TE_FUSED_TO_LOCAL:
            if pat.match(k):
                k = pat.sub(repl, k)
                break
        else:
            if (mt := _GROUPED_EXPERT_RE.match(k)) is not None:
                out.update(_split_grouped(mt[1], mt[2], v, ffn))
                continue
            k = _TE_GROUPED_EXPERT_RE.sub(r"\1.local_experts.\3.\2.weight", k)
        out[k] = v
    return out


def _merge_ranks(per_rank: list[Mapping[str, Tensor]], *, ffn: int | None = None) -> dict[str, Tensor]:
    """One Megatron dict with global expert ids from the dicts of EP ranks 0..n-1 (in EP-rank order)."""
    merged: dict[str, Tensor] = {}
    for rank, sd in enumerate(per_rank):
        sd = _canonical_mcore(sd, ffn=ffn)
        num_local = {}
        for k in sd:
            mt = _MCORE_EXPERT_RE.match(k)
            if mt:
                num_local[mt["layer"]] = max(num_local.get(mt["layer"], 0), int(mt["j"]) + 1)
        for k, v in sd.items():
            mt = _MCORE_EXPERT_RE.match(k)
            if mt is None:
                merged.setdefault(k, v)  # dense weights are replicated; rank 0's copy wins
                continue
            g = rank * num_local[mt["layer"]] + int(mt["j"])
            merged[f"decoder.layers.{mt['layer']}.mlp.experts.local_experts.{g}.{mt['fc']}.weight"] = v
    return merged


def megatron_to_hf(mcore_sd_per_rank: list[Mapping[str, Tensor]] | Mapping[str, Tensor], hf_config, *,
                   layout: str = "fused") -> dict[str, Tensor]:
    """HF state dict from Megatron weights; inverse of `hf_to_megatron`.

    `mcore_sd_per_rank` is either the list of every EP rank's state dict (EP-rank order, local expert
    names) or one dict whose `local_experts.{j}` ids are already global (0..E-1). `layout="fused"`
    gives transformers 5's in-memory names (`experts.gate_up_proj` / `experts.down_proj`),
    `"per_expert"` the on-disk names. Vocabulary padding is stripped; no `lm_head` when tied.
    Outputs other than q/k/v and the fused expert stacks are views of the inputs (clone them for a
    snapshot); `"per_expert"` is therefore copy-free for the expert weights, `"fused"` stacks them.
    """
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"megatron_to_hf: layout={layout!r}; use 'fused' or 'per_expert'")
    check_supported(hf_config)
    ffn = hf_config.moe_intermediate_size
    sd = (_merge_ranks(list(mcore_sd_per_rank), ffn=ffn) if isinstance(mcore_sd_per_rank, (list, tuple))
          else _canonical_mcore(mcore_sd_per_rank, ffn=ffn))
    V, E, I = hf_config.vocab_size, hf_config.num_experts, hf_config.moe_intermediate_size
    missing: list[str] = []

    def get(name):
        t = sd.get(name)
        if t is None:
            missing.append(name)
        return t

    out: dict[str, Tensor] = {}
    emb = get("embedding.word_embeddings.weight")
    if emb is not None:
        out["model.embed_tokens.weight"] = emb[:V]
    for l, is_moe in enumerate(moe_layer_pattern(hf_config)):
        h, m = f"model.layers.{l}.", f"decoder.layers.{l}."
        qkv = get(m + "self_attention.linear_qkv.weight")
        if qkv is not None:
            (out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"],
             out[h + "self_attn.v_proj.weight"]) = _qkv_to_hf(qkv, hf_config)
        for hf_name, mc_name in _LAYER_RENAMES:
            t = get(m + mc_name + ".weight")
            if t is not None:
                out[h + hf_name + ".weight"] = t
        if not is_moe:
            fc1, fc2 = get(m + "mlp.linear_fc1.weight"), get(m + "mlp.linear_fc2.weight")
            if fc1 is not None:
                half = fc1.shape[0] // 2
                out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = fc1[:half], fc1[half:]
            if fc2 is not None:
                out[h + "mlp.down_proj.weight"] = fc2
            continue
        r = get(m + "mlp.router.weight")
        if r is not None:
            out[h + "mlp.gate.weight"] = r
        fc1s = [get(f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight") for e in range(E)]
        fc2s = [get(f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight") for e in range(E)]
        if any(t is None for t in fc1s + fc2s):
            continue
        if layout == "fused":
            out[h + "mlp.experts.gate_up_proj"] = torch.stack(fc1s)
            out[h + "mlp.experts.down_proj"] = torch.stack(fc2s)
        else:
            for e in range(E):
                out[f"{h}mlp.experts.{e}.gate_proj.weight"] = fc1s[e][:I]
                out[f"{h}mlp.experts.{e}.up_proj.weight"] = fc1s[e][I:]
                out[f"{h}mlp.experts.{e}.down_proj.weight"] = fc2s[e]
    norm = get("decoder.final_layernorm.weight")
    if norm is not None:
        out["model.norm.weight"] = norm
    if not hf_config.tie_word_embeddings:
        head = get("output_layer.weight")
        if head is not None:
            out["lm_head.weight"] = head[:V]
    if missing:
        raise ValueError(f"megatron_to_hf: the Megatron weights lack {_shown(missing)}. Pass every EP rank's state "
                         "dict as a list (EP-rank order), or one dict with global expert ids")
    return out


def _to_grouped_layout(sd: dict[str, Tensor], keys: set[str]) -> dict[str, Tensor]:
    """`sd` with each MoE layer's local per-expert weights stacked into the grouped layout's
    `experts.weight{1,2}` where the model has those (module docstring); a layer missing some of its experts
    stays as it is (the load then names what is missing)."""
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for k in sd:
        if (mt := _LOCAL_EXPERT_RE.match(k)) is not None and f"{mt[1]}.weight{mt[3][-1]}" in keys:
            groups.setdefault((mt[1], mt[3][-1]), {})[int(mt[2])] = k
    out = dict(sd)
    for (prefix, which), names in groups.items():
        if sorted(names) != list(range(len(names))):
            continue
        stacked = torch.stack([sd[names[j]].t() for j in range(len(names))])  # [E, H, 2I] / [E, I, H]
        out[f"{prefix}.weight{which}"] = stacked.reshape(-1, stacked.shape[2]) if which == "2" else \
            stacked.reshape(stacked.shape[1], -1)
        for name in names.values():
            del out[name]
    return out


def _adapt_to_model_names(sd: dict[str, Tensor], model_keys: Iterable[str]) -> dict[str, Tensor]:
    """Rename local-spec norm and expert names to the TE-fused / TE-grouped names where the model uses those,
    and stack the experts into the grouped layout where the model has it."""
    keys = set(model_keys)
    sd = _to_grouped_layout(sd, keys)
    out = {}
    for k, v in sd.items():
        if k not in keys and (grouped := _LOCAL_EXPERT_RE.sub(r"\1.\3.weight\2", k)) in keys:
            k = grouped
        if k not in keys:
            for local, fused in _LOCAL_TO_TE_FUSED.items():
                if k.endswith(local):
                    alt = k[: -len(local)] + fused
                    if alt in keys:
                        k = alt
                    break
        out[k] = v
    return out


def _ep_rank_size(ep_rank: int | None, ep_size: int | None) -> tuple[int, int]:
    if ep_rank is not None and ep_size is not None:
        return ep_rank, ep_size
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    return 0, 1


@torch.no_grad()
def load_into_megatron(model, hf_sd: Mapping[str, Tensor], *, ep_rank: int | None = None,
                       ep_size: int | None = None) -> None:
    """Copy an HF state dict into a Megatron `GPTModel` (this EP rank's experts), strict.

    `ep_rank`/`ep_size` default to Megatron's parallel state. Raises `ValueError` listing the missing
    and unexpected keys (Megatron's `_extra_state` entries are ignored) or any shape mismatch;
    nothing is written in that case. Values are cast to each parameter's dtype.
    """
    from moe_gspo.mcore.model import unwrap

    m = unwrap(model)
    hf_config = m.hf_config
    ep_rank, ep_size = _ep_rank_size(ep_rank, ep_size)
    target = {k: v for k, v in m.state_dict().items() if not k.endswith("_extra_state")}
    rows = m.embedding.word_embeddings.weight.shape[0]
    sd = _adapt_to_model_names(
        _hf_to_megatron_rows(hf_sd, hf_config, ep_rank=ep_rank, ep_size=ep_size, vocab_rows=rows), target)
    missing, unexpected = sorted(set(target) - set(sd)), sorted(set(sd) - set(target))
    bad_shape = [f"{k}: got {tuple(sd[k].shape)}, model has {tuple(target[k].shape)}"
                 for k in target if k in sd and tuple(sd[k].shape) != tuple(target[k].shape)]
    if missing or unexpected or bad_shape:
        raise ValueError(f"load_into_megatron: weights do not match the model (ep_rank={ep_rank}, "
                         f"ep_size={ep_size}); missing keys: {missing[:10]}; unexpected keys: {unexpected[:10]}; "
                         f"shape mismatches: {bad_shape[:10]}")
    result = m.load_state_dict(sd, strict=False)
    left = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    assert not left and not result.unexpected_keys, (left, result.unexpected_keys)


def load_hf_model_into_megatron(model, hf_model) -> None:
    """Copy an in-memory transformers `Qwen3MoeForCausalLM` into `model` (this EP rank's experts)."""
    load_into_megatron(model, dict(hf_model.state_dict()))


@torch.no_grad()
def gather_to_hf(named_tensors: Mapping[str, Tensor], hf_config, *, layout: str = "fused") -> dict[str, Tensor]:
    """HF-named tensors on every rank from this rank's Megatron-named tensors (params, grads, ...).

    Expert tensors (`local_experts.{j}`) are all-gathered over Megatron's expert-model-parallel group
    with one `all_gather` per dtype and renumbered to global ids; the rest is taken from this rank
    as is. With EP size 1 (or no parallel state) no collective runs.
    """
    ep_rank, ep_size = _ep_rank_size(None, None)
    if ep_size == 1:
        return megatron_to_hf(named_tensors, hf_config, layout=layout)
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    named = _canonical_mcore(named_tensors, ffn=hf_config.moe_intermediate_size)
    full: dict[str, Tensor] = {}
    by_dtype: dict[torch.dtype, list[tuple[str, re.Match]]] = {}
    num_local: dict[str, int] = {}
    for k, v in named.items():
        mt = _MCORE_EXPERT_RE.match(k)
        if mt is None:
            full[k] = v
            continue
        by_dtype.setdefault(v.dtype, []).append((k, mt))
        num_local[mt["layer"]] = max(num_local.get(mt["layer"], 0), int(mt["j"]) + 1)
    for items in by_dtype.values():
        local = torch.cat([named[k].reshape(-1) for k, _ in items])
        bufs = [torch.empty_like(local) for _ in range(ep_size)]
        dist.all_gather(bufs, local, group=group)
        sizes = [named[k].numel() for k, _ in items]
        for r, buf in enumerate(bufs):
            for (k, mt), piece in zip(items, torch.split(buf, sizes)):
                g = r * num_local[mt["layer"]] + int(mt["j"])
                full[f"decoder.layers.{mt['layer']}.mlp.experts.local_experts.{g}.{mt['fc']}.weight"] = \
                    piece.view(named[k].shape)
    return megatron_to_hf(full, hf_config, layout=layout)


@torch.no_grad()
def gather_hf_state_dict(model, hf_config=None, *, layout: str = "fused") -> dict[str, Tensor]:
    """The full HF state dict on every rank (experts all-gathered over the expert-parallel group).

    Every EP rank must call it (collective). One `all_gather` per parameter dtype carries every
    local expert weight of every layer; with EP size 1 no collective runs. Dtypes are kept.
    Tensors may be views of the model's parameters (see `megatron_to_hf`): copy them before the
    next optimizer step if you need a snapshot. For rollout weight sync `layout="per_expert"` avoids
    stacking the experts (`moe_gspo.rollout.weights_sync.load_named_tensors_` accepts those names).
    """
    from moe_gspo.mcore.model import unwrap

    m = unwrap(model)
    hf_config = hf_config if hf_config is not None else m.hf_config
    return gather_to_hf({k: p.detach() for k, p in m.named_parameters()}, hf_config, layout=layout)
