"""The marker of tests that run megatron-core (``make install`` installs 0.16.1 with ``--no-deps``).

Without it they are skipped, unless ``NEREUS_REQUIRE_MEGATRON=1`` (CI sets it), which makes a
missing megatron-core a failure instead of a skip.
"""

from __future__ import annotations

import os

import pytest

try:
    import megatron.core  # noqa: F401
    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False

requires_megatron = pytest.mark.skipif(
    not HAVE_MEGATRON and os.environ.get("NEREUS_REQUIRE_MEGATRON") != "1",
    reason="megatron-core not installed (make install adds it)")
