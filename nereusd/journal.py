"""The run directory's journals: ``metrics.jsonl`` (one object per RL step), ``events.jsonl``
(every decision and lifecycle event, with why), and ``summary.json`` (written at the end).

Each line is flushed as it is written, so a crash loses at most the line being written and
``nereus-launch`` can follow progress by reading the files.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from nereusd.errors import NereusError

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
SUMMARY_FILE = "summary.json"


class JournalError(NereusError):
    """A journal file is damaged: a line other than a torn last one is not a JSON object."""


def _default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


class Journal:
    """Append-only JSONL writers for one run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")
        self._events = open(self.run_dir / EVENTS_FILE, "a", encoding="utf-8")

    def metric(self, record: dict[str, Any]) -> None:
        """Append one step's metrics."""
        self._metrics.write(json.dumps(record, default=_default) + "\n")
        self._metrics.flush()

    def event(self, name: str, fields: dict[str, Any] | None = None) -> None:
        """Append one event ``{"time_s", "event", ...fields}``."""
        record = {"time_s": round(time.time(), 3), "event": name, **(fields or {})}
        self._events.write(json.dumps(record, default=_default) + "\n")
        self._events.flush()

    def summary(self, record: dict[str, Any]) -> None:
        """Write ``summary.json`` atomically."""
        tmp = self.run_dir / (SUMMARY_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2, default=_default) + "\n")
        os.replace(tmp, self.run_dir / SUMMARY_FILE)

    def close(self) -> None:
        self._metrics.close()
        self._events.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record of the JSONL file at ``path`` (``[]`` when it does not exist).

    Only the last line may be incomplete: a writer that died mid-line (the journal flushes whole
    lines, so nothing else can tear one) leaves it without its newline, and it is skipped. Any
    other line that is not a JSON object means the file is damaged or not a journal.

    Raises:
        JournalError: naming the file, the line number and what is wrong with it.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.readlines()
    except FileNotFoundError:
        return []
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        torn = number == len(lines) and not line.endswith("\n")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if torn:
                break
            raise JournalError(f"{path}:{number}: not a JSON line ({err.msg}): {line.strip()[:80]!r}") from None
        if not isinstance(record, dict):
            raise JournalError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def drop_metrics_from(path: str | Path, step: int) -> list[int]:
    """Remove the records of steps ``>= step`` from the metrics journal at ``path`` (they run again
    after a rewind, so every step appears once); returns their steps. Rewritten in place (a torn
    last line goes too): the journal's append-mode handle keeps writing at the (new) end.

    Raises:
        JournalError: as :func:`read_jsonl`.
    """
    path = Path(path)
    if not path.exists():
        return []
    records = read_jsonl(path)
    keep = [r for r in records if int(r["step"]) < step]
    dropped = [int(r["step"]) for r in records if int(r["step"]) >= step]
    if dropped:
        with open(path, "r+", encoding="utf-8") as fh:
            fh.seek(0)
            fh.truncate()
            fh.writelines(json.dumps(r, default=_default) + "\n" for r in keep)
            fh.flush()
    return dropped
