"""Issue 49, defect 8: an empty prompt (one that encodes to no token) is refused at start-up naming its file and
line, before anything is written. It was warned about, then crashed the first step with `prompts[2] is empty`
(an index, not file:line) after config.yaml, run.json and metrics.jsonl were written, so a rerun needed
--overwrite. Defect 5 (whitespace counted in the length check) is in tests/tasks/test_prompt_chars.py."""

from __future__ import annotations

import json

from faults._tiny import errors, train


def test_an_empty_prompt_is_refused_before_anything_is_written(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(o) + "\n" for o in ({"prompt": "2+3=", "answer": "5"},
                                                           {"prompt": "", "answer": "1"},
                                                           {"prompt": "7*6=", "answer": "42"})))
    run_dir = tmp_path / "run"
    assert train(run_dir, "task.name=jsonl", f"task.path={data}", "train.steps=2") == 2
    err = capsys.readouterr().err
    assert errors(err) == [f"error: {data}:2: 1 prompt(s) encode to no token at all (an empty prompt): the rollout "
                           "engine needs at least one token to start from; remove those lines or give them a prompt "
                           "(task.chat_template=tokenizer adds the template's tokens)"], err[-2000:]
    assert not run_dir.exists()
