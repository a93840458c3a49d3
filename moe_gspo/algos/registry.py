"""The algorithm registry: `algo.name` -> `AlgoSpec`.

The built-in algorithms are registered below, one line each, from the modules that hold their maths
(`ppo_clip`, `gmpo`, `cispo`, `sapo`). `get_algo(name)` answers every question about an algorithm
(`policy_loss`, the config checks, `--help`); `algo_names()` lists the registered names.

A loss of your own, without touching the package: `algo.name=package.module:Spec` (importable from the
working directory or the environment) or `algo.name=path/to/file.py:Spec` (a file, loaded by path,
relative to the working directory), where `Spec` is an `AlgoSpec` (`moe_gspo.algos.algo_spec`), with options
of its own if it declares them (`AlgoOption`; set as `algo.options.<name>`). It is
loaded and registered under its own `AlgoSpec.name` the first time the name is asked for: when the config
is validated, i.e. on every rank, since every rank reads the config. Errors are one ValueError naming
`algo.name` and the fix (the same rules as `task.reward`, `moe_gspo/tasks/plugin.py`).
docs/architecture.md, "Adding a loss".
"""

from __future__ import annotations

from moe_gspo.algos.algo_spec import AlgoOption, AlgoSpec
from moe_gspo.algos.cispo import CISPO
from moe_gspo.algos.gmpo import GMPO
from moe_gspo.algos.ppo_clip import GRPO, GSPO, GSPO_TOKEN
from moe_gspo.algos.sapo import SAPO
from moe_gspo.plugins import import_plugin_module

__all__ = ["AlgoOption", "AlgoSpec", "BUILTIN_ALGOS", "algo_names", "get_algo", "register_algo"]

_SPECS: dict[str, AlgoSpec] = {}
_PLUGINS: dict[str, AlgoSpec] = {}
"""`module:Spec` / `file.py:Spec` references already loaded, and the spec each named."""
RUN_NAMESPACES = ("step", "num_sequences", "reward", "response", "advantage", "eval", "actor", "loss", "clip", "gate",
                  "sampling", "ratio", "mismatch", "mismatch_replayed", "mismatch_ratio", "routing", "routing_prompt",
                  "router", "update", "update_all_minibatches", "rollout_corr", "r3", "grad", "train", "perf")
"""The first parts of the keys a run's metrics rows hold (docs/metrics.md, "What a step logs"): a loss plug-in's
metrics are logged under its `AlgoSpec.name` (`moe_gspo.algos.plugin_terms`), so a plug-in may not take one of
these names (`tests/algos/test_registry.py` holds the tuple against the page)."""
PLUGIN_FORM = "package.module:Spec or path/to/file.py:Spec (an AlgoSpec; docs/architecture.md, \"Adding a loss\")"


def register_algo(spec: AlgoSpec) -> AlgoSpec:
    """Register `spec` under `spec.name` (again with the same object: no-op); returns it. ValueError
    when another spec holds the name."""
    if not isinstance(spec, AlgoSpec):
        raise ValueError(f"register_algo takes an AlgoSpec (moe_gspo.algos.algo_spec), got {type(spec).__name__}")
    have = _SPECS.get(spec.name)
    if have is not None and have is not spec:
        raise ValueError(f"an algorithm named {spec.name!r} is registered already (terms from "
                         f"{getattr(have.terms, '__module__', '?')}); give yours another AlgoSpec.name")
    _SPECS[spec.name] = spec
    return spec


def algo_names() -> tuple[str, ...]:
    """The registered algorithm names, built-ins first, in registration order."""
    return tuple(_SPECS)


def get_algo(name: str) -> AlgoSpec:
    """The spec of `name`: a registered name, or a plug-in reference (`module:Spec`, `file.py:Spec`),
    loaded and registered on first use; ValueError naming algo.name and the choices otherwise."""
    if isinstance(name, str):
        if name in _SPECS:
            return _SPECS[name]
        if name in _PLUGINS:
            return _PLUGINS[name]
        if ":" in name:
            return _load_plugin(name)
    raise ValueError(f"algo.name={name!r} is not one of {list(_SPECS)}; or give a loss of your own as {PLUGIN_FORM}")


def plugin_ref(spec: AlgoSpec) -> str | None:
    """The `module:Spec` / `file.py:Spec` reference `spec` was loaded from (its errors name it); None for a
    built-in or a spec registered in code."""
    return next((ref for ref, s in _PLUGINS.items() if s is spec), None)


def _load_plugin(ref: str) -> AlgoSpec:
    where, _, attr = ref.partition(":")
    if not where or not attr.isidentifier():
        raise ValueError(f"algo.name={ref!r}: give {PLUGIN_FORM}")
    module = import_plugin_module(ref, field="algo.name", prefix="moe_gspo_algo", attr_form="Spec")
    obj = getattr(module, attr, None)
    if not isinstance(obj, AlgoSpec):
        specs = sorted(k for k, v in vars(module).items() if isinstance(v, AlgoSpec))
        what = f"has no {attr!r}" if obj is None else f"has {attr!r}, a {type(obj).__name__}, not an AlgoSpec"
        raise ValueError(f"algo.name={ref!r}: {where!r} {what}; its AlgoSpecs: {', '.join(specs) or 'none'} "
                         "(build one: AlgoSpec(name=..., doc=..., terms=..., level=..., clip=...) from "
                         "moe_gspo.algos.registry)")
    if obj.name in RUN_NAMESPACES:
        raise ValueError(f"algo.name={ref!r}: its AlgoSpec.name {obj.name!r} is a namespace of the run's own metrics "
                         f"(a plug-in's metrics are logged as '<AlgoSpec.name>/...', so they would mix with the "
                         f"run's '{obj.name}/...'); give it another name")
    try:
        register_algo(obj)
    except ValueError as e:
        raise ValueError(f"algo.name={ref!r}: {e}") from None
    _PLUGINS[ref] = obj
    return obj


for _spec in (GSPO, GSPO_TOKEN, GRPO, GMPO, CISPO, SAPO):  # the built-ins, in --help's order
    register_algo(_spec)
BUILTIN_ALGOS = algo_names()
"""The built-in algorithms' names."""
