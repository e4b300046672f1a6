"""The coming step's longest response (nereusd/control/lookahead.py)."""

import math

import pytest

from nereusd.control.lookahead import JUMP_SAFETY, LENGTH_WINDOW, MIN_MARGIN, LengthLookahead


def test_the_drift_threshold_until_a_window_is_seen_then_the_run_s_own_jumps():
    la = LengthLookahead(0.30)
    assert la.coming(100, 10_000) == 130
    lengths = [100, 103, 101, 104, 102, 105, 103, 106]   # the largest jump: 103 over 100
    for length in lengths:
        la.observe(length)
    jump = 0.03
    assert la.jump == pytest.approx(jump)
    assert la.margin() == pytest.approx(max(MIN_MARGIN, JUMP_SAFETY * jump))
    # the base is the window's largest, not the argument, when that is shorter
    assert la.coming(90, 10_000) == math.ceil(106 * (1 + la.margin()))
    assert la.coming(10_000, 10_000) == 10_000   # capped at max_new_tokens


def test_a_jump_widens_the_margin_up_to_the_drift_threshold():
    la = LengthLookahead(0.30)
    for length in [100] * LENGTH_WINDOW + [110]:
        la.observe(length)
    assert la.margin() == pytest.approx(JUMP_SAFETY * 0.10)
    la.observe(200)   # 200 over 110: 82 %, the margin stays at δ_len
    assert la.margin() == 0.30
    assert la.coming(50, 10_000) == math.ceil(200 * 1.3)


def test_the_state_round_trips_and_a_malformed_one_changes_nothing():
    la = LengthLookahead(0.30)
    for length in range(100, 120):
        la.observe(length)
    copy = LengthLookahead(0.30)
    copy.restore(la.to_json())
    assert (list(copy.window), copy.jump, copy.seen) == (list(la.window), la.jump, la.seen)
    for bad in ({"window": [0], "jump": 0.1, "seen": 3}, {"window": [5], "jump": float("nan"), "seen": 3},
                {"window": [5], "seen": 3}, {"window": "ab", "jump": 0.1, "seen": 3}):
        with pytest.raises((KeyError, TypeError, ValueError)):
            copy.restore(bad)
        assert copy.to_json() == la.to_json()


def test_growth_is_the_trend_of_the_recent_longest_responses():
    """The fit reads a noisy 1 %-per-step ramp as about 1 %; flat, falling or too short a
    history reads no growth; the history survives a round trip, and a state written before it
    existed restores from its window."""
    from nereusd.control.lookahead import GROWTH_MIN_STEPS, GROWTH_WINDOW

    ramp = LengthLookahead(0.30)
    for i in range(100):
        ramp.observe(round(500 * 1.01 ** i * (1.04 if i % 3 == 0 else 0.98)))   # a batch's maximum jitters
    assert ramp.growth_per_step() == pytest.approx(0.01, abs=0.002)
    assert len(ramp.history) == GROWTH_WINDOW
    copy = LengthLookahead(0.30)
    copy.restore(ramp.to_json())
    assert copy.growth_per_step() == ramp.growth_per_step()
    old = {k: v for k, v in ramp.to_json().items() if k != "history"}
    copy.restore(old)
    assert list(copy.history) == list(ramp.window)
    for lengths in ([700] * 40, [round(900 * 0.99 ** i) for i in range(40)],
                    [round(500 * 1.05 ** i) for i in range(GROWTH_MIN_STEPS - 1)]):
        la = LengthLookahead(0.30)
        for length in lengths:
            la.observe(length)
        assert la.growth_per_step() == 0.0, lengths
