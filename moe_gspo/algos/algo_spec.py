"""`AlgoSpec`: everything the toolkit knows about one policy-optimisation algorithm, in one place.

A spec owns the algorithm's name, its ratio level (sequence / token), its terms function (the maths,
in the algorithm's own module), its default clip range and aggregation, what its clip range means, the
inputs it accepts (per-token advantages), its own options (`AlgoOption`s, e.g. SAPO's temperatures), a
warning for an implausible clip range, and its one-line doc. `policy_loss`, the config checks and `--help`
ask the spec; nothing compares algorithm names. Specs are registered in `moe_gspo.algos.registry`.

An option is declared once, in the spec: its name, type, default, bounds and one-line doc. The config
carries the values generically (`algo.options.<name>`, checked against the chosen spec at config time),
`policy_loss(..., options={name: value})` checks them again, fills in the defaults and passes every option
to the terms function as a keyword. A loss with an option of its own is therefore one file (a built-in's
module, or a plug-in `file.py:Spec`), with no change to the config or to `policy_loss`.
"""

from __future__ import annotations

import keyword
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from moe_gspo.algos.aggregation import LOSS_AGG_MODES, SEQUENCE_LEVEL_MODE, resolve_loss_agg_mode
from moe_gspo.algos.loss_common import PolicyTerms

CLIP_MEANINGS: dict[str, str] = {
    "ratio": "ratio range [1 - clip_low, 1 + clip_high], clip_low in (0, 1)",
    "log": "a log-space bound: ratio range [e^-clip_low, e^clip_high]",
    "weight": "the detached weight's range [1 - clip_low, 1 + clip_high]; clip_low >= 1 = no floor",
    "none": "no clip range: clip_low / clip_high stay unset",
}
"""What `clip_low` / `clip_high` mean, per `AlgoSpec.clip`."""
RESERVED_OPTION_NAMES = ("clip_low", "clip_high")
"""Keywords the terms function gets from `policy_loss` itself: no option may take these names."""
def _fmt(value: float | int | bool) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}"


_BOUNDS = (("gt", ">", float.__gt__), ("ge", ">=", float.__ge__), ("lt", "<", float.__lt__), ("le", "<=", float.__le__))


@dataclass(kw_only=True, frozen=True)
class AlgoOption:
    """One option of a loss (`AlgoSpec.options`): `algo.options.<name>` in the config, a key of
    `policy_loss(..., options=...)`, and a keyword argument of the spec's terms function."""

    name: str
    """A Python identifier (the terms function's keyword), not `clip_low` / `clip_high`."""
    default: float | int | bool
    """The value when the config (or the caller of `policy_loss`) does not set it; within the bounds."""
    doc: str
    """One line for `--help` and the docs: what the option does."""
    type: type = float
    """float, int or bool. A float option takes integers too (YAML `1` is 1.0); int and bool options take
    exactly their type."""
    gt: float | None = None
    """Values must be > gt (None = no such bound); likewise `ge` (>=), `lt` (<) and `le` (<=)."""
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def __post_init__(self) -> None:
        where = f"AlgoOption(name={self.name!r})"
        if not (isinstance(self.name, str) and self.name.isidentifier() and not keyword.iskeyword(self.name)
                and self.name not in RESERVED_OPTION_NAMES):
            raise ValueError(f"{where}: name must be a Python identifier other than {', '.join(RESERVED_OPTION_NAMES)}")
        if not isinstance(self.doc, str) or not self.doc.strip() or "\n" in self.doc.strip():
            raise ValueError(f"{where}: doc must be one non-empty line")
        if self.type not in (float, int, bool):
            raise ValueError(f"{where}: type must be float, int or bool, got {self.type!r}")
        bounds = {k: getattr(self, k) for k, _, _ in _BOUNDS if getattr(self, k) is not None}
        if self.type is bool and bounds:
            raise ValueError(f"{where}: a bool option has no bounds, got {bounds}")
        for k, v in bounds.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}: {k} must be a finite number, got {v!r}")
        try:
            object.__setattr__(self, "default", self.check(self.default))
        except ValueError as e:
            raise ValueError(f"{where}: the default does not pass its own check: {e}") from None

    def bounds_text(self) -> str:
        """The bounds as text, e.g. "> 0", "> 0 and <= 1"; "" without bounds."""
        parts = [f"{op} {_fmt(getattr(self, k))}" for k, op, _ in _BOUNDS if getattr(self, k) is not None]
        return " and ".join(parts)

    def check(self, value: Any, key: str | None = None) -> float | int | bool:
        """`value` as this option's type (an integer for a float option becomes a float; a string such as
        YAML 1.1's "1e-4" is read as a number), or one ValueError naming `key` (default: the option's name),
        its type or bounds, and the option's doc."""
        key = key or self.name
        what = f"({self.doc})"
        if self.type is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{key}={value!r} must be true or false {what}")
            return value
        if self.type is float and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.type is float else int):
            raise ValueError(f"{key}={value!r} must be {'a number' if self.type is float else 'an integer'} {what}")
        if self.type is float:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{key}={value!r} must be a finite number {what}")
        if not all(test(float(value), float(getattr(self, k))) for k, _, test in _BOUNDS if getattr(self, k) is not None):
            raise ValueError(f"{key}={value!r} must be {self.bounds_text()} {what}")
        return value

    def help_text(self) -> str:
        """`doc (type, bounds; default D)` for `--help`."""
        bounds = self.bounds_text()
        return f"{self.doc} ({self.type.__name__}{', ' + bounds if bounds else ''}; default {_fmt(self.default)})"


def _no_advice(clip_low: float, clip_high: float) -> str | None:
    return None


@dataclass(kw_only=True, frozen=True, eq=False)
class AlgoSpec:
    """How the toolkit treats one algorithm (`algo.name`); see the module docstring. Compared and hashed
    by identity: the registry holds one object per name."""

    name: str
    """The algorithm's `algo.name` and registry key: letters, digits and `_`, starting with a letter."""
    doc: str
    """One line for `--help` and the docs: what the method does, and its paper."""
    terms: Callable[..., PolicyTerms]
    """`terms(inp, *, clip_low, clip_high, **options) -> PolicyTerms` on the sanitised inputs
    (`moe_gspo.algos.loss_common.LossInputs`; take `**_` for keywords you ignore): the objective to
    maximise, per sequence (`objective_B`) or per token (`objective_BT`, 0 at masked positions), and its
    metrics (detached 0-dim tensors, namespaced keys). Pure maths: tensors in, tensors out."""
    level: Literal["sequence", "token"]
    """The ratio level. sequence: a sequence ratio (its token mean inside the ratio), so only the
    seq-mean-token-mean aggregation; token: per-token terms aggregated by `loss_agg_mode`."""
    clip: Literal["ratio", "log", "weight", "none"]
    """What clip_low / clip_high mean (`CLIP_MEANINGS`)."""
    default_clip: tuple[float, float] | None = None
    """(clip_low, clip_high) when the config leaves them null; None exactly when clip is "none"."""
    default_agg: str = SEQUENCE_LEVEL_MODE
    """The aggregation when `loss_agg_mode` is null (the paper's); sequence-level: seq-mean-token-mean."""
    per_token_advantages: bool = True
    """Accepts per-token advantages [B, T]; False = one advantage per sequence [B] only."""
    options: tuple[AlgoOption, ...] = ()
    """This algorithm's own options (`AlgoOption`: name, type, default, bounds, doc): set in the config as
    `algo.options.<name>` (setting one the chosen algorithm does not declare is a config error), passed to
    `policy_loss` as `options={name: value}`, and to `terms` as keywords, every option with a value (the
    default where none was given). sapo: tau_pos 1.0, tau_neg 1.05."""
    clip_advice: Callable[[float, float], str | None] = _no_advice
    """`clip_advice(clip_low, clip_high)`: a warning (config time) for a clip range that is implausible
    for this method, e.g. a token-level range given to a sequence ratio; None = fine."""

    def __post_init__(self) -> None:
        where = f"AlgoSpec(name={self.name!r})"
        if not (isinstance(self.name, str) and self.name[:1].isalpha() and self.name.isascii()
                and self.name.replace("_", "a").isalnum()):
            raise ValueError(f"{where}: name must be letters, digits and _, starting with a letter")
        if not isinstance(self.doc, str) or not self.doc.strip() or "\n" in self.doc.strip():
            raise ValueError(f"{where}: doc must be one non-empty line")
        if not callable(self.terms):
            raise ValueError(f"{where}: terms must be a function (inp, *, clip_low, clip_high, **options) -> "
                             f"PolicyTerms, got {type(self.terms).__name__}")
        if self.level not in ("sequence", "token"):
            raise ValueError(f"{where}: level must be 'sequence' or 'token', got {self.level!r}")
        if self.clip not in CLIP_MEANINGS:
            raise ValueError(f"{where}: clip must be one of {list(CLIP_MEANINGS)}, got {self.clip!r}")
        if (self.clip == "none") != (self.default_clip is None):
            raise ValueError(f"{where}: default_clip must be None exactly when clip='none' (got clip={self.clip!r}, "
                             f"default_clip={self.default_clip!r})")
        if self.default_clip is not None and (len(self.default_clip) != 2 or self.clip_low_problem(self.default_clip[0])
                                              or not self.default_clip[1] > 0):
            raise ValueError(f"{where}: default_clip={self.default_clip!r} is not a valid (clip_low, clip_high) for "
                             f"clip={self.clip!r} ({CLIP_MEANINGS[self.clip]}; clip_high > 0)")
        if self.default_agg not in LOSS_AGG_MODES:
            raise ValueError(f"{where}: default_agg must be one of {LOSS_AGG_MODES}, got {self.default_agg!r}")
        if self.sequence_level and self.default_agg != SEQUENCE_LEVEL_MODE:
            raise ValueError(f"{where}: a sequence-level method aggregates with {SEQUENCE_LEVEL_MODE!r} only")
        if isinstance(self.options, (Mapping, str)) or not all(isinstance(o, AlgoOption) for o in self.options):
            raise ValueError(f"{where}: options must be a tuple of AlgoOption(name=..., default=..., doc=...) "
                             f"(moe_gspo.algos.algo_spec), got {self.options!r}")
        names = [o.name for o in self.options]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: option names must differ, got {names}")
        object.__setattr__(self, "options", tuple(self.options))

    @property
    def sequence_level(self) -> bool:
        """One term per sequence: only the seq-mean-token-mean aggregation."""
        return self.level == "sequence"

    def clip_low_problem(self, clip_low: float) -> str | None:
        """What is wrong with `clip_low` (config time: strict bounds) for this method's clip, or None."""
        if self.clip == "ratio" and not 0 < clip_low < 1:
            return "must be in (0, 1)"
        if self.clip in ("log", "weight") and not clip_low > 0:
            return f"must be > 0 ({CLIP_MEANINGS[self.clip]})"
        return None

    def resolve_mode(self, loss_agg_mode: str | None = None, aggregation: str | None = None) -> str:
        """The aggregation this method uses: `loss_agg_mode`, else the alias `aggregation`, else
        `default_agg`; ValueError for unknown names and for a sequence-level method given another mode."""
        mode = resolve_loss_agg_mode(loss_agg_mode, aggregation, self.default_agg)
        if self.sequence_level and mode != SEQUENCE_LEVEL_MODE:
            given = f"loss_agg_mode={mode!r}" + (f" (aggregation={aggregation!r})" if aggregation else "")
            raise ValueError(f"{given} does not apply to {self.name}: it is a sequence-level method (one term per "
                             f"sequence, its token mean inside the sequence ratio); use {SEQUENCE_LEVEL_MODE!r} or "
                             "leave it unset")
        return mode

    def option(self, name: str) -> AlgoOption | None:
        """The option called `name`, or None."""
        return next((o for o in self.options if o.name == name), None)

    def check_options(self, given: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        """`given` checked against this spec's options (each value as its option's type); ValueError naming
        `prefix + name` for a name the spec does not declare, or a value of the wrong type or out of bounds."""
        if not isinstance(given, Mapping):
            raise ValueError(f"{prefix.rstrip('.') or 'options'} must be a mapping of option names to values, got "
                             f"{given!r}")
        out = {}
        for name, value in given.items():
            opt = self.option(name) if isinstance(name, str) else None
            if opt is None:
                have = ", ".join(o.name for o in self.options)
                raise ValueError(f"{prefix}{name} is not an option of {self.name} "
                                 f"({f'its options: {have}' if have else 'it has no options'})")
            out[name] = opt.check(value, f"{prefix}{name}")
        return out

    def resolve_options(self, given: Mapping[str, Any] | None = None, prefix: str = "") -> dict[str, Any]:
        """Every option's value: `given` (checked, `check_options`), else its default."""
        checked = self.check_options(given or {}, prefix)
        return {o.name: checked.get(o.name, o.default) for o in self.options}

    def help_line(self) -> str:
        """`name: doc (level, default clip, default aggregation, options)` for `--help`."""
        clip = "no clip" if self.default_clip is None else f"clip {self.default_clip[0]:g}/{self.default_clip[1]:g} ({self.clip})"
        opts = "; options " + ", ".join(f"{o.name} {_fmt(o.default)}" for o in self.options) if self.options else ""
        return f"{self.name}: {self.doc} [{self.level} level; {clip}; {self.default_agg}{opts}]"
