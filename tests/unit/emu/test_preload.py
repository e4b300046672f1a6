"""Workers import what their first engine would import lazily (the optimizer; DeepSpeed's first
``initialize`` in a DeepSpeed job) when they build, not inside a transition."""

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


def test_preload_optimizer_leaves_nothing_for_the_first_engine_to_import():
    """After the preload, constructing the engine's optimizer imports no module (the first
    ``torch.optim.Adam`` imports ``torch._dynamo`` on torch 2.13; whatever it imports on another
    torch, the preload must have imported it)."""
    code = ("import sys, torch\n"
            "from emu.engine.stage import preload_optimizer\n"
            "preload_optimizer()\n"
            "before = set(sys.modules)\n"
            "torch.optim.Adam(torch.nn.Linear(4, 4).parameters(), lr=1e-4, weight_decay=0.01)\n"
            "print(sorted(set(sys.modules) - before))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
