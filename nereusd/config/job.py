"""Job configuration: the strict schema of a job YAML and its loader.

YAML → :func:`load_job` → frozen pydantic models. Unknown keys are errors; every error names
the file and the dotted key (``job.yaml: train.micro_batch: expected an integer, got 'x'``).
Paths inside the job (model directories) are resolved relative to the job file. Loaded
configuration is never mutated; values derived from it (the resolved plan, model specs) live
in :class:`ResolvedJob` (see ``nereusd/config/resolve.py``).
"""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import Field, StrictInt, ValidationError, field_validator, model_validator

from nereusd.config.curriculum import LengthStageConfig, curriculum_error, stage_cap
from nereusd.config.pool import PoolConfig
from nereusd.config.schema import Number, Strict
from nereusd.config.yamlfile import read_yaml
from nereusd.errors import ConfigError
from nereusd.models import MAX_MODEL_DIMENSION
from nereusd.plan import MAX_DEVICES

MAX_SEQUENCES = 1 << 20
"""Most sequences (a batch, a group, the prompts of a step) or passes a job file, ``plan`` or
``simulate`` may ask for: RL jobs run a few thousand sequences a step; at 10^6 a simulated step's
continuous-batching truth already takes seconds (a 10^7 typo ran for minutes with no output, and
10^30 ended in numpy's traceback; a 400-digit batch passed the job schema)."""
MAX_TOKENS = MAX_MODEL_DIMENSION
"""Most tokens a prompt, a response or a micro-batch's token budget may hold: the largest context
a model config may give."""
MAX_STEPS = 10**8
"""Most RL steps a job may ask for: published runs take thousands (``steps: 1e30`` was taken)."""
from nereusd.workflow import Algorithm


class ModelsConfig(Strict):
    """Where each role's weights come from.

    A value is a Hugging Face model directory (``config.json`` + ``*.safetensors``), relative to
    the job file. ``actor_config`` instead builds a randomly initialised actor of the given
    shape (``nereusd.models.ModelSpec`` fields) from the job's seed.
    """

    actor: str | None = None
    """Actor (policy) model directory; the reference starts as a copy of it."""
    actor_config: dict[str, Any] | None = None
    """Actor shape when no directory is given (random initialisation from ``seed``)."""
    critic: str | None = None
    """Critic model directory; default: the actor's trunk with a new value head (PPO only)."""
    reference: str | None = None
    """Reference model directory; default: the actor's initial weights."""
    reward: str | None = None
    """Reward model directory (a trunk with a value head); needed when ``reward.kind: model``."""


class RewardConfig(Strict):
    """How responses are scored."""

    kind: Literal["verifier", "model"] = "verifier"
    """``verifier``: a rule-based checker of the task; ``model``: the reward model's score."""


class TaskConfig(Strict):
    """The prompt set and its verifier."""

    name: str = "counting"
    """Task name (``nereusd.tasks``)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Task-specific options, passed to the task's constructor."""


class RolloutConfig(Strict):
    """Generation settings."""

    prompts_per_step: StrictInt = Field(8, ge=1, le=MAX_SEQUENCES)
    """Distinct prompts per RL step."""
    group_size: StrictInt = Field(8, ge=1, le=MAX_SEQUENCES)
    """Samples per prompt (GRPO's group; PPO and ReMax usually 1)."""
    max_new_tokens: StrictInt = Field(96, ge=1, le=MAX_TOKENS)
    """Longest response in tokens: it sizes the vLLM engines (``max_model_len``) and the model's
    context check; with :attr:`max_new_tokens_schedule`, the cap of its last stage at most."""
    max_new_tokens_schedule: list[LengthStageConfig] = Field(default_factory=list)
    """A response-length curriculum: the cap of each step's responses, raised in stages (e.g.
    DeepScaleR's 8K → 16K → 24K context lengthening, Luo et al. 2025). Entry ``k`` caps the
    steps from its ``at_step`` up to the next entry's; the first starts at step 0; caps never
    fall and never exceed :attr:`max_new_tokens`. Empty (default): every step is capped at
    :attr:`max_new_tokens`. See :meth:`max_new_tokens_at`."""
    temperature: Number = Field(1.0, gt=0.0)
    """Sampling temperature."""
    max_staleness: StrictInt = Field(0, ge=0)
    """Asynchronous execution: generation runs up to this many policy versions ahead of
    training (step ``k`` trains on responses generated with the weights of step ``k − s``;
    1 is one-step off-policy, as in AReaL/Laminar). 0 (default): synchronous steps. The safe
    boundary becomes the weight synchronisation (DESIGN.md)."""

    def max_new_tokens_at(self, step: int) -> int:
        """The cap of step ``step``'s responses (tokens): the :attr:`max_new_tokens_schedule`
        stage that step is in, else :attr:`max_new_tokens` (:func:`stage_cap`)."""
        return stage_cap([(s.at_step, s.max_new_tokens) for s in self.max_new_tokens_schedule], step,
                         self.max_new_tokens)


class TrainConfig(Strict):
    """Optimisation settings shared by the trainable roles."""

    global_batch: StrictInt = Field(64, ge=1, le=MAX_SEQUENCES)
    """Sequences per optimizer step; ``dp × micro_batch × grad_accum`` must equal it."""
    micro_batch: StrictInt = Field(8, ge=1, le=MAX_SEQUENCES)
    """Sequences per micro-batch on one replica, at most: a training replica takes the largest
    divisor of its share of ``global_batch`` up to it (:func:`nereusd.plan.training_micro_batch`:
    12 on a share of 16 trains at 8), and for a layout this does not fit in memory, the planner
    takes the largest power of two below it that does (a plan's ``micro_batch``). A
    ``micro_batch`` written in ``plan:`` is taken as it is and must divide the share."""
    max_tokens_per_micro_batch: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    """Form training and inference micro-batches by this token budget instead of by count:
    sequences are packed padding-free into rows of at most this many tokens (verl's dynamic
    batch size). Must hold the longest sequence (prompt plus ``rollout.max_new_tokens``).
    Generation is unaffected. ``None`` (default): ``micro_batch`` sequences, padded."""
    epochs: StrictInt = Field(1, ge=1, le=MAX_SEQUENCES)
    """Passes over each step's rollout (PPO epochs)."""
    actor_lr: Number = Field(3e-4, gt=0.0)
    critic_lr: Number = Field(1e-3, gt=0.0)
    clip: Number = Field(0.2, gt=0.0)
    """PPO ratio clip ε."""
    value_clip: Number = Field(0.2, gt=0.0)
    kl_coef: Number = Field(0.02, ge=0.0)
    """β of the KL penalty to the reference."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    entropy_coef: Number = Field(0.0, ge=0.0)
    gamma: Number = Field(1.0, gt=0.0, le=1.0)
    lam: Number = Field(0.95, ge=0.0, le=1.0)
    grad_clip: Number | None = Field(1.0, gt=0.0)
    weight_decay: Number = Field(0.0, ge=0.0)


class StagePlanConfig(Strict):
    """``tp, pp, dp`` and devices of one model-stage; omitted fields come from ``plan.default``."""

    tp: StrictInt | None = Field(None, ge=1, le=MAX_DEVICES)
    pp: StrictInt | None = Field(None, ge=1, le=MAX_DEVICES)
    dp: StrictInt | None = Field(None, ge=1, le=MAX_DEVICES)
    devices: list[StrictInt] | None = None
    micro_batch: StrictInt | None = Field(None, ge=1, le=MAX_SEQUENCES)
    recompute: bool | None = None
    zero_stage: StrictInt | None = Field(None, ge=0, le=2)
    """ZeRO stage of a training model-stage (1, 2: ``backends: {<ms>: deepspeed}``); pinned like
    the other fields. Unset: ZeRO-0 on the native engine; on deepspeed, 1 at launch and the
    planner's choice after. Non-training model-stages ignore it in ``plan.default``."""


class PlanConfig(Strict):
    """The launch plan.

    ``default`` applies to every model-stage of the algorithm; ``model_stages`` overrides it per
    model-stage (keys like ``actor/training``). A model-stage without devices uses all of the
    job's devices (colocated placement, serialised); ``dp`` defaults to
    ``len(devices) / (tp·pp)``. Generation folds PP into DP (``pp`` is 1 for generation).
    """

    default: StagePlanConfig = StagePlanConfig(tp=1, pp=1)
    model_stages: dict[str, StagePlanConfig] = Field(default_factory=dict)


ADAPTIVE_CHECKPOINT_EVERY = 5
"""Default checkpoint interval (steps) of a job with live adaptation and no ``every_steps``.

With adaptation on, an abrupt device loss (or an out-of-memory step) restarts the job from its
latest checkpoint and the steps since run again; without periodic checkpoints that is the whole
run. A checkpoint of the demo model (0.7 M parameters, actor with Adam state, ~9 MB) took
0.15–0.8 s in measured runs (events.jsonl ``checkpoint`` ``elapsed_s``) against ~6 s per step:
every 5 steps costs ~1–3 % of the run and bounds the loss to 4 steps (2 on average). RL steps of
real models are long (generation-bound) next to a checkpoint write, so the ratio stays small.
"""


class CheckpointConfig(Strict):
    every_steps: StrictInt | None = Field(None, ge=0)
    """Save a DCP checkpoint every N steps (0: only the final one). Unset: 0 without live
    adaptation, :data:`ADAPTIVE_CHECKPOINT_EVERY` with it (see :meth:`interval`)."""
    final: bool = True
    """Save a DCP checkpoint at the end of the run."""
    keep_last: StrictInt = Field(3, ge=1)
    """Periodic checkpoints kept (``checkpoints/step<N>``): after each new one is committed the
    older ones beyond this many are deleted (:func:`nereusd.checkpoints.prune`). ``final``,
    ``preempted-*`` and ``fallback-*`` checkpoints are always kept."""

    def interval(self, adaptive: bool) -> int:
        """Steps between periodic checkpoints (0: none) for a job with (``adaptive``) or without
        live adaptation."""
        if self.every_steps is not None:
            return self.every_steps
        return ADAPTIVE_CHECKPOINT_EVERY if adaptive else 0


DEFAULT_PAYBACK_MARGIN = 0.5
"""Payback margin γ of a job that sets none (``adaptation.payback_margin``; the paper's default,
"γ ∈ [0, 1] (0.5 by default)", with its sensitivity in §7.3.3): the one default that jobs, the
controller's policy, admission and the simulator's ``nereus`` use."""
DEFAULT_DELTA_LENGTH = 0.30
"""Drift threshold δ_len of the response-length signal of a job that sets none
(``adaptation.delta_length``); the monitor's default too (:data:`nereusd.control.monitor.DEFAULT_DELTAS`)."""


class AdaptationConfig(Strict):
    """Live adaptation (paper §4: monitor → planner → admission; §6: transitions at safe boundaries)."""

    enabled: bool = True
    """Re-plan while the job runs; ``false`` freezes the launch plan (pool changes stop the job)."""
    policy: Literal["nereus", "frozen"] = "nereus"
    """``nereus``: monitor, planner and payback admission; ``frozen``: keep the launch layout, only
    rescale DP when the pool changes and, after an out-of-memory failure, restart from the last
    checkpoint into a layout that holds ``max_new_tokens`` (what users of static frameworks do)."""
    # .inf is meaningful; ge=0 refuses NaN
    payback_margin: Number = Field(DEFAULT_PAYBACK_MARGIN, ge=0.0, allow_inf_nan=True)
    """Payback margin γ: admit when ``L_tran / ΔL ≤ γ · H_x`` (``.inf``: any positive gain; 0:
    urgent switches only)."""
    gamma: Any = Field(None, exclude=True)
    """Removed: the payback margin was renamed :attr:`payback_margin` (``train.gamma`` is the RL
    discount); the old key is refused with a message naming the new one."""
    period: StrictInt = Field(0, ge=0)
    """Also re-plan every N steps (0: on triggers only)."""
    delta_length: Number = Field(DEFAULT_DELTA_LENGTH, gt=0.0)
    """Drift threshold δ_len of the response-length signal (relative)."""
    launch_response_length: StrictInt | None = Field(None, ge=1)
    """Response length (tokens) the launch plan is chosen for when the job gives no ``plan``
    (default: step 0's cap, ``rollout.max_new_tokens`` or the first stage of
    ``rollout.max_new_tokens_schedule``, so the launch plan holds the longest response step 0
    can generate)."""
    forced: list["ForcedSwitchConfig"] = Field(default_factory=list)
    """Switches the operator forces at given steps (admission bypassed; e.g. to test that a run
    that switches trains like one that does not)."""


    @field_validator("gamma")
    @classmethod
    def _renamed(cls, value: float | None) -> None:
        if value is not None:
            raise ValueError("renamed: use adaptation.payback_margin (train.gamma is the RL discount)")
        return None


class ForcedSwitchConfig(Strict):
    """A layout forced at the safe boundary before step ``at_step`` (0-based)."""

    at_step: StrictInt = Field(ge=1)
    model_stages: dict[str, StagePlanConfig]
    """Overrides of the *current* plan per model-stage (``tp``, ``pp``, ``dp``, ``micro_batch``,
    ``recompute``, ``zero_stage``); devices default to those the model-stage has now."""


AdaptationConfig.model_rebuild()
RolloutConfig.model_rebuild()


class EvaluationConfig(Strict):
    """Evaluation on the task's held-out prompts (``math``: ``task.options.eval_size`` records)."""

    every_steps: StrictInt = Field(0, ge=0)
    """Evaluate before step 0 and after every N steps, and after the last (0: never)."""
    max_prompts: StrictInt | None = Field(None, ge=1)
    """Evaluate on at most this many held-out prompts (default: all)."""


class WandbConfig(Strict):
    """A Weights & Biases run per job (``pip install wandb``); every number of each
    ``metrics.jsonl`` line is logged at its step (:mod:`nereusd.loggers`)."""

    project: str
    entity: str | None = None
    """Team or user; default: your W&B default entity."""
    name: str | None = None
    """Run name; default: the job's ``name``."""
    mode: Literal["online", "offline"] = "online"
    """``offline`` writes ``RUN_DIR/wandb/`` only (``wandb sync`` uploads it later)."""
    tags: list[str] = Field(default_factory=list)


class MlflowConfig(Strict):
    """An MLflow run per job (``pip install mlflow-skinny`` or ``mlflow``); every number of each
    ``metrics.jsonl`` line is logged at its step (:mod:`nereusd.loggers`)."""

    tracking_uri: str | None = None
    """E.g. ``http://mlflow.example:5000``; default: ``MLFLOW_TRACKING_URI``, else MLflow's own."""
    experiment: str | None = None
    """Default: the job's ``name``."""
    run_name: str | None = None
    """Default: the job's ``name``."""


class LoggersConfig(Strict):
    """Optional experiment trackers beside ``metrics.jsonl``, TensorBoard and Prometheus."""

    wandb: WandbConfig | None = None
    mlflow: MlflowConfig | None = None


class JobConfig(Strict):
    """A whole job YAML."""

    name: str = "nereus-job"
    algorithm: Algorithm = Algorithm.GRPO
    seed: StrictInt = Field(0, ge=0, lt=2**32)
    """Seed of every random draw of the job (numpy's and torch's range: 0 to 2^32 − 1)."""
    steps: StrictInt = Field(20, ge=1, le=MAX_STEPS)
    site: str = "local"
    """Site config: a name under ``site_configs/`` or a path (``.yaml``/``.yml``, or with a
    ``/``), relative to the job file as ``models`` paths are when it is there, else to the
    working directory (:func:`load_job`)."""
    devices: StrictInt | None = Field(None, ge=1, le=MAX_DEVICES)
    """Devices the job uses (local mode: virtual devices); default: the site's node size; at most
    :data:`nereusd.plan.MAX_DEVICES`."""
    memory_gib: Number | None = Field(None, gt=0.0, le=1e6)
    """Override of the site's per-device memory capacity (local virtual devices)."""
    models: ModelsConfig = ModelsConfig()
    reward: RewardConfig = RewardConfig()
    task: TaskConfig = TaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    plan: PlanConfig = PlanConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    adaptation: AdaptationConfig = AdaptationConfig()
    pool: PoolConfig = PoolConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    loggers: LoggersConfig = LoggersConfig()
    backends: dict[str, str] = Field(default_factory=dict)
    """Engine per model-stage, e.g. ``{actor/generation: vllm}``; unnamed model-stages get the
    defaults of :mod:`nereusd.backends` (generation on vLLM when it is installed)."""

    @model_validator(mode="after")
    def _some_step_trains_on_a_rollout(self) -> "JobConfig":
        if self.rollout.max_staleness >= self.steps:
            raise ValueError(f"rollout.max_staleness: {self.rollout.max_staleness} is not below steps={self.steps}: "
                             "step k trains on step k - max_staleness's rollout, so no step would train")
        return self

    @model_validator(mode="after")
    def _stages_rise_to_the_cap(self) -> "JobConfig":
        stages = [(s.at_step, s.max_new_tokens) for s in self.rollout.max_new_tokens_schedule]
        problem = curriculum_error(stages, self.rollout.max_new_tokens, "rollout.max_new_tokens_schedule",
                                   "rollout.max_new_tokens", self.steps)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _launch_length_is_a_response_length(self) -> "JobConfig":
        launch = self.adaptation.launch_response_length
        if launch is not None and launch > self.rollout.max_new_tokens:
            raise ValueError(f"adaptation.launch_response_length: {launch} exceeds rollout.max_new_tokens="
                             f"{self.rollout.max_new_tokens}: no response is longer, so no plan needs to hold it")
        return self

    def launch_response_length(self, step: int = 0) -> int:
        """The response length (tokens) a launch plan for a job starting at ``step`` (0, or the
        checkpoint a resume plans afresh from) is chosen for: ``adaptation.launch_response_length``,
        else the longest response that step can generate (:meth:`RolloutConfig.max_new_tokens_at`)."""
        return self.adaptation.launch_response_length or self.rollout.max_new_tokens_at(step)

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, value: str) -> str:
        # it names run directories and Slurm jobs: ' ', '..', '-rf' and '$(id)' were accepted
        if not JOB_NAME.fullmatch(value):
            raise ValueError("expected a short name: letters, digits, '.', '_' and '-', starting with a letter or "
                             "digit, at most 64 characters (no slashes or spaces)")
        return value


JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What a job's ``name`` may be (:meth:`JobConfig._name_is_simple`)."""

MAX_ERROR_LINES = 20
"""Problems :func:`format_validation_error` lists before it counts the rest."""


_REPR = reprlib.Repr()   # keyword arguments need Python 3.12
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 3, 8, 8, 8, 8
_REPR.maxstring = _REPR.maxother = 200


def _short_repr(value: Any) -> str:
    """A bad value for an error line: at most ~200 characters; a list or mapping is shown
    without its whole ``repr`` (through aliases it can expand to billions of items)."""
    if isinstance(value, (list, dict, tuple, set)):
        return _REPR.repr(value)
    try:
        text = repr(value)
    except ValueError:   # an int past Python's digit limit
        return f"an integer of {value.bit_length()} bits" if isinstance(value, int) else type(value).__name__
    return text if len(text) <= 200 else text[:200] + f"… ({len(text)} characters)"


def _close_key(model: type | None, loc: tuple) -> str:
    """`` (did you mean 'steps'?)`` for an unknown key at ``loc`` close to a field of the model
    there (``model`` the top-level one; ``step:`` had said only "unknown key": a new user's
    trial, 2026-12-07); ``""`` when none is close or the place is not a model's."""
    import difflib
    import typing

    from pydantic import BaseModel

    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        kinds = (field.annotation, *typing.get_args(field.annotation)) if field is not None else ()
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1) if model is not None else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def format_validation_error(source: str, err: ValidationError, model: type | None = None) -> str:
    """One line per problem: ``<source>: <dotted.key[index]>: <message>, got <value>``; at most
    :data:`MAX_ERROR_LINES` of them, then how many more. A check across sections names its keys
    in its message, without the value of the whole file. ``model``: the validated model, whose
    fields an unknown key's line suggests when one is close (:func:`_close_key`)."""
    lines = []
    errors = err.errors()
    for item in errors[:MAX_ERROR_LINES]:
        key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in item["loc"]).lstrip(".")
        msg = item["msg"].removeprefix("Value error, ")
        if not key and item["type"] == "value_error":
            lines.append(f"{source}: {msg}")
            continue
        key = key or "<top>"
        if item["type"] == "extra_forbidden":
            msg = "unknown key" + _close_key(model, tuple(item["loc"]))
        elif item["type"] == "missing":
            msg = "required key is missing"
        suffix = "" if item["type"] in ("extra_forbidden", "missing") else f", got {_short_repr(item.get('input'))}"
        lines.append(f"{source}: {key}: {msg}{suffix}")
    if len(errors) > MAX_ERROR_LINES:
        lines.append(f"{source}: … and {len(errors) - MAX_ERROR_LINES} more problems")
    return "\n".join(lines)


def load_yaml_mapping(path: Path) -> Mapping[str, Any]:
    """Read a YAML file whose top level must be a mapping.

    Raises:
        ConfigError: if the file is missing, too large, not UTF-8, not YAML, repeats a key, or
            is not a mapping (:func:`nereusd.config.yamlfile.read_yaml`).
    """
    data = read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def parse_job(data: Mapping[str, Any], source: str = "<job>") -> JobConfig:
    """Validate a job mapping.

    Raises:
        ConfigError: naming ``source`` and each offending dotted key.
    """
    try:
        return JobConfig.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(format_validation_error(source, err, JobConfig)) from None


def load_job(path: str | Path) -> JobConfig:
    """Load and validate a job YAML (schema only; see ``nereusd.config.resolve.resolve_job``).

    Raises:
        ConfigError: the file is missing or malformed; the message names the file and key.
    """
    path = Path(path)
    job = parse_job(load_yaml_mapping(path), source=str(path))
    site = Path(job.site)
    beside = path.resolve().parent / site
    if (job.site.endswith((".yaml", ".yml")) or "/" in job.site) and not site.is_absolute() and beside.is_file():
        # relative to the job file, as its models are: from another directory it was not found
        # (an adversarial trial, 2026-12-07); one that is only there from the working directory still is
        job = job.model_copy(update={"site": str(beside)})
    return job
