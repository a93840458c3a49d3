"""The README stays a one-page quickstart and the docs hold together: links resolve, the modules the
README runs exist, the config fields it names exist, CI can read its install and test commands."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from moe_gspo.config import Config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 260

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, spaces and
    hyphens kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(page: Path) -> list[str]:
    return [a or b for a, b in _LINK.findall(_prose(page.read_text()))]


def test_readme_is_one_page():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; keep it a quickstart (≤ {MAX_README_LINES}), move the rest to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading '#{anchor}' in {dest.relative_to(ROOT)})")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README) if t.partition("#")[0]}
    unlinked = [p.relative_to(ROOT) for p in PAGES[1:] if p.resolve() not in linked]
    assert unlinked == []


EXTERNAL_TOOLS = {"pip", "venv", "pytest"}
"""`python -m` tools of Python and its packaging, not this project's modules."""


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_modules_exist(page):
    """Every `python -m X` (and `torchrun ... -m X`, `moe_gspo.launch ... -m X`) names an importable module."""
    text = page.read_text()
    modules = set(re.findall(r"python3? -m ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text))
    modules |= set(re.findall(r"(?:torchrun|moe_gspo\.launch) [^`\n]*?-m ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text))
    # tools a page runs (`python3 -m pip ...`) are not looked up: find_spec("pip") makes setuptools' distutils shim
    # stand down for the rest of the process (it assumes pip is running), and a later `import setuptools` (torch's
    # cpp_extension, under megatron) then fails on the stdlib distutils
    missing = sorted(m for m in modules - EXTERNAL_TOOLS if importlib.util.find_spec(m) is None)
    assert missing == [], f"{page.relative_to(ROOT)} names modules that do not exist: {missing}"
    if page == README:
        assert {"moe_gspo.launch", "moe_gspo.train", "analysis.report", "analysis.compare"} <= modules


def _config_fields() -> dict[str, set[str]]:
    cfg = Config()
    return {f.name: {g.name for g in dataclasses.fields(getattr(cfg, f.name))} for f in dataclasses.fields(Config)}


def test_readme_config_fields_exist():
    """Every `section.key` the README names in code is a field of the config."""
    fields = _config_fields()
    readme = README.read_text()
    code = re.findall(r"`([^`\n]+)`", _prose(readme)) + re.findall(r"^```[^\n]*\n(.*?)^```", readme, flags=re.S | re.M)
    text = "\n".join(code)
    named = set(re.findall(r"(?<![\w./-])(" + "|".join(fields) + r")\.([a-z_][a-z_0-9]*)\b(?![./\w])", text))
    files = {"jsonl", "json", "yaml", "md", "py", "log", "html"}  # eval.jsonl, train.log: file names
    unknown = sorted(f"{s}.{k}" for s, k in named if k not in fields[s] and k not in files)
    assert named and unknown == []


@pytest.mark.parametrize("marker", ["install", "test"])
def test_ci_reads_the_readme_commands(marker):
    """`.ci/run` runs the first line after `<!-- install -->` / `<!-- test -->` that does not start
    with a backtick: the command inside the code block right after the marker."""
    lines = README.read_text().splitlines()
    i = lines.index(f"<!-- {marker} -->")
    assert lines[i + 1].startswith("```") and lines[i + 3].startswith("```")
    assert lines[i + 2].strip() and not lines[i + 2].startswith("`")


# --------------------------------------------------------------------------- the pages that describe the code

CODE_PAGES = [ROOT / "docs" / "architecture.md", ROOT / "docs" / "metrics.md"]
"""Pages whose backticked file, function and config-key names must exist (issue 52)."""
SOURCE_DIRS = ("moe_gspo", "analysis", "benchmarks", "tests")
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".jsonl", ".npz", ".log")
UPSTREAM_FILES = {"router_replay.py": ("megatron", "core/transformer/moe/router_replay.py")}
"""Files of a dependency the pages name: (its top-level package, the path inside it)."""
EXAMPLE_FILES = {"my_loss.py"}
"""Files that are the reader's own in an example (architecture.md, "Adding a loss")."""
OUTPUT_FILES = {"train.log"}
"""Files a command writes besides a run's own (`moe_gspo.run.rundir.RUN_OUTPUTS`): an ablation arm's log."""
OTHER_NAMES = {
    # words and values, not code
    "null", "_mean", "_max",
    # other projects' names the pages compare with (verl, TRL, slime, NeMo-RL)
    "pg_clipfrac", "opsm_clipfrac", "num_gen_batches", "frac_reward_zero_std", "isclose",
}


def _code_spans(page: Path) -> list[str]:
    """The inline code spans (`...`) of `page`, outside fenced blocks; a span may run over a line break inside
    a paragraph (its whitespace collapsed to one space), never past one."""
    paragraphs = re.split(r"\n\s*\n", _prose(page.read_text(encoding="utf-8")))
    return [" ".join(m.split()) for para in paragraphs for m in re.findall(r"`([^`]+)`", para)]


def _source_files() -> list[Path]:
    return [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]


@functools.lru_cache(maxsize=1)
def _repo_file_names() -> frozenset[str]:
    """The names of the files under the code, config and docs directories (a bare `name.py` is looked up here)."""
    return frozenset(p.name for d in (*SOURCE_DIRS, "configs", "docs") for p in (ROOT / d).rglob("*") if p.is_file())


@functools.lru_cache(maxsize=1)
def _name_index() -> tuple[set[str], dict[str, set[str]]]:
    """(names, members): every name the source defines (functions, classes, assignment targets, attributes
    set on objects, dataclass fields) or uses as an identifier-like string (dict keys, file keys, Literal
    values); and each class's members (methods, fields, class attributes), by class name."""
    import ast

    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for path in _source_files():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
            if isinstance(node, ast.ClassDef):
                own = members.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        own.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        own.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        own.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return names, members


def _config_key_problem(section: str, key: str, entry: str | None) -> str | None:
    """Why `section.key` (`.entry` of a mapping field) is not a config key, or None."""
    import typing

    from moe_gspo.config import SECTIONS

    cls = typing.get_type_hints(Config)[section]
    known = {f.name for f in dataclasses.fields(cls)}
    if key in getattr(cls, "RENAMED", {}):  # an older config's key, refused naming its new one
        return None
    if key not in known:
        return "no such config field"
    if entry is not None and typing.get_type_hints(cls)[key] is not dict:
        return f"{section}.{key} is not a mapping field"
    assert section in SECTIONS
    return None


def _file_problem(span: str) -> str | None:
    """Why the file (or directory, ending with /) `span` names does not exist, or None."""
    import glob

    from moe_gspo.run.rundir import RUN_OUTPUTS

    first = span.split("/", 1)[0]
    if first in ("RUN_DIR", "runs") or first.rstrip("/") in RUN_OUTPUTS or "XXXXXX" in span:
        return None  # a run's output, not a file of the repository
    if span in EXAMPLE_FILES or span in OUTPUT_FILES:
        return None
    if span in UPSTREAM_FILES:
        package, inner = UPSTREAM_FILES[span]
        spec = importlib.util.find_spec(package)  # locates the package without importing it
        places = [] if spec is None else list(spec.submodule_search_locations or [Path(spec.origin).parent])
        return None if any((Path(d) / inner).is_file() for d in places) else f"not in the installed {package}"
    if "<" in span:  # a placeholder (`moe_gspo/algos/<name>.py`): its directory exists
        span = span.split("<", 1)[0].rpartition("/")[0] + "/"
    alternatives = re.sub(r"\{([^}]*)\}", lambda m: "@" + m.group(1).replace(",", "@") + "@", span)
    patterns = ([alternatives.replace(m.group(0), opt) for opt in m.group(1).split("@") if opt]
                if (m := re.search(r"@(.*?)@", alternatives)) else [span])
    roots = [ROOT, ROOT / "moe_gspo"]
    for pattern in patterns:
        if "/" not in pattern:  # a bare file name: anywhere in the repository's code
            if pattern in _repo_file_names():
                continue
            return "no such file in the repository"
        if not any(glob.glob(str(r / pattern)) for r in roots):
            return "no such file or directory"
    return None


def _python_name_problem(name: str, names: set[str], members: dict[str, set[str]]) -> str | None:
    """Why the Python name `name` (`f`, `Class.member`, `package.module.attr`) does not exist, or None."""
    import importlib

    parts = name.split(".")
    parts[0] = {"np": "numpy"}.get(parts[0], parts[0])
    if len(parts) > 1 and parts[0] not in members and importlib.util.find_spec(parts[0]) is not None:
        for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
            module = ".".join(parts[:i])
            try:
                obj = importlib.import_module(module)
            except ImportError:
                continue
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    return f"{module} has no {'.'.join(parts[i:])}"
                obj = getattr(obj, attr)
            return None
        return "not importable"
    if len(parts) == 2 and parts[0] in members:
        return None if parts[1] in members[parts[0]] else f"class {parts[0]} has no member {parts[1]}"
    if len(parts) == 1:
        import builtins

        import tomllib

        ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
        markers = [m.split(":", 1)[0] for m in ini.get("markers", [])]  # `gpu`: a pytest marker
        known = name in names or name in OTHER_NAMES or hasattr(builtins, name) or name in markers
        return None if known else "defined nowhere in the code"
    return f"no class {parts[0]} in the code"


NOT_CONFIG_KEYS = {"model.generate", "model.layers", "model.norm"}
"""`section.key` look-alikes that are attributes of a transformers model object (`model.generate(...)`)."""


def _algo_option_names() -> set[str]:
    """The options of every registered algorithm (`AlgoSpec.options`)."""
    from moe_gspo.algos.registry import algo_names, get_algo

    return {o.name for name in algo_names() for o in get_algo(name).options}


def _span_config_key_problems(span: str, page_code: str) -> list[str]:
    """Each config key in the code span `span` (anywhere in it: `algo.kl_coef > 0`, `eval.every: N`,
    `algo.options.tau_pos=1`) that is not one, with the reason. A three-part key's entry is checked too:
    `algo.options.<name>` must be an option of a registered algorithm or of the page's own example plug-in (a name
    its fenced code, `page_code`, defines)."""
    sections = "|".join(_config_fields())
    problems = []
    for m in re.finditer(r"(?<![\w./-])(" + sections + r")\.([a-z_][a-z_0-9]*)(?:\.([a-z_]\w*|<\w+>|\*))?"
                         r"(?![\w/-])(?!\.\w)", span):
        if m.group(2) in {s.lstrip(".") for s in FILE_SUFFIXES}:  # eval.jsonl, train.py, train.log: files
            continue
        if f"{m.group(1)}.{m.group(2)}" in NOT_CONFIG_KEYS:
            continue
        why = _config_key_problem(*m.groups())
        entry = m.group(3)
        if why is None and (m.group(1), m.group(2)) == ("algo", "options") and entry and entry[0] not in "<*":
            if entry not in _algo_option_names() and not re.search(rf"\b{entry}\b", page_code):
                why = f"no registered algorithm has the option {entry}"
        if why:
            problems.append(f"`{span}`: {m.group(0)}: {why}")
    return problems


def _fenced_code(page: Path) -> str:
    return "\n".join(re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.S | re.M))


def config_key_problems(page: Path) -> list[str]:
    """Each backticked config key of `page` (two- or three-part) that does not exist, with the reason."""
    code = _fenced_code(page)
    return [p for span in _code_spans(page) for p in _span_config_key_problems(span, code)]


def named_things_problems(page: Path) -> list[str]:
    """Each backticked file, function or config key of `page` that does not exist, with the reason."""
    sections = "|".join(_config_fields())
    names, members = _name_index()
    problems = []
    code = _fenced_code(page)
    for span in _code_spans(page):
        problems += _span_config_key_problems(span, code)
        if re.fullmatch(r"[\w.*{},<>/-]+", span) and (span.endswith(FILE_SUFFIXES) or span.endswith("/")):
            if (why := _file_problem(span)) is not None:
                problems.append(f"`{span}`: {why}")
            continue
        call = re.fullmatch(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(\(.*\))?", span)
        if call is None or "/" in span:
            continue
        name = call.group(1)
        if re.match(r"(" + sections + r")\.", name):
            continue  # a config key (checked above)
        if (why := _python_name_problem(name, names, members)) is not None:
            problems.append(f"`{span}`: {why}")
    return problems


@pytest.mark.parametrize("page", CODE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_function_and_config_key_a_page_names_exists(page):
    """Issue 52: docs/architecture.md and docs/metrics.md stay true as the code moves: every backticked path
    (`moe_gspo/run/steps.py`, `run/errors.py`, `tests/`), Python name (`old_policy_pass`, `Learner.plan_replay`,
    `moe_gspo.algos.mismatch.EXTREME_TAUS`) and config key (`algo.kl_coef`) exists."""
    assert named_things_problems(page) == []


def test_the_name_check_sees_a_missing_file_a_missing_function_and_a_missing_key(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`moe_gspo/run/no_such_file.py`, `run/steps.py`, `no_such_function_x1()`, `Learner.no_such`, "
                    "`algo.no_such_key`, `algo.kl_coef > 0`, `algo.options.tau_pos`, `train.lr.x`, `eval.jsonl`, "
                    "`moe_gspo.algos.mismatch.NO_SUCH`, `old_policy_pass`, `runs/<algo>-<replay>`\n")
    assert named_things_problems(page) == [
        "`moe_gspo/run/no_such_file.py`: no such file or directory",
        "`no_such_function_x1()`: defined nowhere in the code",
        "`Learner.no_such`: class Learner has no member no_such",
        "`algo.no_such_key`: algo.no_such_key: no such config field",
        "`train.lr.x`: train.lr.x: train.lr is not a mapping field",
        "`moe_gspo.algos.mismatch.NO_SUCH`: moe_gspo.algos.mismatch has no NO_SUCH",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_key_a_page_names_exists(page):
    """Issue 60: on every page (not only the two of issue 52), each backticked config key exists, three-part keys
    too (`algo.options.tau_pos`: an option of a registered algorithm)."""
    assert config_key_problems(page) == []


def test_the_key_check_sees_a_wrong_three_part_key(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("`algo.options.tau_pos`, `algo.options.tau_poz=1`, `algo.options.<name>`, `model.norm`, "
                    "`algo.options.my_own`, `rollout.no_such`\n\n```python\nOption(\"my_own\", 0.5)\n```\n")
    assert config_key_problems(page) == [
        "`algo.options.tau_poz=1`: algo.options.tau_poz: no registered algorithm has the option tau_poz",
        "`rollout.no_such`: rollout.no_such: no such config field",
    ]


EVERY_FAMILY = [  # a 2-step run that logs (nearly) every metric family: SAPO (gate/*; the clip/* of the clipped
    # methods: tests/test_train.py's runs, which hold their rows against the page too), R3, KL and entropy,
    # rollout corrections, OPSM, the router aux loss, dynamic sampling, evaluation with pass@k, the drift dial,
    # update drift, traces, samples and checkpoints every step
    "--config", str(ROOT / "configs/tiny_cpu_copy_first.yaml"), "--algo", "sapo", "--routing-replay", "r3",
    "train.steps=2", "parallel.expert_parallel_size=1", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=3", "logging.wandb_mode=disabled", "logging.progress=false", "train.export_hf=false",
    "logging.trace_every=1", "logging.samples_every=1", "train.checkpoint_every=1", "logging.update_drift_every=1",
    "algo.kl_coef=0.1", "algo.entropy_coef=0.01", "algo.rollout_is=token", "algo.rollout_rs=token",
    "algo.rollout_rs_threshold=2", "algo.opsm=true", "algo.router_aux_loss=aux_loss", "algo.router_aux_loss_coef=0.001",
    "algo.dynamic_sampling=true", "algo.max_num_gen_batches=2", "eval.every=1", "eval.greedy=false",
    "eval.samples_per_prompt=2", "eval.num_prompts=4", "rollout.router_flip_prob=0.1"]


def test_every_metric_key_a_run_writes_is_documented(tmp_path):
    """Issue 52: each key of a 2-step run's metrics.jsonl rows (`step` included) is in docs/metrics.md, "What a
    step logs", by name or as `prefix/*`."""
    import json

    from _metric_docs import undocumented_metric_keys
    from moe_gspo import train

    run_dir = tmp_path / "run"
    assert train.main([*EVERY_FAMILY, "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in rows for k in r}
    families = {k.split("/")[0] for k in keys}
    assert {"step", "gate", "mismatch_replayed", "r3", "rollout_corr", "sampling", "eval", "update", "router",
            "perf"} <= families and {"loss/kl", "loss/entropy", "loss/router_aux", "routing/dial_flip_frac",
                                     "perf/checkpoint_s", "perf/traces_s"} <= keys  # the run logged what it should
    assert undocumented_metric_keys(keys) == []


def test_the_engine_recipe_names_every_required_field():
    """docs/architecture.md, "Adding a rollout engine": following it builds an `EngineSpec` (issue 52: `title`
    was missing)."""
    from moe_gspo.rollout.engine_spec import EngineSpec

    required = [f.name for f in dataclasses.fields(EngineSpec)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    recipe = page.split("## Adding a rollout engine", 1)[1].split("\n## ", 1)[0]
    assert "title" in required and [f for f in required if f"{f}=" not in recipe] == []
