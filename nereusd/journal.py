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

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
SUMMARY_FILE = "summary.json"


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
    """All complete JSON lines of ``path`` (a partially written last line is skipped)."""
    records = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return []
    return records
