"""The marker of tests that run DeepSpeed (``make install`` installs it).

Without DeepSpeed they are skipped, unless ``NEREUS_REQUIRE_DEEPSPEED=1`` (CI sets it), which
makes a missing DeepSpeed a failure instead of a skip.
"""

from __future__ import annotations

import os

import pytest

from nereusd.backends import deepspeed_available

requires_deepspeed = pytest.mark.skipif(
    not deepspeed_available() and not os.environ.get("NEREUS_REQUIRE_DEEPSPEED"),
    reason="DeepSpeed is not installed (make install brings it)")
