"""RL arithmetic of the driver (numpy only): advantages, returns and per-token loss weights."""

from nereusd.rl.advantages import (
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

__all__ = [
    "LossAggregation",
    "broadcast_to_tokens",
    "gae",
    "grpo_advantages",
    "pad",
    "remax_advantages",
    "token_rewards",
    "token_weights",
    "whiten",
]
