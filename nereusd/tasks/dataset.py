"""Prompt datasets: JSONL or parquet records with named columns, a held-out split, and a
deterministic global sample order over epochs.

A record is a prompt (a question as text, or a list of chat messages ``{"role", "content"}``) and
its ground truth. Columns are named by dotted keys, so verl's layout (``prompt`` as messages,
``reward_model.ground_truth``) reads like GSM8K's (``question``, ``answer``) or MATH's
(``problem``, ``solution``).

The order is a pure function of ``(seed, index)`` (:class:`SampleOrder`): index ``i`` of the
training split is record ``perm_e[i mod n]`` of epoch ``e = i // n``, ``perm_e`` a permutation
drawn from ``(seed, e)``. A job's sampler position therefore fully describes where it is, and the
order survives transitions and checkpoint/restarts as the counting task's does.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from nereusd.errors import ConfigError, not_utf8

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Record:
    """One dataset row: ``row`` in the file, the prompt (text or chat messages), the ground truth."""

    row: int
    prompt: str | Messages
    answer: str


def _get(record: Any, key: str) -> Any:
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(part)
        value = value[part]
    return value


def _rows(path: Path) -> list[Any]:
    suffix = "".join(path.suffixes[-1:]).lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:   # pragma: no cover - pyarrow is a dependency
            raise ConfigError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # noqa: BLE001 - pyarrow raises many kinds; all mean 'not a parquet file'
            raise ConfigError(f"{path}: not a readable parquet file: {err}") from None
    if suffix in (".jsonl", ".json"):
        rows = []
        try:
            text = path.read_text(encoding="utf-8-sig")   # a leading byte-order mark is not data
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: {not_utf8(err)}") from None
        # JSON lines end at "\n" only: str.splitlines would also cut at U+2028 and U+0085, which
        # JSON allows raw inside strings.
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as err:
                raise ConfigError(f"{path}:{number}: not a JSON line: {str(err)[:80]}") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object per line, got {type(row).__name__}")
            rows.append(row)
        return rows
    raise ConfigError(f"{path}: expected a .jsonl, .json (JSON lines) or .parquet file")


def _column(data: Any, key: str, option: str, where: str) -> Any:
    """``data``'s value at the dotted ``key``; a missing one names the option and the columns there are."""
    try:
        return _get(data, key)
    except KeyError as err:
        missing = err.args[0]
        inner = f" ({missing!r} of {key!r})" if missing != key else ""
        columns = ", ".join(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{where}: task.options.{option}: no column {key!r}{inner}; the row's columns: "
                          f"{columns}") from None


def read_records(path: str | Path, prompt_key: str, answer_key: str) -> list[Record]:
    """Every record of the dataset at ``path``.

    Raises:
        ConfigError: a missing or unreadable file, a row without ``prompt_key`` or
            ``answer_key`` (naming file, row and key), a prompt that is neither text nor a list of
            ``{"role", "content"}`` messages, or an empty dataset.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: " + ("not a regular file (a dataset is a JSON, JSONL or Parquet file)"
                                         if path.exists() else "no such dataset file (a local JSON, JSONL or Parquet "
                                         "file; Nereus downloads nothing: fetch a Hugging Face dataset first with `hf "
                                         "download --repo-type dataset`)"))
    out = []
    for row, data in enumerate(_rows(path)):
        where = f"{path}: row {row}"
        prompt = _column(data, prompt_key, "prompt_key", where)
        answer = _column(data, answer_key, "answer_key", where)
        if isinstance(prompt, list):
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in prompt) or not prompt:
                raise ConfigError(f"{where}: {prompt_key}: a list prompt must be chat messages "
                                  "[{\"role\": ..., \"content\": ...}]")
            prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
        elif not isinstance(prompt, str):
            raise ConfigError(f"{where}: {prompt_key}: expected text or chat messages, got {type(prompt).__name__}")
        if isinstance(answer, float):
            if not math.isfinite(answer):
                raise ConfigError(f"{where}: {answer_key}: expected a finite number, got {answer!r}")
            # positional, never exponent form ("1e+20" would read as 1); float32 columns as written
            answer = format(Decimal(repr(answer)).normalize(), "f")
        elif isinstance(answer, int) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise ConfigError(f"{where}: {answer_key}: expected text or a number, got {type(answer).__name__}")
        out.append(Record(row, prompt, answer))
    if not out:
        raise ConfigError(f"{path}: the dataset has no records")
    return out


def split(n: int, eval_size: int, seed: int) -> tuple[list[int], list[int]]:
    """Rows of the training and held-out splits: ``eval_size`` rows drawn from ``seed`` are held
    out (in row order), the rest train (in row order).

    Raises:
        ConfigError: when the held-out split would leave no training row.
    """
    if not 0 <= eval_size < n:
        raise ConfigError(f"task.options.eval_size: {eval_size} must be >= 0 and below the dataset's {n} records")
    held = set(np.random.default_rng([seed, 0x5EED]).permutation(n)[:eval_size].tolist())
    return [i for i in range(n) if i not in held], sorted(held)


class SampleOrder:
    """The global sample order over ``n`` training records (module docstring): epochs of
    permutations drawn from ``(seed, epoch)``."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"a sample order needs at least one record, got {n}")
        self.n, self.seed = n, seed
        self._perms: dict[int, Sequence[int]] = {}

    def at(self, index: int) -> int:
        """The training record (0 … n−1) at global position ``index`` (≥ 0)."""
        if index < 0:
            raise ValueError(f"sample index must be non-negative, got {index}")
        epoch, offset = divmod(index, self.n)
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) > 8:
                self._perms.clear()
            perm = self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n).tolist()
        return perm[offset]

    def epoch_of(self, index: int) -> int:
        return index // self.n


def epochs_of(steps: int, prompts_per_step: int, n: int) -> float:
    """How many passes over ``n`` training records ``steps`` steps of ``prompts_per_step`` make."""
    return steps * prompts_per_step / max(1, n) if n else math.inf
