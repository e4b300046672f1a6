"""Verifiable RL tasks, looked up by name from a job's ``task.name``.

A task supplies a tokenizer (``pad_id``, ``stop_ids``, ``encode``/``decode``), a deterministic
global prompt order (``prompt_at(index)``: a prompt with its ``index``, ``tokens`` and the
``reference`` its verifier needs), a verifier (``score(reference, response_ids)``), the longest
prompt (``max_prompt_tokens``) and a held-out set (``eval_prompts()``, possibly empty):

- ``counting`` (:mod:`nereusd.tasks.counting`): the counting toy, a character tokenizer;
- ``math`` (:mod:`nereusd.tasks.math`): GSM8K- or MATH-style datasets, the actor's tokenizer
  and chat template, rule-based verifiers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nereusd.errors import ConfigError
from nereusd.tasks.counting import CharTokenizer, CountingPrompt, CountingTask, PromptSampler, Verdict

TASKS = ("counting", "math")


def get_task(name: str, options: dict[str, Any] | None = None, *, base_dir: str | Path = ".",
             model_dir: str | None = None):
    """Build the task registered as ``name`` with ``options`` (the job's ``task.options``).

    Args:
        base_dir: the job file's directory (a dataset path is relative to it).
        model_dir: the actor's model directory (whose tokenizer a task may use).

    Raises:
        ConfigError: unknown task name (the message lists the known ones), or bad options.
    """
    from pydantic import TypeAdapter, ValidationError

    options = dict(options or {})
    if name == "counting":
        cls, extra = CountingTask, {}
    elif name == "math":
        from nereusd.tasks.math import MathTask   # transformers: only when a job uses it

        cls, extra = MathTask, {"base_dir": Path(base_dir), "model_dir": model_dir}
    else:
        raise ConfigError(f"task.name: unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    for key in ("base_dir", "model_dir"):
        if key in options:
            raise ConfigError(f"task.options.{key}: unknown key")
    try:   # pydantic checks each option's type against the task's fields; unknown ones are refused
        return TypeAdapter(cls).validate_python({**options, **extra})
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(x) for x in first["loc"])
        if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            fields = sorted(k for k in getattr(cls, "__dataclass_fields__", {}) if k not in extra)
            raise ConfigError(f"task.options.{key}: unknown key for task {name!r} (options: {', '.join(fields)})") from None
        raise ConfigError(f"task.options.{key}: {first['msg']} (task {name!r}, got {first.get('input')!r})") from None

__all__ = ["TASKS", "CharTokenizer", "CountingPrompt", "CountingTask", "PromptSampler", "Verdict", "get_task"]
