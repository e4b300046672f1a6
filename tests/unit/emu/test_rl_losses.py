"""Per-token RL losses against hand-computed numbers, and micro-batch/replica additivity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from emu.rl import (
    KLEstimator,
    entropy_bonus,
    kl_penalty,
    logprobs_and_entropy,
    policy_loss_fn,
    ppo_policy_loss,
    value_loss,
    value_loss_fn,
)
from nereusd.rl import pad, token_weights

LN2 = math.log(2.0)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_ppo_policy_loss_hand_computed():
    # ratios 1.5, 0.5, 0.5, 1.5, 1.0; advantages 2, 2, -1, -1, 3; clip 0.2
    #  r=1.5 A=2 : max(-3.0, -1.2*2 = -2.4) = -2.4 clipped
    #  r=0.5 A=2 : max(-1.0, -0.8*2 = -1.6) = -1.0
    #  r=0.5 A=-1: max( 0.5,  0.8)          =  0.8 clipped
    #  r=1.5 A=-1: max( 1.5,  1.2)          =  1.5
    #  r=1.0 A=3 : -3.0
    ratios = [1.5, 0.5, 0.5, 1.5, 1.0]
    logprobs = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 5, dtype=torch.float64)
    adv = t([2.0, 2.0, -1.0, -1.0, 3.0])
    loss, clipped = ppo_policy_loss(logprobs, old, adv, clip=0.2)
    torch.testing.assert_close(loss, t([-2.4, -1.0, 0.8, 1.5, -3.0]))
    torch.testing.assert_close(clipped, t([1.0, 0.0, 1.0, 0.0, 0.0]))
    loss.sum().backward()
    # d(-r A)/d logprob = -r A where unclipped; 0 where clipped
    torch.testing.assert_close(logprobs.grad, t([0.0, -1.0, 0.0, 1.5, -3.0]))


def test_value_loss_hand_computed():
    # V=1, V_old=0, R=0.5: plain 0.125, clipped V=0.2 -> 0.045 -> 0.125
    # V=1, V_old=0, R=2  : plain 0.5,   clipped V=0.2 -> 1.62  -> 1.62 (clipped)
    # V=0.1, V_old=0, R=0.1: 0
    values, old, ret = t([1.0, 1.0, 0.1]), t([0.0, 0.0, 0.0]), t([0.5, 2.0, 0.1])
    loss, clipped = value_loss(values, old, ret, value_clip=0.2)
    torch.testing.assert_close(loss, t([0.125, 1.62, 0.0]))
    torch.testing.assert_close(clipped, t([0.0, 1.0, 0.0]))
    plain, none = value_loss(values, old, ret, value_clip=None)
    torch.testing.assert_close(plain, t([0.125, 0.5, 0.0]))
    torch.testing.assert_close(none, t([0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="value_clip must be positive"):
        value_loss(values, old, ret, value_clip=0.0)


def test_kl_estimators_hand_computed():
    # token 0: pi = 0.5, ref = 0.25 -> log r = -ln2; token 1: pi = 0.25, ref = 0.5 -> log r = ln2
    lp = t([math.log(0.5), math.log(0.25)])
    ref = t([math.log(0.25), math.log(0.5)])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), t([LN2, -LN2]))
    torch.testing.assert_close(kl_penalty(lp, ref, KLEstimator.K2), t([0.5 * LN2 ** 2, 0.5 * LN2 ** 2]))
    # k3 = (r - 1) - log r: (0.5 - 1) + ln2 = 0.1931472, (2 - 1) - ln2 = 0.3068528
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), t([0.1931471806, 0.3068528194]))
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(lp, ref, "k4")


def test_entropy_and_logprobs_hand_computed():
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]], dtype=torch.float64)
    logprobs, entropy = logprobs_and_entropy(logits, torch.tensor([[0, 1]]))
    torch.testing.assert_close(logprobs, t([-LN2, math.log(0.75)]))
    # H([.5,.5]) = ln 2; H([.25,.75]) = .25 ln 4 + .75 ln(4/3) = 0.5623351446
    torch.testing.assert_close(entropy, t([LN2, 0.5623351446]))
    torch.testing.assert_close(entropy_bonus(entropy, 0.1), -0.1 * entropy)
    with pytest.raises(ValueError, match="must be"):
        logprobs_and_entropy(logits, torch.tensor([[0, 1, 1]]))


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match=r"logprobs \[1, 2\], old_logprobs \[1, 3\]"):
        ppo_policy_loss(torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2), 0.2)


def test_policy_loss_fn_hand_computed_with_padding():
    # two real tokens + one padded position holding garbage.
    # token 0: r=1.5 A=2 -> pg -2.4 (clipped); token 1: r=0.5 A=2 -> pg -1.0
    # kl k1 = 0.1 each, beta 0.5 -> +0.05; entropy 1, 2, coef 0.01 -> -0.01, -0.02
    # per token: -2.36, -0.97; weights 0.25, 0.75 -> loss = -0.59 - 0.7275 = -1.3175
    lp = torch.tensor([[math.log(1.5), math.log(0.5), 30.0]], dtype=torch.float64, requires_grad=True)
    outputs = {"logprobs": lp, "entropy": t([1.0, 2.0, 7.0])}
    batch = {
        "old_logprobs": t([0.0, 0.0, -30.0]),
        "ref_logprobs": t([math.log(1.5) - 0.1, math.log(0.5) - 0.1, 0.0]),
        "advantages": t([2.0, 2.0, 5.0]),
        "weight": t([0.25, 0.75, 0.0]),
        "mask": t([1.0, 1.0, 0.0]),
    }
    fn = policy_loss_fn(clip=0.2, kl_coef=0.5, kl_estimator="k1", entropy_coef=0.01)
    loss, metrics = fn(outputs, batch)
    assert loss.item() == pytest.approx(-1.3175, abs=1e-12)
    assert metrics["pg_loss"].item() == pytest.approx(-1.35, abs=1e-12)
    assert metrics["clip_frac"].item() == pytest.approx(0.25, abs=1e-12)
    assert metrics["kl"].item() == pytest.approx(0.1, abs=1e-12)
    assert metrics["entropy"].item() == pytest.approx(1.75, abs=1e-12)
    # k3 to the rollout policy: r=1.5 -> (1/1.5 - 1) + ln 1.5 = 0.0721317748; r=0.5 -> 1 - ln2
    assert metrics["approx_kl_old"].item() == pytest.approx(0.25 * 0.0721317748 + 0.75 * (1 - LN2), abs=1e-9)
    loss.backward()
    # grad: token 0 clipped -> only kl: 0.25 * 0.5 = 0.125; token 1: 0.75 * (-r A + 0.5) = 0.75 * -0.5
    torch.testing.assert_close(lp.grad, t([0.125, -0.375, 0.0]))


def test_policy_loss_fn_reports_missing_inputs_and_bad_config():
    fn = policy_loss_fn(kl_coef=0.1)
    batch = {"old_logprobs": torch.zeros(1, 1), "advantages": torch.zeros(1, 1),
             "weight": torch.zeros(1, 1), "mask": torch.ones(1, 1)}
    with pytest.raises(KeyError, match="ref_logprobs"):
        fn({"logprobs": torch.zeros(1, 1)}, batch)
    with pytest.raises(ValueError, match="clip must be positive"):
        policy_loss_fn(clip=0.0)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        policy_loss_fn(kl_estimator="kl")


def test_value_loss_fn_hand_computed():
    # per token 0.125, 1.62 (from test_value_loss_hand_computed); weights 0.5, 0.5 -> 0.8725
    fn = value_loss_fn(value_clip=0.2)
    values = torch.tensor([[1.0, 1.0, 9.0]], dtype=torch.float64, requires_grad=True)
    batch = {"returns": t([0.5, 2.0, 0.0]), "old_values": t([0.0, 0.0, 0.0]),
             "weight": t([0.5, 0.5, 0.0]), "mask": t([1.0, 1.0, 0.0])}
    loss, metrics = fn({"values": values}, batch)
    assert loss.item() == pytest.approx(0.8725, abs=1e-12)
    assert metrics["value_clip_frac"].item() == pytest.approx(0.5)
    assert metrics["value_error"].item() == pytest.approx(0.5 * 0.5 + 0.5 * -1.0)
    loss.backward()
    # token 0 unclipped: 0.5 * (V - R) = 0.25; token 1 clipped: gradient through clamp is 0
    torch.testing.assert_close(values.grad, t([0.25, 0.0, 0.0]))


def _batch_tensors(idx, lengths, arrays, weights):
    width = max(lengths[i] for i in idx)
    out = {name: torch.tensor(pad([arr[i] for i in idx], width)) for name, arr in arrays.items()}
    out["weight"] = torch.tensor(pad([weights[i] for i in idx], width))
    out["mask"] = torch.tensor(pad([np.ones(lengths[i]) for i in idx], width))
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 10), st.sampled_from(["token-mean", "seq-mean-token-mean"]),
       st.integers(1, 4))
def test_micro_batches_and_replicas_sum_to_the_one_process_loss_and_gradient(seed, n, mode, parts):
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 7, size=n)]
    arrays = {name: [rng.normal(size=k) * 0.3 for k in lengths]
              for name in ("logprobs", "old_logprobs", "ref_logprobs", "advantages", "entropy")}
    weights = token_weights(lengths, mode)
    fn = policy_loss_fn(clip=0.2, kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)

    def run(groups):
        total, grads = 0.0, [None] * n
        for idx in groups:
            b = _batch_tensors(idx, lengths, arrays, weights)
            lp = b.pop("logprobs").requires_grad_(True)
            loss, _ = fn({"logprobs": lp, "entropy": b.pop("entropy")}, b)
            loss.backward()
            total += loss.item()
            for row, i in enumerate(idx):
                grads[i] = lp.grad[row, : lengths[i]].numpy()
        return total, grads

    whole, whole_grads = run([list(range(n))])
    split = np.array_split(np.arange(n), parts)  # replicas x micro-batches, contiguous
    summed, split_grads = run([list(map(int, s)) for s in split if len(s)])
    assert summed == pytest.approx(whole, abs=1e-9)
    for a, b in zip(whole_grads, split_grads):
        np.testing.assert_allclose(a, b, atol=1e-12)
    # and the one-process loss is the plain mean, computed independently with numpy
    ratio = [np.exp(arrays["logprobs"][i] - arrays["old_logprobs"][i]) for i in range(n)]
    per_tok = []
    for i in range(n):
        a = arrays["advantages"][i]
        pg = np.maximum(-ratio[i] * a, -np.clip(ratio[i], 0.8, 1.2) * a)
        lr = arrays["ref_logprobs"][i] - arrays["logprobs"][i]
        per_tok.append(pg + 0.05 * (np.exp(lr) - 1 - lr) - 0.01 * arrays["entropy"][i])
    if mode == "token-mean":
        want = np.concatenate(per_tok).mean()
    else:
        want = np.mean([p.mean() for p in per_tok])
    assert whole == pytest.approx(float(want), abs=1e-9)
