"""`python -m benchmarks.gpu_check` on the CPU box: it refuses at once, and its non-CUDA pieces (MFU and
FLOP arithmetic, the throughput table, the plan-vs-measured rows, the verdicts, the summary files, the
parity check on the tiny model, the job's config, the MFU setting's bench options and its profile on the
tiny model) work. The GPU run itself needs a GPU (docs/gpu.md, "Validating a GPU machine")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check as gc
from benchmarks import gpu_check_report as gcr

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_without_cuda_it_stops_at_once_with_one_line(tmp_path, capsys):
    assert gc.main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs CUDA" in err
    assert not (tmp_path / "out").exists()


def test_peak_table_matches_specific_names_first():
    assert gc.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert gc.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert gc.peak_bf16_tflops("NVIDIA GH200 480GB") == 989.4
    assert gc.peak_bf16_tflops("NVIDIA L40S") == 362.1 and gc.peak_bf16_tflops("NVIDIA L4") == 121.0
    assert gc.peak_bf16_tflops("Some Future GPU") is None


def _bench(seconds_update=(2.0, 1.0), seconds_logp=(0.5, 0.25)) -> dict:
    from moe_gspo.tiny import tiny_qwen3_moe_config

    return {"variant": "dist", "hf_config": tiny_qwen3_moe_config().to_dict(),
            "batch": {"num_seqs": 4, "seq_len": 10, "num_minibatches": 2, "micro_batch_size": 1},
            "phases": {"update": {"planned_gib": 1.0, "measured_gib": 1.1, "rel_diff": -0.0909,
                                  "seconds": list(seconds_update)},
                       "logprobs": {"planned_gib": 0.5, "measured_gib": 0.4, "rel_diff": 0.25,
                                    "seconds": list(seconds_logp)},
                       "rollout": {"planned_gib": 2.0, "measured_gib": 1.0, "rel_diff": 1.0, "seconds": [3.0]}}}


def test_learner_mfu_uses_the_fastest_repeat_and_the_flop_formula():
    from moe_gspo.plan.flops import active_matmul_params
    from moe_gspo.plan.params import Geometry
    from moe_gspo.tiny import tiny_qwen3_moe_config

    g = Geometry.from_hf(tiny_qwen3_moe_config())
    n = active_matmul_params(g)
    flops = 4 * (6 * n * 10 + 12 * 3 * 4 * 32 * 10 ** 2)  # 4 sequences of 10 tokens
    m = gc.learner_mfu(_bench(), peak_tflops=1e-6)  # a peak of 1 MFLOP/s
    assert m["tokens"] == 40 and m["update"]["seconds"] == 1.0
    assert m["update"]["mfu"] == pytest.approx(round(flops / 1.0 / 1e6, 4))
    assert m["logprobs"]["model_tflop"] == pytest.approx(round(flops / 3 / 1e12, 3))
    assert m["logprobs"]["mfu"] == pytest.approx(round(flops / 3 / 0.25 / 1e6, 4))
    assert gc.learner_mfu(_bench(), peak_tflops=None)["update"]["mfu"] is None


def test_memory_rows_flag_checked_phases_only():
    rows = gc.memory_rows([_bench()], checked=("update", "logprobs"), tolerance=0.15)
    by_phase = {r["phase"]: r for r in rows}
    assert by_phase["update"]["ok"] is True and by_phase["logprobs"]["ok"] is False
    assert by_phase["rollout"]["ok"] is None  # reported, not checked


def test_memory_bench_rows_compare_the_counted_parts():
    from benchmarks.memory_bench import compare_phases

    planned = {"update": {"learner_params": 1.0, "activations": 0.5, "fragmentation": 0.2, "cuda_runtime": 2.0},
               "optimizer_step": {"learner_params": 1.0, "step_transient": 0.8, "cuda_runtime": 2.0},
               "hf_export": {"learner_params": 1.0, "export_transient": 0.1}}
    rows = compare_phases(planned, {"update": 2.0, "hf_export": 1.0})
    assert rows["update"] == {"planned_gib": 1.8, "measured_gib": 2.0, "rel_diff": -0.1}  # the optimizer step's 1.8
    assert rows["hf_export"]["rel_diff"] == pytest.approx(0.1) and "optimizer_step" not in rows


def _rows(values, start=0):
    return [{"step": start + i, "reward/mean": v, "perf/step_time_s": 1.0 + i} for i, v in enumerate(values)]


def test_resume_verdicts():
    ref = _rows([0.1, 0.2, 0.3, 0.4])
    same = [dict(r, **{"perf/step_time_s": 9.0}) for r in ref]  # wall times may differ
    assert gc.resume_verdict(ref, same, resumed_at=2)["status"] == "pass"
    diverged = ref[:2] + _rows([0.35, 0.4], start=2)
    v = gc.resume_verdict(ref, diverged, resumed_at=2)
    assert v["status"] == "fail" and v["first_difference_after_resume"]["step"] == 2
    noisy = _rows([0.1, 0.25, 0.35, 0.4])  # differs before the resume too: not reproducible here
    assert gc.resume_verdict(ref, noisy, resumed_at=2)["status"] == "inconclusive"
    assert gc.resume_verdict(ref, ref[:3], resumed_at=2)["status"] == "fail"  # a step missing


def test_learning_verdict_by_hand():
    # 20 steps: windows of max(5, 20 // 10) = 5 steps
    first, last = [0.0, 0.1, 0.0, 0.1, 0.0], [0.6, 0.7, 0.6, 0.7, 0.6]
    v = gc.learning_verdict(first + [0.3] * 10 + last)
    assert v["window_steps"] == 5 and v["reward_first"] == 0.04 and v["reward_last"] == 0.64
    assert v["gain"] == pytest.approx(0.6)
    se = (0.003 / 5) ** 0.5  # each window: sample variance 0.012 / 4 = 0.003, SE sqrt(0.003 / 5)
    assert v["gain_se"] == pytest.approx(round(se * 2 ** 0.5, 4))
    assert v["noise_bound"] == pytest.approx(round(4 * se * 2 ** 0.5, 4))
    assert v["status"] == "pass" and v["margin"] == pytest.approx(0.3)


def test_learning_verdict_needs_a_clear_margin():
    flat = [0.01, 0.004, 0.012, 0.008, 0.0, 0.006] * 10  # 60 steps of a run that does not learn
    assert gc.learning_verdict(flat)["status"] == "fail"
    first_h100 = [0.068] * 3 + [0.09] * 24 + [0.120] * 3  # the first H100 run's 0.068 -> 0.120: not enough
    assert gc.learning_verdict(first_h100)["status"] == "fail"
    # gain 0.35 >= 0.3, but the last window alternates 0 and 0.9 (SE 0.2): not clear of the noise
    noisy = gc.learning_verdict([0.1] * 6 + [0.3] * 48 + [0.0, 0.9] * 3)
    assert noisy["gain"] == pytest.approx(0.35) and noisy["noise_bound"] > 0.8 and noisy["status"] == "fail"
    learned = [0.004 * 1.1 ** i for i in range(60)]  # a run that learns: 0.004 -> ~1
    assert gc.learning_verdict(learned)["status"] == "pass"
    assert gc.learning_verdict([0.1, 0.9, 0.9])["status"] == "fail" and "error" in gc.learning_verdict([0.1, 0.9, 0.9])


def test_job_throughput_by_hand():
    rows = [{"step": i, "perf/tokens_per_s": 100.0, "perf/step_time_s": 2.0, "perf/rollout_s": 0.5,
             "perf/old_logp_s": 0.25, "perf/update_s": 1.0, "perf/sync_s": 0.1, "num_sequences": 20,
             "response/len_mean": 3.0} for i in range(4)]
    rows[0] = dict(rows[0], **{"perf/rollout_s": 9.0})  # warm-up, skipped
    rows[3] = dict(rows[3], **{"perf/update_s": 3.0, "perf/tokens_per_s": 50.0, "perf/step_time_s": 2.0})
    t = gc.job_throughput(rows, skip=1, num_gpus=2)
    by = {r["phase"]: r for r in t["rows"]}
    assert t["num_steps"] == 3 and t["source"] == "learning job"
    assert t["setting"] == "mean of steps 1-3 (the first 1 left out)"
    # tokens per step: 200, 200, 100 -> 500 in all; update seconds 1 + 1 + 3 = 5 -> 500 / 5 / 2 GPUs
    assert by["training"] == {"phase": "training", "tokens": 167, "seconds": pytest.approx(5 / 3, abs=1e-4),
                              "tokens_per_s_per_gpu": 50.0}
    assert by["generation"]["tokens_per_s_per_gpu"] == pytest.approx(500 / 1.5 / 2, abs=0.05)
    assert by["generation, generated tokens"]["tokens"] == 60  # 20 sequences x 3 tokens
    assert by["generation, generated tokens"]["tokens_per_s_per_gpu"] == 60.0  # 180 / 1.5 / 2
    assert by["old-policy pass"]["tokens_per_s_per_gpu"] == pytest.approx(500 / 0.75 / 2, abs=0.05)
    assert by["weight sync"]["tokens_per_s_per_gpu"] == pytest.approx(500 / 0.3 / 2, abs=0.05)
    assert by["RL step (end to end)"]["tokens_per_s_per_gpu"] == pytest.approx(500 / 6 / 2, abs=0.05)
    assert [r["phase"] for r in t["rows"]] == ["generation", "generation, generated tokens", "old-policy pass",
                                               "training", "weight sync", "RL step (end to end)"]
    with pytest.raises(ValueError):
        gc.job_throughput(rows, skip=4)


def test_bench_throughput_by_hand():
    b = _bench()  # 4 sequences x 10 tokens; update fastest 1.0 s, log-probs 0.25 s, rollout 3.0 s
    b["batch"]["rollout_tokens"] = 24
    t = gc.bench_throughput(b)
    by = {r["phase"]: r["tokens_per_s_per_gpu"] for r in t["rows"]}
    assert by == {"generation": pytest.approx(40 / 3, abs=0.05), "generation, generated tokens": 8.0,
                  "old-policy pass": 160.0, "training": 40.0}  # no weight_sync timed in this bench result
    assert t["source"] == "bench (dist)" and gc.bench_throughput(b, label="MFU setting")["source"] == "MFU setting"
    assert t["setting"] == "4 x 10 tokens, micro-batch 1 x 10 = 10 tokens, recompute full"


def test_summary_files(tmp_path):
    result = {"status": "fail", "command": "python -m benchmarks.gpu_check --out x", "wall_s": 412.0,
              "environment": {"device": "NVIDIA H100 80GB HBM3", "gpu_mem_gib": 79.2,
                              "versions": {"torch": "2.11.0", "megatron-core": "0.16.1"}},
              "checks": {"parity": {"status": "pass", "headline": "log-prob error 1e-2"},
                         "memory": {"status": "fail", "headline": "over 15%: dist/update +20.0%",
                                    "rows": gc.memory_rows([_bench()], checked=("update",), tolerance=0.15)},
                         "mfu": {"status": "reported", "headline": "update 12%", "profile": "train_step_profile.txt",
                                 "setting": "32 x 1024 tokens", "variants": [gc.learner_mfu(_bench(), 989.4)]},
                         "resume": {"status": "fail", "error": "CheckFailed: the job exited with 1"},
                         "throughput": {"status": "reported", "headline": "tokens/s/GPU",
                                        "tables": [gc.bench_throughput(_bench())]}}}
    jpath, mpath = gc.write_summary(result, tmp_path / "out")
    assert json.loads(jpath.read_text())["checks"]["memory"]["status"] == "fail"
    md = mpath.read_text()
    assert md.startswith("# moe-gspo GPU check: FAIL")
    assert "| resume | fail | CheckFailed: the job exited with 1 |" in md
    assert "| dist | logprobs | 0.50 | 0.40 | +25.0% | reported |" in md
    assert "| update |" in md and "TFLOP/s" in md
    assert "[train_step_profile.txt](train_step_profile.txt)" in md
    assert "## Throughput per phase (tokens/s/GPU)" in md
    assert "| bench (dist) | training | 40 | 1.000 | 40 |" in md
    assert "- bench (dist): 4 x 10 tokens, micro-batch 1 x 10 = 10 tokens, recompute full" in md
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temporary files left


def test_parity_check_on_the_tiny_model(dist_ep1):
    from moe_gspo.tiny import TINY_DEFAULTS

    r = gc.check_parity(dict(TINY_DEFAULTS), device=torch.device("cpu"), dtype=torch.bfloat16, batch=2, seq_len=12)
    assert r["status"] == "pass", r
    assert r["logp_abs_err_mean"]["learner"] < 0.1 and 0 < r["grad_rel_err"]["learner"] < 0.2


@pytest.fixture
def dist_ep1():
    from moe_gspo.mcore.parallel import destroy_distributed, init_distributed

    init_distributed(ep_size=1, num_experts=8, seed=0)
    yield
    destroy_distributed()


def test_the_job_is_a_valid_config_of_a_0_3_to_1_b_model():
    from moe_gspo.plan.params import Geometry, megatron_counts
    from moe_gspo.tiny import tiny_qwen3_moe_config

    cfg = gc.job_config(60)
    assert cfg.rollout.engine == "hf" and cfg.logging.wandb_mode == "disabled" and cfg.train.export_hf
    assert cfg.train.lr == gc.JOB_LR and cfg.train.lr_decay == "none" and cfg.train.lr_warmup_steps == 0
    total = megatron_counts(Geometry.from_hf(tiny_qwen3_moe_config(**cfg.model.tiny))).total
    assert 0.3e9 <= total <= 1e9


OPTIONAL = ("wandb", "vllm", "transformer_engine", "apex", "einops", "trl", "seaborn", "matplotlib")
BLOCKER = f"""
import sys
class _Hiding:  # every finder answers "not found" for these packages, as if they were not installed
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {OPTIONAL!r}:
            return None
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [_Hiding(f) for f in sys.meta_path]
"""


def test_the_gpu_check_path_needs_no_optional_package(tmp_path):
    """The GPU machine of issue 20 has torch and transformers, megatron-core without its extras, and no
    Transformer Engine, vLLM or wandb: the check's modules import and the train path runs without them."""
    code = BLOCKER + f"""
import benchmarks.gpu_check, benchmarks.memory_bench, moe_gspo.launch, moe_gspo.plan.__main__
from moe_gspo import train
rc = train.main(['--run-dir', {str(tmp_path / 'run')!r}, 'train.steps=1', 'rollout.prompts_per_step=2',
                 'rollout.samples_per_prompt=2', 'logging.wandb_mode=disabled', 'logging.progress=false'])
assert rc == 0, rc
leaked = sorted(m for m in sys.modules if m.split('.')[0] in {OPTIONAL!r})
assert not leaked, leaked
print('ok')
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), (p.stdout + p.stderr)[-3000:]
    assert (tmp_path / "run" / "hf_export" / "config.json").is_file()


def test_one_failing_check_does_not_hide_the_others(tmp_path, monkeypatch):
    """The orchestration: every check runs and is recorded; the summary is rewritten after each."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=80 << 30))
    monkeypatch.setattr(gc, "_parity_on_cuda", lambda: {"status": "pass", "headline": "close"})

    def memory_crashes(out, have_te):
        raise gc.CheckFailed("memory_bench exited 1 without results")

    def mfu(out, peak, setting, progress=None):
        assert peak == 989.4 and setting == gc.MFU_DEFAULTS
        return {"status": "reported", "headline": "update 30%"}

    monkeypatch.setattr(gc, "_memory", memory_crashes)
    monkeypatch.setattr(gc, "_mfu", mfu)
    monkeypatch.setattr(gc, "_learning", lambda out, steps: {"status": "pass", "headline": f"{steps} steps"})
    monkeypatch.setattr(gc, "_resume", lambda out: {"status": "inconclusive", "headline": "not reproducible"})
    result = gc._run(tmp_path, 30, None, "python -m benchmarks.gpu_check --out x")
    assert list(result["checks"]) == ["mfu", "parity", "memory", "learning", "resume", "throughput"]  # MFU first
    assert result["checks"]["throughput"]["status"] == "fail"  # nothing finished that it could read
    assert result["checks"]["memory"] == {"status": "fail", "error": "CheckFailed: memory_bench exited 1 without results"}
    assert result["status"] == "fail" and result["checks"]["learning"]["headline"] == "30 steps"
    assert json.loads((tmp_path / "gpu_check.json").read_text())["checks"]["resume"]["status"] == "inconclusive"


def test_help_documents_the_mfu_setting_and_the_throughput_table():
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = " ".join(p.stdout.split())
    for flag in ("--mfu-micro-batch", "--mfu-seq-len", "--mfu-seqs", "--mfu-recompute"):
        assert flag in out
    assert "MFU SETTING" in out and "4 x 1024 = 4096 tokens per forward/backward" in out
    assert "tokens/s/GPU" in out and "old-policy log-prob pass" in out and "weight sync" in out
    assert "train_step_profile.txt" in out and "MIN_REWARD_GAIN" in out
    assert "--checks" in out and "mfu,parity,memory,learning,resume" in out and "--mfu-micro-batches" in out


def test_mfu_setting_bench_options():
    args = gc.mfu_bench_args(**gc.MFU_DEFAULTS)
    assert args[args.index("--micro-batch") + 1] == "4" and args[args.index("--seq-len") + 1] == "1024"
    assert "--no-recompute" in args and "--no-rollout" in args and args[args.index("--seqs") + 1] == "32"
    assert "--no-recompute" not in gc.mfu_bench_args(micro_batch=1, seq_len=4096, seqs=8, recompute="full")
    # by default the grouped expert layout (one weight per projection) under the distributed optimizer, which
    # leaves those weights viewable in place (issue 40)
    assert args[args.index("--expert-layout") + 1] == "grouped" and args[args.index("--variants") + 1] == "dist"
    assert "--batched-experts" not in args
    batched = gc.mfu_bench_args(**{**gc.MFU_DEFAULTS, "experts": "batched"})
    assert "--batched-experts" in batched and batched[batched.index("--variants") + 1] == "nodist"
    assert batched[batched.index("--expert-layout") + 1] == "per_expert"
    loop = gc.mfu_bench_args(**{**gc.MFU_DEFAULTS, "experts": "loop"})
    assert "--batched-experts" not in loop and loop[loop.index("--variants") + 1] == "dist"
    assert loop[loop.index("--expert-layout") + 1] == "per_expert"
    with pytest.raises(ValueError, match="multiple of"):
        gc.mfu_bench_args(micro_batch=4, seq_len=1024, seqs=12, recompute="off")
    with pytest.raises(SystemExit):
        gc.main(["--out", "x", "--mfu-seqs", "12"])


def test_a_run_s_steps_do_not_depend_on_its_length(tmp_path):
    """The resume check compares its 20-step job with the first 20 steps of the learning job: with a
    constant learning rate a shorter run's rows are a prefix of a longer one's (tiny model, 3 vs 5 steps)."""
    from moe_gspo import train

    rows = {}
    for steps in (3, 5):
        d = tmp_path / f"run{steps}"
        rc = train.main(["--config", str(ROOT / "configs" / "tiny_cpu_copy_first.yaml"), "--run-dir", str(d),
                         f"train.steps={steps}", "rollout.prompts_per_step=2", "logging.wandb_mode=disabled",
                         "logging.progress=false", "train.export_hf=false"])
        assert rc == 0
        rows[steps] = gc._metrics(d)
    assert gc.resume_verdict(rows[5][:3], rows[3], resumed_at=1)["status"] == "pass"


FAST_COUNTS = {"forwards": 12, "slow_forwards": 0, "slow_layers": 0, "layers": 2, "slow_because": []}
"""A grouped-layout bench's forward counts with every forward on the fast path (`expert_path_counts`)."""


def test_mfu_and_throughput_checks_from_the_benches_files(tmp_path, monkeypatch):
    """`_mfu` and `_throughput` without a GPU: the bench runs replaced by their JSON results."""
    mfu_res = _bench(seconds_update=(3.0, 2.0, 2.5))
    mfu_res["batch"].update(micro_batch_size=2, recompute=False)
    mfu_res["experts"] = {"path": "grouped_layout", "grouped_modules": 0, "grouped_layout_modules": 2,
                          "te_grouped_modules": 0, "loop_modules": 0, "counts": FAST_COUNTS}
    mfu_res["optimizer"] = {"distributed": True, "precision_aware": False, "cpu_offload": False}
    del mfu_res["phases"]["rollout"]["seconds"]  # --no-rollout
    mem_res = dict(_bench(), batch=dict(_bench()["batch"], rollout_tokens=24))
    (tmp_path / "memory_bench.json").write_text(json.dumps({"results": [mem_res]}))
    calls = []

    def fake_bench(out, name, *extra, timeout=900):
        calls.append((name, extra))
        (out / f"{name}.json").write_text(json.dumps({"results": [mfu_res]}))
        (out / "train_step_profile.txt").write_text("# one train_step\n")
        return [mfu_res]

    monkeypatch.setattr(gc, "_bench", fake_bench)
    m = gc._mfu(tmp_path, 989.4, gc.MFU_DEFAULTS)
    assert calls[0][0] == "mfu_bench" and "--profile-train-step" in calls[0][1] and "--no-recompute" in calls[0][1]
    assert [v["label"] for v in m["variants"]] == ["MFU setting, micro-batch 4"]
    gc.add_memory_setting_mfu(m, tmp_path, 989.4)  # after the memory check (which runs after the MFU check)
    assert [v["label"] for v in m["variants"]] == ["MFU setting, micro-batch 4", "memory-check setting (dist)"]
    assert m["variants"][0]["update"]["seconds"] == 2.0 and m["profile"] == "train_step_profile.txt"
    assert m["micro_batch"] == 2 and m["experts"]["path"] == "grouped_layout" and m["optimizer"]["distributed"] is True
    assert m["setting"] == "4 x 10 tokens, micro-batch 2 x 10 = 20 tokens, recompute off"
    assert {r["variant"] for r in m["memory_rows"]} == {"dist, MFU setting"}
    assert all(r["ok"] is None for r in m["memory_rows"])
    run = tmp_path / "runs" / "uninterrupted"
    run.mkdir(parents=True)
    rows = [{"step": i, "perf/tokens_per_s": 100.0, "perf/step_time_s": 2.0, "perf/rollout_s": 0.5,
             "perf/old_logp_s": 0.25, "perf/update_s": 1.0, "perf/sync_s": 0.1, "num_sequences": 20,
             "response/len_mean": 3.0} for i in range(30)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = gc._throughput(tmp_path)
    assert [x["source"] for x in t["tables"]] == ["MFU setting (dist)", "memory-check setting (dist)", "learning job"]
    assert t["tables"][2]["num_steps"] == 27  # the first 10% (3 steps) left out as warm-up
    assert "generation" not in {r["phase"] for r in t["tables"][0]["rows"]}  # the MFU bench does not generate
    assert t["status"] == "reported" and t["headline"].startswith("tokens/s/GPU, MFU setting (dist): ")


# --- issue 40: the MFU setting really builds the grouped experts ---

@pytest.mark.parametrize("experts", ["grouped", "batched", "loop"])
def test_mfu_setting_model_is_built_with_the_asked_expert_path(dist_ep1, experts):
    """The MFU setting's model built exactly as `gpu_check` has `memory_bench` build it (its bench options,
    parsed by the bench; the tiny geometry, as without CUDA): the asked experts in every MoE layer; by
    default the grouped layout (one weight per projection), whose weights the distributed optimizer's
    buffer leaves copy-free (Megatron's DDP with `use_distributed_optimizer`, as the bench's `dist` variant
    wraps it on CUDA)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from transformers import Qwen3MoeConfig

    from benchmarks import memory_bench as mb
    from moe_gspo.mcore.model import forward_logits, moe_layer_ids
    from moe_gspo.mcore.shims import have_transformer_engine

    opts = gc.mfu_bench_args(micro_batch=2, seq_len=24, seqs=8, recompute="off", experts=experts)
    args = mb.build_parser().parse_args([*opts, "--tiny"])
    assert args.variants == ("nodist" if experts == "batched" else "dist")
    cfg, _ = mb.run_config(args, "cpu", cuda=False)
    assert cfg.model.batched_experts is (experts == "batched") and cfg.train.micro_batch_size == 2
    assert cfg.model.expert_layout == ("grouped" if experts == "grouped" else "per_expert")
    hf = Qwen3MoeConfig(**mb.geometry_from_args(args))
    model = mb.build_bench_model(cfg, hf, torch.float32)
    got = mb.expert_path(model)
    n_moe = len(moe_layer_ids(hf))
    assert n_moe > 0
    zero = {"grouped_modules": 0, "grouped_layout_modules": 0, "te_grouped_modules": 0, "loop_modules": 0,
            "line": model.expert_path["line"]}
    if have_transformer_engine() and experts != "loop":
        assert got == {**zero, "path": "te_grouped", "te_grouped_modules": n_moe}
    else:
        path = {"grouped": "grouped_layout", "batched": "grouped", "loop": "loop"}[experts]
        assert got == {**zero, "path": path, f"{path}_modules": n_moe}
    if got["path"] == "grouped_layout":  # the bench adds the forwards it counted
        got = dict(got, counts=dict(FAST_COUNTS, layers=n_moe))
    assert gc.check_expert_path({"experts": got}, experts) == got
    for other in set(gc.MFU_EXPERTS) - {experts}:
        if got["path"] not in gc.MFU_EXPERTS[other][2]:
            with pytest.raises(gc.CheckFailed, match="not "):
                gc.check_expert_path({"experts": got}, other)
    with pytest.raises(gc.CheckFailed):
        gc.check_expert_path({}, experts)  # a bench from before issue 40 records no experts
    if args.variants == "dist":
        ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=False))
        forward_logits(ddp, torch.randint(3, hf.vocab_size, (2, 12))).sum().backward()
        assert mb.expert_weight_copies(model) == 0  # the grouped layout, and the loop, copy nothing


def test_mfu_bench_json_records_grouped_experts_optimizer_and_micro_batch(tmp_path):
    """`memory_bench` with the MFU setting's options (tiny model on CPU): the JSON names the expert path
    (grouped modules counted after the build), the optimizer and the micro-batch."""
    out = tmp_path / "bench.json"
    opts = gc.mfu_bench_args(micro_batch=2, seq_len=24, seqs=8, recompute="off")
    cmd = [sys.executable, "-m", "benchmarks.memory_bench", *opts, "--steps", "1", "--json", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    res = json.loads(out.read_text())["results"][0]
    assert res["experts"]["path"] in ("grouped_layout", "te_grouped") and res["experts"]["loop_modules"] == 0
    assert res["experts"]["grouped_layout_modules"] + res["experts"]["te_grouped_modules"] > 0
    assert res["experts"]["weight_copies"] == 0  # one weight per projection: viewed in place
    if res["experts"]["path"] == "grouped_layout":  # every MoE layer's forwards counted, none off the fast path
        counts = res["experts"]["counts"]
        assert counts["forwards"] > 0 and counts["slow_forwards"] == 0 and counts["layers"] > 0
        assert gc.check_expert_path(res, "grouped") == res["experts"]
    assert res["token_dispatcher"] == "allgather"  # training's default (issue 61); the CPU's too
    # without CUDA the bench runs its `cpu` variant (torch AdamW); on CUDA the `dist` one
    assert res["variant"] == "cpu" and res["batch"]["micro_batch_size"] == 2


# --- issue 40: --checks, the summary after each check, the micro-batch sweep ---

def test_parse_checks():
    assert gc.parse_checks("mfu,parity,memory,learning,resume") == list(gc.CHECKS) == \
        ["mfu", "parity", "memory", "learning", "resume"]
    assert gc.parse_checks("memory, mfu") == ["mfu", "memory"]  # the fixed order, MFU first
    assert gc.parse_checks("resume,learning") == ["learning", "resume"]
    with pytest.raises(ValueError, match="unknown bogus; choose from mfu,parity,memory,learning,resume"):
        gc.parse_checks("mfu,bogus")
    with pytest.raises(ValueError, match="at least one"):
        gc.parse_checks(" , ")
    with pytest.raises(ValueError, match="resume needs learning"):
        gc.parse_checks("mfu,resume")


@pytest.mark.parametrize("argv,message", [
    (["--checks", "mfu,speed"], "unknown speed"),
    (["--checks", "resume"], "resume needs learning"),
    (["--mfu-micro-batches", "4,x"], "positive integers"),
    (["--mfu-micro-batches", "4,0"], "positive integers"),
    (["--mfu-micro-batches", "4,8,32"], "multiple of 2 x --mfu-micro-batch (64)"),  # 32 sequences: not 2 x 32
])
def test_bad_arguments_stop_with_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        gc.main(["--out", "x", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def _fake_cuda(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=80 << 30))


def test_only_the_selected_checks_run_mfu_first(tmp_path, monkeypatch):
    _fake_cuda(monkeypatch)
    ran = []
    monkeypatch.setattr(gc, "_parity_on_cuda", lambda: ran.append("parity") or {"status": "pass"})
    monkeypatch.setattr(gc, "_mfu", lambda out, peak, setting, progress=None: ran.append("mfu") or
                        {"status": "reported", "headline": "x"})
    monkeypatch.setattr(gc, "_memory", lambda out, have_te: ran.append("memory") or {"status": "pass"})
    monkeypatch.setattr(gc, "_learning", lambda out, steps: pytest.fail("not selected"))
    monkeypatch.setattr(gc, "_resume", lambda out: pytest.fail("not selected"))
    monkeypatch.setattr(gc, "_throughput", lambda out: ran.append("throughput") or {"status": "reported"})
    result = gc._run(tmp_path, 60, None, "cmd", checks_to_run=gc.parse_checks("memory,parity,mfu"))
    assert ran == ["mfu", "parity", "memory", "throughput"] and list(result["checks"]) == ran
    assert result["status"] == "pass" and result["pending"] == []
    ran.clear()
    result = gc._run(tmp_path / "p", 60, None, "cmd", checks_to_run=["parity"])
    assert ran == ["parity"] and list(result["checks"]) == ["parity"]  # no bench, no job: no throughput table


def test_the_summary_is_written_after_each_check_so_a_cut_run_keeps_what_finished(tmp_path, monkeypatch):
    """A call killed during the third check (here: an exception that escapes, as a time limit would end it)
    leaves gpu_check.json / .md with the first two checks and the rest marked as not run yet."""
    _fake_cuda(monkeypatch)
    seen = []

    def mfu(out, peak, setting, progress=None):
        seen.append(json.loads((out / "gpu_check.json").read_text())["pending"])  # written before the first check
        return {"status": "reported", "headline": "update 31.0%"}

    def parity():
        seen.append(json.loads((tmp_path / "gpu_check.json").read_text())["checks"]["mfu"]["headline"])
        return {"status": "pass", "headline": "close"}

    class Cut(BaseException):
        pass

    def memory(out, have_te):
        raise Cut()

    monkeypatch.setattr(gc, "_mfu", mfu)
    monkeypatch.setattr(gc, "_parity_on_cuda", parity)
    monkeypatch.setattr(gc, "_memory", memory)
    with pytest.raises(Cut):
        gc._run(tmp_path, 60, None, "cmd")
    assert seen == [["mfu", "parity", "memory", "learning", "resume", "throughput"], "update 31.0%"]
    got = json.loads((tmp_path / "gpu_check.json").read_text())
    assert got["status"] == "running" and list(got["checks"]) == ["mfu", "parity"]
    assert got["pending"] == ["memory", "learning", "resume", "throughput"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# moe-gspo GPU check: RUNNING")
    assert "| mfu | reported | update 31.0% |" in md and "| memory | not run yet | |" in md


def _mfu_bench_result(mb: int) -> dict:
    res = _bench(seconds_update=(2.0 / mb, 1.0 / mb))
    res["batch"].update(micro_batch_size=mb, recompute=False)
    res["experts"] = {"path": "grouped_layout", "grouped_modules": 0, "grouped_layout_modules": 2,
                      "te_grouped_modules": 0, "loop_modules": 0, "weight_copies": 0, "counts": FAST_COUNTS}
    res["optimizer"] = {"distributed": True, "precision_aware": False, "cpu_offload": False}
    return res


def test_mfu_micro_batch_sweep_records_out_of_memory_and_goes_on(tmp_path, monkeypatch):
    calls, progress = [], []

    def fake_bench(out, name, *extra, timeout=900):
        mb = int(extra[extra.index("--micro-batch") + 1])
        calls.append((name, mb, "--profile-train-step" in extra))
        if mb == 8:
            (out / f"{name}.log").write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3 GiB\n")
            raise gc.CheckFailed(f"memory_bench exited 2 without results; see {name}.log")
        if mb == 2:
            raise gc.CheckFailed("memory_bench exited 1 without results; see x.log")
        res = _mfu_bench_result(mb)
        (out / f"{name}.json").write_text(json.dumps({"results": [res]}))
        return [res]

    monkeypatch.setattr(gc, "_bench", fake_bench)
    setting = dict(gc.MFU_DEFAULTS, micro_batches=[4, 8, 16, 2], micro_batch=4)
    m = gc._mfu(tmp_path, 989.4, setting, progress=progress.append)
    assert calls == [("mfu_bench", 4, True), ("mfu_bench_mb8", 8, False), ("mfu_bench_mb16", 16, False),
                     ("mfu_bench_mb2", 2, False)]
    assert [(r["micro_batch"], r["status"]) for r in m["sweep"]] == [(4, "ok"), (8, "oom"), (16, "ok"), (2, "fail")]
    assert [v["micro_batch"] for v in m["variants"]] == [4, 16] and m["micro_batch"] == 4
    assert m["sweep"][0]["tokens_per_micro_batch"] == 4 * 1024
    assert "out of memory at micro-batch 8" in m["headline"] and "micro-batch 16: update" in m["headline"]
    assert len(progress) == 4 and [r["micro_batch"] for r in progress[1]["sweep"]] == [4, 8]
    result = {"status": "pass", "command": "c", "environment": {}, "checks": {"mfu": m}}
    md = gc.render_markdown(result)
    assert "## MFU setting per micro-batch" in md and "| 8 | 8,192 | oom | n/a | n/a |" in md
    assert "## Learner setups" in md
    assert ("| MFU setting, micro-batch 4 | 4 | distributed | one weight per projection, grouped GEMM "
            "(model.expert_layout=grouped), 2 MoE layers, 0 of 12 forwards off the fast path |") in md
    # every micro-batch out of memory: the check fails, naming them
    monkeypatch.setattr(gc, "_bench", lambda out, name, *e, timeout=900: (_ for _ in ()).throw(
        gc.CheckFailed("CUDA out of memory")))
    with pytest.raises(gc.CheckFailed, match="micro-batch 4: oom"):
        gc._mfu(tmp_path, 989.4, setting)


def test_mfu_settings_and_memory_setups_in_the_summary():
    assert [s["micro_batch"] for s in gc.mfu_settings(gc.MFU_DEFAULTS)] == [4]
    sweep = gc.mfu_settings(dict(gc.MFU_DEFAULTS, micro_batches=[4, 8]))
    assert [s["micro_batch"] for s in sweep] == [4, 8] and all("micro_batches" not in s for s in sweep)
    gc.mfu_bench_args(**sweep[1])  # each one is a valid bench setting
    mem = {"setups": [{"variant": "dist", "micro_batch": 1, "optimizer": {"distributed": True},
                       "experts": {"path": "loop", "loop_modules": 12}}]}
    lines = "\n".join(gcr.setup_lines({}, mem))
    assert "| memory-check setting (dist) | 1 | distributed | Megatron's loop over experts, 12 MoE layers |" in lines


def test_memory_bench_writes_its_failures_when_nothing_ran(tmp_path, monkeypatch):
    """memory_bench: a variant out of memory is recorded in the JSON (`failed`), which then has no results."""
    from benchmarks import memory_bench as mb

    def oom(args, variant, cuda):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")

    monkeypatch.setattr(mb, "run_variant", oom)
    out = tmp_path / "b.json"
    assert mb.main(["--seqs", "8", "--group", "4", "--json", str(out)]) == 2
    got = json.loads(out.read_text())
    assert got["results"] == [] and "out of memory" in got["failed"]["cpu"]
    with pytest.raises(gc.CheckFailed, match="out of memory"):
        monkeypatch.setattr(gc.subprocess, "run", lambda *a, **k: type("P", (), {"returncode": 2})())
        (tmp_path / "mfu_bench.json").write_text(out.read_text())
        gc._bench(tmp_path, "mfu_bench")


def test_the_job_makes_attention_deterministic():
    """Issue 48: under `use_deterministic_algorithms(True, warn_only=True)` flash and memory-efficient attention
    keep a non-deterministic backward; the learning and resume jobs run attention on SDPA's math kernel."""
    b = torch.backends.cuda
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, b.flash_sdp_enabled(),
              b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled())
    try:
        gc.deterministic_job_setup()
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert not (b.flash_sdp_enabled() or b.mem_efficient_sdp_enabled() or b.cudnn_sdp_enabled())
        assert b.math_sdp_enabled() and torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[2], before[3]
        b.enable_flash_sdp(before[4])
        b.enable_mem_efficient_sdp(before[5])
        b.enable_cudnn_sdp(before[6])
        b.enable_math_sdp(before[7])


def test_an_inconclusive_resume_names_the_nondeterministic_ops_of_its_logs():
    logs = ("step 3\n/x/torch/autograd/graph.py:829: UserWarning: scatter_add_cuda_kernel does not have a "
            "deterministic implementation, but you set 'torch.use_deterministic_algorithms(True, warn_only=True)'.\n"
            "UserWarning: Flash Attention defaults to a non-deterministic algorithm. To explicitly enable "
            "determinism call torch.use_deterministic_algorithms(True, warn_only=False).\n"
            "UserWarning: scatter_add_cuda_kernel does not have a deterministic implementation\n")
    assert gcr.nondeterminism_reported(logs) == ["scatter_add_cuda_kernel", "Flash Attention"]
    assert gcr.nondeterminism_reported("step 1\nstep 2\n") == []
    ref = _rows([0.1, 0.2, 0.3, 0.4])
    noisy = gc.resume_verdict(ref, _rows([0.1, 0.25, 0.35, 0.4]), resumed_at=2)
    got = gc.resume_headline(noisy, logs)
    assert "inconclusive" in got["headline"] and "scatter_add_cuda_kernel, Flash Attention" in got["headline"]
    assert got["nondeterministic_ops"] == ["scatter_add_cuda_kernel", "Flash Attention"]
    assert "no non-deterministic op reported" in gc.resume_headline(noisy, "")["headline"]
    exact = gc.resume_headline(gc.resume_verdict(ref, ref, resumed_at=2), logs)
    assert "equals the uninterrupted run's" in exact["headline"] and "inconclusive" not in exact["headline"]
