"""Issue 32: the run report and the comparison report use one definition of the final reward; the
header's learner dtype comes from run.json; the verdict sentences recompute by hand; the eval figure and
headline rows come from eval.jsonl; the samples section marks routing-flipped tokens and escapes text."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from analysis.compare import ArmRun, build_comparison
from analysis.eval_report import fig_eval
from analysis.load import FINAL_REWARD_LABEL, HEADLINE_LABELS, load_run
from analysis.report import build_report, main
from analysis.samples import Sample, md_text, pick_samples, response_pieces, samples_markdown
from analysis.verdicts import routing_sentence, variance_sentence
from synth_run import RUN_INFO, assert_real_png, write_synthetic_run
from test_compare import _table_rows
from test_report import _TagBalance, md_table


@pytest.fixture(scope="module")
def synthetic_report(synthetic_run, tmp_path_factory):
    return build_report(synthetic_run, tmp_path_factory.mktemp("report"))


def _write_metrics(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


# --------------------------------------------------------------------------- final reward


def test_final_reward_is_one_number_in_the_run_report_and_the_comparison(tmp_path):
    """20 steps with reward/mean = step / 20: the last 10% are steps 18 and 19, final reward
    (0.9 + 0.95) / 2 = 0.925, while the last step alone is 0.95 (what report.md used to call final)."""
    run = _write_metrics(tmp_path / "gspo-none-s0", [{"step": i, "reward/mean": i / 20} for i in range(20)])
    md = build_report(run, tmp_path / "report").markdown.read_text()
    table = md_table(md, "Headline numbers")
    assert table[FINAL_REWARD_LABEL] == "0.925"
    assert table[HEADLINE_LABELS["reward_last_step"]] == "0.95"
    assert not any(label.startswith("final reward") for label in table if label != FINAL_REWARD_LABEL)
    cmp_md = build_comparison([ArmRun("gspo-none", 0, run)], tmp_path / "cmp").markdown.read_text()
    arms = _table_rows(cmp_md, "Arms")
    col = {name: i for i, name in enumerate(arms["header"])}
    assert arms["gspo-none"][col[f"{FINAL_REWARD_LABEL}: IQM over seeds [95% CI]"]] == "0.925 (1 seed)"
    assert arms["gspo-none"][col[f"{FINAL_REWARD_LABEL}: seed range (min–max)"]] == "0.925"
    seeds = _table_rows(cmp_md, "Seed statistics")
    assert seeds["gspo-none"][seeds["header"].index("final reward")] == "0.925 (1 seed)"


def test_rollout_learner_variances_in_the_comparison_mismatch_table(tmp_path):
    """Per seed the mean over steps, then the mean over seeds: seed 0 (1e-3 + 3e-3) / 2, seed 1 4e-3."""
    runs = []
    for seed, tok in ((0, [1e-3, 3e-3]), (1, [4e-3, 4e-3])):
        recs = [{"step": i, "reward/mean": 0.5, "mismatch_ratio/token_var": t, "mismatch_ratio/seq_var": t / 10}
                for i, t in enumerate(tok)]
        runs.append(ArmRun("a", seed, _write_metrics(tmp_path / f"a-s{seed}", recs)))
    rows = _table_rows(build_comparison(runs, tmp_path / "cmp").markdown.read_text(), "Train-inference mismatch")
    # the columns before the two R3 ones (the '|Δ log p|' headers hold escaped pipes, so count from the end)
    assert rows["header"][-4:-2] == ["rollout/learner mismatch_ratio/token_var natural",
                                     "rollout/learner mismatch_ratio/seq_var natural"]
    assert rows["a"][-4:] == ["0.003", "0.0003", "n/a", "n/a"]  # no r3/* metric: not an R3 arm


# --------------------------------------------------------------------------- header


def _header(md: str) -> str:
    return md.split("\n## ", 1)[0]


def test_header_learner_dtype_comes_from_run_json(tmp_path):
    run = _write_metrics(tmp_path / "run", [{"step": 0, "reward/mean": 0.5}])
    (run / "config.yaml").write_text("model:\n  params_dtype: auto\nrollout:\n  engine: vllm\n  dtype: bfloat16\n")
    (run / "run.json").write_text(json.dumps({"learner_dtype": "bfloat16", "device": "cuda", "world_size": 1}))
    header = _header(build_report(run, tmp_path / "a").markdown.read_text())
    assert "Rollout: vllm engine in bfloat16; learner: Megatron-core in bfloat16 (run.json)" in header
    assert "Learner device: cuda, 1 process(es)" in header
    assert "float32 on CPU" not in header
    (run / "run.json").write_text(json.dumps({"device": "cpu"}))  # no learner_dtype: the config's rule
    header = _header(build_report(run, tmp_path / "b").markdown.read_text())
    assert "learner: Megatron-core in auto (float32 on CPU, bfloat16 on CUDA) (model.params_dtype)" in header
    (run / "run.json").unlink()  # an old run
    header = _header(build_report(run, tmp_path / "c").markdown.read_text())
    assert "in auto (float32 on CPU, bfloat16 on CUDA) (model.params_dtype)" in header
    assert "Learner device" not in header


def test_synthetic_run_header_names_its_run_json(synthetic_report):
    html = synthetic_report.html.read_text()
    assert f"learner: Megatron-core in {RUN_INFO['learner_dtype']} (run.json)" in html
    assert f"Learner device: cpu, {RUN_INFO['world_size']} process(es)" in html


# --------------------------------------------------------------------------- verdicts

HAND_RECORDS = [
    {"step": 0, "reward/mean": 0.5, "routing/any_layer_flip": 0.1, "routing/layer_disagree": [0.02, 0.10],
     "mismatch_ratio/token_var": 1e-3, "mismatch_ratio/seq_var": 1e-4},
    {"step": 1, "reward/mean": 0.5, "routing/any_layer_flip": 0.2, "routing/layer_disagree": [0.04, 0.30],
     "mismatch_ratio/token_var": 3e-3, "mismatch_ratio/seq_var": 5e-4},
    {"step": 2, "reward/mean": 0.5, "routing/any_layer_flip": None, "routing/layer_disagree": [0.06, 0.20]},
    {"step": 3, "reward/mean": 0.5, "routing/any_layer_flip": 0.3, "routing/layer_disagree": [None, None]},
]
# any-layer flip: (0.1 + 0.2 + 0.3) / 3 = 20% over 3 steps (the null step left out); per layer
# (0.02 + 0.04 + 0.06) / 3 = 4% and (0.1 + 0.3 + 0.2) / 3 = 20%; token var (1e-3 + 3e-3) / 2 = 0.002,
# seq var (1e-4 + 5e-4) / 2 = 0.0003: 6.67x (a ratio of means; the mean of the per-step ratios, 10 and 6,
# would be 8); no ratio/* metric at all. The "did drift matter" sentences open the summary (issue 43): no variance
# share or clip fraction logged, and 2 step pairs (0→1, 1→2) with a flip rate and a reward change.
HAND_SENTENCES = [
    "Drift and ratio variance: not measured (no step with both mismatch_ratio/token_var_share_flipped and "
    "mismatch_ratio/flipped_token_frac; mismatch_ratio/token_var_share_flipped never logged or never defined).",
    "Drift and clipping: not tested (clip/token_frac never logged).",
    "Drift and reward, a step's share of routing-flipped tokens (routing/any_layer_flip) vs the change of "
    "reward/mean from that step to the next: too few step pairs to test (2 with both routing/any_layer_flip and "
    "the reward change; at least 8 needed).",
    "Routing: 20% of response tokens were routed differently by the rollout engine and the learner (natural "
    "routing) in at least one MoE layer (routing/any_layer_flip, mean over 3 steps); per MoE layer 4% (layer 0) "
    "to 20% (layer 1) (routing/layer_disagree, mean over steps).",
    "Rollout/learner ratio (learner before the update vs rollout engine, natural routing): the token-level ratio "
    "had 6.67× the variance of the length-normalised sequence-level ratio (mean mismatch_ratio/token_var 0.002 ÷ "
    "mean mismatch_ratio/seq_var 0.0003).",
    "New/old policy ratio (inside the update): token- vs sequence-ratio variance not measured (ratio/token_var "
    "and ratio/seq_var never logged).",
]


def test_verdict_sentences_recompute_by_hand_and_open_the_report(tmp_path):
    run = _write_metrics(tmp_path / "run", HAND_RECORDS)
    paths = build_report(run, tmp_path / "out")
    md = paths.markdown.read_text()
    summary = md.split("## Summary\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert summary == [f"- {s}" for s in HAND_SENTENCES]
    assert md.index("## Summary") < md.index("## Headline numbers")
    assert md_table(md, "Headline numbers")[HEADLINE_LABELS["mismatch_token_seq_var_ratio"]] == "6.667"
    html = paths.html.read_text()
    assert re.search(r"<h1>[^<]*</h1>(\s*<p>[^<]*</p>)*\s*<h2>Summary</h2>", html)  # after the setup lines only
    assert "had 6.67× the variance" in html


def test_synthetic_report_opens_with_drift_verdicts(synthetic_report):
    """A run with every metric (12 steps): the summary's first three sentences say whether drift mattered."""
    md = synthetic_report.markdown.read_text()
    summary = md.split("## Summary\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert summary[0].startswith("- Drift and ratio variance: tokens routed differently in at least one MoE layer")
    assert summary[1].startswith("- Drift and clipping, per-step share of routing-flipped tokens")
    assert "Spearman ρ = " in summary[1] and "n = 12 steps" in summary[1]
    assert summary[2].startswith("- Drift and reward,") and "n = 11 step pairs" in summary[2]
    assert summary[3].startswith("- Routing: ")


def test_verdicts_say_what_is_missing_or_undefined():
    assert "not measured (routing/any_layer_flip was never logged" in routing_sentence([{"step": 0}])
    one = routing_sentence([{"step": 0, "routing/any_layer_flip": 0.5}])
    assert one.startswith("Routing: 50% of response tokens") and "per-layer disagreement not logged" in one
    only_tok = variance_sentence([{"step": 0, "ratio/token_var": 1.0}], "ratio", "X")
    assert only_tok == "X: token- vs sequence-ratio variance not measured (ratio/seq_var never logged)."
    zero = variance_sentence([{"step": 0, "ratio/token_var": 0.5, "ratio/seq_var": 0.0}], "ratio", "X")
    assert "sequence-level ratio's variance was 0 on average" in zero and "×" not in zero
    named = routing_sentence(HAND_RECORDS, layer_ids=[3, 5])
    assert "4% (layer 3) to 20% (layer 5)" in named


# --------------------------------------------------------------------------- eval


def test_eval_figure_and_last_eval_in_the_headline(synthetic_run, synthetic_report):
    """eval.jsonl at policy steps 0, 6, 12 (synth_run.eval_record): the last has reward 0.25 + 12/48 = 0.5,
    accuracy 12/24 = 0.5, pass@4 0.5 + 12/48 = 0.75, 32 prompts, response length 10 + 12 = 22."""
    paths = synthetic_report
    assert "eval" in {p.stem for p in paths.figures}
    assert_real_png(paths.html.parent / "eval.png")
    table = md_table(paths.markdown.read_text(), "Headline numbers")
    assert table["last evaluation: policy step (updates the evaluated policy had)"] == "12"
    assert table["last evaluation: prompts (eval/num_prompts)"] == "32"
    assert table["last evaluation: mean reward (eval/reward_mean)"] == "0.5"
    assert table["last evaluation: accuracy (eval/accuracy)"] == "0.5"
    assert table["last evaluation: pass@4 (eval/pass_at_k)"] == "0.75"
    assert table["last evaluation: mean response length (eval/response_len_mean, tokens)"] == "22"
    lines = {line.get_label(): line for line in fig_eval(load_run(synthetic_run)).axes[0].lines}
    assert set(lines) == {"eval reward (mean)", "eval accuracy", "eval pass@4", "training batch reward/mean"}
    np.testing.assert_allclose(lines["eval reward (mean)"].get_xdata(), [0, 6, 12])
    np.testing.assert_allclose(lines["eval reward (mean)"].get_ydata(), [0.25, 0.375, 0.5])
    np.testing.assert_allclose(lines["eval pass@4"].get_ydata(), [0.5, 0.625, 0.75])
    np.testing.assert_allclose(lines["training batch reward/mean"].get_xdata(), np.arange(1, 13))


def test_eval_without_pass_at_k_has_no_pass_line(tmp_path):
    run = _write_metrics(tmp_path / "run", [{"step": 0, "reward/mean": 0.5}])
    (run / "eval.jsonl").write_text(json.dumps({"step": 0, "eval/reward_mean": 0.2, "eval/accuracy": 0.1,
                                                "eval/k": 1, "eval/num_prompts": 8, "eval/policy_step": 0}) + "\n")
    labels = [line.get_label() for line in fig_eval(load_run(run)).axes[0].lines]
    assert labels == ["eval reward (mean)", "eval accuracy", "training batch reward/mean"]
    table = md_table(build_report(run, tmp_path / "out").markdown.read_text(), "Headline numbers")
    assert not any("pass@" in label for label in table)
    assert table["last evaluation: mean response length (eval/response_len_mean, tokens)"] == "n/a"


def test_no_eval_and_no_samples_are_listed_as_skipped(tmp_path, capsys):
    run = write_synthetic_run(tmp_path / "run", with_traces=False, with_extras=False)
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "skipped figure eval: no eval.jsonl in the run directory" in err
    assert "skipped section samples: no samples.jsonl in the run directory" in err
    md = (tmp_path / "out" / "report.md").read_text()
    skipped = md.split("## Skipped\n", 1)[1]
    assert "(`eval`)" in skipped and "(`samples`)" in skipped
    assert "## Samples" not in md and "last evaluation" not in md
    assert not (tmp_path / "out" / "eval.png").exists()


# --------------------------------------------------------------------------- samples


def _sample(step: int, reward: float, tokens=("a",), flips=None, prompt="p") -> Sample:
    return Sample(step, prompt, "ans", "".join(tokens), reward, 0.0, "stop", list(tokens),
                  None if flips is None else list(flips))


def test_pick_samples_first_and_last_step_by_reward():
    samples = ([_sample(1, r) for r in (0.1, 0.9, 0.5, 0.3)] + [_sample(5, 1.0)]
               + [_sample(9, r) for r in (0.2, 0.4)])
    picked = pick_samples(samples)
    # step 1 by reward: 0.9, 0.5, 0.3, 0.1 -> positions round(0, 1.5, 3) = 0, 2, 3; step 5 is neither end
    assert [(s.step, s.reward) for s in picked] == [(1, 0.9), (1, 0.3), (1, 0.1), (9, 0.4), (9, 0.2)]
    assert [s.reward for s in pick_samples([_sample(3, r / 10) for r in range(8)])] == [0.7, 0.6, 0.4, 0.3, 0.1, 0.0]


def test_samples_section_marks_the_flipped_token(synthetic_report):
    """synth_run.sample_records: step 12's second sample (reward 0.5) has its token '2' flipped in 2 layers;
    step 1's samples were saved without routes; step 7 is neither the first nor the last step."""
    paths = synthetic_report
    md = paths.markdown.read_text()
    section = md.split("## Samples\n", 1)[1].split("\n## ", 1)[0]
    assert section.count("### Sample, step 1:") == 3 and section.count("### Sample, step 12:") == 3
    assert "step 7:" not in section
    assert ("### Sample, step 12: reward 0.5, advantage -0.2, finished by stop; 1 of 4 response tokens routed "
            "differently in ≥1 MoE layer (at most 2 layers)") in section
    assert "- response: 1**2**3&lt;eos&gt;" in section
    assert "step 1: reward 1, advantage 0.6, finished by stop; routing flips not recorded" in section
    html = paths.html.read_text()
    assert html.count("<mark>") == 1 and "1<mark>2</mark>3&lt;eos&gt;" in html


def test_sample_text_is_escaped_in_html_and_markdown(tmp_path):
    run = _write_metrics(tmp_path / "run", [{"step": 0, "reward/mean": 0.5}])
    sample = {"step": 0, "prompt": 'is a<b && c>d? <script>alert("x")</script>', "answer": "a<b",
              "response": "yes < no", "reward": 1.0, "advantage": 0.5, "finish_reason": "stop",
              "response_tokens": ["yes", " <", " no|*"], "routing_flips": [0, 1, 0]}
    (run / "samples.jsonl").write_text(json.dumps(sample) + "\nnot json\n")
    paths = build_report(run, tmp_path / "out")
    html = paths.html.read_text()
    assert "<script" not in html
    assert "is a&lt;b &amp;&amp; c&gt;d? &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert "yes<mark> &lt;</mark> no|*" in html
    checker = _TagBalance()
    checker.feed(html)
    assert checker.errors == [] and checker.stack == []
    md = paths.markdown.read_text()
    assert "- response: yes **&lt;** no\\|\\*" in md  # the space outside the bold markers
    assert "- prompt: is a&lt;b &amp;&amp; c&gt;d? &lt;script&gt;" in md
    assert "samples.jsonl: skipped line 2: not valid JSON" in md  # input notes


def test_long_text_is_shortened_and_whitespace_flips_are_visible():
    s = _sample(0, 1.0, tokens=["x"] * 130, flips=[0] * 129 + [1], prompt="p" * 1000)
    md = samples_markdown([s])
    assert f"- prompt: {'p' * 150} …\\[700 characters left out\\]… {'p' * 150}" in md
    response = md.split("- response: ", 1)[1].split("\n", 1)[0]
    assert response == "x" * 120 + "…\\[10 more tokens\\]"  # the flipped 130th token is cut: no bold
    assert "1 of 130 response tokens routed differently in ≥1 MoE layer (at most 1 layer)" in md
    pieces, _ = response_pieces(_sample(0, 1.0, tokens=["a", " ", "\n", "b"], flips=[0, 1, 2, 0]))
    assert pieces == [("a", False), (" \n", True), ("b", False)]
    assert "- response: a**␣⏎**b" in samples_markdown([_sample(0, 1.0, tokens=["a", " ", "\n", "b"],
                                                                flips=[0, 1, 2, 0])])
    assert md_text("a_b\nc") == "a\\_b⏎ c"


def test_routing_flips_of_the_wrong_length_are_not_marked(tmp_path):
    run = _write_metrics(tmp_path / "run", [{"step": 0, "reward/mean": 0.5}])
    (run / "samples.jsonl").write_text(json.dumps(
        {"step": 0, "prompt": "p", "answer": "a", "response": "ab", "reward": math.pi, "advantage": 0.0,
         "finish_reason": "length", "response_tokens": ["a", "b"], "routing_flips": [1]}) + "\n")
    md = build_report(run, tmp_path / "out").markdown.read_text()
    assert "routing flips not recorded" in md and "- response: ab" in md and "reward 3.142" in md
    assert "line 1: routing_flips does not hold one integer (or null) per response token" in md


def test_a_token_not_compared_is_neither_marked_nor_counted():
    """routing_flips holds null for a token whose row one side did not compute."""
    s = _sample(0, 1.0, tokens=["a", "b", "c"], flips=[1, None, 0])
    assert response_pieces(s)[0] == [("a", True), ("bc", False)]
    assert ("1 of 2 response tokens routed differently in ≥1 MoE layer (at most 1 layer); 1 token not compared"
            in samples_markdown([s]))


def test_skip_reasons_name_the_switch_that_was_off(tmp_path):
    run = _write_metrics(tmp_path / "run", [{"step": 0, "reward/mean": 0.5}])
    (run / "config.yaml").write_text("eval:\n  every: 0\nlogging:\n  samples_every: 0\n")
    reasons = {s.name: s.reason for s in build_report(run, tmp_path / "out").skipped}
    assert reasons["eval"] == "no eval.jsonl in the run directory: evaluation was off (eval.every: 0)"
    assert reasons["samples"] == ("no samples.jsonl in the run directory: saving samples was off "
                                  "(logging.samples_every: 0)")


def test_samples_intro_names_the_steps_shown():
    one = samples_markdown(pick_samples([_sample(4, 0.5), _sample(4, 0.1)]))
    assert one.startswith("Up to 6 samples of step 4, the only step that saved samples (samples.jsonl), ordered")
    two = samples_markdown(pick_samples([_sample(0, 0.5), _sample(4, 0.1), _sample(9, 0.2)]))
    assert two.startswith("Up to 3 samples each of step 0 and step 9, the first and the last step that saved")
    assert "step 4:" not in two
