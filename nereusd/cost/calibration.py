"""Calibration: one achieved efficiency per operation class, learned from measured times.

``achieved = peak × efficiency`` (paper §4.2 "Calibration"). The cost model predicts, for each
operation class, the *ideal* seconds at peak (efficiency 1); a measured time gives the sample
``efficiency = ideal_s / measured_s``. The estimate of a class is a weighted median over its
last ``window`` samples plus its prior counted ``prior_weight`` times, so one outlier (a page
fault storm, a slow first step) cannot move it, and unseen classes keep a conservative prior
(below what kernels and collectives usually achieve, so early plans do not over-promise).

The state is plain JSON (:meth:`Calibration.to_json` / :meth:`Calibration.save` with an atomic
rename) so that it survives a daemon restart and can be reused for a new model whose
operation classes match.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections import deque
from pathlib import Path
from typing import Iterable, Mapping

from nereusd.errors import ConfigError

log = logging.getLogger(__name__)

GEMM = "gemm"
ATTENTION = "attention"
DECODE = "decode"            # HBM-bound token generation
OPTIMIZER = "optimizer"      # HBM-bound optimizer update
LAUNCH = "launch"            # fixed per-layer dispatch time of each decode step (site layer_launch_us)
LINK_TYPES = ("intra", "inter")
COLLECTIVES = ("all_reduce", "all_gather", "p2p", "broadcast")


def comm_class(collective: str, link: str) -> str:
    """Operation class of a collective on a link type, e.g. ``all_reduce_inter``."""
    assert collective in COLLECTIVES and link in LINK_TYPES, (collective, link)
    return f"{collective}_{link}"


#: Conservative priors: below typical achieved fractions of peak (dense bf16 GEMMs reach
#: 0.6–0.8 on H100/MI250X; NCCL ring all-reduce 0.7–0.9 of link bandwidth intra-node).
PRIORS: dict[str, float] = {
    GEMM: 0.45, ATTENTION: 0.30, DECODE: 0.50, OPTIMIZER: 0.50, LAUNCH: 1.0,
    **{comm_class(c, "intra"): 0.50 for c in COLLECTIVES},
    **{comm_class(c, "inter"): 0.40 for c in COLLECTIVES},
}
DEFAULT_PRIOR = 0.30
MIN_EFFICIENCY, MAX_EFFICIENCY = 1e-4, 1.5
STATE_VERSION = 1


def weighted_median(values: Iterable[float], weights: Iterable[float]) -> float:
    """The lower weighted median of ``values`` (non-empty, positive weights)."""
    pairs = sorted(zip(values, weights))
    half = sum(w for _, w in pairs) / 2.0
    acc = 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= half:
            return value
    return pairs[-1][0]


class Calibration:
    """Per operation class efficiency estimates.

    Args:
        priors: efficiency per class before any sample (defaults: :data:`PRIORS`).
        window: samples kept per class (the oldest are dropped, so drift is followed).
        prior_weight: how many samples the prior counts for in the median.
    """

    def __init__(self, priors: Mapping[str, float] | None = None, window: int = 32,
                 prior_weight: float = 2.0) -> None:
        self.priors = dict(PRIORS if priors is None else priors)
        self.window = window
        self.prior_weight = prior_weight
        self._samples: dict[str, deque[float]] = {}

    def efficiency(self, op_class: str) -> float:
        """Current efficiency of ``op_class`` in (0, 1.5]."""
        prior = self.priors.get(op_class, DEFAULT_PRIOR)
        samples = self._samples.get(op_class)
        if not samples:
            return prior
        values = list(samples) + [prior]
        weights = [1.0] * len(samples) + [self.prior_weight]
        return weighted_median(values, weights)

    def samples(self, op_class: str) -> int:
        return len(self._samples.get(op_class, ()))

    def observe(self, op_class: str, ideal_s: float, measured_s: float) -> None:
        """Record one measurement: ``ideal_s`` predicted at peak, ``measured_s`` observed.

        Non-positive or non-finite inputs are ignored (logged), never raised: a broken timer
        must not stop a job.
        """
        if not (ideal_s > 0 and measured_s > 0) or ideal_s == float("inf") or measured_s == float("inf"):
            log.debug("calibration: ignoring %s sample ideal=%r measured=%r", op_class, ideal_s, measured_s)
            return
        sample = min(MAX_EFFICIENCY, max(MIN_EFFICIENCY, ideal_s / measured_s))
        self._samples.setdefault(op_class, deque(maxlen=self.window)).append(sample)

    def observe_stage(self, ideal_s_by_class: Mapping[str, float], measured_s: float) -> None:
        """Learn from one model-stage's total measured time when per-class times are unknown.

        The measured time is split over classes in proportion to their *predicted* seconds
        (``ideal / efficiency``), and each share gives one sample of its class.
        """
        predicted = {c: s / self.efficiency(c) for c, s in ideal_s_by_class.items() if s > 0}
        total = sum(predicted.values())
        if total <= 0 or not measured_s > 0:
            return
        for op_class, seconds in predicted.items():
            self.observe(op_class, ideal_s_by_class[op_class], measured_s * seconds / total)

    def snapshot(self) -> dict[str, float]:
        """Efficiency of every class with a prior or a sample."""
        return {c: self.efficiency(c) for c in sorted(set(self.priors) | set(self._samples))}

    def to_json(self) -> dict:
        return {
            "version": STATE_VERSION,
            "window": self.window,
            "prior_weight": self.prior_weight,
            "priors": self.priors,
            "samples": {c: list(s) for c, s in sorted(self._samples.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping, source: str = "calibration") -> "Calibration":
        """Rebuild from :meth:`to_json` output.

        Raises:
            ConfigError: on another version or malformed content, naming ``source``.
        """
        version = data.get("version") if isinstance(data, Mapping) else None
        if version != STATE_VERSION:
            raise ConfigError(f"{source}: version: expected {STATE_VERSION}, got {version!r}")
        try:
            cal = cls(priors={str(k): float(v) for k, v in data["priors"].items()},
                      window=int(data["window"]), prior_weight=float(data["prior_weight"]))
            for op_class, values in data["samples"].items():
                cal._samples[str(op_class)] = deque((float(v) for v in values), maxlen=cal.window)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ConfigError(f"{source}: malformed calibration state: {err!r}") from None
        return cal

    def restore(self, data: Mapping, source: str = "calibration") -> None:
        """Take the state :meth:`to_json` wrote, in place (the cost models that read this object
        see it once they :meth:`~nereusd.cost.model.CostModel.refresh`).

        Raises:
            ConfigError: as :meth:`from_json`; this object is then unchanged.
        """
        other = self.from_json(data, source)
        self.priors, self.window, self.prior_weight, self._samples = (other.priors, other.window, other.prior_weight,
                                                                      other._samples)

    def save(self, path: str | os.PathLike) -> None:
        """Write the state as JSON atomically (temporary file in the same directory, rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(self.to_json(), fh, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        """Read a state written by :meth:`save`; a missing file gives a fresh calibration.

        Raises:
            ConfigError: if the file is not valid JSON or not a calibration state.
        """
        path = Path(path)
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON: {err}") from None
        return cls.from_json(data, source=str(path))
