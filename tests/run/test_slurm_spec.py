"""`executor: slurm` without a scheduler: the spec's `slurm:` section and its sbatch parameters, `--dry-run`
on a machine without SLURM, the multi-node rendezvous a job builds from SLURM's variables, and `--status`.
(The jobs themselves run against a real SLURM in tests/run/test_slurm_ablation.py.)"""

from __future__ import annotations

import json
import sys
import os
from pathlib import Path

import pytest
import yaml

from moe_gspo.ablate import expand_arms, main, parse_spec
from moe_gspo.run.slurm_job import ArmJob, multinode_command, rendezvous_port
from moe_gspo.run.slurm_spec import parse_slurm, sbatch_parameters, time_minutes

ROOT = Path(__file__).resolve().parents[2]


def _raw(tmp_path: Path, **changes) -> dict:
    base = tmp_path / "base.yaml"
    base.write_text("train:\n  steps: 3\n")
    d = {"base_config": str(base), "algos": ["gspo", "grpo"], "routing_replay": ["none"], "seeds": [0, 1],
         "nproc": 2, "out_dir": str(tmp_path / "phase"), "executor": "slurm",
         "slurm": {"partition": "gpu", "account": "proj", "time": "04:00:00", "gpus_per_node": 8, "mem": "64G",
                   "cpus_per_task": 16, "array_parallelism": 3, "sbatch_flags": {"qos": "high", "exclusive": True, "reservation": "r1"},
                   "setup": ["module load cuda"]}}
    d.update(changes)
    return d


@pytest.mark.parametrize("text,minutes", [("240", 240), ("04:00:00", 240), ("1-00:00:00", 1440), ("90:30", 91),
                                          ("2-12", 3600), ("0-00:00:01", 1)])
def test_time_in_every_sbatch_format_becomes_minutes(text, minutes):
    assert time_minutes(text) == minutes


def test_the_slurm_section_maps_to_submitit_parameters(tmp_path):
    spec = parse_spec(_raw(tmp_path))
    assert spec.executor == "slurm" and spec.name == "phase"
    assert sbatch_parameters(spec.slurm, "ablate-phase") == {
        "job_name": "ablate-phase", "time": 240, "nodes": 1, "ntasks_per_node": 1, "partition": "gpu",
        "account": "proj", "gpus_per_node": 8, "cpus_per_task": 16, "mem": "64G", "array_parallelism": 3,
        "qos": "high", "exclusive": True,  # submitit's own parameters; the others pasted as #SBATCH lines
        "additional_parameters": {"reservation": "r1"}, "setup": ["module load cuda"]}
    local = parse_spec(_raw(tmp_path, executor="local", slurm=None))
    assert local.executor == "local" and local.slurm.time is None


@pytest.mark.parametrize("slurm,match", [
    ({"time": "4h"}, "slurm.time '4h' is not a SLURM time"),
    ({"time": "1:00", "gpus": 8}, r"unknown slurm keys \['gpus'\]"),
    ({"time": "1:00", "nodes": 0}, "slurm.nodes must be a positive int"),
    ({"time": "1:00", "sbatch_flags": {"time": "2:00"}}, "sbatch_flags.time: use slurm.time"),
    ({"time": "1:00", "sbatch_flags": {"array": "0-3"}}, "sbatch_flags.array: moe_gspo.ablate sets it"),
    ({"time": "1:00", "sbatch_flags": {"--qos": "x"}}, "without the dashes"),
    ({"time": "1:00", "setup": "module load cuda"}, "slurm.setup must be a list of shell lines"),
    ("gpu", "'slurm' must be a mapping"),
])
def test_bad_slurm_sections_are_one_clear_error(tmp_path, slurm, match):
    with pytest.raises(ValueError, match=match):
        parse_slurm(slurm)


def test_slurm_needs_a_time_and_no_parallel_arms(tmp_path):
    spec = parse_spec(_raw(tmp_path, slurm={"partition": "gpu"}))
    with pytest.raises(ValueError, match="executor: slurm needs slurm.time"):
        sbatch_parameters(spec.slurm, "x")
    with pytest.raises(ValueError, match="'parallel_arms' is for executor: local"):
        parse_spec(_raw(tmp_path, parallel_arms=2))
    with pytest.raises(ValueError, match="'executor' must be one of"):
        parse_spec(_raw(tmp_path, executor="ray"))


def test_the_local_default_layout_applies_where_a_spec_sets_none_and_never_stops_a_slurm_spec(tmp_path, monkeypatch):
    """`default_parallel_arms(nproc)` and DEFAULT_NPROC (to follow benchmarks.matrix_throughput) fill a local spec
    without the keys; a SLURM spec without `parallel_arms` stays valid whatever the local default is."""
    from moe_gspo.run import ablation_spec

    monkeypatch.setattr(ablation_spec, "DEFAULT_NPROC", 3)
    monkeypatch.setattr(ablation_spec, "default_parallel_arms", lambda nproc: 7 * nproc)
    raw = {k: v for k, v in _raw(tmp_path, executor="local").items() if k not in ("nproc", "slurm")}
    spec = parse_spec(raw)
    assert spec.parallel_arms == 21 and spec.nproc == 3  # the rule, given the default nproc
    assert parse_spec(dict(raw, nproc=2)).parallel_arms == 14  # ... and given the spec's own nproc
    assert parse_spec(dict(raw, parallel_arms=1, nproc=1)).parallel_arms == 1  # a spec's own value wins
    assert parse_spec(_raw(tmp_path)).executor == "slurm"  # no parallel_arms key: not refused
    with pytest.raises(ValueError, match="'parallel_arms' is for executor: local"):
        parse_spec(_raw(tmp_path, parallel_arms=2))


def test_the_default_is_one_rank_per_core_within_the_memory_available():
    """The rule benchmarks.matrix_throughput measured fastest on 2 cores (2 arms x 1 rank x 1 thread), by hand."""
    from moe_gspo.run.ablation_spec import ARM_LAUNCHER_BYTES, RANK_BYTES, default_parallel_arms

    big = 10**15
    assert default_parallel_arms(1, cores=2, available_bytes=big) == 2
    assert default_parallel_arms(2, cores=2, available_bytes=big) == 1
    assert default_parallel_arms(2, cores=16, available_bytes=big) == 8
    assert default_parallel_arms(3, cores=2, available_bytes=big) == 1  # never 0
    one_rank_run = ARM_LAUNCHER_BYTES + RANK_BYTES
    assert default_parallel_arms(1, cores=16, available_bytes=3 * one_rank_run) == 3  # memory binds
    assert default_parallel_arms(1, cores=16, available_bytes=3 * one_rank_run - 1) == 2
    assert default_parallel_arms(1, cores=16, available_bytes=0) == 1
    assert default_parallel_arms(1, cores=4) >= 1  # this machine's MemAvailable
    from moe_gspo.run.ablation_spec import usable_cores

    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_dry_run_prints_the_sbatch_parameters_without_slurm(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch, no squeue
    spec = _write(tmp_path, _raw(tmp_path))
    assert main(["--config", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    local = _write(tmp_path, _raw(tmp_path, executor="local", slurm=None))
    assert main(["--config", str(local), "--dry-run"]) == 0
    local_out = capsys.readouterr().out
    assert out.startswith(local_out)  # the same runs and command lines as locally, then the sbatch script
    assert "4 runs (2 arms x 2 seeds), 4 to run" in out
    script = out[len(local_out):]
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=240",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --cpus-per-task=16", "#SBATCH --mem=64G",
                 "#SBATCH --array=0-3%3", "#SBATCH --job-name=ablate-phase", "#SBATCH --nodes=1",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --qos=high", "#SBATCH --exclusive",
                 "#SBATCH --reservation=r1", "module load cuda",
                 f"-u -m submitit.core._submit {tmp_path / 'phase' / 'slurm' / 'submitted-<time>-<random>' / '%j'}"):
        assert line in script, (line, script)
    assert not (tmp_path / "phase").exists()  # touched nothing


def test_dry_run_without_a_time_limit_is_refused(tmp_path, capsys):
    raw = _raw(tmp_path, slurm={"partition": "gpu"})
    assert main(["--config", str(_write(tmp_path, raw)), "--dry-run"]) == 2
    assert "error: ablation spec: executor: slurm needs slurm.time" in capsys.readouterr().err


def test_executor_flag_and_on_interrupt_flag(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    local = _write(tmp_path, _raw(tmp_path, executor="local"))
    assert main(["--config", str(local), "--dry-run", "--executor", "slurm"]) == 0
    assert "#SBATCH --partition=gpu" in capsys.readouterr().out
    assert main(["--config", str(local), "--on-interrupt", "cancel"]) == 2
    assert "--on-interrupt is for executor: slurm" in capsys.readouterr().err
    slurm = _write(tmp_path, _raw(tmp_path))
    assert main(["--config", str(slurm)]) == 2  # no sbatch here: one line, nothing submitted
    err = capsys.readouterr().err
    assert "error: executor: slurm needs SLURM's sbatch, squeue, scancel on PATH" in err


def test_a_multinode_job_takes_its_rendezvous_from_slurm(tmp_path, monkeypatch):
    cmd = [sys.executable, "-m", "moe_gspo.launch", "--standalone", "--nproc-per-node", "8", "-m", "moe_gspo.train"]
    assert multinode_command(cmd, num_nodes=1, first_host="n1", job_id="7") == cmd
    port = rendezvous_port("7_3")
    assert 20000 <= port < 40000 and port != rendezvous_port("7_4")
    assert multinode_command(cmd, num_nodes=2, first_host="gpu-a12", job_id="7_3") == [
        sys.executable, "-m", "moe_gspo.launch", "--nnodes", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"gpu-a12:{port}", "--rdzv-id", "moe-gspo-7_3", "--nproc-per-node", "8", "-m",
        "moe_gspo.train"]
    # the job itself, on the second node of a 2-node allocation (SLURM's variables, as srun sets them)
    for k, v in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40",
                 "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2",
                 "SLURM_JOB_NODELIST": "gpu-a[12-13]", "SLURM_NODEID": "1", "SLURM_PROCID": "1",
                 "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(k, v)
    show = [sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", "--standalone", "--x"]
    run = tmp_path / "abl" / "gspo-none-s0"
    job = ArmJob(command=show, resume_command=show + ["--resume"], run_dir=str(run), cwd=str(tmp_path),
                 node_log_dir=str(tmp_path / "abl" / "slurm" / "nodes"), env={"OMP_NUM_THREADS": "2"})
    assert job() == 0
    log = (tmp_path / "abl" / "slurm" / "nodes" / "gspo-none-s0.node1.log").read_text().splitlines()
    assert json.loads(log[-1]) == ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                   f"gpu-a12:{rendezvous_port('40_1')}", "--rdzv-id", "moe-gspo-40_1", "--x"]
    assert not run.exists()  # the second node leaves the run directory to the first


def test_a_job_resumes_skips_or_moves_a_partial_run_aside_at_its_start(tmp_path, monkeypatch):
    for k, v in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "9", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "1",
                 "SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "r"
    say = lambda word: [sys.executable, "-c", f"print({word!r})"]  # noqa: E731
    job = ArmJob(command=say("fresh"), resume_command=say("resumed"), run_dir=str(run), cwd=str(tmp_path))
    run.mkdir()
    (run / "config.yaml").write_text("partial")  # a partial run without a checkpoint: moved aside
    assert job() == 0
    assert (tmp_path / "r.prev1" / "config.yaml").is_file()
    log = (run / "train.log").read_text()
    assert "SLURM job 9: previous partial run moved to" in log and log.rstrip().endswith("fresh")
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    assert job() == 0 and (run / "train.log").read_text().rstrip().endswith("resumed")
    (run / "done.json").write_text("{}")
    size = (run / "train.log").stat().st_size
    assert job() == 0 and (run / "train.log").stat().st_size == size  # done: nothing runs


def test_status_of_a_local_matrix(tmp_path, capsys):
    raw = _raw(tmp_path, executor="local", slurm=None)
    spec = parse_spec(raw)
    arms = {a.name: a for a in expand_arms(spec)}
    (arms["gspo-none-s0"].run_dir).mkdir(parents=True)
    (arms["gspo-none-s0"].run_dir / "done.json").write_text("{}")
    partial = arms["grpo-none-s0"].run_dir
    (partial / "checkpoints" / "step_000010").mkdir(parents=True)
    (partial / "train.log").write_text("step 11/40\nerror: rank 1 failed\n")
    assert main(["--config", str(_write(tmp_path, raw)), "--status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["gspo-none-s0", "done"]
    assert out[1].split() == ["gspo-none-s1", "not", "started"]
    assert out[2].startswith("grpo-none-s0") and "unfinished" in out[2] and "resumes from step_000010" in out[2] \
        and out[2].endswith("train.log: error: rank 1 failed")
    assert out[-1] == "4 runs (2 arms x 2 seeds): 1 done, 1 unfinished, 2 not started (executor: local)"


@pytest.mark.parametrize("slurm,field", [
    ({"time": "10", "partition": "gpu\necho INJECTED > FILE\n#"}, "slurm.partition holds a control character"),
    ({"time": "10", "account": "a\rb"}, "slurm.account holds a control character"),
    ({"time": "10", "mem": "8G\necho INJECTED > FILE"}, "slurm.mem holds a control character"),
    ({"time": "10\necho INJECTED > FILE"}, "slurm.time holds a control character"),
    ({"time": "10", "sbatch_flags": {"qos": "high\necho INJECTED > FILE\n#"}},
     "slurm.sbatch_flags.qos holds a control character"),
    ({"time": "10", "sbatch_flags": {"reservation": "r\x00"}}, "slurm.sbatch_flags.reservation holds a control"),
    ({"time": "10", "setup": ["module load x\necho INJECTED > FILE"]}, "slurm.setup[0] holds a control character"),
    ({"time": "10", "nodes": 10 ** 20},
     "slurm.nodes must be a positive int, at most 10000, got '100000000000000000000'"),
    ({"time": "10", "nodes": "1e20"}, "slurm.nodes must be a positive int"),
    ({"time": "10", "nodes": 1e20}, "slurm.nodes must be a positive int"),
    ({"time": "10", "gpus_per_node": 100_000}, "slurm.gpus_per_node must be a positive int, at most 1024"),
    ({"time": "10", "mem": -5}, "slurm.mem '-5' is not a memory size from 1K to 128T"),
    ({"time": "10", "mem": "0"}, "slurm.mem '0' is not a memory size"),
    ({"time": "10", "mem": "129T"}, "slurm.mem '129T' is not a memory size"),
    ({"time": "10", "mem": "8 G"}, "slurm.mem '8 G' is not a memory size"),
    ({"time": 10 ** 23}, "slurm.time '100000000000000000000000' is over 365 days"),
    ({"time": "366-00:00:00"}, "slurm.time '366-00:00:00' is over 365 days"),
    ({"time": "1e23"}, "slurm.time '1e23' is not a SLURM time"),
    ({"time": "10", "sbatch_flags": {"nice": float("nan")}}, "slurm.sbatch_flags.nice must be a string, a number or"),
])
def test_a_value_that_would_not_stay_a_value_in_the_job_script_is_refused(tmp_path, capsys, monkeypatch, slurm, field):
    """A newline in any value would end its `#SBATCH` comment line: the rest ran as a shell line of the job (the
    partition's echo under bash, with every later #SBATCH line ignored). Refused by --dry-run, one line, nothing
    written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    raw = _raw(tmp_path, slurm=slurm)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.dump(raw))  # (yaml.dump keeps the newlines and the NUL as escapes)
    assert main(["--config", str(spec), "--dry-run"]) == 2
    captured = capsys.readouterr()
    err = [l for l in captured.err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith(f"error: ablation spec: {field}"), err
    assert "INJECTED" not in captured.out and not (tmp_path / "phase").exists() and not (tmp_path / "FILE").exists()


def test_the_values_in_range_still_pass(tmp_path):
    ok = parse_slurm({"time": "365-00:00:00", "nodes": 10_000, "mem": "128T", "sbatch_flags": {"nice": 10.5,
                      "comment": "a comment, with spaces"}})
    assert (ok.nodes, ok.mem, time_minutes(ok.time)) == (10_000, "128T", 365 * 24 * 60)
    for mem in ("64G", "64GB", "512m", "8000", "1K", "3t"):
        assert parse_slurm({"time": "1", "mem": mem}).mem == mem


def test_an_out_dir_with_a_newline_is_refused_before_the_script(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    raw = _raw(tmp_path, out_dir=str(tmp_path / "x\necho INJECTED > FILE"))
    assert main(["--config", str(_write(tmp_path, raw)), "--dry-run"]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith("error: ablation spec: the job name (out_dir's name) holds a control "
                                               "character ('\\n' at 1)"), err


def test_the_flags_submitit_has_go_to_it_as_its_own_parameters():
    import inspect

    from submitit.slurm.slurm import _make_sbatch_string

    from moe_gspo.run.slurm_spec import SUBMITIT_FLAGS

    assert set(SUBMITIT_FLAGS) <= set(inspect.signature(_make_sbatch_string).parameters)
    params = sbatch_parameters(parse_slurm({"time": "1", "sbatch_flags": {"qos": "q", "mail-type": "END",
                                                                          "reservation": "r"}}), "j")
    assert params["qos"] == "q" and params["mail_type"] == "END"
    assert params["additional_parameters"] == {"reservation": "r"}
