"""Vectorised cost of many candidates of one model-stage at once (the planner's fast path).

The planner costs thousands of candidates per replan (every DP degree of every ``(tp, pp,
micro_batch)``). :func:`latencies` computes, for one ``(tp, pp)`` block and arrays of DP
degrees and per-replica micro-batches, the same latencies as
:meth:`nereusd.cost.model.CostModel.stage_cost` — the same formulas (see that module's
docstring for their sources), evaluated with numpy over the DP axis instead of once per
candidate. Per-micro-batch costs come from the cost model's own cache, so learned
efficiencies and the roofline choice of decoding are shared with the scalar path. Results
agree with :meth:`~nereusd.cost.model.CostModel.stage_cost` to floating-point rounding
(summation order may differ; tests check agreement to 1e-12 relative).
"""

from __future__ import annotations

import math

import numpy as np

from nereusd.cost.calibration import DECODE, LAUNCH, comm_class, generation_class, grad_sync_class, latency_class
from nereusd.cost.formulas import (continuous_batching, decode_step_s, p2p_parts, pipeline_slots,
                                   ring_collective_parts)
from nereusd.cost.memory import kv_bytes_per_token
from nereusd.cost.model import CostModel, layer_parameters
from nereusd.models import ModelSpec
from nereusd.plan import ModelStage, Stage
from nereusd.shards import value_head_for


def _ceil_div(a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
    return -(-np.asarray(a, dtype=np.int64) // np.asarray(b, dtype=np.int64))


class _Sum:
    """Seconds at peak per operation class as arrays over candidates."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ideal: dict[str, np.ndarray] = {}

    def add(self, op_class: str, seconds) -> None:
        have = self.ideal.get(op_class)
        if have is None:
            self.ideal[op_class] = np.full(self.n, seconds, dtype=np.float64) if np.ndim(seconds) == 0 \
                else np.asarray(seconds, dtype=np.float64)
        else:
            self.ideal[op_class] = have + seconds

    def latency(self, cm: CostModel) -> np.ndarray:
        out = np.zeros(self.n)
        for c, s in self.ideal.items():
            out += s / cm.efficiency(c)
        return out


def latencies(cm: CostModel, spec: ModelSpec, model_stage: ModelStage, *, sequences: int, prompt_length: int,
              response_length: int, tp: int, pp: int, dp: np.ndarray, micro_batch: np.ndarray,
              recompute: np.ndarray, mini_batches: int = 1, response_mean_fraction: float = 1.0,
              epochs: int = 1) -> np.ndarray:
    """Predicted seconds per RL step of ``model_stage`` for each candidate ``⟨tp, pp, dp[i]⟩``
    with per-replica micro-batch ``micro_batch[i]`` and recomputation ``recompute[i]``.

    Args and units as :meth:`CostModel.stage_cost`; ``dp``, ``micro_batch`` and ``recompute``
    are equal-length 1-d arrays. Returns a float64 array of seconds.
    """
    dp = np.asarray(dp, dtype=np.int64)
    mb = np.asarray(micro_batch, dtype=np.int64)
    rc = np.asarray(recompute, dtype=bool)
    n = len(dp)
    acc = _Sum(n)
    per_replica = _ceil_div(sequences, dp)
    dpn = cm.site.devices_per_node
    e = cm.bytes_per_element
    if model_stage.stage is Stage.GENERATION:
        concurrent = np.maximum(1, np.minimum(mb, per_replica))
        waves = _ceil_div(per_replica, concurrent)
        _add_per_mb(cm, acc, spec, True, prompt_length, tp, pp, concurrent, np.zeros(n, bool),
                    pipeline_slots(waves, pp, _lone_speedup(cm, tp * pp * dp)), False, launch=False,
                    classes=generation_class, prefill=True)
        _add_decode(cm, acc, spec, per_replica, concurrent, waves, prompt_length, response_length,
                    response_mean_fraction, tp, pp)
        spans = tp * pp * dp > dpn
        weights = cm._params(spec, tp, pp) * e
        for flag, link in ((False, "intra"), (True, "inter")):
            _, bw, alpha = cm.link(flag)
            bandwidth_s, per_call_s = p2p_parts(weights, bw, alpha)
            acc.add(comm_class("broadcast", link), np.where(spans == flag, bandwidth_s, 0.0))
            acc.add(latency_class(link), np.where(spans == flag, per_call_s, 0.0))
        return acc.latency(cm)
    training = model_stage.stage is Stage.TRAINING
    minis = mini_batches if training else 1
    b = np.maximum(1, np.minimum(mb, per_replica))
    micro_per_opt = np.maximum(1, _ceil_div(per_replica, b * minis))
    lm_head = not value_head_for(model_stage.role)
    _add_per_mb(cm, acc, spec, lm_head, prompt_length + response_length, tp, pp, b, rc,
                minis * pipeline_slots(micro_per_opt, pp, _lone_speedup(cm, tp * pp * dp)), training)
    if training:   # CostModel._optimizer_step, with the DP all-reduce over the dp axis
        shard = cm._params(spec, tp, pp, not lm_head)
        spans = tp * pp * dp > dpn
        for flag, link in ((False, "intra"), (True, "inter")):
            _, bw, alpha = cm.link(flag)
            bandwidth_s, per_call_s = ring_collective_parts("all_reduce", shard * e, dp, bw, alpha,
                                                            cm.latency_growth(link))
            acc.add(grad_sync_class(link), np.where((spans == flag) & (dp > 1), bandwidth_s * minis, 0.0))
            acc.add(latency_class(link), np.where((spans == flag) & (dp > 1), per_call_s * minis, 0.0))
        for c, v in cm._optimizer_step(spec, tp, pp, 1, minis, not lm_head).ideal.items():   # dp 1: no DP all-reduce
            acc.add(c, v)
        return acc.latency(cm) * epochs   # CostModel.stage_cost: every pass costs the same
    return acc.latency(cm)


def _lone_speedup(cm: CostModel, devices: np.ndarray) -> np.ndarray | float:
    """:meth:`~nereusd.config.site.SiteConfig.lone_speedup` over an array of device counts (a
    scalar 1.0 where no device shares cores, the common case)."""
    if not cm.site.device.host_cores:
        return 1.0
    return np.array([cm.site.lone_speedup(int(g)) for g in np.asarray(devices).tolist()], dtype=np.float64)


def _add_per_mb(cm: CostModel, acc: _Sum, spec: ModelSpec, lm_head: bool, seq: int, tp: int, pp: int,
                b: np.ndarray, rc: np.ndarray, slots: np.ndarray, training: bool, launch: bool = True,
                classes=lambda c: c, prefill: bool = False) -> None:
    """``slots ×`` the cached per-micro-batch cost, for each distinct ``(b, recompute)``
    (``launch``: with its per-layer dispatch, ``prefill``: the head at the last position only,
    as :meth:`CostModel._micro_batch`; ``classes`` maps its operation classes, e.g. to a
    generation engine's)."""
    groups = sorted(set(zip(b.tolist(), rc.tolist())))
    for bb, rr in groups:
        scaled = slots if len(groups) == 1 else np.where((b == bb) & (rc == rr), slots, 0)
        for c, v in cm._per_mb_items(spec, lm_head, seq, tp, pp, bb, training, rr, launch, prefill):
            acc.add(classes(c), v * scaled)


def _add_decode(cm: CostModel, acc: _Sum, spec: ModelSpec, per_replica: np.ndarray, concurrent: np.ndarray,
                waves: np.ndarray, prompt: int, response: int, mean_fraction: float, tp: int, pp: int) -> None:
    """:meth:`CostModel._decode` of ``per_replica`` sequences, ``concurrent`` at once, over arrays."""
    e = cm.bytes_per_element
    h, d = spec.hidden_size, spec.head_dim
    layers = math.ceil(spec.num_layers / pp)
    q = spec.num_heads * d
    weights = cm._params(spec, tp, pp)
    steps, c = continuous_batching(per_replica.astype(np.float64), concurrent.astype(np.float64), response,
                                   mean_fraction)
    mean_context = prompt + mean_fraction * response / 2.0
    step_s = decode_step_s(pp * weights * e, c * mean_context * kv_bytes_per_token(spec, tp, pp, e),
                           2 * (layers * layer_parameters(spec) + spec.vocab_size * h) * c / tp,
                           4 * layers * q * mean_context * c / tp, cm.site.hbm_bytes_per_s, cm.peak_flops)
    acc.add(DECODE, step_s * steps)
    if cm.site.layer_launch_s:
        acc.add(generation_class(LAUNCH), cm.site.layer_launch_s * spec.num_layers * (steps + waves))
    nbytes = c * h * e / pp
    if tp > 1:
        link, bw, alpha = cm.link(cm.spans_nodes(tp))
        bandwidth_s, per_call_s = ring_collective_parts("all_reduce", nbytes, tp, bw, alpha, cm.latency_growth(link))
        acc.add(generation_class(comm_class("all_reduce", link)), bandwidth_s * (2 * spec.num_layers) * steps)
        acc.add(generation_class(latency_class(link)), per_call_s * (2 * spec.num_layers) * steps)
    if pp > 1:
        link, bw, alpha = cm.link(cm.spans_nodes(tp * pp))
        bandwidth_s, per_call_s = p2p_parts(nbytes, bw, alpha)
        acc.add(generation_class(comm_class("p2p", link)), bandwidth_s * pp * steps)
        acc.add(generation_class(latency_class(link)), per_call_s * pp * steps)
