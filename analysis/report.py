"""Expert-drift report of one training run or one probe: `python -m analysis.report`.

    python -m analysis.report RUN_DIR [--out reports/NAME] [--probe drift.json]
    python -m analysis.report drift.json [--out DIR]          # probe-only report

Writes into `--out` (default `RUN_DIR/report/`, or `<probe stem>_report/` beside a probe file):
`report.html` (self-contained: every figure embedded as a base64 PNG data URI), `report.md` (the
same content referencing the PNGs), and one `<figure>.png` per figure. A run report starts with the
setup (both sides' engine and dtype: the learner's from run.json when the run wrote one) and one
verdict sentence per question (`analysis.verdicts`), then a table of headline numbers
(`analysis.load.headline_numbers`, plus the last evaluation's from eval.jsonl), then the figures
(`analysis.figures`, the eval figure of `analysis.eval_report`), a handful of samples with their
routing-flipped tokens marked (`analysis.samples`, from samples.jsonl), then a "Skipped" section naming
each figure or section that could not be drawn and why (metric never logged, traces or file missing),
then notes about input lines that were skipped. A run (or probe) with the routing-drift dial on
(`rollout.router_flip_prob`, `rollout.router_noise_std`) gets a header line with its settings and realised rate
(`routing/dial_flip_frac`), a first summary sentence and a table that split its routing drift into the injected
and the rest (`analysis.dial_report`); a run without the dial reads as before. HTML and Markdown are written
atomically.

Exit codes: 0 built, 2 bad input (missing run dir, nothing to report on, a file that cannot be read) or an output
directory that cannot be written (read-only, full, a regular file): one `error:` line (`analysis.outputs`).
"""

from __future__ import annotations

import base64
import html
import math
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from analysis.dial_report import (
    DRIFT_TABLE_TITLE, DialDrift, drift_rows, header_line, probe_dial, run_dial, with_dial_summary,
)
from analysis.eval_report import EVAL_FIGURES, last_eval_rows
from analysis.figure_kit import RenderedFigure, SkippedFigure, render_figures
from analysis.figures import ROLLOUT_CORR_PANELS, RUN_FIGURES, rollout_corrections_used
from analysis.outputs import check_outputs, read_error_message, writing_output
from analysis.probe_figures import PROBE_FIGURES
from analysis.r3_report import r3_rows
from analysis.router_figures import ROUTER_FIGURES
from analysis.stability_figures import STABILITY_FIGURES
from analysis.samples import PER_STEP, pick_samples, read_samples, samples_html, samples_markdown
from analysis.verdicts import run_verdicts
from moe_gspo.rollout.fp8 import rollout_precision
from analysis.load import (
    HEADLINE_LABELS, PROBE_LABELS, ReportInputError, RunData, RunDataWarning, finite_mean, headline_numbers,
    load_probe, load_run, probe_headline, probe_value, series,
)

assert RUN_FIGURES[0].name == "reward"
RUN_REPORT_FIGURES = [RUN_FIGURES[0], *EVAL_FIGURES, *RUN_FIGURES[1:], *ROUTER_FIGURES, *STABILITY_FIGURES]
"""The run report's figures: the eval figure right after the training reward."""


# --------------------------------------------------------------------------- files

def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write `data` to `path` through a temp file in the same directory and `os.replace`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------- page model

@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]


@dataclass
class Section:
    """A block after the figures whose body is rendered by its owner (both forms escaped already)."""

    name: str
    title: str
    html: str
    markdown: str


class SkippedSection(SkippedFigure):
    """A section that could not be built; listed under "Skipped" with the figures."""


@dataclass
class Page:
    title: str
    intro: list[str] = field(default_factory=list)
    """Plain-text lines under the title."""
    summary: list[str] = field(default_factory=list)
    """Verdict sentences, shown as the first section ("Summary")."""
    tables: list[Table] = field(default_factory=list)
    figures: list[RenderedFigure | SkippedFigure] = field(default_factory=list)
    """Drawn figures, and what was skipped (figures and sections)."""
    sections: list[Section] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Input problems worth knowing (skipped JSONL lines, unreadable files)."""
    details: list[tuple[str, str]] = field(default_factory=list)
    """(summary, preformatted text) blocks shown collapsed in HTML, fenced in Markdown."""


@dataclass
class ReportPaths:
    html: Path
    markdown: Path
    figures: list[Path]
    skipped: list[SkippedFigure]


def fmt_number(v: float, integer: bool = False) -> str:
    """Table formatting: 'n/a' for NaN, integers plain, others with 4 significant digits."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if integer:
        return str(int(v))
    return f"{v:.4g}"


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{border:1px solid #ccc;padding:.25em .6em;
text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}th{background:#f3f3f3}
figure{margin:1.5em 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{color:#555;font-size:.9em}pre{background:#f7f7f7;padding:.6em;overflow:auto;font-size:.85em}
.skipped li,.notes li{margin:.2em 0}
table.sample{width:100%}table.sample th{width:6em;vertical-align:top}
td.text{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:.85em}
mark{background:#ffd966;font-weight:bold}section h3{font-size:1em;margin:1.2em 0 .3em}
"""


def _is_num(s: str) -> bool:
    try:
        float(s.split("±")[0])
        return True
    except ValueError:
        return s == "n/a"


def render_html(page: Page) -> str:
    """The self-contained HTML of a page (figures as base64 data URIs, no scripts)."""
    e = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{e(page.title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{e(page.title)}</h1>"]
    parts += [f"<p>{e(line)}</p>" for line in page.intro]
    if page.summary:
        parts.append('<h2>Summary</h2><ul class="summary">')
        parts += [f"<li>{e(line)}</li>" for line in page.summary]
        parts.append("</ul>")
    for t in page.tables:
        parts.append(f"<h2>{e(t.title)}</h2><table><thead><tr>"
                     + "".join(f"<th>{e(c)}</th>" for c in t.columns) + "</tr></thead><tbody>")
        for row in t.rows:
            cells = "".join(f'<td class="num">{e(c)}</td>' if i and _is_num(c) else f"<td>{e(c)}</td>"
                            for i, c in enumerate(row))
            parts.append(f"<tr>{cells}</tr>")
        parts.append("</tbody></table>")
    drawn = [f for f in page.figures if isinstance(f, RenderedFigure)]
    skipped = [f for f in page.figures if isinstance(f, SkippedFigure)]
    if drawn:
        parts.append("<h2>Figures</h2>")
    for f in drawn:
        b64 = base64.b64encode(f.png).decode("ascii")
        parts.append(f'<figure id="{e(f.name)}"><h3>{e(f.title)}</h3>'
                     f'<img src="data:image/png;base64,{b64}" alt="{e(f.title)}">'
                     f"<figcaption>{e(f.caption)}</figcaption></figure>")
    for sec in page.sections:
        parts.append(f'<section id="{e(sec.name)}"><h2>{e(sec.title)}</h2>{sec.html}</section>')
    if skipped:
        parts.append('<h2>Skipped</h2><ul class="skipped">')
        parts += [f"<li><b>{e(s.title)}</b> ({e(s.name)}): {e(s.reason)}</li>" for s in skipped]
        parts.append("</ul>")
    if page.notes:
        parts.append('<h2>Input notes</h2><ul class="notes">')
        parts += [f"<li>{e(n)}</li>" for n in page.notes]
        parts.append("</ul>")
    for summary, text in page.details:
        parts.append(f"<details><summary>{e(summary)}</summary><pre>{e(text)}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


_MD_HTML = re.compile(r"<(?=[A-Za-z/!?])|&(?=#?\w+;)")  # what could start a tag or an entity ("< 0.5" stays)
_MD_PUNCT = re.compile(r"([\\`*|~]|\](?=[(\[:])|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])|^#|^[>+-](?=\s))")


def md_plain(text: str) -> str:
    """Plain text safe in a Markdown line: HTML-escaped where it could start a tag or an entity (`<img ...>`
    shows as text, `gate frac < 0.5` stays as written), Markdown punctuation
    backslash-escaped (`_` only where it could start or end emphasis, so snake_case names stay readable;
    `]` only where it could close a link),
    line breaks as spaces."""
    text = str(text).replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
    text = _MD_HTML.sub(lambda m: "&amp;" if m.group() == "&" else "&lt;", text)
    return _MD_PUNCT.sub(r"\\\1", text)


def _md_cell(s: str) -> str:
    return md_plain(s)


def render_markdown(page: Page) -> str:
    """The Markdown summary of a page (figures referenced as `<name>.png` beside it). Plain text (the
    title, which names the run directory, intro lines, table cells, figure titles, skipped reasons,
    notes) is escaped (`md_plain`: HTML entities, Markdown punctuation), so a run named
    `<img src=x onerror=...>` shows as text; summary sentences and captions may carry Markdown of
    their own and are kept as written."""
    out = [f"# {md_plain(page.title)}", ""]
    out += [md_plain(line) + "  " for line in page.intro]
    if page.summary:
        out += ["", "## Summary", ""] + [f"- {line}" for line in page.summary]
    for t in page.tables:
        out += ["", f"## {md_plain(t.title)}", "", "| " + " | ".join(map(_md_cell, t.columns)) + " |",
                "|" + "---|" * len(t.columns)]
        out += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in t.rows]
    drawn = [f for f in page.figures if isinstance(f, RenderedFigure)]
    skipped = [f for f in page.figures if isinstance(f, SkippedFigure)]
    if drawn:
        out += ["", "## Figures"]
    for f in drawn:
        out += ["", f"### {md_plain(f.title)}", "", f"![{md_plain(f.title)}]({f.name}.png)", "", f.caption]
    for sec in page.sections:
        out += ["", f"## {md_plain(sec.title)}", "", sec.markdown]
    if skipped:
        out += ["", "## Skipped", ""]
        out += [f"- **{md_plain(s.title)}** (`{s.name}`): {md_plain(s.reason)}" for s in skipped]
    if page.notes:
        out += ["", "## Input notes", ""] + [f"- {md_plain(n)}" for n in page.notes]
    for summary, text in page.details:
        fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
        out += ["", f"<details><summary>{html.escape(summary)}</summary>", "", fence, text.rstrip(), fence,
                "", "</details>"]
    return "\n".join(out) + "\n"


def write_page(page: Page, out_dir: str | Path, *, flag: str = "--out") -> ReportPaths:
    """Write `<name>.png` per drawn figure, `report.html` and `report.md` into `out_dir`.
    A stale PNG of a figure that is skipped this time is removed. A write that fails (a read-only or full
    filesystem, a path under a file) is a one-line `ReportInputError` naming `flag` (`analysis.outputs`)."""
    out_dir = Path(out_dir)
    with writing_output(flag, out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
        pngs = []
        for f in page.figures:
            png_path = out_dir / f"{f.name}.png"
            if isinstance(f, RenderedFigure):
                write_atomic(png_path, f.png)
                pngs.append(png_path)
            elif png_path.exists():
                png_path.unlink()
        html_path, md_path = out_dir / "report.html", out_dir / "report.md"
        write_atomic(html_path, render_html(page))
        write_atomic(md_path, render_markdown(page))
    return ReportPaths(html_path, md_path, pngs,
                       [f for f in page.figures if isinstance(f, SkippedFigure)])


# --------------------------------------------------------------------------- run / probe pages

def headline_table(run: RunData, dial: DialDrift | None = None) -> Table:
    """The headline numbers of the run's metrics, then the last evaluation's (when eval.jsonl has one); with the
    routing-drift dial on, the any-layer flip's label says that it counts the injected drift."""
    nums = headline_numbers(run.records)
    labels = dict(HEADLINE_LABELS)
    if dial is not None:
        labels["any_layer_flip_mean"] += " (injected by the dial and natural together)"
    rows = [[labels[k], fmt_number(v, integer=k.startswith("num_"))] for k, v in nums.items()]
    rows += [[label, fmt_number(v, integer=integer)] for label, v, integer in last_eval_rows(run.evals)]
    return Table("Headline numbers", ["quantity", "value"], rows)


def rollout_corr_table(run: RunData) -> Table | None:
    """Mean over steps of each rollout_corr/* metric the run logged (TIS, MIS, OPSM); None when it logged none."""
    keys = [k for _, _, pairs in ROLLOUT_CORR_PANELS for k, _ in pairs]
    keys += sorted({k for r in run.records for k in r if k.startswith("rollout_corr/")} - set(keys))
    rows = [[k, fmt_number(finite_mean(series(run.records, k)[1]))] for k in keys
            if any(k in r for r in run.records)]
    return Table("Rollout corrections (mean over steps)", ["metric", "value"], rows) if rows else None


def r3_table(run: RunData) -> Table | None:
    """R3's replay contract and fallback over the run (`analysis.r3_report`); None when not an R3 run."""
    rows = r3_rows(run.records)
    return Table("Routing replay (R3): did the replayed pass use the rollout routes?",
                 ["metric", "mean over steps (counts: total)", "max over steps", "steps with a value"],
                 rows) if rows else None


def rollout_corr_line(run: RunData) -> str:
    """The header's 'Rollout corrections: ...' line: those config.yaml turns on, or 'not used'."""
    used = rollout_corrections_used(run.config)
    logged = any(k.startswith("rollout_corr/") for r in run.records for k in r)
    if used:
        return "Rollout corrections: " + ", ".join(used) + ("" if logged else "; no rollout_corr/* metric logged")
    if logged:
        return "Rollout corrections: rollout_corr/* metrics logged (config.yaml does not say which correction)"
    if used is None:
        return "Rollout corrections: not used (no rollout_corr/* metric logged; config.yaml has no algo section)"
    return "Rollout corrections: not used (algo.rollout_is and algo.rollout_rs none, algo.opsm false)"


def probe_setup_rows(probe: dict) -> list[list[str]]:
    """The probe's setup: model, both sides' engine and dtype (probe files before the learner dtype was
    recorded: float32 on CPU, bfloat16 on CUDA), world size."""
    learner = probe.get("learner_dtype") or "not recorded (float32 on CPU, bfloat16 on CUDA)"
    rows = [("model", probe.get("model")),
            ("rollout side", f"{probe['engine']} engine, " + rollout_precision(
                probe["dtype"], probe.get("quantization"), probe.get("fp8_scale"), probe["engine"])
             if "engine" in probe else None),
            ("learner side", f"Megatron-core, {learner}"), ("processes", probe.get("world_size"))]
    dial = probe_dial(probe)
    if dial is not None:
        rows.append(("routing-drift dial", f"ON, {dial.settings}: injected drift (realised "
                                           f"{fmt_number(dial.injected)} of the (token, MoE layer) routes)"))
    return [[k, str(v)] for k, v in rows if v is not None]


def probe_tables(probe: dict, heading: str = "Probe") -> list[Table]:
    info = probe_setup_rows(probe)
    nums = probe_headline(probe)
    rows = [[PROBE_LABELS[k], fmt_number(v, integer=k.startswith("num_"))] for k, v in nums.items()]
    tables = [Table(f"{heading}: setup", ["field", "value"], info)] if info else []
    tables.append(Table(f"{heading}: headline numbers", ["quantity", "value"], rows))
    dial = probe_dial(probe)
    if dial is not None:  # the routing-drift dial was on: its injected drift apart (analysis.dial_report)
        tables.append(Table(f"{heading}: {DRIFT_TABLE_TITLE[0].lower()}{DRIFT_TABLE_TITLE[1:]}", ["quantity", "value"],
                            drift_rows(dial, fmt_number, probe_value(probe, "routing/any_layer_flip"))))
    return tables


def _config_summary(run: RunData, dial: DialDrift | None = None) -> list[str]:
    lines = [f"Run directory: {run.source}"]
    cfg = run.config or {}
    algo = cfg.get("algo") if isinstance(cfg.get("algo"), dict) else {}
    bits = [f"{k}={algo[k]}" for k in ("name", "routing_replay") if k in algo]
    if bits:
        lines.append("Algorithm: " + ", ".join(bits))
    sides = _sides(cfg, run.run_info)
    if sides:
        lines.append(sides)
    if dial is not None:  # injected drift must not read as the engine's or the precision's (issue 60)
        lines.append(header_line(dial))
    lines.append(rollout_corr_line(run))
    info = run.run_info or {}
    if info.get("device") is not None or info.get("world_size") is not None:
        lines.append(f"Learner device: {info.get('device', '?')}, {info.get('world_size', '?')} process(es) "
                     "(run.json, the last (re)start)")
    if run.done is not None:
        lines.append(f"Finished: last step {run.done.get('step', '?')}, "
                     f"wall time {fmt_number(float(run.done.get('wall_s', math.nan)))} s")
    else:
        lines.append("Not finished (no done.json): the run is in progress, failed, or was killed.")
    lines.append(f"Metric records: {len(run.records)}; traced steps: {len(run.traces)}")
    return lines


def _sides(cfg: dict, run_info: dict | None = None) -> str:
    """"Rollout: <engine> engine in <dtype>; learner: Megatron-core in <dtype>" from config.yaml; the
    learner dtype is the one run.json records (what the run used), else model.params_dtype (runs
    that predate run.json: 'auto' is then spelled out as its rule)."""
    rollout = cfg.get("rollout") if isinstance(cfg.get("rollout"), dict) else {}
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    recorded = (run_info or {}).get("learner_dtype")
    if not rollout and not model and not recorded:
        return ""
    if isinstance(recorded, str) and recorded:
        learner = f"{recorded} (run.json)"
    else:
        learner = str(model.get("params_dtype", "auto"))
        learner = "auto (float32 on CPU, bfloat16 on CUDA)" if learner == "auto" else learner
        learner += " (model.params_dtype)"
    engine = rollout.get("engine", "?")
    precision = rollout_precision(rollout.get("dtype", "?"), rollout.get("quantization"), rollout.get("fp8_scale"),
                                  engine)
    return f"Rollout: {engine} engine in {precision}; learner: Megatron-core in {learner}"


def samples_section(run: RunData) -> Section | SkippedSection:
    """The samples of samples.jsonl (`analysis.samples`), or why there are none; unusable lines are
    added to `run.warnings`."""
    path = run.source / "samples.jsonl"
    if not path.is_file():
        logging_cfg = (run.config or {}).get("logging")
        off = isinstance(logging_cfg, dict) and logging_cfg.get("samples_every") == 0
        return SkippedSection("samples", "Samples", "no samples.jsonl in the run directory: " + (
            "saving samples was off (logging.samples_every: 0)" if off else "no samples were saved"))
    try:
        picked = pick_samples(read_samples(path, run.warnings))
    except OSError as e:
        return SkippedSection("samples", "Samples", f"could not read samples.jsonl: {e}")
    if not picked:
        return SkippedSection("samples", "Samples", "samples.jsonl holds no valid samples")
    enc = prompt_encoding_line(run)
    return Section("samples", "Samples", f"<p>{html.escape(enc)}</p>\n" + samples_html(picked, PER_STEP),
                   md_plain(enc) + "\n\n" + samples_markdown(picked, PER_STEP))


def prompt_encoding_line(run: RunData) -> str:
    """How the run turned prompt text into token ids (task.chat_template, task.system_prompt), from run.json,
    else config.yaml."""
    enc = (run.run_info or {}).get("prompt_encoding")
    source = "run.json"
    if not isinstance(enc, dict):
        task = (run.config or {}).get("task")
        enc, source = (task, "config.yaml") if isinstance(task, dict) else ({}, "")
    if "chat_template" not in enc:
        return "Prompt encoding: not recorded (task.chat_template is in neither run.json nor config.yaml)."
    system = enc.get("system_prompt")
    return (f"Prompt encoding: task.chat_template={enc['chat_template']}, task.system_prompt="
            + ("none" if system is None else repr(system)) + f" ({source}).")


def dial_table(run: RunData, dial: DialDrift) -> Table:
    """The drift table of a dialled run: the dial's settings, its injected drift, the total and the rest."""
    return Table(DRIFT_TABLE_TITLE, ["quantity", "value"],
                 drift_rows(dial, fmt_number, finite_mean(series(run.records, "routing/any_layer_flip")[1])))


def build_run_page(run: RunData, probe: dict | None = None) -> Page:
    dial = run_dial(run.config, run.records)  # None without the routing-drift dial: the page reads as before
    page = Page(title=f"Expert-drift report: {run.name}", intro=_config_summary(run, dial),
                summary=with_dial_summary(run_verdicts(run), dial))
    page.tables.append(headline_table(run, dial))
    if dial is not None:
        page.tables.append(dial_table(run, dial))
    for extra in (rollout_corr_table(run), r3_table(run)):
        if extra is not None:
            page.tables.append(extra)
    page.figures = render_figures(RUN_REPORT_FIGURES, run)
    samples = samples_section(run)
    if isinstance(samples, Section):
        page.sections.append(samples)
    else:
        page.figures.append(samples)
    if probe is not None:
        page.tables += probe_tables(probe)
        page.figures += render_figures(PROBE_FIGURES, probe)
    page.notes = list(run.warnings)
    if run.config:
        page.details.append(("config.yaml", yaml.safe_dump(run.config, sort_keys=False)))
    return page


def build_probe_page(probe: dict, source: Path) -> Page:
    setup = "; ".join(f"{k}: {v}" for k, v in probe_setup_rows(probe) if k != "model")
    page = Page(title=f"Routing-drift probe: {source.name}", intro=[f"Probe file: {source}", setup])
    page.tables = probe_tables(probe)
    page.figures = render_figures(PROBE_FIGURES, probe)
    return page


def build_report(source: str | Path, out_dir: str | Path | None = None,
                 probe_path: str | Path | None = None) -> ReportPaths:
    """Build the report of a run directory (optionally with a probe JSON) or of a probe JSON alone.
    Raises `ReportInputError` for unusable inputs and for an output directory that cannot be written (checked
    before any compute; a write that fails all the same, e.g. a full disk: `analysis.outputs`)."""
    source = Path(source)
    is_probe = source.suffix == ".json" and not source.is_dir()
    if is_probe and probe_path is not None:
        raise ReportInputError("--probe is for a run directory; the source is already a probe file")
    flag = "--out" if out_dir is not None else "--out (default: " + ("beside the probe file)" if is_probe else
                                                                     "RUN_DIR/report/)")
    if out_dir is None:
        out_dir = source.parent / f"{source.stem}_report" if is_probe else source / "report"
    if is_probe or source.is_dir():  # a missing run directory is load_run's one line
        check_outputs(dirs={flag: out_dir})  # before any compute
    try:
        if is_probe:
            page = build_probe_page(load_probe(source), source)
        else:
            run = load_run(source)
            probe = load_probe(probe_path) if probe_path is not None else None
            page = build_run_page(run, probe)
    except OSError as e:  # a file of the run that cannot be read
        raise ReportInputError(read_error_message(e, "an input file")) from None
    return write_page(page, Path(out_dir), flag=flag)


def main(argv: list[str] | None = None) -> int:
    from moe_gspo.run.cli import OnceArgumentParser

    parser = OnceArgumentParser(prog="python -m analysis.report", description=__doc__.split("\n\nExit codes")[0],
                                raise_errors=True)
    parser.add_argument("source", help="training run directory, or a probe JSON file")
    parser.add_argument("--out", default=None, help="output directory (default RUN_DIR/report/)")
    parser.add_argument("--probe", default=None, help="probe JSON to add to a run report")
    try:
        args = parser.parse_args(argv)
    except ValueError as e:  # argparse's own errors: one line, as every entry point
        print(f"error: {e}", file=sys.stderr)
        return 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RunDataWarning)
        try:
            paths = build_report(args.source, args.out, args.probe)
        except ReportInputError as e:
            paths, error = None, e
    for w in caught:
        if issubclass(w.category, RunDataWarning):
            print(f"warning: {w.message}", file=sys.stderr)
    if paths is None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for s in paths.skipped:
        kind = "section" if isinstance(s, SkippedSection) else "figure"
        print(f"skipped {kind} {s.name}: {s.reason}", file=sys.stderr)
    for p in paths.figures:
        print(p)
    print(paths.markdown)
    print(paths.html)
    return 0


if __name__ == "__main__":
    sys.exit(main())
