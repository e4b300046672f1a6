"""Reading a configuration YAML (job files, site files) with the checks both need.

A file is refused, naming it, when it is larger than :data:`MAX_YAML_BYTES` (configuration is
kilobytes; a 50 MB file would take minutes and print thousands of errors), not UTF-8, not
YAML, nested deeper than :data:`MAX_YAML_DEPTH`, expands through aliases to more than
:data:`MAX_YAML_VALUES` values, or when a mapping repeats a key: PyYAML keeps the last silently, so ``steps: 3`` then
``steps: 5`` would run 5 steps without a word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from nereusd.errors import ConfigError, not_utf8

MAX_YAML_BYTES = 1 << 20
"""Largest configuration file read (1 MiB)."""

MAX_YAML_VALUES = 1 << 20
"""Most values a configuration may expand to through aliases: 2 KB of nested ``&a [*b, *b, …]``
expand to 9^9 values (a "billion laughs"), which validation and its error message then walked
for minutes."""
MAX_YAML_DEPTH = 100
"""Deepest nesting of lists and mappings (``[[[…`` 5,000 deep raised a ``RecursionError``)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a repeated key in any mapping.

    Checked in :meth:`flatten_mapping`, which every mapping passes through before its merge keys
    (``<<: *anchor``) are expanded in place, once per node: a merged key may be overridden, and an
    anchor aliased again after it served as a merge source is the same, already checked, node.
    """

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        checked = self.__dict__.setdefault("_checked_nodes", set())
        if id(node) not in checked:
            checked.add(id(node))
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:   # an unhashable key: construct_mapping reports it
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {first})", key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        super().flatten_mapping(node)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path`` (module docstring for what is refused).

    Raises:
        ConfigError: ``<path>: <problem>``, with the line and column of a YAML error.
    """
    try:
        size = path.stat().st_size
        if size > MAX_YAML_BYTES:
            raise ConfigError(f"{path}: {size} bytes is larger than a configuration file may be "
                              f"({MAX_YAML_BYTES} bytes)")
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: {not_utf8(err)}; is it a YAML file?") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested deeper than a configuration may be ({MAX_YAML_DEPTH} levels)") from None
    except ValueError as err:   # an integer past Python's 4,300-digit limit
        raise ConfigError(f"{path}: not a valid configuration value: {str(err)[:120]}") from None
    values = _expanded_values(data, {}, 0, path)
    if values > MAX_YAML_VALUES:
        raise ConfigError(f"{path}: expands to {values:,} values through its aliases (*name), more than a "
                          f"configuration may hold ({MAX_YAML_VALUES:,})")
    return data


def _expanded_values(node: Any, memo: dict[int, int], depth: int, path: Path) -> int:
    """How many values ``node`` holds with every alias expanded (each shared list or mapping
    counted once per reference, computed once per object: linear in the file, not in the
    expansion).

    Raises:
        ConfigError: nested deeper than :data:`MAX_YAML_DEPTH`.
    """
    if not isinstance(node, (list, dict)):
        return 1
    if depth > MAX_YAML_DEPTH:
        raise ConfigError(f"{path}: nested deeper than a configuration may be ({MAX_YAML_DEPTH} levels)")
    if id(node) not in memo:
        children = node.values() if isinstance(node, dict) else node
        memo[id(node)] = 1 + sum(_expanded_values(c, memo, depth + 1, path) for c in children)
    return memo[id(node)]
