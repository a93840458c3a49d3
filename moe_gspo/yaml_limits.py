"""YAML with a cap on alias expansion (ground floor: imports nothing from `moe_gspo`).

A YAML alias (`*name`) refers to an anchored node (`&name`) instead of copying it, so a few hundred bytes of
nested aliases ("9 levels of 9 aliases") describe 9^9 = 387 million values. PyYAML builds such a document as
shared Python objects in no time, but anything that walks it (a copy, a repr, `dataclasses.asdict`, a YAML dump)
expands it, past gigabytes and minutes. `load_capped` counts the values the document holds once every alias is
expanded, from its node graph (each distinct node counted once, so the count itself is cheap), before any
Python object is built, and refuses more than `MAX_VALUES` (a recursive alias counts as too many) with one
ValueError naming the document. A run config holds a few hundred values.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_VALUES = 100_000
"""The most values (scalars, lists and mappings, aliases expanded) a config document may hold."""


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


def load_capped(text: str, loader_cls: type = yaml.SafeLoader, *, what: str, limit: int = MAX_VALUES) -> Any:
    """`yaml.load(text, Loader=loader_cls)`, refusing a document that expands past `limit` values (see the module
    docstring) with a ValueError starting with `what`. YAML syntax errors propagate as `yaml.YAMLError`."""
    loader = loader_cls(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if expanded_values(node, limit) > limit:
            raise ValueError(f"{what}: its YAML aliases (*name) expand to more than {limit} values (a config holds a "
                             "few hundred); write the values out, or drop the aliases")
        return loader.construct_document(node)
    finally:
        loader.dispose()
