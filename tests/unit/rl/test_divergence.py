"""A training step whose loss or gradient norm is not finite stops the job (``RLDriver._check_finite``):
a run trained three steps of NaN losses and ended ``succeeded`` (an adversarial trial, 2026-12-07)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nereusd.errors import TrainingDiverged
from nereusd.rl.driver import RLDriver


def test_a_non_finite_loss_or_gradient_norm_stops_the_job_naming_it():
    driver = SimpleNamespace(step_index=7, last_checkpoint=("runs/x/checkpoints/step000005", 5, 320))
    RLDriver._check_finite(driver, {"actor/loss": 0.3, "actor/grad_norm": 1.2, "actor/kl": float("nan")})
    with pytest.raises(TrainingDiverged, match=r"^training diverged at step 7: actor/grad_norm = inf, "
                                               r"critic/loss = nan \(the weights are no longer finite; the "
                                               r"latest checkpoint, step 5, holds finite weights\)"):
        RLDriver._check_finite(driver, {"actor/loss": 0.3, "actor/grad_norm": float("inf"),
                                        "critic/loss": float("nan")})
    with pytest.raises(TrainingDiverged, match="no checkpoint was written before it"):
        RLDriver._check_finite(SimpleNamespace(step_index=0, last_checkpoint=None), {"actor/loss": float("nan")})
