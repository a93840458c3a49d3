"""YAML with a cap on alias expansion and one on nesting depth (ground floor: imports nothing from `moe_gspo`).
Every YAML the project reads (run configs, overrides, ablation specs, a run's config.yaml in `analysis`) goes
through `load_capped`.

A YAML alias (`*name`) refers to an anchored node (`&name`) instead of copying it, so a few hundred bytes of
nested aliases ("9 levels of 9 aliases") describe 9^9 = 387 million values. PyYAML builds such a document as
shared Python objects in no time, but anything that walks it (a copy, a repr, `dataclasses.asdict`, a YAML dump)
expands it, past gigabytes and minutes. `load_capped` counts the values the document holds once every alias is
expanded, from its node graph (each distinct node counted once, so the count itself is cheap), before any
Python object is built, and refuses more than `MAX_VALUES` (a recursive alias counts as too many) with one
ValueError naming the document. A run config holds a few hundred values.

PyYAML composes a document recursively, so YAML nested 1000 deep (`[[[[...]]]]`) ended in a RecursionError
(issue 59); the parser underneath is a loop. `load_capped` first counts the nesting depth from the parser's
events, before anything is composed, and refuses more than `MAX_DEPTH` levels with one ValueError naming the
document and the cap. A run config nests three or four levels.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_VALUES = 100_000
"""The most values (scalars, lists and mappings, aliases expanded) a config document may hold."""
MAX_DEPTH = 64
"""The most levels of lists and mappings nested in one another a document may have."""


class YamlLimitError(ValueError):
    """A YAML document past `MAX_DEPTH` or `MAX_VALUES`: crafted or broken, never a config one means to load
    (a ValueError, so every entry point's one-line user-error path takes it)."""


def nesting_depth(text: str, limit: int = MAX_DEPTH) -> int:
    """The deepest nesting of lists and mappings in the YAML `text`, or `limit + 1` once it exceeds `limit`,
    from the parser's events (iterative: no recursion, nothing composed). YAML syntax errors propagate."""
    depth = deepest = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                return limit + 1
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return deepest


def expanded_values(node: yaml.Node, limit: int = MAX_VALUES) -> int:
    """The number of values `node` stands for with every alias expanded, or `limit + 1` once it exceeds `limit`
    (also for a node that contains itself). Iterative: deep nesting needs no recursion."""
    size: dict[int, int] = {}
    visiting: set[int] = set()
    todo: list[tuple[yaml.Node, bool]] = [(node, False)]
    while todo:
        n, done = todo.pop()
        key = id(n)
        if key in size:
            continue
        if isinstance(n, yaml.ScalarNode):
            size[key] = 1
            continue
        children = ([c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else list(n.value))
        if done:
            visiting.discard(key)
            size[key] = min(limit + 1, 1 + sum(size[id(c)] for c in children))
            continue
        if key in visiting:  # reached again while its own children are counted: it contains itself
            return limit + 1
        visiting.add(key)
        todo.append((n, True))
        for c in children:
            if id(c) in visiting:
                return limit + 1
            if id(c) not in size:
                todo.append((c, False))
    return size[id(node)]


def load_capped(text: str, loader_cls: type = yaml.SafeLoader, *, what: str, limit: int = MAX_VALUES,
                max_depth: int = MAX_DEPTH) -> Any:
    """`yaml.load(text, Loader=loader_cls)`, refusing a document that nests deeper than `max_depth` levels or
    expands past `limit` values (see the module docstring) with a ValueError starting with `what`. YAML syntax
    errors propagate as `yaml.YAMLError`."""
    if nesting_depth(text, max_depth) > max_depth:
        raise YamlLimitError(f"{what}: its YAML nests lists and mappings more than {max_depth} levels deep (a config "
                         "nests three or four); flatten it")
    loader = loader_cls(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if expanded_values(node, limit) > limit:
            raise YamlLimitError(f"{what}: its YAML aliases (*name) expand to more than {limit} values (a config holds a "
                             "few hundred); write the values out, or drop the aliases")
        return loader.construct_document(node)
    finally:
        loader.dispose()
