"""The Nereus exception hierarchy.

Everything a user or a peer can cause raises a subclass of :class:`NereusError` with the
offending values in the message. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations


class NereusError(Exception):
    """Base class of every error Nereus raises on purpose."""


class ConfigError(NereusError):
    """A job or site YAML is malformed; the message names the file and the dotted key."""


class PlanError(NereusError):
    """A plan or candidate is invalid for the model, the pool or the devices."""


class ProtocolError(NereusError):
    """A control message is malformed, of an unknown type or version, or unauthenticated."""


def format_bytes(nbytes: float) -> str:
    """``nbytes`` for a message: GiB from 1 GiB up, else MiB (``'0.1 GiB'`` of a 100 MiB device said
    nothing), with one decimal."""
    if abs(nbytes) >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def not_utf8(err: UnicodeDecodeError) -> str:
    """What a message says of a file that is not UTF-8 text: ``not UTF-8 text (<reason> at byte N)``."""
    return f"not UTF-8 text ({err.reason} at byte {err.start})"


def shortened(value: object, limit: int = 80) -> str:
    """``value`` for a message: a string quoted, its first ``limit`` characters and ``…`` when
    longer (a name too long for the file system is thousands of characters); anything else its
    ``repr`` cut the same way (a foreign file read as YAML is one long value)."""
    if isinstance(value, str):
        return f"{value[:limit]!r}{'…' if len(value) > limit else ''}"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


class DeviceOutOfMemory(NereusError):
    """An allocation on a (virtual) device would exceed its capacity.

    The message names the model-stage, the device, the bytes wanted and the capacity.
    """

    def __init__(
        self, model_stage: str, device: int, wanted_bytes: int, in_use_bytes: int, capacity_bytes: int, what: str = ""
    ) -> None:
        self.model_stage = model_stage
        self.device = device
        self.wanted_bytes = wanted_bytes
        self.in_use_bytes = in_use_bytes
        self.capacity_bytes = capacity_bytes
        self.what = what
        detail = f" for {what}" if what else ""
        super().__init__(
            f"out of memory on device {device} in {model_stage}{detail}: wanted {wanted_bytes} bytes "
            f"with {in_use_bytes} bytes in use, capacity {capacity_bytes} bytes"
        )


class WorkerError(NereusError):
    """A worker reported a failure of a task, or died.

    Attributes:
        error_kind: the exception class the worker's task raised (``DeviceOutOfMemory``,
            ``PlanError``, ...), ``None`` when no worker reported one (a worker died, a timeout).
    """

    def __init__(self, message: str, error_kind: str | None = None) -> None:
        super().__init__(message)
        self.error_kind = error_kind


class StorageError(NereusError):
    """A checkpoint or journal write or read failed (disk full, read-only, quota): a fault of the
    storage, not of a device. The message names the path and the cause."""


class CheckpointUnreadable(NereusError):
    """No checkpoint a restore tried could be read (each damaged or incomplete): the message names
    them and the last one's error. Not a storage fault: no space or write is at stake."""


class TrainingDiverged(NereusError):
    """A training model-stage's loss or gradient norm is not finite: its weights are no longer
    either, so the job stops (its last checkpoint holds finite ones). The message names the step,
    the metric and its value."""


class SlurmError(NereusError):
    """A Slurm command failed; the message carries argv, exit code and stderr.

    ``refused`` is true only when the command ran and said no (a non-zero exit, or not
    installed): nothing was done. A timeout or an unreadable answer leaves it false, since the
    controller may have acted (``sbatch`` may have queued the job)."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused
