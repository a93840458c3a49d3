"""Hugging Face checkpoint directories (safetensors) in and out of the Megatron learner.

Reading: `load_hf_config` and `read_hf_weights` open `model.safetensors` or a sharded
`model.safetensors.index.json` with `safetensors.safe_open` and read only the tensors this expert-
parallel rank needs (every non-expert tensor, and its own experts: per-expert tensors of other ranks
are never read; a fused `experts.gate_up_proj`/`down_proj` on disk is sliced lazily to this rank's
rows). `load_megatron_from_hf_dir` builds the Megatron `GPTModel` and loads it.

Writing: `save_hf_checkpoint` writes what `transformers.AutoModelForCausalLM.from_pretrained` loads:
the per-expert on-disk layout (as in real Qwen3-MoE checkpoints), optionally sharded with an index,
`config.json` (with the weights' dtype), `generation_config.json` and the tokenizer files copied
from `tokenizer_dir`. It writes into a temporary sibling directory and renames it into place; when
torch.distributed is running, rank 0 writes and every rank waits at a barrier. Given the Megatron model,
the weights are streamed one decoder layer at a time (`moe_gspo.mcore.weight_stream.HFWeightStream`:
a layer's experts gathered over EP, then dropped) and only the writing rank copies them to host memory:
a rank's GPU never holds more than one layer's experts beyond its own (for Qwen3-30B-A3B at EP=8,
1.3 GiB instead of the ~61 GiB of gathering every layer at once), the others keep nothing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import torch

from moe_gspo.mcore.model import check_supported, moe_layer_ids
from moe_gspo.mcore.weights import expert_keys_for_rank

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
_PER_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _ckpt_dir(ckpt_dir, field: str = "model.path") -> Path:
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise ValueError(f"{field}={str(path)!r} is not a directory; point it at a Hugging Face "
                         "checkpoint directory (config.json + *.safetensors)")
    return path


def load_hf_config(ckpt_dir, *, field: str = "model.path"):
    """The transformers config of a Qwen3-MoE checkpoint directory (checked by `check_supported`).
    `field` is how the user gave the directory (`model.path`, `--model`), named in errors."""
    from transformers import AutoConfig

    path = _ckpt_dir(ckpt_dir, field)
    if not (path / "config.json").is_file():
        raise ValueError(f"{field}={str(path)!r} has no config.json; it is not a Hugging Face "
                         "checkpoint directory")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:  # transformers reports a corrupt config.json as OSError/ValueError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{field}={str(path)!r}: config.json cannot be read ({first[:200]}); re-copy or re-save "
                         "the checkpoint") from None
    check_supported(config)
    return config


@contextlib.contextmanager
def _reading(fpath: Path):
    """A truncated or corrupt safetensors file: one ValueError naming it."""
    try:
        yield
    except ValueError:
        raise
    except Exception as e:  # SafetensorError, OSError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"checkpoint file {str(fpath)!r} cannot be read ({first[:200]}): it is truncated or "
                         "corrupt; re-copy or re-save the checkpoint") from None


def _weight_files(path: Path, field: str = "model.path") -> dict[str, list[str]]:
    """file name -> tensor names it should hold, from the index or the single safetensors file."""
    from safetensors import safe_open

    if (path / SAFE_INDEX).is_file():
        try:
            with open(path / SAFE_INDEX, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{path / SAFE_INDEX} is not a valid index ({type(e).__name__}); re-save the "
                             "checkpoint") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / SAFE_INDEX} has no 'weight_map'; re-save the checkpoint")
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        return files
    if (path / SAFE_SINGLE).is_file():
        with _reading(path / SAFE_SINGLE), safe_open(str(path / SAFE_SINGLE), framework="pt") as f:
            return {SAFE_SINGLE: list(f.keys())}
    raise ValueError(f"{field}={str(path)!r} has neither {SAFE_SINGLE} nor {SAFE_INDEX}; only "
                     "safetensors checkpoints are supported (convert .bin weights with save_pretrained)")


def _finite(t: torch.Tensor, name: str, fpath: Path) -> torch.Tensor:
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(torch.linalg.vector_norm(t, float("inf")))):
        raise ValueError(f"checkpoint file {str(fpath)!r}: tensor {name!r} holds NaN/Inf values (bit rot or a "
                         "diverged run); re-copy the checkpoint or use an earlier one")
    return t


def read_hf_weights(ckpt_dir, hf_config, *, ep_rank: int = 0, ep_size: int = 1,
                    field: str = "model.path") -> dict[str, torch.Tensor]:
    """The HF tensors EP rank `ep_rank` needs: all non-expert weights and its own experts only.

    Per-expert names of other ranks are skipped without reading; a fused on-disk expert tensor is
    sliced to this rank's experts and returned under per-expert names. Raises `ValueError` naming
    the file for a shard listed in the index but missing, a tensor the index promises but the
    shard lacks, a truncated or corrupt file, or a tensor holding NaN/Inf.
    """
    from safetensors import safe_open

    path = _ckpt_dir(ckpt_dir, field)
    wanted_experts = expert_keys_for_rank(hf_config, ep_rank=ep_rank, ep_size=ep_size)
    num_local = hf_config.num_experts // ep_size
    lo, hi = ep_rank * num_local, (ep_rank + 1) * num_local
    I = hf_config.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for fname, names in _weight_files(path, field).items():
        fpath = path / fname
        if not fpath.is_file():
            raise ValueError(f"checkpoint shard {str(fpath)!r} is listed in {SAFE_INDEX} but missing; "
                             "copy the complete checkpoint (every model-*.safetensors file)")
        with _reading(fpath), safe_open(str(fpath), framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if _PER_EXPERT_RE.match(name) and name not in wanted_experts:
                    continue
                if name not in present:
                    raise ValueError(f"tensor {name!r} is listed for {str(fpath)!r} in {SAFE_INDEX} but the "
                                     "file lacks it; the checkpoint is corrupt or incomplete, re-save it")
                fused = _FUSED_RE.match(name)
                if fused is None:
                    out[name] = _finite(f.get_tensor(name), name, fpath)
                    continue
                layer, proj = fused.groups()
                rows = _finite(f.get_slice(name)[lo:hi], name, fpath)
                for j, e in enumerate(range(lo, hi)):
                    p = f"model.layers.{layer}.mlp.experts.{e}."
                    if proj == "down_proj":
                        out[p + "down_proj.weight"] = rows[j]
                    else:
                        out[p + "gate_proj.weight"] = rows[j, :I]
                        out[p + "up_proj.weight"] = rows[j, I:]
    return out


def load_megatron_from_hf_dir(ckpt_dir, *, ep_size: int = 1, params_dtype: torch.dtype = torch.float32,
                              enable_routing_replay: bool = False, token_dispatcher: str = "allgather",
                              vocab_pad_multiple: int = 1, field: str = "model.path", **build_kwargs):
    """`(model, hf_config)`: a Megatron `GPTModel` holding the checkpoint's weights (this rank's experts).

    Needs `moe_gspo.mcore.parallel.init_distributed(ep_size=...)` to have run in this process.
    Extra keyword arguments go to `build_gpt_model` (e.g. `recompute`).
    """
    from megatron.core import parallel_state as ps

    from moe_gspo.mcore.model import build_gpt_model
    from moe_gspo.mcore.weights import load_into_megatron

    if not ps.model_parallel_is_initialized():
        raise ValueError("load_megatron_from_hf_dir: call moe_gspo.mcore.parallel.init_distributed(ep_size=...) "
                         "before loading a model")
    if ps.get_expert_model_parallel_world_size() != ep_size:
        raise ValueError(f"load_megatron_from_hf_dir: ep_size={ep_size} but the parallel state was "
                         f"initialised with EP={ps.get_expert_model_parallel_world_size()}")
    hf_config = load_hf_config(ckpt_dir, field=field)
    ep_rank = ps.get_expert_model_parallel_rank()
    hf_sd = read_hf_weights(ckpt_dir, hf_config, ep_rank=ep_rank, ep_size=ep_size, field=field)
    model = build_gpt_model(hf_config, ep_size=ep_size, params_dtype=params_dtype,
                            enable_routing_replay=enable_routing_replay, token_dispatcher=token_dispatcher,
                            vocab_pad_multiple=vocab_pad_multiple, **build_kwargs)
    load_into_megatron(model, hf_sd, ep_rank=ep_rank, ep_size=ep_size)
    return model, hf_config


def to_per_expert_layout(hf_sd: Mapping[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """The same weights with fused `experts.gate_up_proj`/`down_proj` split into per-expert names."""
    I = hf_config.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in hf_sd.items():
        fused = _FUSED_RE.match(name)
        if fused is None:
            out[name] = t
            continue
        layer, proj = fused.groups()
        for e in range(t.shape[0]):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            if proj == "down_proj":
                out[p + "down_proj.weight"] = t[e]
            else:
                out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t[e, :I], t[e, I:]
    return out


def _check_complete(hf_sd: Mapping[str, torch.Tensor], hf_config) -> None:
    layers = set(moe_layer_ids(hf_config))
    for l in layers:
        for e in range(hf_config.num_experts):
            if f"model.layers.{l}.mlp.experts.{e}.down_proj.weight" not in hf_sd:
                raise ValueError(f"save_hf_checkpoint: expert {e} of layer {l} is missing; pass the full "
                                 "state dict (gather_hf_state_dict gathers every EP rank's experts)")


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_dir(tmp: Path, hf_sd: dict[str, torch.Tensor], hf_config, tokenizer_dir, max_shard_size) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    from transformers.utils.hub import convert_file_size_to_int

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in sorted(hf_sd.items())}
    max_bytes = convert_file_size_to_int(max_shard_size) if max_shard_size is not None else None
    shards = _shards(tensors, max_bytes)
    if len(shards) == 1:
        save_file(tensors, str(tmp / SAFE_SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: tensors[k] for k in names}, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in names})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(tmp / SAFE_INDEX, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    config = copy.deepcopy(hf_config)
    config.dtype = next(iter(tensors.values())).dtype
    if not getattr(config, "architectures", None):
        config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(str(tmp))
    src = Path(tokenizer_dir) if tokenizer_dir is not None else None
    if src is not None and not src.is_dir():
        raise ValueError(f"save_hf_checkpoint: tokenizer_dir={str(src)!r} is not a directory")
    if src is not None and (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", tmp / "generation_config.json")
    else:
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
    if src is not None:
        copied = [n for n in TOKENIZER_FILES if (src / n).is_file()]
        if not copied:
            raise ValueError(f"save_hf_checkpoint: tokenizer_dir={str(src)!r} holds no tokenizer file "
                             f"(looked for {', '.join(TOKENIZER_FILES)})")
        for n in copied:
            shutil.copy2(src / n, tmp / n)


def _write_atomically(out: Path, hf_sd, hf_config, tokenizer_dir, max_shard_size) -> None:
    from moe_gspo.files import publish_mode

    _check_complete(hf_sd, hf_config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=str(out.parent)))
    try:
        _write_dir(tmp, hf_sd, hf_config, tokenizer_dir, max_shard_size)
        publish_mode(tmp, recursive=True)  # mkdtemp's 0700, safetensors' 0600 -> what open() / mkdir give
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=str(out.parent)))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_hf_checkpoint(model_or_hf_sd, hf_config, out_dir, *, tokenizer_dir=None,
                       max_shard_size: int | str | None = None) -> Path:
    """Write a Hugging Face checkpoint directory that `from_pretrained` loads; returns its path.

    `model_or_hf_sd` is a Megatron model (streamed layer by layer, experts gathered over EP, so every
    rank must call this; only rank 0 keeps a host copy, see the module docstring) or an HF state dict
    in either expert layout. `max_shard_size` (bytes or a string such as "5GB") shards the weights
    with an index. An existing `out_dir` is replaced only once the new directory is complete.
    """
    import torch.distributed as dist

    check_supported(hf_config)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    writer = not distributed or dist.get_rank() == 0
    failure = None
    if isinstance(model_or_hf_sd, torch.nn.Module):
        hf_sd, failure = _streamed_to_host(model_or_hf_sd, hf_config, keep=writer)
    else:
        hf_sd = to_per_expert_layout(model_or_hf_sd, hf_config)
        if hf_config.tie_word_embeddings:
            hf_sd.pop("lm_head.weight", None)
    out = Path(out_dir)
    if not distributed:
        if failure is not None:
            raise failure
        _write_hf_dir(out, hf_sd, hf_config, tokenizer_dir, max_shard_size)
        return out
    error: list = [None]
    if writer:
        try:
            if failure is not None:
                raise failure
            _write_hf_dir(out, hf_sd, hf_config, tokenizer_dir, max_shard_size)
        except Exception as exc:  # tell the other ranks instead of leaving them at a barrier
            error[0] = (isinstance(exc, ValueError), str(exc) if isinstance(exc, ValueError) else
                        f"{type(exc).__name__}: {exc}")
            dist.broadcast_object_list(error, src=0)
            raise
    dist.broadcast_object_list(error, src=0)  # doubles as the barrier: rank 0 sends once written
    if error[0] is not None:
        user_error, message = error[0]
        if user_error:  # the same one-line user error on every rank (printed once)
            raise ValueError(message)
        raise RuntimeError(f"save_hf_checkpoint failed on rank 0: {message}")
    return out


def _streamed_to_host(model, hf_config, *, keep: bool) -> tuple[dict[str, torch.Tensor], Exception | None]:
    """(the model's HF tensors, per-expert names, copied to host memory when `keep`; the exception that
    stopped the copy, or None). Collective over the EP group: every rank runs the stream to its end,
    also after a failure on this rank (the other ranks wait in its all-gathers)."""
    from moe_gspo.mcore.weight_stream import HFWeightStream, drain

    stream = iter(HFWeightStream(model, hf_config, layout="per_expert"))
    out: dict[str, torch.Tensor] = {}
    try:
        for name, t in stream:
            if keep:
                out[name] = t.detach().to("cpu", copy=True)
    except Exception as e:  # e.g. host memory: keep the collectives matched, report it as this rank's error
        drain(stream)
        return {}, e
    return out, None


def _write_hf_dir(out: Path, hf_sd, hf_config, tokenizer_dir, max_shard_size) -> None:
    """`_write_atomically`, with a full disk reported as one ValueError naming `out`."""
    from moe_gspo.files import writing

    with writing(out, "the Hugging Face export"):
        _write_atomically(out, hf_sd, hf_config, tokenizer_dir, max_shard_size)
