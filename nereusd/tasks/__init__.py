"""Verifiable RL tasks, looked up by name from a job's ``task.name``.

A task supplies a tokenizer, a deterministic global prompt order (``prompt_at(index)``) and a
verifier (``score(start, response_ids)``). It is pure Python so the driver can use it anywhere.
"""

from __future__ import annotations

from typing import Any

from nereusd.errors import ConfigError
from nereusd.tasks.counting import CharTokenizer, CountingPrompt, CountingTask, PromptSampler, Verdict

TASKS: dict[str, type[CountingTask]] = {
    CountingTask.name: CountingTask,
}


def get_task(name: str, **options: Any) -> CountingTask:
    """Build the task registered as ``name`` with keyword ``options``.

    Raises:
        ConfigError: unknown task name (the message lists the known ones), or bad options.
    """
    try:
        cls = TASKS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"task.name: unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}") from None
    try:
        return cls(**options)
    except TypeError as err:
        raise ConfigError(f"task {name!r}: bad options {sorted(options)}: {err}") from None


__all__ = ["TASKS", "CharTokenizer", "CountingPrompt", "CountingTask", "PromptSampler", "Verdict", "get_task"]
