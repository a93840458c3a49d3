"""Reading a run configuration: YAML files (duplicate keys rejected), dotted CLI overrides, type checks
of every field against its annotation in `moe_gspo.config`, then the checks of `moe_gspo.config_checks`.

`moe_gspo.config` holds the section dataclasses only; this module imports both it and the checks (so that
neither imports the other's caller: no import circle).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from moe_gspo.config import SECTIONS, Config
from moe_gspo.config_checks import validate
from moe_gspo.yaml_limits import load_capped

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
"""The checkout's shipped configs (`configs/` beside the package; the README installs it editable)."""


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


def field_docs(cls) -> dict[str, str]:
    """Per-field docstrings (the string literal after each field), read from the source."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    docs: dict[str, str] = {}
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` against the annotation `tp`; returns the (lightly coerced) value or raises."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ValueError(f"{where}={value!r} is not one of {list(choices)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}={value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}={value!r} must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}={value!r} must be a number")
        if not math.isfinite(value):
            raise ValueError(f"{where}={value!r} must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}={value!r} must be a string")
        return value
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {value!r}")
        return value
    raise AssertionError(f"unsupported annotation {tp} for {where}")


def _build_section(name: str, cls: type, data: dict) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"config section '{name}' must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    renamed = getattr(cls, "RENAMED", {})  # keys of older configs (e.g. AlgoConfig.RENAMED)
    kwargs = {}
    for key, value in data.items():
        if key in renamed and key not in known:
            if value is None:  # an older run's config.yaml writes every key, unset ones as null
                continue
            new, v = renamed[key], _yaml_scalar(value)
            head, _, entry = new.partition(".")
            in_yaml = f" (in YAML: {head}: {{{entry}: {v}}} under {name})" if entry else ""
            raise ValueError(f"{name}.{key} is now {name}.{new}; write {name}.{new}={v}{in_yaml}")
        if key not in known:
            raise ValueError(f"unknown config key '{name}.{key}'; known keys of '{name}': {', '.join(known)}")
        kwargs[key] = _coerce(value, hints[key], f"{name}.{key}")
    return cls(**kwargs)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps
    the last one silently, so a second `train:` section would drop the first)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: let PyYAML report it
                continue
            if first != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {first}); merge the two into one",
                    key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml_file(path: str | Path, *, what: str) -> Any:
    """Parse a YAML file with duplicate keys rejected; errors are one ValueError naming the file,
    the line and the problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise ValueError(f"{what} {str(p)!r} line {line}: not valid UTF-8 (byte 0x{e.object[e.start]:02x}); "
                         "save it as UTF-8") from None
    try:
        return load_capped(text, _UniqueKeyLoader, what=f"{what} {str(p)!r}")  # an alias bomb: one line
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ValueError(f"{what} {str(p)!r}{where}: {problem}") from None


def _yaml_scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value` -> (section, key, value parsed as YAML); `section.key.name=value` sets one entry of
    a mapping field (`algo.options`, `model.tiny`) -> (section, "key.name", value)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like section.key=value (e.g. train.lr=1e-3)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) not in (2, 3) or parts[0] not in SECTIONS or not all(parts):
        raise ValueError(
            f"override key {key!r} must be section.key with section in {list(SECTIONS)} (e.g. train.lr=1e-3)"
        )
    if len(parts) == 3 and typing.get_type_hints(_section_classes()[parts[0]]).get(parts[1]) is not dict:
        raise ValueError(f"override key {key!r}: {parts[0]}.{parts[1]} is not a mapping field, so it takes no "
                         f".{parts[2]}; give {parts[0]}.{parts[1]}=value")
    try:
        value = load_capped(raw, what=f"override {text[:80]!r}") if raw.strip() else None
    except yaml.YAMLError as e:
        raise ValueError(f"override {text!r}: value is not valid YAML ({e})") from None
    return parts[0], ".".join(parts[1:]), value


def config_from_dict(data: dict | None, overrides: list[str] = ()) -> Config:
    """Build and validate a Config from a nested mapping plus dotted overrides."""
    data = dict(data or {})
    for sec, body in data.items():
        if sec not in SECTIONS:
            raise ValueError(f"unknown config section '{sec}'; sections: {', '.join(SECTIONS)}")
        if body is not None and not isinstance(body, dict):
            raise ValueError(f"config section '{sec}' must be a mapping of keys (e.g. '{sec}:' then indented "
                             f"'key: value' lines), got a {type(body).__name__}: {body!r}")
    merged = {sec: dict(data.get(sec) or {}) for sec in SECTIONS}
    for ov in overrides:
        sec, key, value = parse_override(ov)
        if "." in key:  # one entry of a mapping field
            key, _, entry = key.partition(".")
            current = merged[sec].get(key)
            if current is not None and not isinstance(current, dict):
                raise ValueError(f"override {ov!r}: {sec}.{key} is {current!r}, not a mapping")
            merged[sec][key] = {**(current or {}), entry: value}
        else:
            merged[sec][key] = value
    classes = _section_classes()
    cfg = Config(**{sec: _build_section(sec, classes[sec], merged[sec]) for sec in SECTIONS})
    return validate(cfg)


def shipped_configs(kind: str = "run") -> list[str]:
    """File names of the shipped configs: run configs (`kind="run"`) or ablation specs (`"ablation"`)."""
    if not CONFIG_DIR.is_dir():
        return []
    names = sorted(q.name for q in CONFIG_DIR.glob("*.yaml"))
    return [n for n in names if n.startswith("ablation_") == (kind == "ablation")]


def resolve_config_path(path: str | Path, *, kind: str = "run", flag: str = "--config") -> Path:
    """`path` if it is a file; else the shipped config it names, from any directory: `NAME`,
    `NAME.yaml` or `configs/NAME.yaml` (the shipped configs live in `configs/` of the checkout,
    `CONFIG_DIR`; an editable install, as the README's, finds them from anywhere, a non-editable one has
    none and needs a file path). Raises one ValueError listing the shipped configs of `kind` ("run" or
    "ablation") otherwise."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_absolute() and CONFIG_DIR.is_dir():
        rest = Path(*p.parts[1:]) if p.parts[:1] == ("configs",) and len(p.parts) > 1 else p
        for cand in (CONFIG_DIR / rest, CONFIG_DIR / f"{rest}.yaml"):
            if cand.is_file() and cand.resolve().parent == CONFIG_DIR.resolve():
                return cand
    shipped = shipped_configs(kind)
    where = f" (nor in the shipped {CONFIG_DIR})" if shipped and not p.is_absolute() else ""
    fix = (f"pass {flag} FILE with an existing file, or the name of a shipped one: {', '.join(shipped)}"
           if shipped else f"pass {flag} FILE with an existing file")
    what = "config file" if kind == "run" else "ablation spec"
    raise ValueError(f"{what} {str(p)!r} does not exist{where}; {fix}")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML config file (or the defaults when path is None) and apply overrides; a relative
    `configs/NAME` path falls back to the shipped config of that name (`resolve_config_path`)."""
    data: dict = {}
    if path is not None:
        p = resolve_config_path(path)
        data = load_yaml_file(p, what="config file") or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(p)!r} must hold a mapping of sections, got {type(data).__name__}")
    return config_from_dict(data, overrides)
