"""RL losses of the engine (torch): per-token PPO/GRPO/ReMax terms and loss-function factories."""

from emu.rl.losses import (
    KLEstimator,
    entropy_bonus,
    kl_penalty,
    logprobs_and_entropy,
    policy_loss_fn,
    ppo_policy_loss,
    value_loss,
    value_loss_fn,
)

__all__ = [
    "KLEstimator",
    "entropy_bonus",
    "kl_penalty",
    "logprobs_and_entropy",
    "policy_loss_fn",
    "ppo_policy_loss",
    "value_loss",
    "value_loss_fn",
]
