"""Per-token RL loss terms (PPO, GRPO, ReMax) and the loss functions the engine trains with.

Every term is a per-token tensor ``[mb, T]`` (``mb`` sequences of a micro-batch, ``T`` padded
response positions) so that a caller reduces it as ``(weight * per_token).sum()`` with the
global-minibatch weights of :func:`nereusd.rl.advantages.token_weights`. Summed over
micro-batches and DP replicas (all-reduce SUM) that gives exactly the one-process loss.

The factories :func:`policy_loss_fn` and :func:`value_loss_fn` return
``loss_fn(outputs, batch) -> (loss, metrics)``. Each metric is a *weighted sum*
``Σ weight · x`` over the micro-batch, so summing metrics over micro-batches and replicas, like
the loss, yields the global weighted mean.

Sources: Schulman et al. 2017 (PPO, eq. 7 clipped surrogate; eq. 9 value and entropy terms);
the clipped value loss of OpenAI baselines ``ppo2``; J. Schulman, "Approximating KL
Divergence" (2020), estimators k1, k2 and k3.
"""

from __future__ import annotations

import enum
from typing import Callable, Mapping

import torch

LossFn = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]],
                  tuple[torch.Tensor, dict[str, torch.Tensor]]]


class KLEstimator(str, enum.Enum):
    """Estimators of ``KL(π_θ ‖ π_ref)`` from a sample of ``π_θ`` (Schulman 2020).

    With ``log r = log π_ref(a) − log π_θ(a)``: ``k1 = −log r`` (unbiased, high variance, may
    be negative), ``k2 = ½ (log r)²`` (biased, low variance), ``k3 = (r − 1) − log r``
    (unbiased, low variance, never negative; used by GRPO, Shao et al. 2024, eq. 4).
    """

    K1 = "k1"
    K2 = "k2"
    K3 = "k3"

    def __str__(self) -> str:
        return self.value


def _same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        detail = ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"per-token tensors must share one shape [mb, T]; got {detail}")


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate loss per token: ``max(−ρ A, −clip(ρ, 1−ε, 1+ε) A)``, ``ρ = e^{lp − lp_old}``.

    Args:
        logprobs: ``log π_θ(a_t)``, ``[mb, T]``, differentiable.
        old_logprobs: ``log π_old(a_t)`` from the generation policy, ``[mb, T]``.
        advantages: ``A_t``, ``[mb, T]``.
        clip: ``ε > 0``.

    Returns:
        ``(loss, clipped)``: the per-token loss ``[mb, T]`` and a float mask ``[mb, T]`` that is 1
        where the clipped branch was taken (the gradient is zero there).

    Raises:
        ValueError: shapes differ or ``clip <= 0``.

    Source: Schulman et al. 2017, eq. 7 (negated to be minimised).
    """
    _same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    if clip <= 0:
        raise ValueError(f"clip must be positive, got {clip}")
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -ratio * advantages
    clipped = -torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * advantages
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).to(logprobs.dtype)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               value_clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token: ``½ max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²)``.

    Args:
        values: the critic's ``V_θ(s_t)``, ``[mb, T]``, differentiable.
        old_values: values at rollout time ``V_old(s_t)``, ``[mb, T]``.
        returns: targets ``R_t`` (e.g. GAE returns), ``[mb, T]``.
        value_clip: ``c > 0``, or None for the plain ``½ (V − R)²``.

    Returns:
        ``(loss, clipped)``: per-token loss ``[mb, T]`` and a float mask of where the clipped
        branch was larger.

    Raises:
        ValueError: shapes differ or ``value_clip <= 0``.

    Source: Schulman et al. 2017, eq. 9 ``L^VF``; clipping as in OpenAI baselines ``ppo2``.
    """
    _same_shape(values=values, old_values=old_values, returns=returns)
    plain = 0.5 * (values - returns) ** 2
    if value_clip is None:
        return plain, torch.zeros_like(plain)
    if value_clip <= 0:
        raise ValueError(f"value_clip must be positive or None, got {value_clip}")
    v_clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    clipped = 0.5 * (v_clipped - returns) ** 2
    return torch.maximum(plain, clipped), (clipped > plain).to(values.dtype)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
               estimator: KLEstimator | str = KLEstimator.K3) -> torch.Tensor:
    """Per-token estimate of ``KL(π_θ ‖ π_ref)`` at the sampled tokens, ``[mb, T]``.

    Args:
        logprobs: ``log π_θ(a_t)``, ``[mb, T]``.
        ref_logprobs: ``log π_ref(a_t)``, ``[mb, T]``.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see :class:`KLEstimator`).

    Raises:
        ValueError: shapes differ or unknown estimator.

    Source: J. Schulman, "Approximating KL Divergence", 2020.
    """
    _same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    try:
        est = KLEstimator(estimator)
    except ValueError:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of k1, k2, k3") from None
    log_ratio = ref_logprobs - logprobs
    if est is KLEstimator.K1:
        return -log_ratio
    if est is KLEstimator.K2:
        return 0.5 * log_ratio ** 2
    return torch.expm1(log_ratio) - log_ratio


def entropy_bonus(entropy: torch.Tensor, entropy_coef: float) -> torch.Tensor:
    """Per-token loss term ``−c · H(π_θ(·|s_t))`` that rewards entropy, ``[mb, T]``.

    Source: Schulman et al. 2017, eq. 9 (the ``c_2 S[π_θ]`` term, negated to be minimised).
    """
    return -entropy_coef * entropy


def logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token and the entropy of each predictive distribution.

    Args:
        logits: ``[B, S, V]`` where position ``s`` predicts ``targets[:, s]``.
        targets: token ids ``[B, S]`` (int64).

    Returns:
        ``(logprobs, entropy)``, each ``[B, S]`` float (nats), computed in float32 or wider.

    Raises:
        ValueError: shapes do not match.
    """
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(targets.shape):
        raise ValueError(f"logits {list(logits.shape)} must be [B, S, V] for targets {list(targets.shape)}")
    log_p = torch.log_softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits,
                              dim=-1)
    logprobs = log_p.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return logprobs, entropy


def _masked(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where() rather than a product: padded positions may hold inf/nan, which 0 * x would keep.
    return torch.where(mask > 0, per_token, torch.zeros_like(per_token))


def _need(what: str, source: Mapping[str, torch.Tensor], keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in source]
    if missing:
        raise KeyError(f"{what} lacks {missing}; it has {sorted(source)}")


def policy_loss_fn(clip: float = 0.2, kl_coef: float = 0.0, kl_estimator: KLEstimator | str = KLEstimator.K3,
                   entropy_coef: float = 0.0) -> LossFn:
    """Actor loss: ``Σ w · mask · (ppo + β · kl + (−c · H))`` over one micro-batch.

    The returned ``loss_fn(outputs, batch)`` reads ``outputs["logprobs"]`` and (when
    ``entropy_coef != 0``) ``outputs["entropy"]``, each ``[mb, T]``, and ``batch["old_logprobs"]``,
    ``batch["advantages"]``, ``batch["weight"]``, ``batch["mask"]`` and (when ``kl_coef != 0``)
    ``batch["ref_logprobs"]``, all float ``[mb, T]``. It returns the scalar loss and metrics
    ``pg_loss``, ``kl``, ``entropy``, ``clip_frac``, ``approx_kl_old`` (k3 to the rollout policy) —
    each the weighted sum ``Σ w · mask · x`` (a global mean once summed over micro-batches and
    replicas). ``kl``/``entropy`` are reported when their inputs are present.

    Raises:
        ValueError: ``clip <= 0`` or unknown estimator (at construction); KeyError for missing
        inputs and ValueError for mismatched shapes (at call time).

    Source: Schulman et al. 2017 (PPO); Shao et al. 2024, eq. 3 (GRPO: KL in the loss, k3).
    """
    if clip <= 0:
        raise ValueError(f"clip must be positive, got {clip}")
    try:
        est = KLEstimator(kl_estimator)
    except ValueError:
        raise ValueError(f"unknown KL estimator {kl_estimator!r}; expected one of k1, k2, k3") from None

    def loss_fn(outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _need("outputs", outputs, ("logprobs",) + (("entropy",) if entropy_coef else ()))
        _need("batch", batch, ("old_logprobs", "advantages", "weight", "mask")
              + (("ref_logprobs",) if kl_coef else ()))
        logprobs = outputs["logprobs"]
        mask = batch["mask"]
        weight = _masked(batch["weight"], mask)
        pg, clipped = ppo_policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], clip)
        per_token = pg
        metrics: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            metrics["pg_loss"] = (weight * _masked(pg, mask)).sum()
            metrics["clip_frac"] = (weight * clipped).sum()
            metrics["approx_kl_old"] = (weight * _masked(
                kl_penalty(logprobs.detach(), batch["old_logprobs"], KLEstimator.K3), mask)).sum()
        if "ref_logprobs" in batch:
            kl = kl_penalty(logprobs, batch["ref_logprobs"], est)
            if kl_coef:
                per_token = per_token + kl_coef * kl
            metrics["kl"] = (weight * _masked(kl.detach(), mask)).sum()
        if "entropy" in outputs:
            entropy = outputs["entropy"]
            if entropy_coef:
                per_token = per_token + entropy_bonus(entropy, entropy_coef)
            metrics["entropy"] = (weight * _masked(entropy.detach(), mask)).sum()
        loss = (weight * _masked(per_token, mask)).sum()
        return loss, metrics

    return loss_fn


def value_loss_fn(value_clip: float | None = 0.2) -> LossFn:
    """Critic loss: ``Σ w · mask · value_loss`` over one micro-batch.

    The returned ``loss_fn(outputs, batch)`` reads ``outputs["values"]`` and ``batch["returns"]``,
    ``batch["old_values"]``, ``batch["weight"]``, ``batch["mask"]`` (float ``[mb, T]``). Metrics,
    each a weighted sum: ``value_loss``, ``value_clip_frac``, ``value_error`` (``V − R``, signed).

    Raises:
        ValueError: ``value_clip <= 0`` (at construction); KeyError / ValueError for missing or
        mismatched inputs (at call time).

    Source: Schulman et al. 2017, eq. 9; OpenAI baselines ``ppo2`` value clipping.
    """
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"value_clip must be positive or None, got {value_clip}")

    def loss_fn(outputs: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _need("outputs", outputs, ("values",))
        _need("batch", batch, ("returns", "old_values", "weight", "mask"))
        values = outputs["values"]
        mask = batch["mask"]
        weight = _masked(batch["weight"], mask)
        per_token, clipped = value_loss(values, batch["old_values"], batch["returns"], value_clip)
        loss = (weight * _masked(per_token, mask)).sum()
        with torch.no_grad():
            metrics = {
                "value_loss": loss.detach().clone(),
                "value_clip_frac": (weight * clipped).sum(),
                "value_error": (weight * _masked(values.detach() - batch["returns"], mask)).sum(),
            }
        return loss, metrics

    return loss_fn
