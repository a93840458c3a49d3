"""The samples part of a run report, from the run's `samples.jsonl` (one JSON object per saved sample:
`step`, `prompt`, `prompt_encoded` (the prompt as the rollout engine got it: after the chat template and
system prompt, decoded from its token ids; absent in older files), `answer`, `response`, `reward`, `advantage`,
`finish_reason`, `response_tokens`
[str], `routing_flips` [int] per response token = MoE layers whose top-k expert set differs between
rollout engine and learner (null for a token whose row one side did not compute), or null for the
whole sample when routes were not recorded).

`read_samples` reads the file leniently (a bad line is skipped with a note naming it), `pick_samples`
chooses a handful (of the first and of the last step that saved samples, by reward: the highest, the lowest
and evenly spaced ones between), and `samples_markdown` / `samples_html` render them with the response tokens
that were routed differently in ≥1 layer marked (**bold** in Markdown, <mark> in HTML), every piece
of sample text escaped and long text shortened.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from analysis.load import iter_step_records

PER_STEP = 3
"""Samples shown from each of the first and the last step (twice as many when only one step saved any)."""
MAX_CHARS = 300
"""Prompts and answers longer than this lose their middle."""
MAX_RESPONSE_TOKENS = 120
"""Responses longer than this (tokens; characters × 5 without tokens) lose their end."""


@dataclass
class Sample:
    step: int
    prompt: str
    answer: str
    response: str
    reward: float
    advantage: float
    finish_reason: str
    tokens: list[str] | None
    """The response's tokens as text (None when not saved)."""
    flips: list[int | None] | None
    """Per response token, the MoE layers routed differently (None for a token not compared; the whole
    list None when not recorded or unusable)."""
    prompt_encoded: str | None = None
    """The decoded token ids the rollout engine got (chat template, system prompt); None when not saved."""


def _text(v: Any) -> str:
    return v if isinstance(v, str) else "" if v is None else str(v)


def _float(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _sample(rec: dict[str, Any], where: str, notes: list[str]) -> Sample:
    tokens = rec.get("response_tokens")
    tokens = [_text(t) for t in tokens] if isinstance(tokens, list) else None
    flips = rec.get("routing_flips")
    if flips is not None:
        ok = (isinstance(flips, list) and tokens is not None and len(flips) == len(tokens)
              and all(f is None or (isinstance(f, int) and not isinstance(f, bool)) for f in flips))
        if not ok:
            notes.append(f"samples.jsonl {where}: routing_flips does not hold one integer (or null) per response "
                         "token; its flipped tokens are not marked")
            flips = None
    return Sample(int(rec["step"]), _text(rec.get("prompt")), _text(rec.get("answer")), _text(rec.get("response")),
                  _float(rec.get("reward")), _float(rec.get("advantage")), _text(rec.get("finish_reason")),
                  tokens, flips, rec["prompt_encoded"] if isinstance(rec.get("prompt_encoded"), str) else None)


def read_samples(path: str | Path, notes: list[str]) -> list[Sample]:
    """Every usable line of a samples.jsonl in file order; skipped lines are described in `notes`."""
    return [_sample(rec, f"line {lineno}", notes) for lineno, _, rec in iter_step_records(Path(path), notes.append)]


def _spread(group: list[Sample], n: int) -> list[Sample]:
    """Up to n samples of one step: the highest-, lowest- and evenly spaced rewards between (NaN last)."""
    ranked = sorted(group, key=lambda s: -s.reward if math.isfinite(s.reward) else math.inf)
    if len(ranked) <= n:
        return ranked
    idx = np.unique(np.round(np.linspace(0, len(ranked) - 1, n)).astype(int))
    return [ranked[i] for i in idx]


def pick_samples(samples: list[Sample], per_step: int = PER_STEP) -> list[Sample]:
    """The samples to show: `per_step` from the first and from the last step that saved samples
    (2 × `per_step` when that is one step), each step's ordered by reward, highest first."""
    if not samples:
        return []
    steps = sorted({s.step for s in samples})
    chosen = [steps[0]] if len(steps) == 1 else [steps[0], steps[-1]]
    n = per_step * (2 if len(chosen) == 1 else 1)
    return [s for step in chosen for s in _spread([x for x in samples if x.step == step], n)]


# --------------------------------------------------------------------------- text pieces

def shorten(text: str, limit: int = MAX_CHARS) -> str:
    """`text` with its middle replaced by '…[N characters left out]…' when longer than `limit`."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} …[{len(text) - 2 * half} characters left out]… {text[-half:]}"


def response_pieces(s: Sample, max_tokens: int = MAX_RESPONSE_TOKENS) -> tuple[list[tuple[str, bool]], str]:
    """(runs of (text, flipped in ≥1 layer), note on what was left out) of the response: consecutive tokens
    of the same kind merged, at most `max_tokens` tokens (or 5 × that many characters without tokens)."""
    if not s.tokens:
        limit = 5 * max_tokens
        cut = len(s.response) - limit
        return [(s.response[:limit], False)], (f"…[{cut} more characters]" if cut > 0 else "")
    flips = s.flips if s.flips is not None else [None] * len(s.tokens)
    pieces: list[tuple[str, bool]] = []
    for tok, n in zip(s.tokens[:max_tokens], flips[:max_tokens]):
        flipped = n is not None and n > 0
        if pieces and pieces[-1][1] == flipped:
            pieces[-1] = (pieces[-1][0] + tok, flipped)
        else:
            pieces.append((tok, flipped))
    cut = len(s.tokens) - max_tokens
    return pieces, (f"…[{cut} more tokens]" if cut > 0 else "")


def flip_summary(s: Sample) -> str:
    if s.flips is None:
        return "routing flips not recorded"
    compared = [n for n in s.flips if n is not None]
    flipped = sum(1 for n in compared if n > 0)
    most = max(compared, default=0)
    uncompared = len(s.flips) - len(compared)
    return (f"{flipped} of {len(compared)} response tokens routed differently in ≥1 MoE layer"
            + (f" (at most {most} layer{'s' if most != 1 else ''})" if flipped else "")
            + (f"; {uncompared} token{'s' if uncompared != 1 else ''} not compared" if uncompared else ""))


def _heading(s: Sample) -> str:
    fmt = lambda v: "n/a" if not math.isfinite(v) else f"{v:.4g}"  # noqa: E731
    return (f"step {s.step}: reward {fmt(s.reward)}, advantage {fmt(s.advantage)}, "
            f"finished by {s.finish_reason or '?'}; {flip_summary(s)}")


def intro(samples: list[Sample], per_step: int, how: str) -> str:
    """What the shown samples are (which steps, how chosen) and how flipped tokens are marked."""
    steps = sorted({s.step for s in samples})
    if len(steps) == 1:
        which = f"Up to {2 * per_step} samples of step {steps[0]}, the only step that saved samples (samples.jsonl)"
    else:
        which = (f"Up to {per_step} samples each of step {steps[0]} and step {steps[-1]}, the first and the last "
                 "step that saved samples (samples.jsonl)")
    return (which + ", ordered by reward: the highest, the lowest and evenly spaced ones between. Response tokens "
            "that the rollout engine and the learner routed differently in at least one MoE layer are marked "
            f"({how}). Long text is shortened.")


# --------------------------------------------------------------------------- Markdown

_MD_ESCAPE = re.compile(r"([\\`*_\[\]|~#])")


def md_text(text: str) -> str:
    """Plain text safe inside a Markdown line: HTML-escaped, Markdown punctuation backslash-escaped,
    line breaks shown as ⏎."""
    text = html.escape(text, quote=False)
    text = _MD_ESCAPE.sub(r"\\\1", text)
    return text.replace("\r\n", "\n").replace("\n", "⏎ ").replace("\r", "⏎ ")


def _md_marked(text: str) -> str:
    """Bold for a flipped run; surrounding whitespace stays outside the markers (CommonMark needs it so);
    a run of whitespace only is shown as ␣ / ⏎."""
    core = text.strip()
    if not core:
        return "**" + text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥") + "**"
    lead, trail = text[:len(text) - len(text.lstrip())], text[len(text.rstrip()):]
    return md_text(lead) + "**" + md_text(core) + "**" + md_text(trail)


def samples_markdown(samples: list[Sample], per_step: int = PER_STEP) -> str:
    out = [md_text(intro(samples, per_step, "in bold")) if samples else ""]
    for s in samples:
        pieces, cut = response_pieces(s)
        response = "".join(_md_marked(t) if flipped else md_text(t) for t, flipped in pieces) + md_text(cut)
        out += ["", f"### Sample, {md_text(_heading(s))}", "",
                f"- prompt: {md_text(shorten(s.prompt))}"]
        if s.prompt_encoded is not None:
            out.append("- prompt as encoded (the token ids the engine got, decoded): "
                       + md_text(shorten(s.prompt_encoded)))
        out += [f"- response: {response}",
                f"- answer: {md_text(shorten(s.answer))}"]
    return "\n".join(out)


# --------------------------------------------------------------------------- HTML

def samples_html(samples: list[Sample], per_step: int = PER_STEP) -> str:
    e = html.escape
    out = [f"<p>{e(intro(samples, per_step, 'highlighted'))}</p>" if samples else ""]
    for s in samples:
        pieces, cut = response_pieces(s)
        response = "".join(f"<mark>{e(t)}</mark>" if flipped else e(t) for t, flipped in pieces) + e(cut)
        out.append(f'<h3>Sample, {e(_heading(s))}</h3><table class="sample"><tbody>'
                   f'<tr><th>prompt</th><td class="text">{e(shorten(s.prompt))}</td></tr>'
                   + (f'<tr><th>prompt as encoded</th><td class="text">{e(shorten(s.prompt_encoded))}</td></tr>'
                      if s.prompt_encoded is not None else "") +
                   f'<tr><th>response</th><td class="text">{response}</td></tr>'
                   f'<tr><th>answer</th><td class="text">{e(shorten(s.answer))}</td></tr></tbody></table>')
    return "\n".join(out)
