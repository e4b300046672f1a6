"""A response-length curriculum (``rollout.max_new_tokens_schedule``, ``simulate
--max-new-tokens-schedule``): its stages, the cap of a step, and the checks every stage list
passes. Stages are ``(at_step, max_new_tokens)`` pairs in step order."""

from __future__ import annotations

from typing import Sequence

from pydantic import Field, StrictInt

from nereusd.config.schema import Strict


def stage_cap(stages: Sequence[tuple[int, int]], step: int, default: int) -> int:
    """The response cap (tokens) of step ``step`` under a length curriculum: the cap of the last
    of ``stages`` (``(at_step, max_new_tokens)``, in step order) that starts at or before it;
    ``default`` before the first (or without stages)."""
    cap = default
    for at_step, max_new_tokens in stages:
        if at_step > step:
            break
        cap = max_new_tokens
    return cap


def parse_stages(text: str) -> tuple[tuple[int, int], ...]:
    """A curriculum written on a command line: ``"0:8192,500:16384"`` → ``((0, 8192), (500,
    16384))``; blank → ``()``, no curriculum (:func:`curriculum_error` checks the stages).

    Raises:
        ValueError: for text of another form, with a message to show after the option's name."""
    if not text.strip():
        return ()
    try:
        stages = [part.split(":") for part in text.split(",")]
        if any(len(stage) != 2 for stage in stages):
            raise ValueError
        return tuple((int(at), int(cap)) for at, cap in stages)
    except ValueError:
        raise ValueError(f"expected STEP:CAP stages separated by commas (e.g. 0:8192,500:16384), got {text!r}") from None


def curriculum_error(stages: Sequence[tuple[int, int]], max_new_tokens: int | None, key: str,
                     max_key: str, steps: int | None = None) -> str | None:
    """Why ``stages`` (``(at_step, max_new_tokens)`` pairs, written as ``key``) is not a length
    curriculum, or ``None``: the first stage starts at step 0, each later one at a later step
    below ``steps`` (the job's; ``None``: no bound) with a cap that is not lower, every cap at
    least 1 and at most ``max_new_tokens`` (``max_key``; ``None``: no bound)."""
    if not stages:
        return None
    if stages[0][0] != 0:
        return f"{key}[0].at_step: the first stage starts at step 0, got {stages[0][0]}"
    late = next((k for k, (at, _) in enumerate(stages) if steps is not None and at >= steps), None)
    if late is not None:
        return f"{key}[{late}].at_step: {stages[late][0]} is not below steps={steps}: no step would run in that stage"
    for k, ((at_a, cap_a), (at_b, cap_b)) in enumerate(zip(stages, stages[1:]), start=1):
        if at_b <= at_a:
            return f"{key}[{k}].at_step: {at_b} is not after the previous stage's {at_a}"
        if cap_b < cap_a:
            return (f"{key}[{k}].max_new_tokens: {cap_b} is below the previous stage's {cap_a} (a curriculum "
                    "only raises the cap)")
    low = next((k for k, (_, cap) in enumerate(stages) if cap < 1), None)   # caps rise: the first, if any
    if low is not None:
        return f"{key}[{low}].max_new_tokens: {stages[low][1]} is below 1"
    over = next((k for k, (_, cap) in enumerate(stages) if max_new_tokens is not None and cap > max_new_tokens), None)
    if over is not None:
        return f"{key}[{over}].max_new_tokens: {stages[over][1]} exceeds {max_key} {max_new_tokens}, which sizes " \
               "the engines and the context"
    return None


class LengthStageConfig(Strict):
    """One stage of ``rollout.max_new_tokens_schedule``."""

    at_step: StrictInt = Field(ge=0)
    """The stage's first step."""
    max_new_tokens: StrictInt = Field(ge=1)
    """The cap of its steps' responses (tokens)."""
