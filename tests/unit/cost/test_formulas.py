"""The communication and update terms of the cost model (nereusd.cost.formulas)."""

from __future__ import annotations

import numpy as np
import pytest

from nereusd.cost.formulas import (ADAM_BYTES_MOVED_PER_PARAM, adam_update_s, continuous_batching, local_copy_s,
                                   p2p_parts, p2p_s, ring_collective_parts, ring_collective_s)
from nereusd.sim.measured import _slot_ends


def test_ring_collectives():
    bw, alpha = 1e9, 1e-5
    assert ring_collective_s("all_reduce", 1e9, 1, bw, alpha) == 0.0          # one rank: nothing moves
    # 8 ranks: 2·7/8 of the buffer over the link (ring), 2·log2 8 = 6 latencies (Rabenseifner)
    assert ring_collective_s("all_reduce", 1e9, 8, bw, alpha) == pytest.approx(1.75 + 6e-5)
    assert ring_collective_s("all_gather", 1e9, 8, bw, alpha) == pytest.approx((1.75 + 6e-5) / 2)
    # two ranks: the ring's 2 α; then the latency grows with log2 of the group, not linearly
    assert ring_collective_parts("all_reduce", 1.0, 2, bw, alpha)[1] == pytest.approx(2e-5)
    assert ring_collective_parts("all_reduce", 1.0, 3, bw, alpha)[1] == pytest.approx(4e-5)
    assert ring_collective_parts("all_reduce", 1.0, 64, bw, alpha)[1] == pytest.approx(12e-5)
    with pytest.raises(KeyError):
        ring_collective_s("broadcast", 1.0, 2, bw, alpha)
    # the α–β terms apart, as the cost model calibrates them
    assert ring_collective_parts("all_reduce", 1e9, 8, bw, alpha) == pytest.approx((1.75, 6e-5))
    assert p2p_parts(2e9, 1e9, 0.5) == (2.0, 0.5)


def test_a_measured_latency_growth_carries_the_2_rank_latency_to_larger_groups():
    """``latency_growth`` g: per call ``factor·α·(1 + g·(⌈log2 n⌉ − 1))``; g = 1 is Rabenseifner's
    (the default), g = 0.5 a library whose 8-rank latency is twice its 2-rank one, as
    ``(t8 − t2)/(2·t2)`` reads it back."""
    bw, alpha = 1e9, 1e-5
    for n in (1, 2, 3, 4, 8, 64):
        assert ring_collective_parts("all_reduce", 1.0, n, bw, alpha, 1.0) == ring_collective_parts(
            "all_reduce", 1.0, n, bw, alpha)
    t = {n: ring_collective_parts("all_reduce", 1.0, n, bw, alpha, 0.5)[1] for n in (1, 2, 4, 8)}
    assert t == pytest.approx({1: 0.0, 2: 2e-5, 4: 3e-5, 8: 4e-5})
    assert (t[8] - t[2]) / (2 * t[2]) == pytest.approx(0.5)
    assert ring_collective_parts("all_gather", 1.0, 8, bw, alpha, 0.0)[1] == pytest.approx(1e-5)   # flat: one pass
    per_call = ring_collective_parts("all_reduce", 1.0, np.array([1, 2, 8]), bw, alpha, 0.5)[1]
    assert per_call == pytest.approx([0.0, 2e-5, 4e-5])


def test_terms_take_arrays_and_scalars_alike():
    ranks = np.array([1, 2, 4, 8])
    vec = ring_collective_s("all_reduce", 4096.0, ranks, 2e9, 1e-6)
    assert vec.tolist() == [ring_collective_s("all_reduce", 4096.0, int(n), 2e9, 1e-6) for n in ranks]
    assert p2p_s(2e9, 1e9, 0.5) == 2.5 and local_copy_s(1e9, 2e9) == 1.0
    assert adam_update_s(1e9, 2, 64e9) == 2 * 1e9 * ADAM_BYTES_MOVED_PER_PARAM / 64e9


def test_continuous_batching_is_the_waves_model_for_equal_lengths_and_tracks_fcfs_slots():
    # equal lengths, slots dividing the sequences: 4 waves of 100 steps at a full batch of 16
    steps, batch = continuous_batching(64, 16, 100)
    assert (steps, batch) == (400, 16)
    # no more sequences than slots: the longest response sets the steps; the batch shrinks
    assert continuous_batching(10, 16, 100, 0.4) == (100, pytest.approx(4.0))
    # arrays and scalars alike (the planner's fast path)
    vec = continuous_batching(np.array([64.0, 10.0]), np.array([16.0, 10.0]), 100, 0.5)
    assert vec[0].tolist() == [continuous_batching(64, 16, 100, 0.5)[0], 100.0]
    # against first-come-first-served slots over log-normal lengths (what vLLM's scheduler does and
    # the simulator's measured truth times): the mean ratio over 20 draws within -15 % / +30 %
    rng = np.random.default_rng(0)
    for sigma in (0.2, 0.41, 0.8):
        for n, slots in ((128, 64), (100, 64), (256, 64), (512, 32), (1024, 16), (64, 8), (300, 128)):
            ratios = []
            for _ in range(20):
                x = np.exp(rng.normal(0.0, sigma, n))
                lengths = np.maximum(1.0, np.round(1000 * x / x.max()))
                steps, batch = continuous_batching(n, slots, 1000, lengths.mean() / 1000)
                ratios.append(steps / _slot_ends(lengths, slots).max())
                assert batch * steps == pytest.approx(lengths.sum())   # every token decoded once
                assert batch <= slots
            assert 0.85 < np.mean(ratios) < 1.3, (sigma, n, slots)
