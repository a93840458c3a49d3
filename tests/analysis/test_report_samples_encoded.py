"""Issue 43: the report's samples section shows each sample's prompt as the rollout engine got it
(samples.jsonl `prompt_encoded`) and how prompts were encoded (run.json `prompt_encoding`)."""

from __future__ import annotations

import json

from analysis.report import build_report


def _sample(step: int, encoded: str | None) -> dict:
    rec = {"step": step, "prompt": "copy 12", "answer": "12", "response": "12", "reward": 1.0, "advantage": 0.5,
           "finish_reason": "stop", "response_tokens": ["1", "2"], "routing_flips": [0, 1]}
    if encoded is not None:
        rec["prompt_encoded"] = encoded
    return rec


def test_samples_show_the_encoded_prompt_and_the_template_setting(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
    (run / "run.json").write_text(json.dumps({"prompt_encoding": {"chat_template": "tokenizer",
                                                                  "system_prompt": "be brief"}}))
    (run / "samples.jsonl").write_text(json.dumps(_sample(0, "<bos>s:be brief<eos><bos>u:copy 12<eos>a:")) + "\n"
                                       + json.dumps(_sample(0, None)) + "\n")
    paths = build_report(run, tmp_path / "out")
    md, html = paths.markdown.read_text(), paths.html.read_text()
    assert "Prompt encoding: task.chat_template=tokenizer, task.system_prompt='be brief' (run.json)." in md
    assert md.count("- prompt as encoded (the token ids the engine got, decoded): ") == 1  # the older sample has none
    assert "&lt;bos&gt;s:be brief&lt;eos&gt;&lt;bos&gt;u:copy 12&lt;eos&gt;a:" in md
    assert ("<tr><th>prompt as encoded</th><td class=\"text\">&lt;bos&gt;s:be brief&lt;eos&gt;&lt;bos&gt;u:copy 12"
            "&lt;eos&gt;a:</td></tr>") in html
    assert "Prompt encoding: task.chat_template=tokenizer, task.system_prompt=&#x27;be brief&#x27; (run.json)." in html


def test_template_setting_from_config_yaml_or_not_recorded(tmp_path):
    for name, config, line in [("cfg", "task:\n  chat_template: none\n  system_prompt: null\n",
                                "Prompt encoding: task.chat_template=none, task.system_prompt=none (config.yaml)."),
                               ("bare", None, "Prompt encoding: not recorded")]:
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward/mean": 0.5}) + "\n")
        (run / "samples.jsonl").write_text(json.dumps(_sample(0, "copy 12")) + "\n")
        if config:
            (run / "config.yaml").write_text(config)
        assert line in build_report(run, tmp_path / name / "out").markdown.read_text()
