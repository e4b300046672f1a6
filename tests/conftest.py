"""Fixtures shared by the whole suite (helpers they build on are in ``tests/support``)."""

from __future__ import annotations

import os

import pytest

# Generation runs on the native decoder unless a test's job names vllm (nereusd.backends): a vLLM
# engine start takes ~10 s here, so only the tests of the vLLM backend pay for them.
os.environ.setdefault("NEREUS_GENERATION_BACKEND", "native")

from tests.support.specs import TINY_MODELS


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a test module's torch ops on one thread, restoring the setting afterwards.

    On the shared 2-core machine two OpenMP threads contend with other processes: a tiny
    forward took ~1 s with 2 threads and ~0.03 s with 1 (measured under load average 5).
    A module uses it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_models():
    """Every role with the tiny spec (``{Role: ModelSpec}``), as the transition planner takes them."""
    return dict(TINY_MODELS)
