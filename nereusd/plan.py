"""Plan vocabulary: roles, stages, model-stages, layouts, candidates and plans.

These are frozen value types shared by the controller (``nereusd``), the workers (``emu``)
and the launcher. They carry no behaviour beyond validation and rank arithmetic, and import
nothing heavy, so that the pure core (cost model, planner, admission, transition DAG,
simulator) can use them anywhere.

Vocabulary and notation follow DESIGN.md ("Vocabulary") and the Nereus paper §4: a
candidate ``π_M = ⟨tp, pp, dp, R⟩`` per model-stage ``M``, and a plan ``S = {π_M}``.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

from nereusd.errors import PlanError

MAX_DEVICES = 1 << 16
"""Most devices a job, a plan or a simulated cluster may have (65,536): far above what the planner
is measured at (8,192 GPUs, ``scripts/bench_planner.py``); ``--gpus 10**9`` was killed for its
memory."""


class Role(str, enum.Enum):
    """A model of the RL job. Each role has its own parameters."""

    ACTOR = "actor"
    CRITIC = "critic"
    REFERENCE = "reference"
    REWARD = "reward"

    def __str__(self) -> str:
        return self.value


class Stage(str, enum.Enum):
    """A phase of one RL step; members are declared in execution order."""

    GENERATION = "generation"
    INFERENCE = "inference"
    TRAINING = "training"

    def __str__(self) -> str:
        return self.value

    @property
    def order(self) -> int:
        """Position inside one RL step: generation 0, inference 1, training 2."""
        return list(Stage).index(self)


@dataclass(frozen=True)
class ModelStage:
    """One role bound to one stage, e.g. ``actor/generation``: the unit the planner decides for."""

    role: Role
    stage: Stage

    def __str__(self) -> str:
        return f"{self.role.value}/{self.stage.value}"

    @classmethod
    def parse(cls, text: str) -> "ModelStage":
        """Parse ``"role/stage"``.

        Raises:
            PlanError: if ``text`` is not ``<role>/<stage>`` with known names.
        """
        parts = str(text).split("/")
        if len(parts) != 2:
            raise PlanError(f"model-stage {text!r}: expected '<role>/<stage>', e.g. 'actor/training'")
        role_s, stage_s = parts
        try:
            role = Role(role_s)
        except ValueError:
            raise PlanError(
                f"model-stage {text!r}: unknown role {role_s!r} (one of {[r.value for r in Role]})"
            ) from None
        try:
            stage = Stage(stage_s)
        except ValueError:
            raise PlanError(
                f"model-stage {text!r}: unknown stage {stage_s!r} (one of {[s.value for s in Stage]})"
            ) from None
        return cls(role, stage)

    def sort_key(self) -> tuple[int, int]:
        """Canonical order: by stage (generation → inference → training), then role."""
        return (self.stage.order, list(Role).index(self.role))


@dataclass(frozen=True)
class Layout:
    """The layout ``T = (tp, pp)`` inside one replica (one EMU)."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"layout {name} must be a positive integer, got {value!r}")

    @property
    def size(self) -> int:
        """Devices per replica, ``tp · pp``."""
        return self.tp * self.pp

    def check_devices(self, devices: int) -> None:
        """Raises:
            PlanError: ``devices`` cannot hold whole replicas of this layout (not a multiple of
                ``tp · pp``).
        """
        if devices % self.size:
            raise PlanError(f"{devices} devices are not a multiple of tp·pp = {self.tp}·{self.pp}")


ZERO_STAGES = (0, 1, 2)
"""ZeRO stages of a training model-stage: 0 replicated Adam (native engine), 1 optimizer state and
2 also gradients sharded across DP (DeepSpeed; Rajbhandari et al., "ZeRO", SC 2020)."""


@dataclass(frozen=True)
class Candidate:
    """``π_M = ⟨tp, pp, dp, R⟩`` for one model-stage (paper §4, Eq. 1).

    ``devices`` is the ordered GPU set ``R`` (global device indices, ``len == tp·pp·dp``).
    Device order is replica-major, then pipeline stage, then tensor rank, so a TP group is a
    contiguous run of ``tp`` devices (kept inside a node by placement)::

        devices[(dp_rank * pp + pp_rank) * tp + tp_rank]

    ``micro_batch`` is the per-replica micro-batch in sequences (0: the job's default) and
    ``recompute`` enables activation recomputation; both are knobs of the urgent path.
    ``zero_stage`` (training only) shards the optimizer state (1) and the gradients (2) across
    the ``dp`` replicas; 0 replicates them (:data:`ZERO_STAGES`; engines in :mod:`nereusd.backends`).

    Raises:
        PlanError: on non-positive degrees, a device count other than ``tp·pp·dp`` or a
            device listed twice.
    """

    tp: int
    pp: int
    dp: int
    devices: tuple[int, ...]
    micro_batch: int = 0
    recompute: bool = False
    zero_stage: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        need = self.tp * self.pp * self.dp
        if len(self.devices) != need:
            raise PlanError(
                f"tp·pp·dp = {self.tp}·{self.pp}·{self.dp} = {need} devices, "
                f"but {len(self.devices)} given: {list(self.devices)}"
            )
        if len(set(self.devices)) != len(self.devices):
            raise PlanError(f"device listed twice in {list(self.devices)}")
        if self.micro_batch < 0:
            raise PlanError(f"micro_batch must be >= 0, got {self.micro_batch}")
        if self.zero_stage not in ZERO_STAGES:
            raise PlanError(f"zero_stage must be one of {ZERO_STAGES}, got {self.zero_stage!r}")

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp)

    @property
    def size(self) -> int:
        """``|R| = tp · pp · dp``."""
        return self.tp * self.pp * self.dp

    def device_at(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        """The device holding shard ``(pp_rank, tp_rank)`` of replica ``dp_rank``."""
        return self.devices[(dp_rank * self.pp + pp_rank) * self.tp + tp_rank]

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        """Position of each device in :attr:`devices` (``tuple.index`` per call was O(devices):
        0.6 s of a 3.6 s ``plan_transition`` at 8,192 devices)."""
        return {d: i for i, d in enumerate(self.devices)}

    def coords_of(self, device: int) -> tuple[int, int, int]:
        """``(dp_rank, pp_rank, tp_rank)`` of ``device``.

        Raises:
            PlanError: if ``device`` is not in ``R``.
        """
        index = self._index.get(device)
        if index is None:
            raise PlanError(f"device {device} is not in {list(self.devices)}")
        tp_rank = index % self.tp
        pp_rank = (index // self.tp) % self.pp
        dp_rank = index // (self.tp * self.pp)
        return dp_rank, pp_rank, tp_rank

    def replica_devices(self, dp_rank: int) -> tuple[int, ...]:
        """Devices of replica (EMU) ``dp_rank``, in ``(pp, tp)`` order."""
        n = self.tp * self.pp
        return self.devices[dp_rank * n : (dp_rank + 1) * n]

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Every TP group as a tuple of devices."""
        return [
            tuple(self.device_at(d, p, t) for t in range(self.tp))
            for d in range(self.dp)
            for p in range(self.pp)
        ]

    def pp_groups(self) -> list[tuple[int, ...]]:
        """Every PP group (one per replica and tensor rank)."""
        return [
            tuple(self.device_at(d, p, t) for p in range(self.pp))
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Every DP group (one per ``(pp_rank, tp_rank)`` position)."""
        return [
            tuple(self.device_at(d, p, t) for d in range(self.dp))
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def describe(self) -> str:
        """Short text, e.g. ``tp2·pp1·dp2@[0,1,2,3]``."""
        devs = ",".join(str(d) for d in self.devices)
        extra = ""
        if self.micro_batch:
            extra += f" mb{self.micro_batch}"
        if self.recompute:
            extra += " recompute"
        if self.zero_stage:
            extra += f" zero{self.zero_stage}"
        return f"tp{self.tp}·pp{self.pp}·dp{self.dp}@[{devs}]{extra}"

    def to_dict(self) -> dict:
        """JSON form; ``zero_stage`` appears only when not 0 (plans and journals of ZeRO-0 jobs
        read as before)."""
        out = {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "devices": list(self.devices),
            "micro_batch": self.micro_batch,
            "recompute": self.recompute,
        }
        if self.zero_stage:
            out["zero_stage"] = self.zero_stage
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "Candidate":
        return cls(
            tp=int(data["tp"]),
            pp=int(data["pp"]),
            dp=int(data["dp"]),
            devices=tuple(data["devices"]),
            micro_batch=int(data.get("micro_batch", 0)),
            recompute=bool(data.get("recompute", False)),
            zero_stage=int(data.get("zero_stage", 0)),
        )


def training_micro_batch(configured: int, share: int) -> int:
    """The per-replica training micro-batch for a job's ``train.micro_batch`` (an upper bound)
    and a replica's ``share`` of the global batch (sequences per optimizer step): the largest
    ``b ≤ configured`` dividing ``share``, so that ``dp × b × grad_accum`` is the global batch.
    The planner and the launch plan both use it (:func:`nereusd.planner.space.micro_batch_choices`,
    :mod:`nereusd.config.resolve`). E.g. ``(3, 16) → 2``, ``(128, 16) → 16``, ``(12, 24) → 12``."""
    b = max(1, min(configured, share))
    while share % b:
        b -= 1
    return b


@dataclass(frozen=True)
class Plan:
    """A plan ``S``: one candidate per model-stage.

    Iteration is in canonical model-stage order (stage, then role), which every worker uses
    when it creates communicators so that collective group creation matches across ranks.
    """

    candidates: Mapping[ModelStage, Candidate] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ordered = dict(sorted(self.candidates.items(), key=lambda kv: kv[0].sort_key()))
        object.__setattr__(self, "candidates", ordered)

    def __getitem__(self, model_stage: ModelStage) -> Candidate:
        return self.candidates[model_stage]

    def __contains__(self, model_stage: object) -> bool:
        return model_stage in self.candidates

    def __iter__(self) -> Iterator[ModelStage]:
        return iter(self.candidates)

    def __len__(self) -> int:
        return len(self.candidates)

    def items(self) -> Iterable[tuple[ModelStage, Candidate]]:
        return self.candidates.items()

    def devices(self) -> tuple[int, ...]:
        """All devices used by any model-stage, sorted."""
        return tuple(sorted({d for c in self.candidates.values() for d in c.devices}))

    def model_stages_on(self, device: int) -> list[ModelStage]:
        """Model-stages with a shard on ``device``, in canonical order."""
        return [m for m, c in self.candidates.items() if device in c.devices]

    def describe(self) -> str:
        return "; ".join(f"{m} {c.describe()}" for m, c in self.candidates.items())

    def key(self) -> tuple:
        """A hashable identity (model-stages, layouts, micro-batches and devices): equal plans,
        equal keys."""
        return tuple((str(m), c.tp, c.pp, c.dp, c.micro_batch, c.recompute, c.zero_stage, c.devices)
                     for m, c in self.items())

    def to_dict(self) -> dict:
        return {str(m): c.to_dict() for m, c in self.candidates.items()}

    @classmethod
    def from_dict(cls, data: Mapping) -> "Plan":
        return cls({ModelStage.parse(k): Candidate.from_dict(v) for k, v in data.items()})
