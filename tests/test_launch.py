"""moe_gspo.launch: the one-line summary when this node's agent loses the rendezvous store (its host
node finished first), read back from what the workers recorded. The real two-node run is in
tests/run/test_multinode.py; here torchrun's `run` is replaced so that the race happens every time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from moe_gspo import launch
from moe_gspo.run.errors import run_entry

ARGS = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29999",
        "-m", "moe_gspo.train"]


def _agent_losing_the_store(worker_rank: str | None, seen: dict):
    """A stand-in for torchrun's `run`: its worker (if any) reports a user error into its error file
    under the launcher's log dir, as a real worker does, then the agent loses the store."""

    def fake_run(args):
        seen["log_dir"] = args.log_dir
        if worker_rank is not None:
            error_file = Path(args.log_dir) / "issue22_x" / "attempt_0" / "0" / "error.json"
            error_file.parent.mkdir(parents=True)
            env = {"TORCHELASTIC_ERROR_FILE": str(error_file), "RANK": worker_rank}
            with pytest.MonkeyPatch.context() as mp:
                for k, v in env.items():
                    mp.setenv(k, v)
                run_entry(lambda: (_ for _ in ()).throw(ValueError("--run-dir 'run' is not shared")))
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    return fake_run


@pytest.mark.parametrize("worker_rank, printed_here", [("0", True), ("1", False)])
def test_a_lost_store_after_the_workers_reported_gives_their_code_and_one_line(monkeypatch, capsys, worker_rank,
                                                                               printed_here):
    seen = {}
    monkeypatch.setattr(torchrun, "run", _agent_losing_the_store(worker_rank, seen))
    assert launch.main(ARGS) == 2
    err = capsys.readouterr().err.splitlines()
    launcher = [line for line in err if line.startswith("[moe_gspo.launch]")]
    assert launcher == [f"[moe_gspo.launch] moe_gspo.train failed with exit code 2 (first on rank {worker_rank}); "
                        + ("the error is printed above" if printed_here
                           else "error: --run-dir 'run' is not shared")]
    assert ("error: --run-dir 'run' is not shared" in err) == printed_here  # rank 0 printed, rank 1 did not
    assert not Path(seen["log_dir"]).exists()  # the launcher's own log dir is removed


def test_a_lost_store_without_a_record_says_the_host_went_away(monkeypatch, capsys, tmp_path):
    seen = {}
    monkeypatch.setattr(torchrun, "run", _agent_losing_the_store(None, seen))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    assert launch.main(["--log-dir", str(log_dir), *ARGS]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("[moe_gspo.launch] lost the rendezvous at 127.0.0.1:29999")
    assert seen["log_dir"] == str(log_dir) and log_dir.is_dir()  # a log dir the user named is kept


def test_old_records_in_a_named_log_dir_are_not_read(tmp_path):
    old = tmp_path / "run_a" / "attempt_0" / "0" / "error.json"
    old.parent.mkdir(parents=True)
    old.write_text('{"message": {"message": "error: old", "extraInfo": {"exitcode": 2, "rank": 0, "timestamp": "1"}}}')
    assert [r["message"] for r in launch.local_records(tmp_path, since=0)] == ["error: old"]
    assert launch.local_records(tmp_path, since=old.stat().st_mtime + 10) == []


@pytest.mark.parametrize("train_args, msg", [
    (["train.lr=abc"], "error: train.lr='abc' must be a number"),
    (["--algo", "ppo"], "error: algo.name='ppo' is not one of ['gspo', "),
    (["--resume", "--overwrite"], "error: --resume continues the run"),
])
def test_a_train_config_error_is_one_line_before_any_worker_starts(monkeypatch, capsys, train_args, msg):
    """Issue 32, defect 2: the launcher checks `-m moe_gspo.train`'s command line itself; no worker (no
    torchrun agent) starts, and stderr is that one line."""
    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(args))
    code = launch.main(["--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train", *train_args])
    err = capsys.readouterr().err.strip().splitlines()
    assert (code, started, len(err)) == (2, [], 1) and err[0].startswith(msg), err


def test_a_valid_train_command_and_help_go_to_the_workers(monkeypatch):
    started = []
    monkeypatch.setattr(torchrun, "run", lambda args: started.append(args.training_script_args))
    assert launch.main(["--standalone", "--nproc-per-node", "2", "-m", "moe_gspo.train", "train.steps=2"]) == 0
    assert launch.main(["--standalone", "-m", "moe_gspo.train", "train.lr=abc", "--help"]) == 0
    assert started == [["train.steps=2"], ["train.lr=abc", "--help"]]
