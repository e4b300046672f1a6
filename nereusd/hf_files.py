"""A Hugging Face model directory's files, read without torch: its JSON configs
(``config.json``, ``generation_config.json``, ``tokenizer_config.json``) and its safetensors
weights (``model.safetensors``, or the shards a ``model.safetensors.index.json`` names).

:mod:`nereusd.models` builds a :class:`~nereusd.models.ModelSpec` from the config; the engine
(:mod:`emu.engine.hf_io`) loads and writes the weights; the job's checks
(:mod:`nereusd.config.resolve`) compare the weights' shapes with the spec's before any worker
starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nereusd.errors import ConfigError, not_utf8


def read_json_object(path: Path, hint: str = "") -> dict[str, Any]:
    """The JSON object in the UTF-8 file ``path`` (a model directory's ``config.json``,
    ``generation_config.json``).

    Raises:
        ConfigError: the file is not UTF-8 (``hint`` appended), not JSON, or not an object, or
            cannot be read for another reason than its absence (a directory, no permission),
            naming it.
        FileNotFoundError: there is no such file (the caller words it).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except OSError as err:   # a directory by that name, no permission
        raise ConfigError(f"{path}: cannot read it: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: {not_utf8(err)}{hint}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a model directory: ``model.safetensors``, else the shards its
    ``model.safetensors.index.json`` names (sorted, each once).

    Raises:
        ConfigError: naming the directory or index, if there are no weights, or the index cannot
            be read or is not JSON with a ``weight_map``.
    """
    src = Path(path)
    if (src / WEIGHTS_NAME).exists():
        return [src / WEIGHTS_NAME]
    index = src / INDEX_NAME
    if not index.exists():
        raise ConfigError(f"{src}: neither {WEIGHTS_NAME} nor {INDEX_NAME} found")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return [src / name for name in sorted(set(weight_map.values()))]
    except OSError as err:
        raise ConfigError(f"{index}: cannot read: {err}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(f"{index}: expected JSON with a 'weight_map' object ({err})") from None


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of a model directory's weight files (:func:`safetensors_files`),
    from the files' headers only (nothing is loaded).

    Raises:
        ConfigError: as :func:`safetensors_files`, or when a file is not a readable safetensors
            file (truncated, corrupt), naming it.
    """
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="numpy") as fh:
                for name in fh.keys():
                    shapes[name] = tuple(fh.get_slice(name).get_shape())
        except Exception as err:  # noqa: BLE001 - safetensors raises its own and OS errors alike
            raise ConfigError(f"{file}: not a readable safetensors file: {err}") from None
    return shapes


def safetensors_equal(path: str | Path, a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` of a model directory's weight files hold the same dtype,
    shape and bytes (read from the files, in chunks; nothing is converted).

    Raises:
        ConfigError: as :func:`safetensors_shapes`, or a name in no file.
    """
    import struct

    where: dict[str, tuple[Path, dict, int]] = {}
    for file in safetensors_files(path):
        try:
            with open(file, "rb") as fh:
                size = struct.unpack("<Q", fh.read(8))[0]
                header = json.loads(fh.read(size))
        except (OSError, ValueError, struct.error) as err:
            raise ConfigError(f"{file}: not a readable safetensors file: {err}") from None
        for name in (a, b):
            if name in header:
                where[name] = (file, header[name], 8 + size)
    for name in (a, b):
        if name not in where:
            raise ConfigError(f"{path}: no tensor {name}")
    (fa, ha, da), (fb, hb, db) = where[a], where[b]
    if ha["dtype"] != hb["dtype"] or ha["shape"] != hb["shape"]:
        return False
    (sa, ea), (sb, eb) = ha["data_offsets"], hb["data_offsets"]
    if ea - sa != eb - sb:
        return False
    with open(fa, "rb") as x, open(fb, "rb") as y:
        x.seek(da + sa)
        y.seek(db + sb)
        left = ea - sa
        while left > 0:
            n = min(left, 1 << 24)
            if x.read(n) != y.read(n):
                return False
            left -= n
    return True
