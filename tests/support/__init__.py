"""Shared helpers of the test suite (fixtures that use them are in ``tests/conftest.py``)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root."""


def demo_job(curriculum: bool = True):
    """The demo job (``examples/counting_grpo.yaml``), resolved; ``curriculum=False``: without
    its response-length curriculum, every step capped at ``max_new_tokens`` (the growth that the
    controller's tests of one cap were written for)."""
    import dataclasses

    from nereusd.config.resolve import load_and_resolve

    job = load_and_resolve(REPO / "examples" / "counting_grpo.yaml")
    if curriculum:
        return job
    rollout = job.config.rollout.model_copy(update={"max_new_tokens_schedule": []})
    return dataclasses.replace(job, config=job.config.model_copy(update={"rollout": rollout}))
