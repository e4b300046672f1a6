"""Advantage estimation and per-token loss weights for PPO, GRPO and ReMax (numpy only).

Every function takes and returns *lists of per-sequence arrays*: one 1-D ``float64`` array per
response, of that response's length ``T_i`` (ragged responses, no padding). Index ``t`` is the
``t``-th generated token of the response; its reward/value/advantage is the one of the action
that produced that token.

The driver (``nereusd``) computes advantages and loss weights here, so this module never
imports torch. Sources:

- GAE: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
  Estimation", eq. 16; per-token KL penalty in the reward as in Ziegler et al. 2019 /
  Ouyang et al. 2022 (InstructGPT) — the task reward arrives at the last response token.
- GRPO: Shao et al. 2024, "DeepSeekMath", §4.1.2 (outcome supervision): every token of
  response ``i`` gets ``(r_i - mean(r_group)) / (std(r_group) + eps)``.
- ReMax: Li et al. 2024, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
  Method for Aligning Large Language Models", Algorithm 1: the baseline of a sampled response
  is the reward of the greedy response to the same prompt.
"""

from __future__ import annotations

import enum
from typing import Sequence

import numpy as np

ArrayList = list[np.ndarray]


def _as_arrays(name: str, seqs: Sequence[Sequence[float]]) -> ArrayList:
    out = []
    for i, seq in enumerate(seqs):
        arr = np.asarray(seq, dtype=np.float64)
        if arr.ndim != 1:
            raise ValueError(f"{name}[{i}]: expected a 1-D per-token array, got shape {arr.shape}")
        out.append(arr)
    return out


def _check_same_lengths(name_a: str, a: ArrayList, name_b: str, b: ArrayList) -> None:
    if len(a) != len(b):
        raise ValueError(f"{name_a} has {len(a)} sequences but {name_b} has {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise ValueError(f"sequence {i}: {name_a} has {x.shape[0]} tokens but {name_b} has {y.shape[0]}")


def token_rewards(
    scores: Sequence[float],
    lengths: Sequence[int],
    kl: Sequence[Sequence[float]] | None = None,
    kl_coef: float = 0.0,
) -> ArrayList:
    """Per-token rewards for PPO: ``r_t = -kl_coef * kl_t``, plus the task score at the last token.

    Args:
        scores: the verifier's scalar reward per response, length ``N``.
        lengths: response lengths ``T_i`` (tokens), each ``>= 1``.
        kl: optional per-token KL estimates to the reference policy, usually
            ``old_logprob - ref_logprob`` (k1), one array of length ``T_i`` per response.
        kl_coef: penalty coefficient ``β``; ignored when ``kl`` is None.

    Returns:
        ``N`` arrays ``r_i`` of shape ``[T_i]``.

    Raises:
        ValueError: mismatched counts/lengths, or a response of length 0.

    Source: Ziegler et al. 2019, eq. 2; Ouyang et al. 2022 (per-token KL penalty with the
    reward-model score added at the final token).
    """
    if len(scores) != len(lengths):
        raise ValueError(f"{len(scores)} scores but {len(lengths)} lengths")
    rewards = []
    for i, (score, length) in enumerate(zip(scores, lengths)):
        if int(length) < 1:
            raise ValueError(f"lengths[{i}]: a response needs at least one token, got {length}")
        rewards.append(np.zeros(int(length), dtype=np.float64))
    if kl is not None:
        kl_arrays = _as_arrays("kl", kl)
        _check_same_lengths("rewards", rewards, "kl", kl_arrays)
        for r, k in zip(rewards, kl_arrays):
            r -= kl_coef * k
    for r, score in zip(rewards, scores):
        r[-1] += float(score)
    return rewards


def gae(
    rewards: Sequence[Sequence[float]],
    values: Sequence[Sequence[float]],
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[ArrayList, ArrayList]:
    """Generalised advantage estimation over each response; the episode ends after its last token.

    ``δ_t = r_t + γ V_{t+1} − V_t`` with ``V_{T} = 0``; ``A_t = δ_t + γ λ A_{t+1}``;
    returns ``R_t = A_t + V_t`` (the critic's regression target).

    Args:
        rewards: per-token rewards, ``N`` arrays of shape ``[T_i]`` (see :func:`token_rewards`).
        values: the critic's value estimate at each response token, same shapes.
        gamma: discount ``γ`` in ``[0, 1]``.
        lam: GAE ``λ`` in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, each ``N`` arrays of shape ``[T_i]``.

    Raises:
        ValueError: shapes differ, or ``γ``/``λ`` outside ``[0, 1]``.

    Source: Schulman et al. 2016, eq. 16 (GAE(γ, λ)); Schulman et al. 2017 (PPO), eq. 11–12.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must lie in [0, 1], got {lam}")
    r_list = _as_arrays("rewards", rewards)
    v_list = _as_arrays("values", values)
    _check_same_lengths("rewards", r_list, "values", v_list)
    advantages, returns = [], []
    for r, v in zip(r_list, v_list):
        adv = np.zeros_like(r)
        next_value = 0.0
        running = 0.0
        for t in range(r.shape[0] - 1, -1, -1):
            delta = r[t] + gamma * next_value - v[t]
            running = delta + gamma * lam * running
            adv[t] = running
            next_value = v[t]
        advantages.append(adv)
        returns.append(adv + v)
    return advantages, returns


def grpo_advantages(scores: Sequence[float], group_size: int, eps: float = 1e-6,
                    scale: bool = True) -> np.ndarray:
    """Group-relative advantage of each response: ``(r_i − mean_g) / (std_g + eps)``.

    Responses of one prompt are contiguous: response ``i`` belongs to group ``i // group_size``.
    ``std_g`` is the sample standard deviation (``ddof = 1``, as ``torch.std`` in TRL and verl).
    With ``scale=False`` only the mean is subtracted (Dr. GRPO, Liu et al. 2025).

    Args:
        scores: scalar rewards, shape ``[N]`` with ``N`` a multiple of ``group_size``.
        group_size: responses per prompt ``G >= 2``.
        eps: added to the standard deviation so that a group of equal rewards gives 0.
        scale: divide by ``std_g + eps``.

    Returns:
        ``float64`` array ``[N]``, one advantage per response (broadcast to tokens with
        :func:`broadcast_to_tokens`).

    Raises:
        ValueError: ``group_size < 2`` or ``N`` not a multiple of it.

    Source: Shao et al. 2024 (DeepSeekMath), §4.1.2, outcome supervision.
    """
    r = np.asarray(scores, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"scores: expected shape [N], got {r.shape}")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 for a group baseline, got {group_size}")
    if r.shape[0] % group_size:
        raise ValueError(f"{r.shape[0]} scores are not a whole number of groups of {group_size}")
    groups = r.reshape(-1, group_size)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (groups.std(axis=1, ddof=1, keepdims=True) + eps)
    return centred.reshape(-1)


def remax_advantages(scores: Sequence[float], greedy_scores: Sequence[float]) -> np.ndarray:
    """ReMax advantage of each sampled response: its reward minus the greedy response's reward.

    Args:
        scores: reward of each sampled response, shape ``[N]``.
        greedy_scores: reward of the greedy response to the same prompt, shape ``[N]``
            (repeat a prompt's greedy reward for each of its samples).

    Returns:
        ``float64`` array ``[N]``.

    Raises:
        ValueError: shapes differ.

    Source: Li et al. 2024 (ReMax), Algorithm 1, line 6.
    """
    r = np.asarray(scores, dtype=np.float64)
    b = np.asarray(greedy_scores, dtype=np.float64)
    if r.ndim != 1 or r.shape != b.shape:
        raise ValueError(f"scores {r.shape} and greedy_scores {b.shape} must both be shape [N]")
    return r - b


def broadcast_to_tokens(per_sequence: Sequence[float], lengths: Sequence[int]) -> ArrayList:
    """Give every token of response ``i`` the value ``per_sequence[i]``.

    Returns ``N`` arrays of shape ``[T_i]``. Raises ValueError when the counts differ.
    """
    if len(per_sequence) != len(lengths):
        raise ValueError(f"{len(per_sequence)} values but {len(lengths)} lengths")
    return [np.full(int(n), float(x), dtype=np.float64) for x, n in zip(per_sequence, lengths)]


def whiten(seqs: Sequence[Sequence[float]], shift_mean: bool = True, eps: float = 1e-8) -> ArrayList:
    """Normalise all tokens of all sequences together to unit variance (and zero mean).

    ``x' = (x − μ) / sqrt(σ² + eps)`` with ``μ, σ²`` over every token of the batch (population
    variance); with ``shift_mean=False`` the mean is added back (as for PPO advantages in TRL).

    Returns arrays of the input shapes. Raises ValueError on an empty batch.
    """
    arrays = _as_arrays("seqs", seqs)
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    if flat.size == 0:
        raise ValueError("cannot whiten an empty batch")
    mean = flat.mean()
    scale = 1.0 / np.sqrt(flat.var() + eps)
    out = []
    for a in arrays:
        w = (a - mean) * scale
        if not shift_mean:
            w = w + mean
        out.append(w)
    return out


class LossAggregation(str, enum.Enum):
    """How per-token losses of one global minibatch are averaged.

    ``TOKEN_MEAN``: every response token of the minibatch weighs the same
    (``1 / Σ_i T_i``; DAPO, Yu et al. 2025). ``SEQ_MEAN_TOKEN_MEAN``: mean over each response's
    tokens, then over responses (``1 / (N · T_i)``; the original GRPO objective, Shao et al. 2024,
    eq. 3). ``SEQ_MEAN_TOKEN_SUM``: sum over tokens, mean over responses (``1 / N``).
    """

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"

    def __str__(self) -> str:
        return self.value


def token_weights(lengths: Sequence[int], mode: LossAggregation | str = LossAggregation.TOKEN_MEAN
                  ) -> ArrayList:
    """Per-token loss weights of one GLOBAL minibatch, so that partial sums add up exactly.

    The engine computes ``Σ weight · per_token_loss`` on each micro-batch, sums over gradient
    accumulation and all-reduces (SUM) over DP replicas. Because the weights are normalised over
    the whole global minibatch here — not per micro-batch — that sum equals the one-process
    loss, whatever the split into replicas and micro-batches.

    Args:
        lengths: response lengths ``T_i`` of every sequence of the global minibatch (``N``).
        mode: a :class:`LossAggregation` or its string value.

    Returns:
        ``N`` arrays of shape ``[T_i]`` whose grand total is 1.

    Raises:
        ValueError: unknown mode, empty minibatch, or a length below 1.
    """
    try:
        agg = LossAggregation(mode)
    except ValueError:
        known = ", ".join(m.value for m in LossAggregation)
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of: {known}") from None
    if len(lengths) == 0:
        raise ValueError("token_weights needs at least one sequence")
    for i, n in enumerate(lengths):
        if int(n) < 1:
            raise ValueError(f"lengths[{i}]: a response needs at least one token, got {n}")
    num_seqs = len(lengths)
    if agg is LossAggregation.TOKEN_MEAN:
        total = float(sum(int(n) for n in lengths))
        return [np.full(int(n), 1.0 / total) for n in lengths]
    if agg is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        return [np.full(int(n), 1.0 / (num_seqs * int(n))) for n in lengths]
    return [np.full(int(n), 1.0 / num_seqs) for n in lengths]


def pad(seqs: Sequence[Sequence[float]], length: int | None = None, value: float = 0.0) -> np.ndarray:
    """Right-pad ragged sequences into a ``[N, length]`` ``float64`` array.

    ``length`` defaults to the longest sequence. Raises ValueError if a sequence is longer.
    """
    arrays = _as_arrays("seqs", seqs)
    width = max((a.shape[0] for a in arrays), default=0) if length is None else int(length)
    out = np.full((len(arrays), width), value, dtype=np.float64)
    for i, a in enumerate(arrays):
        if a.shape[0] > width:
            raise ValueError(f"seqs[{i}] has {a.shape[0]} tokens, more than the padded length {width}")
        out[i, : a.shape[0]] = a
    return out
