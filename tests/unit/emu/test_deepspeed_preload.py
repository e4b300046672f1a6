"""Workers of a DeepSpeed job import what DeepSpeed's first ``initialize`` would import lazily."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO
from tests.support.deepspeed import requires_deepspeed

LAZY = "deepspeed.runtime.zero.muon.muon_optimizer"


@requires_deepspeed
def test_preload_imports_what_the_first_engine_would():
    """``is_zero_supported_optimizer`` imports DeepSpeed's Muon optimizer (and torch.compile's
    inductor with it) on the first ``initialize``: a worker that preloaded has it already."""
    code = ("import sys, torch\n"
            "from emu.engine.deepspeed_stage import preload_deepspeed\n"
            f"assert {LAZY!r} not in sys.modules\n"
            "preload_deepspeed(torch.device('cpu'))\n"
            f"print({LAZY!r} in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"
