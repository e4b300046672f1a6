"""A job resolved against its site and models: model specs per role, the launch plan, budgets.

:func:`resolve_job` turns a validated :class:`~nereusd.config.job.JobConfig` into a
:class:`ResolvedJob` and checks everything that must hold before a process starts: model
directories exist, the plan's degrees multiply to its devices, heads and layers divide, the
global batch is exact (``dp × micro_batch × grad_accum``). Errors name the job file and key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from nereusd.backends import (ZERO_STAGES, Backend, check_engine_support, check_zero_stage, default_zero_stage,
                              resolve_backends)
from nereusd.config.job import JobConfig, StagePlanConfig, load_job
from nereusd.cost.memory import WORKSPACE_BYTES
from nereusd.loggers import check_loggers
from nereusd.errors import ConfigError, PlanError, shortened
from nereusd.hf_files import safetensors_equal, safetensors_shapes
from nereusd.models import ModelSpec, shortest_context
from nereusd.plan import Candidate, Layout, ModelStage, Plan, Role, Stage, training_micro_batch
from nereusd.shards import check_checkpoint_shapes, check_layout, value_head_for
from nereusd.workflow import Algorithm, build_workflow

def job_model_stages(algorithm: Algorithm, reward_model: bool) -> tuple[ModelStage, ...]:
    """Model-stages of one RL step for ``algorithm`` (plus ``reward/inference`` when scored by a
    model), in canonical order: those of :func:`nereusd.workflow.build_workflow`."""
    return build_workflow(algorithm, reward_model=reward_model).model_stages


@dataclass(frozen=True)
class RoleModel:
    """Where one role's initial weights come from and its shape."""

    role: Role
    spec: ModelSpec
    path: str | None
    """HF directory to load, or None for a seeded random initialisation."""
    value_head: bool
    """Critic and reward model carry a scalar value head."""
    init_from_actor: bool = False
    """Critic default: the actor's trunk (from ``path``) with a new value head."""


@dataclass(frozen=True)
class ResolvedJob:
    """A job ready to run: config, its directory, role models, launch plan, device budget."""

    config: JobConfig
    source: str
    base_dir: Path
    devices: int
    device_memory_bytes: int
    site_name: str
    roles: dict[Role, RoleModel]
    plan: Plan
    grad_accum: dict[ModelStage, int] = field(default_factory=dict)
    max_prompt_tokens: int = 1
    """The task's longest prompt in tokens (what the planner plans for)."""
    backends: dict[ModelStage, Backend] = field(default_factory=dict)
    """The engine of every model-stage (:func:`nereusd.backends.resolve_backends`)."""
    zero_stages: dict[ModelStage, tuple[int, ...]] = field(default_factory=dict)
    """Training model-stages that may run ZeRO-1/2 → the stages the planner may choose (the
    job's pinned one alone, else all the backend runs); absent: ZeRO-0."""

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence a rollout can make: longest prompt + ``rollout.max_new_tokens``
        (a vLLM engine's ``max_model_len``)."""
        return self.max_prompt_tokens + self.config.rollout.max_new_tokens

    @property
    def sequences_per_step(self) -> int:
        return self.config.rollout.prompts_per_step * self.config.rollout.group_size

    def pool_limit(self, launch_devices: int = 0) -> int:
        """Most devices the pool may hold at once: ``pool.max_devices``, by default 4 × the larger
        of ``devices`` and ``launch_devices`` (the devices the launch allocation's agents register:
        on Slurm every GPU of every node, which may be more than the job uses)."""
        return self.config.pool.max_devices or 4 * max(self.devices, launch_devices)


def _resolve_path(base_dir: Path, value: str, key: str, source: str) -> str:
    try:
        path = (base_dir / value).resolve()
        found = (path / "config.json").is_file()
    except OSError as err:   # a name too long for the file system
        raise ConfigError(f"{source}: {key}: {shortened(value)}: {err.strerror}") from None
    if not found:
        hint = (f"; if it is a Hugging Face id: Nereus downloads nothing, fetch it first (`hf download {value} "
                "--local-dir DIR`) and give DIR" if _looks_like_hub_id(value) and not path.exists() else "")
        what = "not a file" if (path / "config.json").exists() else "missing"
        raise ConfigError(f"{source}: {key}: {value!r} is not a model directory "
                          f"({path / 'config.json'} is {what}){hint}")
    return str(path)


def _looks_like_hub_id(value: str) -> bool:
    """``owner/name`` (one slash, no leading ``.``, ``/`` or ``~``): how a model on the Hugging
    Face Hub is named, which a user may write where Nereus reads a local directory."""
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "~"))


def _resolve_roles(job: JobConfig, base_dir: Path, source: str, reward_model: bool) -> dict[Role, RoleModel]:
    models = job.models
    if models.actor and models.actor_config:
        raise ConfigError(f"{source}: models: give either actor or actor_config, not both")
    if models.actor:
        actor_path = _resolve_path(base_dir, models.actor, "models.actor", source)
        actor_spec = ModelSpec.from_pretrained_dir(actor_path)
    elif models.actor_config:
        actor_path = None
        known = [f.name for f in dataclasses.fields(ModelSpec)]
        unknown = sorted(set(models.actor_config) - set(known))
        if unknown:
            raise ConfigError(f"{source}: models.actor_config: unknown key(s) {', '.join(map(repr, unknown))} "
                              f"(the keys are {', '.join(known)})")
        try:
            actor_spec = ModelSpec(**models.actor_config)
        except TypeError as err:
            raise ConfigError(f"{source}: models.actor_config: {err}") from None
        except ConfigError as err:
            raise ConfigError(f"{source}: models.actor_config: {err}") from None
    else:
        raise ConfigError(f"{source}: models.actor: required (a model directory) unless actor_config is given")
    roles = {Role.ACTOR: RoleModel(Role.ACTOR, actor_spec, actor_path, value_head=False)}

    if models.reference:
        ref_path = _resolve_path(base_dir, models.reference, "models.reference", source)
        roles[Role.REFERENCE] = RoleModel(Role.REFERENCE, ModelSpec.from_pretrained_dir(ref_path), ref_path, False)
    else:
        roles[Role.REFERENCE] = RoleModel(Role.REFERENCE, actor_spec, actor_path, False)

    if job.algorithm == Algorithm.PPO:
        if models.critic:
            critic_path = _resolve_path(base_dir, models.critic, "models.critic", source)
            roles[Role.CRITIC] = RoleModel(Role.CRITIC, ModelSpec.from_pretrained_dir(critic_path), critic_path, True)
        else:
            roles[Role.CRITIC] = RoleModel(Role.CRITIC, actor_spec, actor_path, True, init_from_actor=True)
    elif models.critic:
        raise ConfigError(f"{source}: models.critic: {job.algorithm.value} has no critic; remove the key")

    if reward_model:
        if not models.reward:
            raise ConfigError(f"{source}: models.reward: required when reward.kind is 'model'")
        reward_path = _resolve_path(base_dir, models.reward, "models.reward", source)
        roles[Role.REWARD] = RoleModel(Role.REWARD, ModelSpec.from_pretrained_dir(reward_path), reward_path, True)
    elif models.reward:
        raise ConfigError(f"{source}: models.reward: given but reward.kind is 'verifier'")
    return roles


def _resolve_candidate(
    ms: ModelStage, default: StagePlanConfig, override: StagePlanConfig | None, devices: int,
    spec: ModelSpec, job: JobConfig, source: str, backend: Backend = Backend.NATIVE,
) -> tuple[Candidate, int]:
    key = f"plan.model_stages.{ms}" if override is not None else "plan.default"
    merged = default.model_dump()
    if override is not None:
        merged.update({k: v for k, v in override.model_dump().items() if v is not None})
    devs = merged["devices"] if merged["devices"] is not None else list(range(devices))
    if not devs:
        raise ConfigError(f"{source}: {key}.devices: empty list (leave it out to use all the job's devices)")
    bad = [d for d in devs if not 0 <= d < devices]
    if bad:
        raise ConfigError(f"{source}: {key}.devices: {bad} outside the job's devices 0..{devices - 1}")
    tp = merged["tp"] or 1
    pp = merged["pp"] or 1
    if ms.stage == Stage.GENERATION and pp > 1:
        if override is not None and override.pp not in (None, 1):
            raise ConfigError(
                f"{source}: {key}.pp: generation folds PP into DP, pp must be 1, got {override.pp}"
            )
        pp = 1
    try:
        Layout(tp, pp).check_devices(len(devs))
    except PlanError as err:
        raise ConfigError(f"{source}: {key}: {err}") from None
    dp = merged["dp"] or len(devs) // (tp * pp)
    if tp * pp * dp != len(devs):
        raise ConfigError(
            f"{source}: {key}: tp·pp·dp = {tp}·{pp}·{dp} = {tp * pp * dp} but {len(devs)} devices given"
        )
    own_zero = override is not None and override.zero_stage is not None
    if ms.stage == Stage.TRAINING:
        zero = default_zero_stage(ms, backend) if merged["zero_stage"] is None else merged["zero_stage"]
    else:   # plan.default's zero_stage is for training; one named on this model-stage is checked
        zero = override.zero_stage if own_zero else 0
    zero_key = key if own_zero or merged["zero_stage"] is None else "plan.default"
    explicit = merged["micro_batch"] is not None   # written in the plan (else train.micro_batch, an upper bound)
    micro_batch = merged["micro_batch"] or job.train.micro_batch
    grad_accum = 1
    if ms.stage == Stage.TRAINING:
        gb = job.train.global_batch
        if gb % dp:
            raise ConfigError(f"{source}: {key}: train.global_batch={gb} is not a multiple of dp={dp} "
                              f"({len(devs)} devices at tp·pp = {tp}·{pp}): each replica trains an equal share")
        if not explicit:
            micro_batch = training_micro_batch(micro_batch, gb // dp)
        elif gb % (dp * micro_batch):
            raise ConfigError(
                f"{source}: {key}.micro_batch: {micro_batch} does not divide a replica's share of "
                f"train.global_batch={gb} at dp={dp} ({gb // dp} sequences): dp·micro_batch·grad_accum must be "
                f"the global batch (leave it out to take train.micro_batch, lowered to a divisor of the share)")
        grad_accum = gb // (dp * micro_batch)
    try:
        check_zero_stage(ms, backend, zero, tp=tp, pp=pp, key=f"{source}: {zero_key}")
        check_layout(spec, Layout(tp, pp), value_head=value_head_for(ms.role))
        cand = Candidate(tp, pp, dp, tuple(devs), micro_batch=micro_batch, recompute=bool(merged["recompute"]),
                         zero_stage=zero)
    except PlanError as err:
        msg = str(err)
        raise ConfigError(msg if msg.startswith(source) else f"{source}: {key}: {msg}") from None
    return cand, grad_accum


def _fallback_candidate(ms: ModelStage, devices: int, spec: ModelSpec, job: JobConfig,
                        source: str, backend: Backend = Backend.NATIVE) -> tuple[Candidate, int]:
    """``plan.default`` on devices ``0 … n−1`` for the largest ``n ≤ devices`` that resolves
    (e.g. 3 devices cannot split a global batch of 8); raises the all-devices error when none does."""
    first: ConfigError | None = None
    for n in range(devices, 0, -1):
        default = job.plan.default.model_copy(update={"devices": list(range(n)), "dp": None})
        try:
            return _resolve_candidate(ms, default, None, devices, spec, job, source, backend)
        except ConfigError as err:
            first = first or err
    raise first


def _check_forced(job: JobConfig, stages: list[ModelStage], backends: dict[ModelStage, Backend],
                  specs: dict[Role, ModelSpec], source: str) -> None:
    """Refuse ``adaptation.forced`` entries that could never apply, before any process starts:
    a model-stage the job does not have, a step it never reaches or that another entry has, a ZeRO
    stage or a TP/PP its backend does not run, a TP or PP the model cannot be sharded by
    (:func:`~nereusd.shards.check_layout`, whose rules each involve one degree: a degree the entry
    leaves out is the running plan's, which passed them), devices listed twice, and devices that
    are not a multiple of the TP·PP the entry sets. The rest depends on the plan at that step,
    and a forced layout that does not fit it then is journalled and not applied; these were
    refused only at their step, after every step before it had run (an adversarial trial).

    Raises:
        ConfigError: naming ``adaptation.forced[i]`` and the key.
    """
    known = {str(m): m for m in stages}
    first: dict[int, int] = {}
    for i, entry in enumerate(job.adaptation.forced):
        key = f"{source}: adaptation.forced[{i}]"
        if entry.at_step >= job.steps:
            raise ConfigError(f"{key}.at_step: {entry.at_step} is never reached (steps: {job.steps})")
        if entry.at_step in first:   # one layout per step: which of two would apply was a guess
            raise ConfigError(f"{key}.at_step: step {entry.at_step} already has adaptation.forced"
                              f"[{first[entry.at_step]}]; give one entry per step (it may override several "
                              "model-stages)")
        first[entry.at_step] = i
        for name, cfg in entry.model_stages.items():
            if name not in known:
                raise ConfigError(f"{key}.model_stages.{name}: not a model-stage of {job.algorithm.value} "
                                  f"(one of {sorted(known)})")
            ms = known[name]
            backend = backends[ms]
            where = f"{key}.model_stages.{name}"
            zero = default_zero_stage(ms, backend) if cfg.zero_stage is None else cfg.zero_stage
            check_zero_stage(ms, backend, zero, tp=cfg.tp or 1, pp=cfg.pp or 1, key=where)
            layout = Layout(cfg.tp or 1, cfg.pp or 1)
            if cfg.devices is not None:
                if not cfg.devices:
                    raise ConfigError(f"{where}.devices: empty list (leave it out to keep the model-stage's devices)")
                if len(set(cfg.devices)) != len(cfg.devices):
                    raise ConfigError(f"{where}.devices: device listed twice in {list(cfg.devices)}")
            try:
                check_layout(specs[ms.role], layout, value_head=value_head_for(ms.role),
                             generation=ms.stage is Stage.GENERATION)
                if cfg.devices is not None:
                    layout.check_devices(len(cfg.devices))
            except PlanError as err:
                raise ConfigError(f"{where}: {err}") from None


def resolve_job(job: JobConfig, *, source: str, base_dir: Path, site_devices: int,
                site_memory_bytes: int, site_name: str, device_kind: str = "cuda") -> ResolvedJob:
    """Resolve ``job`` against a site's device count, memory and device kind (``cpu``, ``cuda``, …).

    Raises:
        ConfigError: naming ``source`` and the key for every inconsistency.
    """
    devices = job.devices or site_devices
    if devices > site_devices:
        raise ConfigError(f"{source}: devices: {devices} requested but site {site_name!r} has {site_devices}")
    memory = int(job.memory_gib * 2**30) if job.memory_gib else site_memory_bytes
    workspace = WORKSPACE_BYTES.get(device_kind, 0)
    if memory <= workspace:   # the worker books it before any weight: it failed building, naming neither
        key = "memory_gib" if job.memory_gib else f"(site {site_name!r} device.memory_gib)"
        raise ConfigError(f"{source}: {key}: {memory:,} bytes per device do not exceed the {workspace >> 20} MiB "
                          f"workspace every {device_kind} device books (nereusd/cost/memory.py WORKSPACE_BYTES): "
                          "no model fits")
    reward_model = job.reward.kind == "model"
    roles = _resolve_roles(job, base_dir, source, reward_model)
    checked = set()
    for rm in roles.values():   # corrupt or mismatched weights fail here, not in a worker
        if rm.path and (rm.path, rm.value_head) not in checked:
            checked.add((rm.path, rm.value_head))
            try:
                check_checkpoint_shapes(rm.spec, safetensors_shapes(rm.path), value_head=rm.value_head,
                                        source=rm.path, equal=partial(safetensors_equal, rm.path))
            except ConfigError as err:
                raise ConfigError(f"{source}: models.{rm.role.value}: {err}") from None
    stages = job_model_stages(job.algorithm, reward_model)
    seqs = job.rollout.prompts_per_step * job.rollout.group_size
    if seqs % job.train.global_batch:
        raise ConfigError(
            f"{source}: train.global_batch: {job.train.global_batch} does not divide the "
            f"{seqs} sequences of a step (rollout.prompts_per_step × rollout.group_size)"
        )
    if job.algorithm == Algorithm.GRPO and job.rollout.group_size < 2:
        raise ConfigError(f"{source}: rollout.group_size: GRPO needs groups of at least 2, got {job.rollout.group_size}")
    for i, event in enumerate(job.pool.schedule):
        if event.at_step is not None and event.at_step >= job.steps:
            raise ConfigError(f"{source}: pool.schedule[{i}].at_step: {event.at_step} is never reached (boundaries "
                              f"come before steps 1..{job.steps - 1}; steps: {job.steps})")
        if event.remove and event.remove >= devices + sum(e.add or 0 for e in job.pool.schedule[:i]):
            raise ConfigError(f"{source}: pool.schedule[{i}].remove: {event.remove} would leave the job no device "
                              f"(devices: {devices})")
    check_loggers(job.loggers, source)
    backends = resolve_backends(stages, job.backends, source=source)
    check_engine_support(backends, {r: rm.spec for r, rm in roles.items()}, device_kind=device_kind, source=source)
    known = {str(m) for m in stages}
    for name in job.plan.model_stages:
        if name not in known:
            raise ConfigError(
                f"{source}: plan.model_stages.{name}: not a model-stage of {job.algorithm.value} "
                f"(one of {sorted(known)})"
            )
    _check_forced(job, stages, backends, {r: rm.spec for r, rm in roles.items()}, source)
    candidates, grad_accum = {}, {}
    for ms in stages:
        try:
            cand, accum = _resolve_candidate(
                ms, job.plan.default, job.plan.model_stages.get(str(ms)), devices, roles[ms.role].spec, job, source,
                backends[ms]
            )
        except ConfigError:
            if "plan" in job.model_fields_set or not job.adaptation.enabled:
                raise
            # no plan in the YAML and the planner picks the launch plan: this is only the
            # fallback plan, on the most devices whose batch split works
            cand, accum = _fallback_candidate(ms, devices, roles[ms.role].spec, job, source, backends[ms])
        candidates[ms] = cand
        grad_accum[ms] = accum
    from nereusd.tasks import get_task   # the task reads its dataset and tokenizer

    try:
        task = get_task(job.task.name, job.task.options, base_dir=base_dir, model_dir=roles[Role.ACTOR].path)
    except ConfigError as err:
        msg = str(err)
        raise ConfigError(msg if msg.startswith(source) else f"{source}: {msg}") from None
    prompt = task.max_prompt_tokens
    short = shortest_context({r.value: rm.spec for r, rm in roles.items()}, job.rollout.max_new_tokens + prompt)
    if short:
        raise ConfigError(
            f"{source}: rollout.max_new_tokens: {job.rollout.max_new_tokens} plus the longest prompt ({prompt} "
            f"tokens) exceeds the {short[0]} model's max_position={short[1].max_position}"
        )
    budget = job.train.max_tokens_per_micro_batch
    if budget is not None and budget < job.rollout.max_new_tokens + prompt:
        raise ConfigError(
            f"{source}: train.max_tokens_per_micro_batch: {budget} tokens cannot hold the longest sequence "
            f"(prompt {prompt} + rollout.max_new_tokens {job.rollout.max_new_tokens})"
        )
    vocab, top = task.tokenizer.vocab_size, task.tokenizer.max_token_id
    small = [rm for rm in roles.values() if rm.spec.vocab_size <= max(vocab - 1, top)]
    if small:   # the largest id, not the count: a tokenizer with gaps in its ids indexed past the embedding
        raise ConfigError(f"{source}: the task's tokenizer has {vocab} tokens (largest id {top}) but the "
                          f"{small[0].role.value} model's vocab_size is {small[0].spec.vocab_size}")
    if job.pool.max_devices is not None and job.pool.max_devices < devices:
        raise ConfigError(f"{source}: pool.max_devices: {job.pool.max_devices} is below the job's {devices} devices")
    zero_stages = {}
    for ms in stages:
        override = job.plan.model_stages.get(str(ms))
        pinned = override.zero_stage if override is not None and override.zero_stage is not None \
            else job.plan.default.zero_stage
        if ms.stage == Stage.TRAINING and ZERO_STAGES[backends[ms]] != (0,):
            zero_stages[ms] = (pinned,) if pinned is not None else ZERO_STAGES[backends[ms]]
    return ResolvedJob(job, source, base_dir, devices, memory, site_name, roles, Plan(candidates), grad_accum,
                       max_prompt_tokens=prompt, backends=backends, zero_stages=zero_stages)


def load_and_resolve(path: str | Path, site_loader=None) -> ResolvedJob:
    """Load a job YAML and resolve it against its site config.

    Raises:
        ConfigError: for any problem in the job or site files.
    """
    from nereusd.config.site import load_site, require_site  # the site schema lives in its own module

    path = Path(path)
    job = load_job(path)
    if site_loader is None:
        require_site(job.site, f"{path}: site")
    site = (site_loader or load_site)(job.site)
    return resolve_job(
        job, source=str(path), base_dir=path.resolve().parent,
        site_devices=site.nodes * site.devices_per_node,
        site_memory_bytes=site.device_memory_bytes, site_name=site.name, device_kind=site.device_kind,
    )
