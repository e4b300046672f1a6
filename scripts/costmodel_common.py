"""What ``scripts/bench_costmodel.py``'s training and generation parts share: the model they
time, the calibration/held-out split, percentage errors, the per-layout table and the noise line,
and a bare barrier's time (subtracted from every timed step)."""

from __future__ import annotations

import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nereusd.config.site import SiteConfig  # noqa: E402
from nereusd.cost.calibration import RIDGE, Calibration  # noqa: E402
from nereusd.cost.model import CostModel, StageCost  # noqa: E402
from nereusd.models import ModelSpec  # noqa: E402

SPEC = ModelSpec(vocab_size=512, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8,
                 num_kv_heads=4, max_position=512)


def split_layouts(items: Sequence, every: int = 2) -> tuple[list, list]:
    """``(calibration, held_out)``: every ``every``-th item (from the first) calibrates, the
    rest are predicted. Deterministic, so a rerun predicts the same layouts."""
    if every < 2:
        raise ValueError(f"every must be >= 2 (something must be held out), got {every}")
    calib = [x for i, x in enumerate(items) if i % every == 0]
    held = [x for i, x in enumerate(items) if i % every != 0]
    return calib, held


def percent_errors(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    """Signed errors ``100·(predicted − measured)/measured`` (measured values must be > 0)."""
    if len(predicted) != len(measured):
        raise ValueError(f"{len(predicted)} predictions for {len(measured)} measurements")
    if any(m <= 0 for m in measured):
        raise ValueError(f"measured values must be positive, got {list(measured)}")
    return [100.0 * (p - m) / m for p, m in zip(predicted, measured)]


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, in percent."""
    errors = percent_errors(predicted, measured)
    return sum(abs(e) for e in errors) / len(errors)


def max_abs_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Largest absolute percentage error, in percent."""
    return max(abs(e) for e in percent_errors(predicted, measured))


def calibrate_with(site: SiteConfig, spec: ModelSpec, samples: Iterable[tuple[object, float]],
                   predict: Callable[[CostModel, ModelSpec, object], StageCost], rounds: int = 1,
                   ridge: float = RIDGE) -> Calibration:
    """A fresh :class:`Calibration` fed ``(layout, measured_s)`` samples through
    :meth:`Calibration.observe_stage` with ``predict``'s ideal seconds, as nereusd feeds it
    measured stage times; ``rounds`` passes over the samples (a daemon sees the same layout step
    after step); ``ridge``: its least-squares fit's pull toward the anchors (nereusd's default)."""
    cal = Calibration(ridge=ridge)
    samples = list(samples)
    for _ in range(rounds):
        for layout, measured_s in samples:
            cm = CostModel(site, cal)  # efficiencies are read once per CostModel
            cal.observe_stage(predict(cm, spec, layout).ideal_s_by_class, measured_s)
    return cal


def held_out_table(names: Sequence[str], rows: list[dict], measured: Sequence[float], in_calib: Sequence[bool],
                   predicted: Sequence[float], extra: Sequence[str] = ()) -> tuple[list[str], float, float]:
    """Per-layout lines (measured, predicted, error, spread and ``extra`` columns) and the MAPE
    and largest error (percent) over the layouts not in the calibration set."""
    lines = []
    for k, (name, row) in enumerate(zip(names, rows)):
        err = percent_errors([predicted[k]], [measured[k]])[0]
        lines.append(f"{name:<34}{'calib' if in_calib[k] else 'test':>6}{measured[k]:>12.3f}{predicted[k]:>13.3f}"
                     f"{err:>+9.1f}{row['spread']:>8.2f}" + (extra[k] if extra else ""))
    held = [k for k in range(len(names)) if not in_calib[k]]
    pred, meas = [predicted[k] for k in held], [measured[k] for k in held]
    return lines, mape(pred, meas), max_abs_error(pred, meas)


def noise_line(rows: list[dict], what: str) -> str:
    """How much repetitions of one layout differ, and so how uncertain their median is."""
    sd = statistics.median(r["rel_sd"] for r in rows)
    return (f"noise ({what}): repetitions differ by {100 * sd:.1f} % (median relative stdev), "
            f"so the median of {rows[0]['reps']} is uncertain by about ±{125 * sd / math.sqrt(rows[0]['reps']):.1f} %")


def barrier_s(reps: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
