"""The communication and update terms of the cost model (nereusd.cost.formulas)."""

from __future__ import annotations

import numpy as np
import pytest

from nereusd.cost.formulas import (ADAM_BYTES_MOVED_PER_PARAM, adam_update_s, local_copy_s, p2p_parts, p2p_s,
                                   ring_collective_parts, ring_collective_s)


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


def test_terms_take_arrays_and_scalars_alike():
    ranks = np.array([1, 2, 4, 8])
    vec = ring_collective_s("all_reduce", 4096.0, ranks, 2e9, 1e-6)
    assert vec.tolist() == [ring_collective_s("all_reduce", 4096.0, int(n), 2e9, 1e-6) for n in ranks]
    assert p2p_s(2e9, 1e9, 0.5) == 2.5 and local_copy_s(1e9, 2e9) == 1.0
    assert adam_update_s(1e9, 2, 64e9) == 2 * 1e9 * ADAM_BYTES_MOVED_PER_PARAM / 64e9
