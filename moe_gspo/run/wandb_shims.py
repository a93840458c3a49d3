"""W&B shims: the one module where moe_gspo changes W&B's behaviour (each dependency's shims stay in one documented
module; tests/test_shim_modules.py checks that no other module patches W&B).

- `skip_unstaged_launch_inputs`: `wandb.init` imports `wandb.sdk.launch` only when W&B Launch inputs can have been
  staged in this process (issue 62, start-up: 0.5-1 s of CPU on rank 0 otherwise).
"""

from __future__ import annotations

_LAUNCH_INPUTS = "wandb.sdk.launch.inputs.internal"


def skip_unstaged_launch_inputs() -> None:
    """`wandb.init` applies the inputs staged for a W&B Launch job (`StagedLaunchInputs`, a singleton of
    `wandb.sdk.launch.inputs.internal` that `wandb.sdk.launch.manage_config_file` / `manage_wandb_config`
    fill in this process) by importing `wandb.sdk.launch`: 0.5-1 s of CPU once torch, transformers and
    Megatron-core are loaded (pydantic reads the source of its ~80 models), on rank 0 before the first step.
    Nothing can be staged unless that module was imported, so the import is skipped then; otherwise W&B's
    own method runs. Idempotent; a no-op on a W&B without that method."""
    from wandb.sdk import wandb_run

    apply = getattr(wandb_run.Run, "_detect_and_apply_job_inputs", None)
    if apply is None or getattr(apply, "_moe_gspo_skip", False):
        return

    def detect_and_apply_job_inputs(self) -> None:
        import sys

        if _LAUNCH_INPUTS in sys.modules:
            apply(self)

    detect_and_apply_job_inputs._moe_gspo_skip = True
    wandb_run.Run._detect_and_apply_job_inputs = detect_and_apply_job_inputs
