"""Typed payloads of the tasks nereusd sends to workers, one model per task kind.

A :class:`nereusd.protocol.messages.Task` carries one of these as ``args``; the ``kind`` field
selects the model (a discriminated union), so a task of an unknown kind, or with a missing,
unknown or mistyped field, is refused when the frame is decoded — by the agent that relays it
and by the worker — never half-understood by a handler. Results stay plain mappings
(:class:`~nereusd.protocol.messages.TaskResult`).

The handlers are in :mod:`emu.worker.runtime` and :mod:`emu.worker.transition_tasks`; their
docstrings say what each returns.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from nereusd.errors import ProtocolError


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


class RoleArgs(_Args):
    """Where a role's initial weights come from: ``spec`` (``ModelSpec.to_dict``), an HF
    directory (``None``: seeded random initialisation), whether it has a value head."""

    spec: dict[str, Any]
    path: str | None = None
    value_head: bool = False


class EngineSettings(_Args):
    """Optimiser and batching settings every training engine of the job shares."""

    micro_batch: int = Field(ge=1)
    """Sequences per micro-batch on one replica (a candidate's own ``micro_batch`` wins)."""
    weight_decay: float = Field(ge=0.0)
    grad_clip: float | None = Field(None, gt=0.0)
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """Token budget of a training/inference micro-batch (packed, padding-free); ``None``: by count."""


class SyncDag(_Args):
    """One weight-sync DAG of a plan (``nereusd.transition.weight_sync_dags``), as JSON."""

    source: str
    target: str
    dag: str


class BuildArgs(_Args):
    """Create every model-stage's communicators and the engines this rank holds."""

    kind: Literal["build"] = "build"
    plan: dict[str, Any]
    """``Plan.to_dict()``; an empty plan only records the job's models on a worker that joins."""
    roles: dict[str, RoleArgs]
    train: EngineSettings
    lr: dict[str, float]
    """Learning rate per training model-stage (``"actor/training"``)."""
    seed: int
    syncs: list[SyncDag] = Field(default_factory=list)
    backends: dict[str, Literal["native", "vllm", "deepspeed"]] = Field(default_factory=dict)
    """Engine per model-stage (:mod:`nereusd.backends`); a model-stage not named runs native. A
    training model-stage's engine follows its candidate's ``zero_stage`` (0 native, 1–2 DeepSpeed)."""
    max_model_len: int = Field(1, ge=1)
    """Longest sequence of a generation model-stage in tokens: the task's longest prompt plus
    ``rollout.max_new_tokens`` (a vLLM engine's ``max_model_len`` and KV-cache budget)."""


class GenerateArgs(_Args):
    """Sample responses to ``prompts`` (token ids) on this replica."""

    kind: Literal["generate"] = "generate"
    model_stage: str
    prompts: list[list[int]]
    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(gt=0.0)
    greedy: bool
    stop_ids: list[int]
    """A response ends at any of these (EOS and the generation config's stop tokens)."""
    pad_id: int
    seed: int
    seeds: list[int] | None = None
    """One sampling seed per prompt (draws independent of the layout)."""


class _Sequences(_Args):
    """A replica's share of the step's sequences (token ids, prompt then response)."""

    model_stage: str
    sequences: list[list[int]]
    prompt_lens: list[int]


class LogprobsArgs(_Sequences):
    """Per-token log-probabilities of the responses in ``sequences``."""

    kind: Literal["logprobs"] = "logprobs"


class ValuesArgs(_Sequences):
    """Per-token values of the responses in ``sequences`` (critic)."""

    kind: Literal["values"] = "values"


class ScoresArgs(_Args):
    """One scalar score per sequence (reward model)."""

    kind: Literal["scores"] = "scores"
    model_stage: str
    sequences: list[list[int]]


class PolicyLoss(_Args):
    """The clipped policy loss (PPO/GRPO/ReMax), ``emu.rl.losses.policy_loss_fn``."""

    kind: Literal["policy"] = "policy"
    clip: float
    kl_coef: float
    kl_estimator: Literal["k1", "k3"]
    entropy_coef: float


class ValueLoss(_Args):
    """The clipped value loss (PPO critic), ``emu.rl.losses.value_loss_fn``."""

    kind: Literal["value"] = "value"
    value_clip: float


class TrainArgs(_Sequences):
    """One optimizer step of this replica's share of a mini-batch."""

    kind: Literal["train"] = "train"
    per_token: dict[str, list[list[float]]]
    """Per-token inputs of the loss (``old_logprobs``, ``advantages``, ``weight``, ...)."""
    loss: Annotated[Union[PolicyLoss, ValueLoss], Field(discriminator="kind")]
    completes_step: int | None = Field(None, ge=1)
    """On the RL step's last update: the RL steps the model-stage's state holds once it is
    applied (step index + 1; the EMU's ``LogicalState.version``). ``None`` on the others: the
    state is then between steps (version −1) until that last update."""


class SyncWeightsArgs(_Args):
    """Copy ``source``'s parameters into ``targets`` through their planned sync DAGs."""

    kind: Literal["sync_weights"] = "sync_weights"
    source: str
    targets: list[str]


class _Directory(_Args):
    dir: str
    """The checkpoint's directory (one DCP checkpoint per role below it)."""


class SaveCheckpointArgs(_Directory):
    """Save every training model-stage this rank holds under ``dir`` (DCP)."""

    kind: Literal["save_checkpoint"] = "save_checkpoint"


class LoadCheckpointArgs(_Directory):
    """Load every training model-stage this rank holds from ``dir`` (any saved layout)."""

    kind: Literal["load_checkpoint"] = "load_checkpoint"


class TransitionPrepareArgs(_Args):
    """Detach the engines ``dag`` changes and create its communicators."""

    kind: Literal["transition_prepare"] = "transition_prepare"
    dag: str
    """``TransitionDag.to_json()``: this device's slice (:meth:`TransitionDag.slices`) when
    ``communicators`` is given, else the whole DAG; without its plans when ``plans`` is given."""
    communicators: list[tuple[str, list[int]]] | None = None
    """The whole DAG's communicators in creation order (:func:`nereusd.transition.comms.communicator_plan`)."""
    plans: str | None = None
    """``TransitionDag.plans_json()``: the plans a ``to_json(plans=False)`` slice left out."""
    changed: list[str] | None = None
    """The model-stages the whole DAG changes (their engines are detached and rebuilt on every
    device that holds them, with or without an op of its own)."""
    ops: list[str] = Field(default_factory=list)
    """This device's part of the DAG's first ready set, run once the communicators exist, as a
    ``transition_run`` of them would (one round trip of every worker less per transition)."""


class TransitionRunArgs(_Args):
    """Run this device's part of ``ops`` (a ready set of the prepared DAG)."""

    kind: Literal["transition_run"] = "transition_run"
    ops: list[str]


class TransitionFinishArgs(_Args):
    """Build the target plan's engines on the holdings the transition produced."""

    kind: Literal["transition_finish"] = "transition_finish"
    syncs: list[SyncDag] = Field(default_factory=list)


class ReformWorldArgs(_Args):
    """Join world generation ``generation`` with rank = index of this device in ``devices``;
    through the store at ``store_host:store_port`` when given (a resumed nereusd serves a new
    one), else the one the worker joined before."""

    kind: Literal["reform_world"] = "reform_world"
    generation: int = Field(ge=0)
    devices: list[int]
    timeout_s: float = Field(300.0, gt=0.0)
    store_host: str | None = None
    store_port: int | None = Field(None, ge=1, le=65535)


class EngineReplica(_Args):
    """One generation replica whose vLLM engine a joining device starts early: what
    :func:`nereusd.backends.vllm_replica_key` names (``tp``, its TP devices in order,
    ``max_num_seqs``)."""

    model_stage: str
    tp: int = Field(ge=1)
    devices: list[int] = Field(min_length=1)
    max_num_seqs: int = Field(ge=1)


class PrestartEnginesArgs(_Args):
    """Start the engines of ``replicas`` on the devices of a background join, before they join
    the world (``emu.worker.vllm_stages.VllmStages.prestart_engines``); ``world``: the joining
    devices in the rank order of their private world."""

    kind: Literal["prestart_engines"] = "prestart_engines"
    replicas: list[EngineReplica]
    world: list[int] = Field(min_length=1)


class DescribeArgs(_Args):
    """Report what this worker holds: the plan its EMUs form and, per training model-stage it
    holds, the RL steps its state holds (``LogicalState.version``; −1 between steps)."""

    kind: Literal["describe"] = "describe"


class MemoryReportArgs(_Args):
    """Report this device's memory accounting."""

    kind: Literal["memory_report"] = "memory_report"


TaskArgs = Annotated[
    Union[BuildArgs, GenerateArgs, LogprobsArgs, ValuesArgs, ScoresArgs, TrainArgs, SyncWeightsArgs,
          SaveCheckpointArgs, LoadCheckpointArgs, TransitionPrepareArgs, TransitionRunArgs, TransitionFinishArgs,
          ReformWorldArgs, MemoryReportArgs, DescribeArgs, PrestartEnginesArgs],
    Field(discriminator="kind"),
]
TASK_KINDS = ("build", "generate", "logprobs", "values", "scores", "train", "sync_weights", "save_checkpoint",
              "load_checkpoint", "transition_prepare", "transition_run", "transition_finish", "reform_world",
              "memory_report", "describe", "prestart_engines")
_TASK_ARGS: TypeAdapter = TypeAdapter(TaskArgs)


def task_args(kind: str, fields: dict[str, Any]) -> BaseModel:
    """The typed payload of a ``kind`` task from plain ``fields`` (what the driver assembles).

    Raises:
        ProtocolError: an unknown kind, or fields that do not match its model (named).
    """
    if kind not in TASK_KINDS:
        raise ProtocolError(f"unknown task kind {kind!r} (known: {', '.join(TASK_KINDS)})")
    try:
        return _TASK_ARGS.validate_python({"kind": kind, **fields})
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or '<args>'}: {e['msg']}"
                             for e in err.errors())
        raise ProtocolError(f"malformed {kind!r} task: {problems}") from None
