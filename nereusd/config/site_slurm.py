"""The Slurm and communication sections of a site config (``slurm:`` and ``env:``).

A site admin writes these once per cluster; ``nereus-launch render/submit`` turns them into
``#SBATCH`` directives and ``export`` lines, so that the batch template holds no site literal.
The loader in :mod:`nereusd.config.site` builds the frozen dataclasses below from YAML (unknown keys
are errors) and then calls :func:`check_slurm` and :func:`check_env` for the rules that span
fields. Every error names the file and the dotted key.

Sources for the formats checked here: ``man sbatch`` (``--time`` accepts ``MM``, ``MM:SS``,
``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``; ``--gres=gpu[:type]:N``;
``--gpus-per-node=[type:]N``; ``--signal=[B:]SIG[@seconds]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Mapping

from nereusd.errors import ConfigError

GresSyntax = Literal["gres", "gpus-per-node", "none"]
ContainerRuntime = Literal["apptainer", "pyxis"]

_TIME = re.compile(r"^(\d+-\d{1,2}(:\d{2}(:\d{2})?)?|\d+(:\d{2}){0,2})$")
_WORD = re.compile(r"^[A-Za-z0-9_.+\-]+$")
MAX_SIGNAL_S = 65535
"""The largest ``--signal=B:USR2@N`` sbatch takes (above it: "Invalid --signal specification")."""
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.\-&|,\[\]*:()!]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: Variables a site may not set: Slurm and Nereus set them per job, node or device.
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")
RESERVED_ENV_PREFIXES = ("SLURM_", "SLURMD_", "NEREUS_")


@dataclass(frozen=True, kw_only=True)
class ContainerSpec:
    """A container every Nereus process of the job runs in."""

    runtime: ContainerRuntime
    """``apptainer`` (``apptainer exec IMAGE cmd``) or ``pyxis`` (``srun --container-image``)."""
    image: str
    """Image path or reference (``/sw/images/nereus.sif``, ``nvcr.io#nvidia/pytorch:24.05-py3``)."""
    mounts: tuple[str, ...] = ()
    """Bind mounts ``SRC[:DST]``; the run directory is always mounted."""


@dataclass(frozen=True, kw_only=True)
class SlurmSpec:
    """How to ask this cluster's Slurm for nodes (``#SBATCH`` directives and the job setup)."""

    partition: str = ""
    """``--partition``; empty: the cluster's default partition."""
    account: str = ""
    """``--account`` charged for the job; empty: the user's default."""
    qos: str = ""
    """``--qos``; empty: the default QoS."""
    constraint: str = ""
    """``--constraint`` node features (``gpu80g&nvlink``); empty: none."""
    gpus_per_node: int = 0
    """GPUs requested per node; equals ``devices_per_node`` (one worker per GPU). On a CPU site
    (the project's test cluster, whose GPUs are fake) the agents make one virtual device per
    GPU that Slurm makes visible."""
    gres_syntax: GresSyntax = "gres"
    """``gres``: ``--gres=gpu[:type]:N``; ``gpus-per-node``: ``--gpus-per-node=[type:]N``;
    ``none``: request no GPUs (sites that give whole nodes with all GPUs)."""
    gpu_type: str = ""
    """GPU type name of the GRES (``a100``), empty for untyped ``gpu:N``."""
    time_limit: str = "01:00:00"
    """``--time`` in a Slurm format: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``."""
    cpus_per_task: int = 0
    """``--cpus-per-task`` of the one task per node; 0: not set."""
    exclusive: bool = False
    """``--exclusive`` whole nodes."""
    preempt_signal_s: int = 120
    """Seconds before the time limit (or preemption) Slurm sends USR2 to the batch shell
    (``--signal=B:USR2@N``); 0: no warning signal."""
    modules: tuple[str, ...] = ()
    """Environment modules loaded in order (``module load X``) before anything runs."""
    container: ContainerSpec | None = None
    """Run every Nereus process in this container (none: on the host)."""
    python: str = ""
    """Python interpreter with Nereus installed, on the compute nodes; empty: the one that runs
    ``nereus-launch submit`` (a shared file system is assumed)."""
    control_port: int = 0
    """TCP port nereusd binds on the head node; 0: a free port chosen at start."""
    heartbeat_timeout_s: float = 15.0
    """An agent silent this long (seconds) is declared lost and its node leaves the pool."""


def _fail(label: str, key: str, problem: str) -> ConfigError:
    return ConfigError(f"{label}: {key}: {problem}")


def check_slurm(spec: SlurmSpec, *, device_kind: str, devices_per_node: int, label: str) -> None:
    """Rules across the fields of ``slurm:`` and the node shape.

    Raises:
        ConfigError: ``<file>: slurm.<key>: <problem>`` for the first rule broken.
    """
    for key in ("partition", "account", "qos", "gpu_type"):
        value = getattr(spec, key)
        if value and not _WORD.match(value):
            raise _fail(label, f"slurm.{key}", f"expected letters, digits and ._+- only, got {value!r}")
    if spec.constraint and not _CONSTRAINT.match(spec.constraint):
        raise _fail(label, "slurm.constraint", f"not a Slurm feature expression: {spec.constraint!r}")
    if not _TIME.match(spec.time_limit):
        raise _fail(label, "slurm.time_limit",
                    f"expected MM, MM:SS, HH:MM:SS or D-HH[:MM[:SS]], got {spec.time_limit!r}")
    for key in ("gpus_per_node", "cpus_per_task", "preempt_signal_s", "control_port"):
        if getattr(spec, key) < 0:
            raise _fail(label, f"slurm.{key}", f"expected a number >= 0, got {getattr(spec, key)!r}")
    check_preempt_signal(spec.preempt_signal_s, spec.time_limit, f"{label}: slurm.preempt_signal_s")
    if spec.control_port > 65535:
        raise _fail(label, "slurm.control_port", f"expected a port 0..65535, got {spec.control_port}")
    if spec.heartbeat_timeout_s <= 0:
        raise _fail(label, "slurm.heartbeat_timeout_s", f"expected a positive number, got {spec.heartbeat_timeout_s}")
    if spec.gres_syntax == "none":
        if spec.gpus_per_node or spec.gpu_type:
            raise _fail(label, "slurm.gres_syntax", "'none' requests no GPUs: drop gpus_per_node and gpu_type")
    elif device_kind != "cpu" and spec.gpus_per_node == 0:
        raise _fail(label, "slurm.gpus_per_node", f"a {device_kind} site must request its GPUs "
                    f"(expected {devices_per_node}) or set gres_syntax: none")
    if spec.gpus_per_node and spec.gpus_per_node != devices_per_node:
        raise _fail(label, "slurm.gpus_per_node", f"expected devices_per_node = {devices_per_node} "
                    f"(one worker per GPU of the node), got {spec.gpus_per_node}")
    if spec.gpu_type and spec.gpus_per_node == 0:
        raise _fail(label, "slurm.gpu_type", "a GPU type needs gpus_per_node > 0")
    for i, module in enumerate(spec.modules):
        if not module or any(ch.isspace() for ch in module):
            raise _fail(label, f"slurm.modules.{i}", f"expected one module name without spaces, got {module!r}")
    if spec.python and ("\n" in spec.python or not spec.python.strip()):
        raise _fail(label, "slurm.python", f"expected an interpreter path, got {spec.python!r}")
    if spec.container is not None:
        if not spec.container.image or "\n" in spec.container.image:
            raise _fail(label, "slurm.container.image", f"expected an image, got {spec.container.image!r}")
        for i, mount in enumerate(spec.container.mounts):
            if not mount or "," in mount or any(ch.isspace() for ch in mount):
                raise _fail(label, f"slurm.container.mounts.{i}", f"expected SRC[:DST] without spaces, got {mount!r}")


def check_env(env: Mapping[str, str], *, label: str) -> None:
    """Names and values of ``env:`` (exported to nereusd, agents and workers).

    Raises:
        ConfigError: a name that is not a shell identifier, one Slurm or Nereus sets itself
            (:data:`RESERVED_ENV`, :data:`RESERVED_ENV_PREFIXES`), or a value with a newline or NUL.
    """
    for name, value in env.items():
        if not _ENV_NAME.match(name):
            raise _fail(label, f"env.{name}", "not a valid environment variable name")
        if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES):
            raise _fail(label, f"env.{name}", "set by Slurm or Nereus per job and device; a site may not set it")
        if "\n" in value or "\0" in value:
            raise _fail(label, f"env.{name}", f"value may not contain a newline or NUL, got {value!r}")


def time_limit_s(text: str) -> int:
    """Seconds of a Slurm time limit (``sbatch --time``: ``MM``, ``MM:SS``, ``HH:MM:SS``,
    ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``; one that :data:`_TIME` matches); 0: none."""
    days, _, rest = text.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days or len(parts) == 3:   # D-HH[:MM[:SS]], HH:MM:SS
        hours, minutes, seconds = (parts + [0, 0])[:3]
    else:                         # MM, MM:SS
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


def check_preempt_signal(preempt_signal_s: int, time_limit: str, where: str) -> None:
    """The warning signal must fit sbatch's ``--signal`` and come in the second half of the time
    limit: one 1,795 s before the end of 30 minutes made a job checkpoint and stop 19 s in, at
    every resume (an adversarial trial on Slurm, 2026-12-07).

    Raises:
        ConfigError: ``<where>: …`` naming both values.
    """
    if preempt_signal_s > MAX_SIGNAL_S:
        raise ConfigError(f"{where}: {preempt_signal_s} s is more than sbatch's --signal takes ({MAX_SIGNAL_S} s)")
    limit_s = time_limit_s(time_limit)
    if preempt_signal_s and limit_s and 2 * preempt_signal_s > limit_s:
        raise ConfigError(f"{where}: the preemption warning {preempt_signal_s} s before the end of a "
                          f"{time_limit} time limit ({limit_s} s) comes in its first half, and the job would "
                          "checkpoint and stop soon after it starts, at every resume too: lower "
                          "slurm.preempt_signal_s or raise the time limit")
