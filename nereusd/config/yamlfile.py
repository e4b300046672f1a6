"""Reading a configuration YAML (job files, site files) with the checks both need.

A file is refused, naming it, when it is larger than :data:`MAX_YAML_BYTES` (configuration is
kilobytes; a 50 MB file would take minutes and print thousands of errors), not UTF-8, not
YAML, or when a mapping repeats a key: PyYAML keeps the last silently, so ``steps: 3`` then
``steps: 5`` would run 5 steps without a word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from nereusd.errors import ConfigError

MAX_YAML_BYTES = 1 << 20
"""Largest configuration file read (1 MiB)."""


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
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); is it a YAML file?") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read: {err}") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
