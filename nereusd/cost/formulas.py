"""The cost model's communication and update terms, each written once.

Every function is plain arithmetic, so it takes scalars or numpy arrays alike: the scalar cost
model (:mod:`nereusd.cost.model`), its vectorised fast path (:mod:`nereusd.cost.vector`) and the
transition engine's link prices (:mod:`nereusd.transition.cost`) call the same expression in the
same order of operations, which is why their results agree to the bit. Units: bytes, bytes per
second, seconds.
"""

from __future__ import annotations

import numpy as np

ADAM_BYTES_MOVED_PER_PARAM = 32
"""Bytes read and written per parameter by one Adam update at ZeRO-0 with fp32 state: parameter,
gradient, master copy, ``m`` and ``v``, each read and written."""

_RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}


def ring_collective_s(collective: str, nbytes, ranks, bandwidth_bytes_per_s: float, latency_s: float,
                      latency_growth: float = 1.0):
    """Seconds of a ``collective`` of ``nbytes`` per rank over ``ranks`` ranks: the ring's
    bandwidth term and the logarithmic latency term of :func:`ring_collective_parts`.

    All-reduce: ``2(n−1)/n · bytes / bw + 2⌈log2 n⌉·α``; all-gather and reduce-scatter half of
    it. One rank costs nothing.

    Raises:
        KeyError: for another collective.
    """
    bandwidth_s, per_call_s = ring_collective_parts(collective, nbytes, ranks, bandwidth_bytes_per_s, latency_s,
                                                    latency_growth)
    return bandwidth_s + per_call_s


def ring_collective_parts(collective: str, nbytes, ranks, bandwidth_bytes_per_s: float, latency_s: float,
                          latency_growth: float = 1.0):
    """The two terms ``(bytes over bandwidth, per-call latency)`` of a collective, which the cost
    model calibrates as separate classes (the α–β model; on gloo the per-call term is ~5 ms
    whatever the size).

    Bandwidth: the ring's ``2(n−1)/n · bytes / bw`` for an all-reduce (half for all-gather and
    reduce-scatter), optimal for large messages. Latency: ``2⌈log2 n⌉·α`` for an all-reduce
    (``⌈log2 n⌉·α`` for the others), the latency term of Rabenseifner's reduce-scatter +
    all-gather and of recursive doubling/halving, which libraries use where latency matters
    (Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in
    MPICH", IJHPCA 2005, §4; NCCL's trees and NVLink SHARP likewise grow with ``log n`` or not
    at all). The ring's own ``2(n−1)·α`` made a TP-8 decode step's 64 small all-reduces cost 14 α
    each, so a controller calibrated at TP 4 judged TP 2 better than a log-latency truth does
    (:mod:`nereusd.sim.measured`). Equal to the ring's at two ranks. Scalars or numpy arrays.

    ``latency_growth`` ``g`` (the site's ``*_latency_growth``, measured: nccl-tests'
    ``all_reduce_perf`` at a few bytes over 2, 4 and 8 ranks) is what each doubling of the group
    adds to the 2-rank latency, as a share of it: per call ``factor·α·(1 + g·(⌈log2 n⌉ − 1))``.
    ``g = 1`` is Rabenseifner's ``factor·⌈log2 n⌉·α``; a library whose small collectives run in
    one tree or one NVLink SHARP pass grows less. Calibration scales ``α`` from the group sizes a
    job runs; ``g`` is what carries it to the sizes it has not run: with ``g = 1`` a controller
    calibrated on TP-4 engines priced a TP-8 decode step's 64 all-reduces 1.1 s dearer than TP 4,
    and kept generating at TP 4 where TP 8 ran 13 % faster (``scripts/bench_sim.py --seeds``,
    2026-12-06)."""
    factor = _RING_FACTOR[collective]
    steps = np.ceil(np.log2(np.maximum(ranks, 1)))
    per_call = factor * np.where(steps > 0, 1.0 + latency_growth * (steps - 1.0), 0.0) * latency_s
    return factor * (ranks - 1) / ranks * nbytes / bandwidth_bytes_per_s, (
        float(per_call) if np.ndim(per_call) == 0 else per_call)


def p2p_s(nbytes, bandwidth_bytes_per_s: float, latency_s: float):
    """Seconds of one message of ``nbytes``: ``bytes / bw + α`` (the α-β model, Hockney 1994)."""
    return nbytes / bandwidth_bytes_per_s + latency_s


def p2p_parts(nbytes, bandwidth_bytes_per_s: float, latency_s: float):
    """:func:`p2p_s` as its two terms ``(bytes / bw, α)``."""
    return nbytes / bandwidth_bytes_per_s, latency_s


def local_copy_s(nbytes, hbm_bytes_per_s: float):
    """Seconds to copy ``nbytes`` inside one device's memory: read and write, ``2 · bytes / hbm``."""
    return 2.0 * nbytes / hbm_bytes_per_s


def adam_update_s(parameters, optimizer_steps, hbm_bytes_per_s: float):
    """Seconds of ``optimizer_steps`` Adam updates of ``parameters`` on one device: memory-bound,
    ``steps · P · ADAM_BYTES_MOVED_PER_PARAM / hbm`` (:data:`ADAM_BYTES_MOVED_PER_PARAM`)."""
    return optimizer_steps * parameters * ADAM_BYTES_MOVED_PER_PARAM / hbm_bytes_per_s


def decode_step_s(weight_bytes, kv_bytes, gemm_flops, attention_flops, hbm_bytes_per_s: float, peak_flops: float):
    """Ideal seconds of one decode step on one device (scalars or arrays).

    Its GEMMs and its attention (PagedAttention, a kernel of its own: Kwon et al. 2023) each take
    their roofline time (Williams et al. 2009), the slower of their HBM traffic and their FLOPs
    at peak, and the two add:

        max(weight_bytes / hbm, gemm_flops / peak) + max(kv_bytes / hbm, attention_flops / peak)

    Both HBM-bound, it is all the bytes over bandwidth.
    """
    return (np.maximum(weight_bytes / hbm_bytes_per_s, gemm_flops / peak_flops)
            + np.maximum(kv_bytes / hbm_bytes_per_s, attention_flops / peak_flops))


def continuous_batching(per_replica, concurrent, response_length, mean_fraction: float = 1.0):
    """Decode steps and mean running batch of one replica's continuous-batching decode.

    A replica decodes ``per_replica`` sequences with at most ``concurrent`` running at once (its
    KV-cache slots); a finished sequence's slot takes the next waiting one (vLLM's scheduler).
    With responses of mean ``m = mean_fraction · response_length`` tokens and longest
    ``L = response_length``, the replica runs

        steps = L + max(0, per_replica − concurrent) · m / concurrent

    decode steps: the longest response bounds the first ``concurrent`` sequences' time and the
    remaining sequences' work spreads over the slots. This is Graham's list-scheduling bound
    (makespan ≤ T/c + (1 − 1/c)·L, Graham 1969) with the first slots' work counted once in
    ``L``. Against first-come-first-served slots over log-normal lengths (σ 0.2–0.8, 64–1,024
    sequences, 8–128 slots, 20 draws each) its mean ratio to the true makespan is 0.90–1.22,
    single draws 0.83–1.52 (over where one very long response outlasts the rest's work;
    ``tests/unit/cost/test_formulas.py``). With equal lengths
    (``mean_fraction`` 1) and ``concurrent`` dividing ``per_replica`` it is the waves model,
    ``per_replica / concurrent`` waves of ``L`` steps.

    The running batch averages ``per_replica · m / steps`` sequences (≤ ``concurrent``): the
    tokens decoded over the steps.

    Args:
        per_replica: sequences of the replica (≥ 1; scalar or array).
        concurrent: running sequences at most (≥ 1, ≤ ``per_replica``).
        response_length: the longest response in tokens.
        mean_fraction: mean response length over the longest, in (0, 1].

    Returns:
        ``(steps, batch)``: decode steps and mean running sequences per step (floats or arrays).
    """
    mean = mean_fraction * response_length
    steps = response_length + np.maximum(0, per_replica - concurrent) * mean / concurrent
    return steps, per_replica * mean / steps


def pipeline_slots(micro_batches, pp: int, lone_speedup=1.0):
    """Micro-batch slots on a replica's critical path: ``m + pp − 1`` for ``m`` micro-batches
    through ``pp`` stages (the GPipe/1F1B bubble ``(pp−1)/(m+pp−1)``, Narayanan et al. 2021
    §2.2), each slot one micro-batch through one stage at the device's speed.

    ``lone_speedup`` (:meth:`nereusd.config.site.SiteConfig.lone_speedup`, > 1 only for virtual
    CPU devices sharing a node's cores, and only for a model-stage that holds every device of its
    nodes): a stage idle in the fill or drain lends its core to the busy ones, so the time is
    the larger of the node's work, ``m`` slots at the shared speed, and the critical path at a
    lone device's speed, ``(m + pp − 1) / lone_speedup`` (a work-conserving schedule's two
    lower bounds; Graham 1969). Scalars or numpy arrays. Training, inference and a generation's
    prefill passes use it; a pipelined generation's decode steps (``generation_pp`` only) keep
    their own count.
    """
    slots = micro_batches + pp - 1
    if np.ndim(lone_speedup) == 0 and lone_speedup <= 1.0:
        return slots
    return np.maximum(micro_batches, slots / lone_speedup) if np.ndim(micro_batches) or np.ndim(lone_speedup) \
        else max(micro_batches, slots / lone_speedup)
