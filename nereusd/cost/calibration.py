"""Calibration: one achieved efficiency per operation class, learned from measured times.

``achieved = peak × efficiency`` (paper §4.2 "Calibration"). The cost model predicts, for each
operation class, the *ideal* seconds at peak (efficiency 1); a measured time gives the sample
``efficiency = ideal_s / measured_s``. Two estimates, the second built on the first:

- **Robust anchor.** Per class, a weighted median over its last ``window`` samples plus its
  prior counted ``prior_weight`` times, so one outlier (a page fault storm, a slow first step)
  cannot move it, and unseen classes keep a conservative prior (below what kernels and
  collectives usually achieve, so early plans do not over-promise). A whole model-stage's
  measured time is split over its classes in proportion to their predictions
  (:meth:`Calibration.observe_stage`): one sample scales every class of the stage alike.
- **Per-class least squares** over the last ``window`` whole-stage samples
  (:func:`fit_efficiencies`): where stages of different class mixes were measured (layouts,
  lengths), the fit tells the classes apart — the share of a stage's time that is GEMM,
  collectives or the optimizer — where one shared ratio per sample cannot. A ridge term keeps
  every class near its robust anchor, so a class the samples cannot pin down stays there.

A class measured on its own (:meth:`Calibration.pin`: a site's nccl-tests all-reduce figure) is
not learned: whole-stage samples are explained by the other classes around its pinned time.

The state is plain JSON (:meth:`Calibration.to_json` / :meth:`Calibration.save` with an atomic
rename) so that it survives a daemon restart and can be reused for a new model whose
operation classes match.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections import Counter, deque
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from nereusd.errors import ConfigError, not_utf8, shortened

log = logging.getLogger(__name__)

GEMM = "gemm"
ATTENTION = "attention"
DECODE = "decode"            # a decode step at its roofline time (HBM- or compute-bound)
OPTIMIZER = "optimizer"      # HBM-bound optimizer update
LAUNCH = "launch"            # fixed per-layer dispatch time of each decode step (site layer_launch_us)
LINK_TYPES = ("intra", "inter")
COLLECTIVES = ("all_reduce", "all_gather", "p2p", "broadcast")


def comm_class(collective: str, link: str) -> str:
    """Operation class of a collective on a link type, e.g. ``all_reduce_inter``."""
    assert collective in COLLECTIVES and link in LINK_TYPES, (collective, link)
    return f"{collective}_{link}"


def grad_sync_class(link: str) -> str:
    """Operation class of the DP gradient all-reduce on a link type, e.g. ``grad_sync_inter``:
    an engine's gradient synchronisation (one flat all-reduce after the last micro-batch in the
    native engine; bucketed, in fp32 and overlapped with the backward in Megatron-core's and
    DeepSpeed's) is priced as a ring all-reduce of the gradient shard but learned apart from the
    layers' all-reduces (:func:`comm_class`), which a site's nccl-tests figure describes
    (:meth:`Calibration.pin`)."""
    assert link in LINK_TYPES, link
    return f"grad_sync_{link}"


def latency_class(link: str) -> str:
    """Operation class of collectives' per-call latency (the α of the α–β model) on a link type,
    e.g. ``latency_intra``: calibrated apart from their bytes over bandwidth (:func:`comm_class`),
    so a fit can tell a launch-bound collective from a bandwidth-bound one."""
    assert link in LINK_TYPES, link
    return f"latency_{link}"


#: Conservative priors: below typical achieved fractions of peak (dense bf16 GEMMs reach
#: 0.6–0.8 on H100/MI250X; NCCL ring all-reduce 0.7–0.9 of link bandwidth intra-node).
PRIORS: dict[str, float] = {
    GEMM: 0.45, ATTENTION: 0.30, DECODE: 0.50, OPTIMIZER: 0.50, LAUNCH: 1.0,
    **{comm_class(c, "intra"): 0.50 for c in COLLECTIVES},
    **{comm_class(c, "inter"): 0.40 for c in COLLECTIVES},
    grad_sync_class("intra"): 0.50, grad_sync_class("inter"): 0.40,   # as the all-reduces'
    latency_class("intra"): 0.50, latency_class("inter"): 0.40,   # as the collectives': unchanged sums
}
GENERATION_PREFIX = "generation_"


def generation_class(op_class: str) -> str:
    """The class of ``op_class`` when a generation engine runs it (a wave's prefill and decode).

    The engine's dispatch (:data:`LAUNCH`) and its collectives (a collective's bytes and its
    per-call latency) are classes of their own, ``generation_<class>``: vLLM runs its own
    scheduler per decode step and its own communicator (a shared-memory all-reduce on CPU,
    custom all-reduce or NCCL on GPUs), which cost what the training engines' gloo or NCCL calls
    do not. On this machine's local site a TP-2 decode step of vLLM took ~11 ms more than a
    TP-1 one, where 16 gloo all-reduces at the site's 2 ms each would take 32 ms
    (``scripts/bench_costmodel.py``, 2026-12-04). Compute and memory classes (GEMM, ATTENTION,
    DECODE) are the device's and stay shared. The weight synchronisation into the engine runs
    on the job's communicators and keeps their classes.
    """
    if op_class == LAUNCH or op_class.startswith(("latency_",) + COLLECTIVES):
        return GENERATION_PREFIX + op_class
    return op_class


PRIORS.update({generation_class(c): e for c, e in list(PRIORS.items()) if generation_class(c) != c})
"""A generation engine's classes start from the training engines' priors (so an uncalibrated
model prices both alike)."""
DEFAULT_PRIOR = 0.30
MIN_EFFICIENCY, MAX_EFFICIENCY = 1e-4, 1.5
MAX_EFFICIENCY_PER_CALL = 10.0
"""Upper bound of a class priced from a per-call time the site config estimates (a collective's
α, a layer's dispatch) rather than from a hardware peak: such a figure can overstate what an
engine pays several times over. Hardware-peak classes stay within :data:`MAX_EFFICIENCY`."""
MAX_EFFICIENCY_ENGINE_CALL = 1000.0
"""Upper bound of a generation engine's per-call collective latency (``generation_latency_<link>``):
the engine's own communicator is not the site's link. vLLM's shared-memory all-reduce on CPU
learned 445× the local site's gloo α (~9 µs a call against 4 ms) in ``scripts/bench_costmodel.py``
on 2026-12-05, where the cap of 10 left TP-2 rollouts over-predicted by 120–200 %."""


def max_efficiency(op_class: str) -> float:
    """The largest efficiency ``op_class`` may take: :data:`MAX_EFFICIENCY_ENGINE_CALL` for a
    generation engine's ``latency_<link>``, :data:`MAX_EFFICIENCY_PER_CALL` for the other
    per-call classes (``latency_<link>``, :data:`LAUNCH`, ``generation_launch``),
    :data:`MAX_EFFICIENCY` for the rest."""
    engine = op_class.startswith(GENERATION_PREFIX)
    base = op_class[len(GENERATION_PREFIX):] if engine else op_class
    if engine and base.startswith("latency_"):
        return MAX_EFFICIENCY_ENGINE_CALL
    return MAX_EFFICIENCY_PER_CALL if base == LAUNCH or base.startswith("latency_") else MAX_EFFICIENCY
STATE_VERSION = 2
"""2 adds the whole-stage samples of the least-squares fit; a version-1 state (anchors only) loads."""
RIDGE = 1e-2
"""Weight of the pull toward the robust anchor in :func:`fit_efficiencies`, per sample and per
class. Chosen on ``scripts/bench_costmodel.py --load`` of one 5-repetition run (held-out MAPE
23.6 % without the fit; 19.3, 18.9, 19.1, 21.2 % at 0.001, 0.01, 0.1, 1) and the simulator's
64-GPU ramp (nereus 3.6 % faster than frozen without the fit, 3.1 % at 0.01 and 0.1). On
2026-12-06 the benchmark's held-out training error was lower at 1e-4 (4.3–4.8 % against
6.9–8.2 % on two runs) and the simulated controller slower (``bench_sim.py --quick``: 1.4 %
slower than frozen against 0.1 % faster): a job calibrates on the layouts it runs and its
planner picks what the fit misprices lowest, which the strong pull limits (docs/RESULTS_LOG.md).
The benchmark prints both."""
MIN_FIT_SAMPLES = 2
MAX_WINDOW = 100_000
"""Largest sample window a saved calibration state may ask for (nereusd's default is 32)."""


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


def fit_efficiencies(samples: Sequence[tuple[Mapping[str, float], float]], anchor: Mapping[str, float],
                     ridge: float = RIDGE, pinned: Mapping[str, float] | None = None) -> dict[str, float]:
    """Per-class efficiencies that best explain whole-stage measured times.

    Each sample is ``(ideal_s_by_class, measured_s)``; the model ``measured ≈ Σ_c ideal_c · x_c``
    is linear in ``x_c = 1/efficiency_c``. Minimises ``Σ_i (Σ_c ideal_ic·x_c/measured_i − 1)²``
    (relative residuals: short and long stages weigh alike) plus ``ridge · n · Σ_c (x_c·anchor_c
    − 1)²`` over ``n`` samples: every class pays alike for a relative move off its anchor, so a
    class with a small share of the samples' time stays near it instead of absorbing their noise
    (a penalty scaled by the class's share let such classes swing to the efficiency bounds, and
    the simulator's ramp went from 3.6 % faster than frozen to 1.0 % slower). ``x_c`` outside
    ``[1/max_efficiency(c), 1/MIN_EFFICIENCY]`` (:func:`max_efficiency`) is fixed at the bound
    and the rest solved again. A class in ``pinned`` is fixed at its efficiency from the start.

    Returns:
        Efficiency per class that appears in a sample with positive ideal seconds (an unknown
        anchor counts as :data:`DEFAULT_PRIOR`); ``{}`` without such samples.
    """
    samples = [(ideal, float(meas)) for ideal, meas in samples
               if 0 < meas < math.inf and all(0 <= v < math.inf for v in ideal.values())]
    classes = sorted({c for ideal, _ in samples for c, v in ideal.items() if v > 0})
    if not classes:
        return {}
    a = np.array([[ideal.get(c, 0.0) / meas for c in classes] for ideal, meas in samples])
    keep = np.isfinite(a).all(axis=1)   # a ratio can still overflow (1e308 / 1e-300)
    if not keep.all():
        a, samples = a[keep], [x for x, k in zip(samples, keep) if k]
        if not samples:
            return {}
    x0 = np.array([1.0 / min(max_efficiency(c), max(MIN_EFFICIENCY, anchor.get(c, DEFAULT_PRIOR)))
                   for c in classes])
    weight = ridge * len(samples) * np.diag(1.0 / x0 ** 2)
    lows, hi = [1.0 / max_efficiency(c) for c in classes], 1.0 / MIN_EFFICIENCY
    fixed = {k: 1.0 / pinned[c] for k, c in enumerate(classes) if pinned and c in pinned}
    x = x0.copy()
    x[list(fixed)] = list(fixed.values())
    for _ in classes:
        free = [k for k in range(len(classes)) if k not in fixed]
        if not free:
            break
        rhs = np.ones(len(samples))
        if fixed:
            rhs -= a[:, list(fixed)] @ np.array(list(fixed.values()))
        w = weight[np.ix_(free, free)]
        try:
            solved = np.linalg.solve(a[:, free].T @ a[:, free] + w, a[:, free].T @ rhs + w @ x0[free])
        except np.linalg.LinAlgError:   # singular in floating point: a measured 1e-9 s beside 529 s
            return {}
        if not np.isfinite(solved).all():
            return {}   # ill-conditioned: the callers keep the anchors
        x[free] = solved
        out = {k: (lows[k] if x[k] < lows[k] else hi) for k in free if not lows[k] <= x[k] <= hi}
        if not out:
            break
        fixed.update(out)
        x[list(out)] = list(out.values())
    return {c: float(1.0 / x[k]) for k, c in enumerate(classes)}


class Calibration:
    """Per operation class efficiency estimates.

    Args:
        priors: efficiency per class before any sample (defaults: :data:`PRIORS`).
        window: samples kept per class (the oldest are dropped, so drift is followed).
        prior_weight: how many samples the prior counts for in the median.
        ridge: the least-squares fit's pull toward the anchors (:data:`RIDGE`; not part of the
            saved state: a restored calibration takes the one it was constructed with).
    """

    def __init__(self, priors: Mapping[str, float] | None = None, window: int = 32,
                 prior_weight: float = 2.0, ridge: float = RIDGE) -> None:
        self.priors = dict(PRIORS if priors is None else priors)
        self.window = window
        self.prior_weight = prior_weight
        self.ridge = ridge
        self._samples: dict[str, deque[float]] = {}
        self._stages: deque[tuple[dict[str, float], float]] = deque(maxlen=window)
        self._fitted: dict[str, float] | None = None
        self.pinned: dict[str, float] = {}
        """Classes measured on their own (:meth:`pin`); not part of the saved state."""

    def pin(self, op_class: str, efficiency: float) -> None:
        """Fix ``op_class`` at ``efficiency``, measured on its own (a site's nccl-tests figure,
        :attr:`~nereusd.config.site.NetworkSpec.intra_node_all_reduce_efficiency`): its samples
        are no longer taken, and a whole stage's measured time is explained by its other classes
        around the pinned class's predicted time. On one layout a stage's classes grow together,
        so learning them all lets a share of what the model lacks elsewhere (element-wise work,
        small-GEMM efficiency) land on the collectives, and plans that use more of them are
        over-priced (the simulator's A100 ramp, ``docs/RESULTS_LOG.md``, 2026-12-06).

        Raises:
            ConfigError: ``efficiency`` outside ``[MIN_EFFICIENCY, max_efficiency(op_class)]``.
        """
        if not MIN_EFFICIENCY <= efficiency <= max_efficiency(op_class):
            raise ConfigError(f"pinned efficiency of {op_class}: expected {MIN_EFFICIENCY:g} to "
                              f"{max_efficiency(op_class):g}, got {efficiency!r}")
        self.pinned[op_class] = float(efficiency)
        self._fitted = None

    def efficiency(self, op_class: str) -> float:
        """Current efficiency of ``op_class`` in (0, :func:`max_efficiency`]: the pinned one
        (:meth:`pin`), else the least-squares fit where at least :data:`MIN_FIT_SAMPLES` whole-stage
        samples cover the class, else the robust anchor."""
        if op_class in self.pinned:
            return self.pinned[op_class]
        if self._fitted is None:
            self._fitted = {}
            covered = Counter(c for ideal, _ in self._stages for c, v in ideal.items() if v > 0)
            if covered and max(covered.values()) >= MIN_FIT_SAMPLES:
                fitted = fit_efficiencies(self._stages, {c: self.anchor(c) for c in covered}, self.ridge,
                                          self.pinned)
                self._fitted = {c: e for c, e in fitted.items() if covered[c] >= MIN_FIT_SAMPLES}
        fitted = self._fitted.get(op_class)
        return fitted if fitted is not None else self.anchor(op_class)

    def anchor(self, op_class: str) -> float:
        """The robust estimate of ``op_class``: weighted median of its samples and its prior."""
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
        must not stop a job; so is a sample of a pinned class (:meth:`pin`).
        """
        if op_class in self.pinned:
            return
        if not (ideal_s > 0 and measured_s > 0) or ideal_s == float("inf") or measured_s == float("inf"):
            log.debug("calibration: ignoring %s sample ideal=%r measured=%r", op_class, ideal_s, measured_s)
            return
        sample = min(max_efficiency(op_class), max(MIN_EFFICIENCY, ideal_s / measured_s))
        self._samples.setdefault(op_class, deque(maxlen=self.window)).append(sample)
        self._fitted = None

    def observe_stage(self, ideal_s_by_class: Mapping[str, float], measured_s: float) -> None:
        """Learn from one model-stage's total measured time when per-class times are unknown.

        The measured time, less the pinned classes' predicted seconds (:meth:`pin`), is split
        over the other classes in proportion to their *predicted* seconds (``ideal /
        efficiency``), and each share gives one sample of its class's anchor (none when the
        pinned classes alone were predicted to take longer); the whole sample joins the
        least-squares window (module docstring).
        """
        predicted = {c: s / self.efficiency(c) for c, s in ideal_s_by_class.items() if 0 < s < float("inf")}
        learned = {c: s for c, s in predicted.items() if c not in self.pinned}
        total = sum(learned.values())
        pinned_s = sum(predicted.values()) - total
        if total + pinned_s <= 0 or not 0 < measured_s < float("inf"):
            return
        rest = measured_s - pinned_s
        for op_class, seconds in learned.items() if rest > 0 else ():
            self.observe(op_class, ideal_s_by_class[op_class], rest * seconds / total)
        self._stages.append(({c: float(ideal_s_by_class[c]) for c in predicted}, float(measured_s)))
        self._fitted = None

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
            "stages": [[ideal, measured] for ideal, measured in self._stages],
        }

    @classmethod
    def from_json(cls, data: Mapping, source: str = "calibration") -> "Calibration":
        """Rebuild from :meth:`to_json` output.

        Raises:
            ConfigError: on another version or malformed content, naming ``source``.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: expected a calibration state (a JSON object written by nereusd), "
                              f"got a {type(data).__name__}")
        version = data.get("version")
        if version not in (1, STATE_VERSION):
            raise ConfigError(f"{source}: version: expected 1 or {STATE_VERSION}, got {version!r}")
        def number(value: object, low: float, high: float, what: str) -> float:
            x = float(value)   # TypeError/ValueError: reported below
            if not low <= x <= high:   # NaN fails too
                raise ValueError(f"{what} {x!r} outside [{low:g}, {high:g}]")
            return x

        try:
            window = data["window"]
            if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_WINDOW:
                raise ValueError(f"window {str(window)[:40]} is not an integer from 1 to {MAX_WINDOW:,}")
            cal = cls(priors={str(k): number(v, MIN_EFFICIENCY, max_efficiency(str(k)), f"prior of {k}")
                              for k, v in data["priors"].items()},
                      window=window, prior_weight=number(data["prior_weight"], 0.0, 1e6, "prior_weight"))
            for op_class, values in data["samples"].items():
                cal._samples[str(op_class)] = deque(
                    (number(v, MIN_EFFICIENCY, max_efficiency(str(op_class)), f"sample of {op_class}") for v in values),
                    maxlen=cal.window)
            for ideal, measured in data.get("stages", []) if version > 1 else []:
                cal._stages.append(({str(c): number(v, 0.0, 1e9, f"stage ideal_s of {c}") for c, v in ideal.items()},
                                    number(measured, 1e-12, 1e9, "stage measured_s")))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:   # 10**400 overflows float()
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
        self._stages, self._fitted = other._stages, None

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
        try:
            if not path.exists():
                return cls()
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON: {err}") from None
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: {not_utf8(err)}; is it a calibration "
                              "file?") from None
        except OSError as err:
            raise ConfigError(f"{shortened(str(path))}: cannot read it ({err.strerror})") from None
        return cls.from_json(data, source=str(path))
