"""What one RL step measured: the typed record the driver returns and ``metrics.jsonl`` holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from nereusd.plan import ModelStage, Plan


@dataclass(frozen=True)
class StepRecord:
    """One RL step, as the driver measured it.

    Attributes:
        step: step index (0-based).
        step_latency_s: wall time of the whole step.
        stage_latency_s: wall seconds per phase (``generation``, ``inference``, ``training``,
            ``weight_sync``).
        model_stage_s: seconds per model-stage (its slowest device's task time, summed over
            the step's tasks of that model-stage).
        reward_mean: mean score of the step's responses.
        response_length_mean, response_length_max: generated tokens per response.
        max_new_tokens: the cap of the step's responses (its stage's, under
            ``rollout.max_new_tokens_schedule``; ``None`` in records made without one).
        tokens_per_s: generated tokens over the step's wall time.
        peak_memory_bytes: measured peak bytes per device (every model-stage resident on it).
        plan: the plan the step ran under.
        sample_position: the prompt sampler's position of the step's first prompt.
        policy_version: weight synchronisations before the rollout's generation was submitted.
        staleness: ``step − policy_version``.
        train_metrics: losses and norms, ``{"actor/loss": …}`` (mean over mini-batches).
        greedy_reward_mean: ReMax's greedy-baseline reward (``None`` otherwise).
        eval_pass_at_1, eval_s: see below.
    """

    step: int
    step_latency_s: float
    stage_latency_s: Mapping[str, float]
    model_stage_s: Mapping[ModelStage, float]
    reward_mean: float
    response_length_mean: float
    response_length_max: int
    tokens_per_s: float
    peak_memory_bytes: Mapping[int, int]
    plan: Plan
    sample_position: int
    policy_version: int
    staleness: int
    train_metrics: Mapping[str, float] = field(default_factory=dict)
    greedy_reward_mean: float | None = None
    eval_pass_at_1: float | None = None
    """Fraction of held-out prompts the greedy policy answers right, after this step (when an
    evaluation ran: ``evaluation.every_steps``)."""
    eval_s: float | None = None
    """Wall time of that evaluation (not part of ``step_latency_s``)."""
    max_new_tokens: int | None = None
    weight_sync: Mapping[str, float] = field(default_factory=dict)
    """The generation engines' side of the weight synchronisation (vLLM): ``engine_load_s``
    (slowest device) and ``engine_bytes`` (all devices); empty without an engine."""

    def to_dict(self) -> dict[str, Any]:
        """The step's ``metrics.jsonl`` line (model-stages and devices as strings, losses as
        ``train/<role>/<name>``)."""
        out: dict[str, Any] = {
            "step": self.step, "step_latency_s": self.step_latency_s, "stage_latency_s": dict(self.stage_latency_s),
            "model_stage_s": {str(m): s for m, s in self.model_stage_s.items()},
            "reward_mean": self.reward_mean, "response_length_mean": self.response_length_mean,
            "response_length_max": self.response_length_max, "tokens_per_s": self.tokens_per_s,
            "peak_memory_bytes": {str(d): b for d, b in sorted(self.peak_memory_bytes.items())},
            "plan": self.plan.to_dict(), "sample_position": self.sample_position,
            "policy_version": self.policy_version, "staleness": self.staleness,
            **{f"train/{k}": v for k, v in self.train_metrics.items()},
            **{f"weight_sync/{k}": v for k, v in self.weight_sync.items()},
        }
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        if self.greedy_reward_mean is not None:
            out["greedy_reward_mean"] = self.greedy_reward_mean
        if self.eval_pass_at_1 is not None:
            out["eval/pass@1"] = self.eval_pass_at_1
            out["eval_s"] = self.eval_s
        return out
