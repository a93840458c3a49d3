"""`AlgoSpec`: everything the toolkit knows about one policy-optimisation algorithm, in one place.

A spec owns the algorithm's name, its ratio level (sequence / token), its terms function (the maths,
in the algorithm's own module), its default clip range and aggregation, what its clip range means, the
inputs it accepts (per-token advantages, its own options such as SAPO's temperatures), a warning for
an implausible clip range, and its one-line doc. `policy_loss`, the config checks and `--help` ask the
spec; nothing compares algorithm names. Specs are registered in `moe_gspo.algos.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Literal, Mapping

from moe_gspo.algos.aggregation import LOSS_AGG_MODES, SEQUENCE_LEVEL_MODE, resolve_loss_agg_mode
from moe_gspo.algos.loss_common import PolicyTerms

CLIP_MEANINGS: dict[str, str] = {
    "ratio": "ratio range [1 - clip_low, 1 + clip_high], clip_low in (0, 1)",
    "log": "a log-space bound: ratio range [e^-clip_low, e^clip_high]",
    "weight": "the detached weight's range [1 - clip_low, 1 + clip_high]; clip_low >= 1 = no floor",
    "none": "no clip range: clip_low / clip_high stay unset",
}
"""What `clip_low` / `clip_high` mean, per `AlgoSpec.clip`."""
OPTION_NAMES = ("sapo_tau_pos", "sapo_tau_neg")
"""The option keywords of `policy_loss` (each also an `algo.<name>` config field) that a spec may claim in
`AlgoSpec.options`. A plug-in's other hyper-parameters are constants of its own file."""


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
    options: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """This algorithm's own options (names from `OPTION_NAMES`: `algo.<name>` config fields and `policy_loss`
    keywords, passed on to `terms`) with their defaults, each > 0 (sapo: sapo_tau_pos 1.0, sapo_tau_neg 1.05);
    setting one for another algorithm is a config error."""
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
        bad = {k: v for k, v in self.options.items()
               if not (k in OPTION_NAMES and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)}
        if bad:
            raise ValueError(f"{where}: options must map names of {OPTION_NAMES} to defaults > 0, got {bad}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

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

    def help_line(self) -> str:
        """`name: doc (level, default clip, default aggregation)` for `--help`."""
        clip = "no clip" if self.default_clip is None else f"clip {self.default_clip[0]:g}/{self.default_clip[1]:g} ({self.clip})"
        opts = "".join(f", {k} {v:g}" for k, v in self.options.items())
        return f"{self.name}: {self.doc} [{self.level} level; {clip}; {self.default_agg}{opts}]"
