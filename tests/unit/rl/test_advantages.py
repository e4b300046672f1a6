"""Advantages, returns and global token weights against hand-computed numbers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nereusd.rl import (
    LossAggregation,
    broadcast_to_tokens,
    gae,
    grpo_advantages,
    pad,
    remax_advantages,
    token_rewards,
    token_weights,
    whiten,
)


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-9)


def test_token_rewards_put_score_on_last_token_and_kl_penalty_everywhere():
    # scores 2 and 5; beta = 0.1; kl 0.1, 0.2, 0.3 | 0.5
    got = token_rewards([2.0, 5.0], [3, 1], kl=[[0.1, 0.2, 0.3], [0.5]], kl_coef=0.1)
    _close(got, [[-0.01, -0.02, 1.97], [4.95]])


def test_token_rewards_without_kl():
    _close(token_rewards([3.0], [2]), [[0.0, 3.0]])


def test_token_rewards_rejects_mismatch():
    with pytest.raises(ValueError, match="2 scores but 1 lengths"):
        token_rewards([1.0, 2.0], [3])
    with pytest.raises(ValueError, match="sequence 0: rewards has 2 tokens but kl has 3"):
        token_rewards([1.0], [2], kl=[[0.1, 0.2, 0.3]], kl_coef=1.0)
    with pytest.raises(ValueError, match="at least one token"):
        token_rewards([1.0], [0])


def test_gae_hand_computed_lambda_half():
    # gamma 1, lam 0.5, r = [0, 0, 1], V = [0.5, 0.6, 0.7], V_3 = 0
    # d2 = 1 - 0.7 = 0.3              A2 = 0.3
    # d1 = 0 + 0.7 - 0.6 = 0.1        A1 = 0.1 + 0.5 * 0.3  = 0.25
    # d0 = 0 + 0.6 - 0.5 = 0.1        A0 = 0.1 + 0.5 * 0.25 = 0.225
    adv, ret = gae([[0.0, 0.0, 1.0]], [[0.5, 0.6, 0.7]], gamma=1.0, lam=0.5)
    _close(adv, [[0.225, 0.25, 0.3]])
    _close(ret, [[0.725, 0.85, 1.0]])


def test_gae_hand_computed_discount_two_sequences():
    # seq 0: gamma 0.9, lam 1, r = [1, 2], V = [1, 1]
    #   d1 = 2 - 1 = 1; d0 = 1 + 0.9 - 1 = 0.9; A1 = 1; A0 = 0.9 + 0.9 * 1 = 1.8
    #   returns = discounted Monte Carlo: [1 + 0.9 * 2, 2] = [2.8, 2]
    # seq 1: r = [4], V = [0.5] -> A = 3.5, R = 4
    adv, ret = gae([[1.0, 2.0], [4.0]], [[1.0, 1.0], [0.5]], gamma=0.9, lam=1.0)
    _close(adv, [[1.8, 1.0], [3.5]])
    _close(ret, [[2.8, 2.0], [4.0]])


def test_gae_lambda_zero_is_one_step_td():
    # lam 0: A_t = r_t + gamma V_{t+1} - V_t = [0 + 0.5*2 - 1, 3 - 2] = [0, 1]
    adv, _ = gae([[0.0, 3.0]], [[1.0, 2.0]], gamma=0.5, lam=0.0)
    _close(adv, [[0.0, 1.0]])


def test_gae_rejects_bad_arguments():
    with pytest.raises(ValueError, match="gamma must lie in"):
        gae([[1.0]], [[0.0]], gamma=1.5)
    with pytest.raises(ValueError, match="lam must lie in"):
        gae([[1.0]], [[0.0]], lam=-0.1)
    with pytest.raises(ValueError, match="rewards has 2 tokens but values has 1"):
        gae([[1.0, 2.0]], [[0.0]])


def test_grpo_hand_computed():
    # group [1, 2, 3, 6]: mean 3, deviations [-2, -1, 0, 3], sample var 14/3, std 2.1602469
    got = grpo_advantages([1.0, 2.0, 3.0, 6.0], group_size=4, eps=0.0)
    np.testing.assert_allclose(got, [-0.9258201, -0.4629100, 0.0, 1.3887301], atol=1e-7)


def test_grpo_two_groups_and_constant_group():
    # group [0, 4]: mean 2, std sqrt(8); group [1, 1]: all equal -> 0
    got = grpo_advantages([0.0, 4.0, 1.0, 1.0], group_size=2)
    np.testing.assert_allclose(got, [-0.7071066, 0.7071066, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(grpo_advantages([0.0, 4.0], 2, scale=False), [-2.0, 2.0])


def test_grpo_rejects_bad_groups():
    with pytest.raises(ValueError, match="at least 2"):
        grpo_advantages([1.0, 2.0], group_size=1)
    with pytest.raises(ValueError, match="3 scores are not a whole number of groups of 2"):
        grpo_advantages([1.0, 2.0, 3.0], group_size=2)


def test_remax_subtracts_greedy_reward():
    np.testing.assert_allclose(remax_advantages([3.0, 1.0, 4.0], [2.0, 2.0, 2.0]), [1.0, -1.0, 2.0])
    with pytest.raises(ValueError, match="must both be shape"):
        remax_advantages([1.0, 2.0], [1.0])


def test_broadcast_and_pad():
    toks = broadcast_to_tokens([0.5, -1.0], [2, 3])
    _close(toks, [[0.5, 0.5], [-1.0, -1.0, -1.0]])
    np.testing.assert_array_equal(pad(toks), [[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]])
    np.testing.assert_array_equal(pad([[1.0]], length=2, value=9.0), [[1.0, 9.0]])
    with pytest.raises(ValueError, match="more than the padded length 1"):
        pad(toks, length=1)


def test_whiten_hand_computed():
    # tokens [1, 2, 3]: mean 2, population var 2/3 -> (x - 2) / sqrt(2/3)
    got = whiten([[1.0, 2.0], [3.0]], eps=0.0)
    _close(got, [[-1.2247448714, 0.0], [1.2247448714]])
    kept = whiten([[1.0, 2.0], [3.0]], shift_mean=False, eps=0.0)
    _close(kept, [[0.7752551286, 2.0], [3.2247448714]])
    with pytest.raises(ValueError, match="empty"):
        whiten([])


def test_token_weights_hand_computed():
    lengths = [2, 3, 5]
    _close(token_weights(lengths, "token-mean"), [[0.1] * 2, [0.1] * 3, [0.1] * 5])
    _close(token_weights(lengths, LossAggregation.SEQ_MEAN_TOKEN_MEAN),
           [[1 / 6] * 2, [1 / 9] * 3, [1 / 15] * 5])
    _close(token_weights(lengths, "seq-mean-token-sum"), [[1 / 3] * 2, [1 / 3] * 3, [1 / 3] * 5])


def test_token_weights_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        token_weights([1], "mean")
    with pytest.raises(ValueError, match="at least one sequence"):
        token_weights([])
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        token_weights([2, 0])


@st.composite
def _batches(draw):
    n = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, 9), min_size=n, max_size=n))
    losses = [draw(st.lists(st.floats(-10, 10), min_size=k, max_size=k)) for k in lengths]
    # an arbitrary partition of the sequences into contiguous chunks (replicas x micro-batches)
    cuts = sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=n)))) if n > 1 else []
    mode = draw(st.sampled_from(list(LossAggregation)))
    return lengths, losses, cuts, mode


@settings(max_examples=200, deadline=None)
@given(_batches())
def test_partial_weighted_sums_add_up_to_the_one_process_loss(case):
    lengths, losses, cuts, mode = case
    weights = token_weights(lengths, mode)
    bounds = [0, *cuts, len(lengths)]
    partial = [sum(float(np.dot(weights[i], losses[i])) for i in range(a, b))
               for a, b in zip(bounds[:-1], bounds[1:])]
    if mode is LossAggregation.TOKEN_MEAN:
        want = float(np.mean(np.concatenate([np.asarray(x) for x in losses])))
    elif mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        want = float(np.mean([np.mean(x) for x in losses]))
    else:
        want = float(np.mean([np.sum(x) for x in losses]))
    assert sum(partial) == pytest.approx(want, abs=1e-9)
    if mode is not LossAggregation.SEQ_MEAN_TOKEN_SUM:
        assert sum(float(w.sum()) for w in weights) == pytest.approx(1.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=6), st.integers(1, 4))
def test_grpo_groups_have_zero_mean(group, repeats):
    scores = group * repeats
    adv = grpo_advantages(scores, group_size=len(group)).reshape(repeats, -1)
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=8), st.floats(0.0, 1.0))
def test_gae_with_lambda_one_is_reward_to_go_minus_value(rewards, gamma):
    values = [0.25 * i for i in range(len(rewards))]
    adv, ret = gae([rewards], [values], gamma=gamma, lam=1.0)
    to_go = [sum(gamma ** (k - t) * rewards[k] for k in range(t, len(rewards))) for t in range(len(rewards))]
    np.testing.assert_allclose(ret[0], to_go, atol=1e-9)
    np.testing.assert_allclose(adv[0], np.asarray(to_go) - values, atol=1e-9)
