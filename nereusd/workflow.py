"""RL workflows (PPO, GRPO, ReMax; synchronous or asynchronous) as graphs of model-stages.

A :class:`Workflow` says which model-stages an algorithm runs, in which order, which of them
run concurrently (on disjoint GPUs), and how much data flows between them. The cost model
turns it into the execution-overlap graph whose critical path is the step latency
(paper §4.2; DESIGN.md "One RL step").

Phases run in stage order (generation → inference → training). Model-stages of one phase run
concurrently on disjoint GPU sets — they form the concurrent set ``C_s`` of the paper's Eq. 1,
so ``Σ_{M∈C_s} |R_M| ≤ |pool|`` — while different phases run one after another and may share
GPUs. Asynchronous execution (one-step off-policy, as in AReaL/Laminar) runs generation on its
own GPUs concurrently with inference and training of the previous batch; the safe boundary is
the weight synchronisation, and the critical path is ``max(L_gen, L_inf + L_train)``.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass, replace
from typing import Mapping

from nereusd.errors import ConfigError
from nereusd.plan import ModelStage, Role, Stage

A, C, REF, RW = Role.ACTOR, Role.CRITIC, Role.REFERENCE, Role.REWARD
GEN, INF, TRAIN = Stage.GENERATION, Stage.INFERENCE, Stage.TRAINING


class Algorithm(str, enum.Enum):
    """The RL algorithm of a job."""

    PPO = "ppo"
    GRPO = "grpo"
    REMAX = "remax"

    def __str__(self) -> str:
        return self.value


def _expected_max_z(k: int) -> float:
    """Expected largest of ``k`` standard normal draws, by Blom's approximation
    ``Φ⁻¹((k − 0.375) / (k + 0.25))`` (Blom 1958); 0 for ``k = 1``."""
    return statistics.NormalDist().inv_cdf((k - 0.375) / (k + 0.25)) if k > 1 else 0.0


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one RL step processes.

    Attributes:
        prompt_length: prompt tokens per sequence.
        response_length: generated tokens per sequence: the step's longest response (the
            ``len`` drift signal of the monitor; memory is priced padded to it, training and
            inference as the engine pads, :meth:`priced_pass`).
        response_mean_fraction: the step's mean response length over ``response_length``, in
            (0, 1] (1: equal lengths). Generation's continuous batching finishes short responses
            early (:func:`nereusd.cost.formulas.continuous_batching`).
        global_batch: sequences per RL step after group sampling (GRPO: prompts × group size;
            ReMax: prompts — the greedy baseline rollouts are added by the workflow).
        mini_batches: optimizer steps per pass over the step's sequences; the training global
            batch of one optimizer step is ``global_batch / mini_batches`` and must stay exactly
            that under DP scaling.
        epochs: passes of training over the step's sequences (``train.epochs``, PPO epochs):
            ``epochs · mini_batches`` optimizer steps per RL step, training priced ``epochs`` times
            one pass.
        micro_batch: default per-replica micro-batch in sequences for inference and training.
        max_tokens_per_micro_batch: when set, the engine forms inference and training
            micro-batches by this token budget (packed, padding-free; ``train.`` key of the same
            name) and they are priced by :meth:`priced_micro_batch`; ``micro_batch`` then only
            splits the global batch (``dp × micro_batch × grad_accum``).

    Raises:
        ConfigError: on non-positive values or ``mini_batches`` not dividing ``global_batch``.
    """

    prompt_length: int
    response_length: int
    global_batch: int
    mini_batches: int = 1
    micro_batch: int = 1
    epochs: int = 1
    max_tokens_per_micro_batch: int | None = None
    response_mean_fraction: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prompt_length", "response_length", "global_batch", "mini_batches", "micro_batch", "epochs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"workload.{name}: expected a positive integer, got {value!r}")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise ConfigError(f"workload.max_tokens_per_micro_batch: expected a positive integer, got {budget!r}")
        fraction = self.response_mean_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ConfigError(f"workload.response_mean_fraction: expected a number in (0, 1], got {fraction!r}")
        if self.global_batch % self.mini_batches:
            raise ConfigError(
                f"workload.mini_batches: {self.mini_batches} does not divide global_batch={self.global_batch}"
            )

    @property
    def seq_length(self) -> int:
        """Tokens per sequence, prompt plus response."""
        return self.prompt_length + self.response_length

    @property
    def mini_batch_size(self) -> int:
        """Sequences per optimizer step, ``global_batch / mini_batches``: ``dp × b × a``."""
        return self.global_batch // self.mini_batches

    def priced_micro_batch(self, stage: Stage, micro_batch: int, share: int) -> int:
        """Sequences per micro-batch the engine runs for ``stage`` at plan micro-batch ``micro_batch``.

        By count, ``micro_batch``. By token budget ``B`` (inference and training), packed rows
        fill to nearly ``B`` tokens, so a micro-batch is priced as ``ceil(B / seq_length)``
        sequences of :attr:`seq_length` (the step's longest: conservative when lengths differ;
        rounding up never books fewer than ``B`` tokens), at most ``share`` — the sequences
        one replica processes per pass (training: per optimizer step) — whatever
        ``micro_batch`` is. The memory model and the cost model price that and no padding.
        Generation is unaffected (its micro-batch is the concurrent sequences).
        """
        if self.max_tokens_per_micro_batch is None or stage is Stage.GENERATION:
            return micro_batch
        return self._per_row(self.seq_length, share)

    def _per_row(self, sequence_tokens: int, share: int) -> int:
        """Sequences of ``sequence_tokens`` a budget row holds, rounded up (a row fills to
        nearly the budget), at least one and at most ``share``."""
        return max(1, min(share, -(-self.max_tokens_per_micro_batch // sequence_tokens)))

    def priced_pass(self, stage: Stage, micro_batch: int, share: int, pp: int = 1,
                    sequences: int | None = None) -> tuple[int, int]:
        """``(sequences per micro-batch, response tokens each)`` at which the cost model prices
        the time of an inference or training pass (memory keeps :meth:`priced_micro_batch` at the
        longest response: a row may hold the longest sequence).

        Args:
            share: sequences one replica processes per pass (training: per optimizer step).
            pp: the layout's pipeline degree.
            sequences: the model-stage's sequences in the step (``n``; default ``share``).

        By count the engine pads rows in groups (:mod:`emu.engine.batch`,
        :meth:`emu.engine.stage.StageEngine._run`): at ``pp = 1`` each micro-batch of ``b``
        sequences to its own longest; at ``pp > 1`` every row of a call (training: one per
        optimizer step, :attr:`mini_batches` of them) to the call's longest, since pipeline stages
        exchange one shape. The replica holding the step's longest ``L`` runs ``G`` groups of
        ``g`` sequences a step (``g = b`` or ``share``), one as wide as ``L`` and the others as
        the longest of ``g`` sequences, ``E_g``; a pass is priced at its mean,
        ``⌈((G − 1)·E_g + L) / G⌉``. For log-normal lengths (the verl traces' shape, which the
        simulator's truth draws) the longest of ``k`` sits ``z_k`` standard deviations above the
        log-mean, so ``E_g = m·(L/m)^(z_g/z_n)`` with ``m`` the mean response and ``z_k`` the
        expected largest of ``k`` standard normals, by Blom's approximation ``Φ⁻¹((k − 0.375) /
        (k + 0.25))`` (Blom 1958; within 5 % of the exact values for ``k ≥ 2``). ``E_1 = m``:
        micro-batch 1 at ``pp = 1`` is padding-free. Pricing every row at ``L`` charged such a
        replica ``(prompt + L)/(prompt + m)`` times its tokens (2–3× on the simulator's verl
        traces).

        By token budget ``B``, rows are padding-free and hold sequences of the mean response,
        ``m = ⌈response_mean_fraction · response_length⌉``: ``ceil(B / (prompt + m))`` of them, at
        most ``share``. Pricing them at the longest, as memory does, charged a replica ``(prompt +
        longest) / (prompt + m)`` times its tokens. Generation: ``(micro_batch, response_length)``.
        """
        if stage is Stage.GENERATION:
            return micro_batch, self.response_length
        longest = self.response_length
        mean = max(1, math.ceil(self.response_mean_fraction * longest))
        if self.max_tokens_per_micro_batch is not None:
            return self._per_row(self.prompt_length + mean, share), mean
        if mean >= longest:
            return micro_batch, longest
        group = max(1, micro_batch) if pp == 1 else max(1, share)
        n = max(sequences or share, group)
        calls = self.mini_batches if stage is Stage.TRAINING else 1
        groups = calls * max(1, -(-share // group))
        if groups == 1 or n <= 1:
            return micro_batch, longest
        widest = mean * (longest / mean) ** (_expected_max_z(group) / _expected_max_z(n))
        return micro_batch, min(longest, max(1, math.ceil(((groups - 1) * widest + longest) / groups)))

    @property
    def packed(self) -> bool:
        """Whether inference and training micro-batches are packed rows (a token budget)."""
        return self.max_tokens_per_micro_batch is not None

    def with_response_length(self, response_length: int) -> "Workload":
        return replace(self, response_length=response_length)


@dataclass(frozen=True)
class DataFlow:
    """Data handed from one model-stage to another through the driver, per sequence.

    ``bytes_per_token`` over ``response`` tokens only or over the whole sequence.
    """

    src: ModelStage
    dst: ModelStage
    what: str
    bytes_per_token: int
    response_only: bool

    def bytes_per_step(self, sequences: int, workload: Workload) -> int:
        tokens = workload.response_length if self.response_only else workload.seq_length
        return sequences * tokens * self.bytes_per_token


@dataclass(frozen=True)
class Workflow:
    """Model-stages of one algorithm, their phases, concurrency and data flow.

    Attributes:
        algorithm: PPO, GRPO or ReMax.
        asynchronous: generation overlaps inference and training (see module docstring).
        phases: ``(generation, inference, training)`` model-stage tuples; each runs
            concurrently on disjoint GPUs.
        data_flow: edges with their payload.
        generation_factor: rollouts per ``global_batch`` sequence (ReMax: 2, the sampled and the
            greedy baseline response).
    """

    algorithm: Algorithm
    asynchronous: bool
    phases: tuple[tuple[ModelStage, ...], ...]
    data_flow: tuple[DataFlow, ...]
    generation_factor: int = 1

    @property
    def model_stages(self) -> tuple[ModelStage, ...]:
        """All model-stages in canonical order."""
        return tuple(m for phase in self.phases for m in phase)

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(sorted({m.role for m in self.model_stages}, key=list(Role).index))

    def phase_of(self, model_stage: ModelStage) -> int:
        """Index of the phase holding ``model_stage``.

        Raises:
            ConfigError: if the workflow does not run it.
        """
        for i, phase in enumerate(self.phases):
            if model_stage in phase:
                return i
        raise ConfigError(f"{self.algorithm}: model-stage {model_stage} is not part of this workflow")

    def sequences(self, model_stage: ModelStage, workload: Workload) -> int:
        """Sequences ``model_stage`` processes per RL step."""
        if model_stage.stage is GEN or model_stage.role is RW:
            return workload.global_batch * self.generation_factor
        return workload.global_batch

    def concurrent_sets(self) -> list[tuple[ModelStage, ...]]:
        """The ``C_s`` of Eq. 1: model-stages that hold disjoint GPUs at the same time.

        Synchronous: each phase. Asynchronous: generation together with each later phase.
        """
        if not self.asynchronous:
            return [p for p in self.phases if p]
        gen, rest = self.phases[0], self.phases[1:]
        return [gen + p for p in rest if p] or [gen]

    def critical_path_s(self, latency_s: Mapping[ModelStage, float]) -> float:
        """Step latency: the critical path of the execution-overlap graph (paper §4.2).

        Args:
            latency_s: predicted seconds per model-stage (every model-stage of the workflow).

        Synchronous: ``Σ_phase max_{M∈phase} L_M``. Asynchronous: ``max(L_gen, Σ_{later}
        max L_M)`` — the interval between weight synchronisations.
        """
        per_phase = [max((latency_s[m] for m in p), default=0.0) for p in self.phases]
        if self.asynchronous:
            return max(per_phase[0], sum(per_phase[1:]))
        return sum(per_phase)

    def data_bytes_per_step(self, workload: Workload) -> dict[tuple[ModelStage, ModelStage], int]:
        """Bytes each data-flow edge carries per RL step (token ids, log-probs, values, rewards)."""
        return {
            (e.src, e.dst): e.bytes_per_step(self.sequences(e.dst, workload), workload)
            for e in self.data_flow
        }


def _ms(role: Role, stage: Stage) -> ModelStage:
    return ModelStage(role, stage)


def build_workflow(
    algorithm: Algorithm | str,
    *,
    asynchronous: bool = False,
    reward_model: bool = True,
    reference: bool = True,
) -> Workflow:
    """The workflow of ``algorithm``.

    PPO (Ouyang et al. 2022): actor generation; actor, reference, reward and critic inference;
    actor and critic training. GRPO (Shao et al. 2024): no critic; advantages from group
    statistics. ReMax (Li et al. 2024): no critic; a greedy rollout per prompt is the baseline,
    so generation and reward inference see twice the sequences.

    Args:
        reward_model: False for rule-based rewards (a verifier on the driver, no model-stage).
        reference: False to drop the KL reference model.

    Raises:
        ConfigError: for an unknown algorithm name.
    """
    try:
        algo = Algorithm(str(algorithm).lower())
    except ValueError:
        raise ConfigError(f"algorithm {algorithm!r}: expected one of {[a.value for a in Algorithm]}") from None
    inference_roles = [A] + ([REF] if reference else []) + ([RW] if reward_model else [])
    training_roles = [A]
    if algo is Algorithm.PPO:
        inference_roles.append(C)
        training_roles.append(C)
    gen = (_ms(A, GEN),)
    inf = tuple(sorted((_ms(r, INF) for r in inference_roles), key=ModelStage.sort_key))
    train = tuple(sorted((_ms(r, TRAIN) for r in training_roles), key=ModelStage.sort_key))
    ids = 4  # int32 token ids
    flows = [DataFlow(gen[0], m, "token ids", ids, False) for m in inf]
    for m in inf:
        what = {A: "old log-probs", REF: "reference log-probs", RW: "rewards", C: "values"}[m.role]
        for t in train:
            flows.append(DataFlow(m, t, what, 4, True))
    return Workflow(
        algorithm=algo,
        asynchronous=asynchronous,
        phases=(gen, inf, train),
        data_flow=tuple(flows),
        generation_factor=2 if algo is Algorithm.REMAX else 1,
    )
