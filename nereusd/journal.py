"""The run directory's journals: ``metrics.jsonl`` (one object per RL step), ``events.jsonl``
(every decision and lifecycle event, with why), and ``summary.json`` (written at the end).

Each line is flushed as it is written, so a crash loses at most the line being written and
``nereus-launch`` can follow progress by reading the files.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable

from nereusd.errors import ConfigError, NereusError, StorageError, not_utf8

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
SUMMARY_FILE = "summary.json"
RESERVE_FILE = ".space-reserve"
"""Written when the journal opens and deleted when the summary is written: the room the
summary of a job stopped by a full disk needs (:meth:`Journal.summary`)."""
RESERVE_BYTES = 256 * 1024
ENDPOINT_FILE = "nereusd.json"
"""Where a running nereusd says how to reach it (endpoint, store, pid), in the run directory."""


class Event(str, enum.Enum):
    """The kinds of ``events.jsonl`` records (a ``str``: a record's ``event`` field is the value)."""

    NEREUSD_STARTED = "nereusd_started"
    """Nereusd bound its endpoint; the job, its devices and whether it adapts."""
    NEREUSD_RESUMED = "nereusd_resumed"
    """A nereusd started with ``--resume`` continues a crashed run: ``mode`` ``kept_workers`` (on
    the EMUs its agents kept in memory) or ``checkpoint`` (from its latest checkpoint)."""
    NEREUSD_STOPPED = "nereusd_stopped"
    """Nereusd stopped every agent and exits (with the job's status)."""
    AGENT_REGISTERED = "agent_registered"
    """An agent registered its devices (their global numbers)."""
    AGENT_LOST = "agent_lost"
    """An agent left the pool: heartbeats stopped, or Slurm took its node."""
    AGENT_RETIRED = "agent_retired"
    """An agent whose devices had all left the pool (removed, lost as spares, failed while
    joining) was told to exit (``ControlPlane.retire_idle_agents``)."""
    CONNECTION_REFUSED = "connection_refused"
    """A peer failed the CURVE handshake."""
    MESSAGE_REFUSED = "message_refused"
    """A malformed or unexpected message was answered with an error."""
    WORKER_EXITED = "worker_exited"
    """A worker process ended (with its exit code)."""
    WORKER_STRAGGLING = "worker_straggling"
    """Workers of a task that half its workers finished long ago, killed as stalled (site
    ``liveness.straggler_factor``, ``straggler_min_s``)."""
    WORKERS_STOPPED = "workers_stopped"
    """Nereusd stopped workers to restart them (the devices stay in the pool)."""
    DEVICES_RELEASED = "devices_released"
    """Nereusd stopped the workers of devices that leave the pool."""
    WORKERS_STARTED = "workers_started"
    """Workers of devices that joined started in a private world (``background``: while steps ran,
    with ``elapsed_s`` from the devices' arrival and the vLLM engines started early, ``warm``)."""
    JOIN_STARTED = "join_started"
    """Devices that arrived begin to join in the background (``pool.join: background``)."""
    JOIN_FAILED = "join_failed"
    """A background join failed (a joining worker exited or a task failed): its devices' workers
    stopped; those that failed leave the pool, the others join again."""
    JOIN_CANCELLED = "join_cancelled"
    """A background join stopped before its devices joined, for ``reason``: a checkpoint/restart
    of the job (the devices join again, or carry the restart), a removal that took joining
    devices (``left_pool``; the others join again), or the end of the job."""
    WORKERS_KEPT = "workers_kept"
    """``--resume``: whether the job continues on the workers the lost nereusd's agents kept
    (their EMUs in memory), and why not (:mod:`nereusd.daemon.kept`)."""
    WORLD_FORMED = "world_formed"
    """Every worker joined a world generation."""
    LAUNCH_PLAN = "launch_plan"
    """The plan the job starts on, and where it came from."""
    BUILD = "build"
    """The workers built every model-stage's engines."""
    CHECKPOINT = "checkpoint"
    """A DCP checkpoint of the trained roles was saved."""
    CHECKPOINT_LOADED = "checkpoint_loaded"
    """A resume's checkpoint loaded (``dir``, ``step``): the steps from it on left ``metrics.jsonl``
    (``dropped_metrics``) and run again."""
    CHECKPOINT_UNREADABLE = "checkpoint_unreadable"
    """A resume could not read a checkpoint (damaged or truncated) and falls back to an older one."""
    STEP_PREDICTION = "step_prediction"
    """The controller's prediction of the step against what it measured."""
    TRIGGER = "trigger"
    """A signal that started a replan."""
    REPLAN = "replan"
    """A replan: the length planned for, the headroom, the planner's log."""
    ADMISSION = "admission"
    """Admission's verdict with ΔL, L_tran, H_x, the payback margin and the alternatives."""
    EVALUATION = "evaluation"
    """Pass@1 of the greedy policy on the held-out prompts."""
    TRANSITION = "transition"
    """A transition ran: its ops, predicted and measured time, per-op timings."""
    RESTART_STARTED = "restart_started"
    """A checkpoint/restart begins: why, the failed step, the checkpoint and the world it restarts
    on. Its ``fallback`` record follows once it is done; a job that fails during it has this one."""
    FALLBACK = "fallback"
    """A checkpoint/restart (or none possible), why, and the steps lost."""
    DEVICE_LOST = "device_lost"
    """Devices were lost abruptly (a worker died, an agent went silent)."""
    POOL_CHANGED = "pool_changed"
    """Devices joined or left, with the verdict and what caused it."""
    POOL_REQUEST = "pool_request"
    """Nereus-launch pool asked for devices to leave."""
    POOL_REQUEST_REFUSED = "pool_request_refused"
    """A pool change the job cannot take, with the reason; the job goes on: a removal that
    would leave it fewer devices than it needs, or an add over ``pool.max_devices`` or whose
    agent did not start or register."""
    POOL_SCHEDULE_DUE = "pool_schedule_due"
    """The job's pool schedule or trace has events due at this boundary."""
    SLURM_EVENT = "slurm_event"
    """The allocation watcher saw Slurm change a node or a job."""
    JOB_FAILED = "job_failed"
    """The job failed (its error and error kind)."""
    JOB_STOPPED = "job_stopped"
    """The job stopped because the pool lost devices it needs."""
    JOB_PREEMPTED = "job_preempted"
    """The job checkpointed and stopped on Slurm's preemption warning."""
    JOB_INTERRUPTED = "job_interrupted"
    """Nereusd received SIGTERM or SIGINT."""

    def __str__(self) -> str:
        return self.value


JOB_PLAN_SOURCE = "the job's plan"
"""A ``launch_plan`` event's ``source`` when the job runs the plan its job file sets (or its
default plan, when it does not adapt); the launcher says that plan before nereusd starts."""


def switch_kind(record: dict[str, Any]) -> str | None:
    """What layout switch that ran an ``events.jsonl`` record is, as ``summary.json``'s
    ``switches`` counts them: ``"transition"`` (a transition that changed the plan; a rebuild on
    the same plan after the world re-formed is none), ``"restart"`` (an in-run checkpoint/restart),
    else ``None``. An ``admission`` is a decision, not a switch: one whose step was interrupted
    never ran, and a resume admits it again."""
    kind = record.get("event")
    if kind == Event.TRANSITION.value and record.get("from_plan") != record.get("to_plan"):
        return "transition"
    if kind == Event.FALLBACK.value and record.get("action") == "checkpoint_restart":
        return "restart"
    return None


def resume_restarts(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int]]:
    """The resumes of ``events`` (``events.jsonl``) that were checkpoint restarts, as
    ``summary.json``'s ``restarts`` counts them, each ``(its nereusd_resumed record, steps it
    re-ran)``: one from a checkpoint once that loaded (its ``checkpoint_loaded``, whose dropped
    steps include those of older checkpoints it fell back to), one from the initial weights that
    dropped finished steps. A resume interrupted before its checkpoint loaded re-ran nothing: it
    had been counted, and the steps the next resume re-ran counted twice (an adversarial trial,
    2026-12-07); so had one that ran nothing at all."""
    out, pending = [], None
    for record in events:
        kind = record.get("event")
        if kind == Event.NEREUSD_STARTED.value:
            pending = None
        elif kind == Event.NEREUSD_RESUMED.value and record.get("mode") == "checkpoint":
            dropped = record.get("dropped_metrics")
            dropped = len(dropped) if isinstance(dropped, list) else 0
            pending = record if record.get("checkpoint") else None
            if not record.get("checkpoint") and dropped:
                out.append((record, dropped))
        elif kind == Event.CHECKPOINT_LOADED.value and pending is not None:
            dropped = record.get("dropped_metrics")
            out.append((pending, len(dropped) if isinstance(dropped, list) else 0))
            pending = None
    return out


class JournalError(NereusError):
    """A journal file is damaged: a line other than a torn last one is not a JSON object."""


def _default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float as the string ``"inf"``, ``"-inf"`` or ``"nan"``:
    JSON has no such numbers (Python writes ``Infinity``, which strict readers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def to_json(record: Any, **kwargs: Any) -> str:
    """``record`` as strict JSON (no ``NaN``/``Infinity``; numpy values and objects with
    ``to_dict`` converted)."""
    return json.dumps(_finite(json.loads(json.dumps(record, default=_default))), allow_nan=False, **kwargs)


class Journal:
    """Append-only JSONL writers for one run directory.

    A write the storage refuses (disk full, quota, read-only) leaves no torn line: the file is
    cut back to where the record began, and :class:`StorageError` names the file and the cause,
    so the job stops as a storage fault, not as a crash. After that first fault the journal is
    :attr:`fault`-y: later events are logged and dropped instead of raising again, so the
    job's teardown still runs; ``summary.json`` is tried once more.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = _open_append(self.run_dir / METRICS_FILE)
        self._events = _open_append(self.run_dir / EVENTS_FILE)
        with contextlib.suppress(OSError):   # best effort: without it a full disk may take the summary too
            (self.run_dir / RESERVE_FILE).write_bytes(b"\0" * RESERVE_BYTES)
        self.fault: str | None = None
        """The first storage fault, once one happened."""
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        """Called with every record written (events and metrics; ``"event"`` in it tells which),
        after it is on disk (:mod:`nereusd.daemon.observe`). A listener that raises is logged."""

    def _append(self, fh, line: str, name: str) -> None:
        data = line.encode("utf-8")
        start = os.fstat(fh.fileno()).st_size   # O_APPEND writes at the end, wherever tell() says
        try:
            if fh.write(data) != len(data):
                raise OSError(28, "short write (no space left on device?)")
        except OSError as err:
            try:
                fh.truncate(start)   # no torn line for the next reader
            except OSError:
                pass
            self.fault = f"{self.run_dir / name}: cannot append: {err.strerror or err}"
            raise StorageError(self.fault + " (free space or fix the run directory; the last checkpoint stays)") from None

    def metric(self, record: dict[str, Any]) -> None:
        """Append one step's metrics.

        Raises:
            StorageError: the storage refused the write.
        """
        self._append(self._metrics, to_json(record) + "\n", METRICS_FILE)
        self._tell(record)

    def _tell(self, record: dict[str, Any]) -> None:
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:  # noqa: BLE001 - metrics for dashboards must never stop the job
                log.exception("journal listener %r failed", listener)

    def event(self, kind: Event, fields: dict[str, Any] | None = None) -> None:
        """Append one event ``{"time_s", "event", ...fields}``.

        Raises:
            ValueError: ``kind`` is not an :class:`Event` (an unknown name is a bug here).
            StorageError: the storage refused the write (the first time; later events are
                logged and dropped, see the class docstring).
        """
        record = {**(fields or {}), "time_s": round(time.time(), 3), "event": Event(kind).value}
        if self.fault is not None:
            log.error("event %s not journalled (%s): %s", record["event"], self.fault, to_json(record)[:500])
            return
        self._append(self._events, to_json(record) + "\n", EVENTS_FILE)
        self._tell(record)

    def summary(self, record: dict[str, Any]) -> None:
        """Write ``summary.json`` (:func:`write_summary`)."""
        write_summary(self.run_dir, record)

    def close(self) -> None:
        self._metrics.close()
        self._events.close()


def is_simulation_summary(record: Any) -> bool:
    """Whether ``record``, a parsed ``summary.json``, is the one ``nereus-launch simulate --out``
    writes (:func:`nereusd.sim.report.write`: the setting and a ``summary`` list of per-policy
    rows) rather than a job's (which has a ``status``)."""
    return isinstance(record, dict) and "status" not in record and isinstance(record.get("summary"), list)


def write_summary(run_dir: str | Path, record: dict[str, Any]) -> None:
    """Write ``RUN_DIR/summary.json`` atomically; a storage fault is logged (the job is ending).
    On a full disk the space reserve (:data:`RESERVE_FILE`, written when the journal opens) is
    given up first, so that the summary of a job that stopped for want of space can still say so.
    nereusd writes it at the end of a job; the launcher for a nereusd that died without one."""
    run_dir = Path(run_dir)
    tmp = run_dir / (SUMMARY_FILE + ".tmp")
    for attempt in range(2):
        try:
            tmp.write_text(to_json(record, indent=2) + "\n")
            os.replace(tmp, run_dir / SUMMARY_FILE)
            break
        except OSError as err:
            with contextlib.suppress(OSError):   # a full disk leaves no empty or partial .tmp behind
                tmp.unlink(missing_ok=True)
            reserve = run_dir / RESERVE_FILE
            if attempt == 0 and reserve.exists():
                with contextlib.suppress(OSError):
                    reserve.unlink()
                continue
            log.error("cannot write %s: %s; the summary was %s", run_dir / SUMMARY_FILE, err,
                      to_json(record)[:2000])
    with contextlib.suppress(OSError):
        (run_dir / RESERVE_FILE).unlink(missing_ok=True)


def _open_append(path: Path):
    """``path`` opened for appending, after cutting a torn last line (a writer that died mid-line
    left it without its newline): an appended record would otherwise run on into it."""
    if path.exists():
        _check_regular(path)
        with open(path, "rb+") as fh:
            data = fh.read()
            if data and not data.endswith(b"\n"):
                fh.truncate(data.rfind(b"\n") + 1)
    return open(path, "ab", buffering=0)   # one write per record: all of it reaches the file or none


def _check_regular(path: Path) -> None:
    """Refuse a journal path that is not a regular file (a FIFO or ``/dev/zero`` would be read forever).

    Raises:
        JournalError: naming the path.
    """
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise JournalError(f"{path}: not a regular file (a journal is a plain file in the run directory)")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record of the JSONL file at ``path`` (``[]`` when it does not exist).

    Only the last line may be incomplete: a writer that died mid-line, or one appending while this
    reads (the journal writes whole lines, so nothing else can tear one), leaves it without its
    newline, and it is skipped. Any other line that is not a JSON object means the file is damaged
    or not a journal. The file is read as one buffer and split here: a text-mode ``readlines``
    returned a line being appended as two lines, its part before the reader reached the end and
    the rest (a multi-page record; the launcher's progress poll failed on one in a suite run,
    2026-12-05).

    Raises:
        JournalError: naming the file, the line number and what is wrong with it.
    """
    try:
        _check_regular(Path(path))
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return []
    except OSError as err:   # a symlink loop, no permission, an I/O error
        raise JournalError(f"{path}: cannot read: {err.strerror or err}") from None
    raw = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")   # a JSON line holds no raw CR
    whole = raw.rfind(b"\n") + 1   # after it: the torn last line, if any
    try:
        lines = [line + "\n" for line in raw[:whole].decode("utf-8").split("\n")[:-1]]
    except UnicodeDecodeError as err:   # named by its line, as the other damage is
        line = raw.count(b"\n", 0, err.start) + 1
        raise JournalError(f"{path}:{line}: {not_utf8(err)}") from None
    if whole < len(raw):
        try:
            lines.append(raw[whole:].decode("utf-8"))
        except UnicodeDecodeError:
            pass   # torn inside a character: skipped as any torn line
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        torn = number == len(lines) and not line.endswith("\n")
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as err:
            if torn:
                break
            raise JournalError(f"{path}:{number}: not a JSON line ({type(err).__name__}: {str(err)[:80]}): "
                               f"{line.strip()[:80]!r}") from None
        if not isinstance(record, dict):
            raise JournalError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def metrics_steps(path: str | Path) -> list[int]:
    """The ``step`` of each record of the metrics journal at ``path``, in file order (``[]``
    when there is none).

    Raises:
        JournalError: as :func:`read_jsonl`, or a record without an integer ``step``.
    """
    path = Path(path)
    return _record_steps(path, read_jsonl(path)) if path.exists() else []


def _record_steps(path: Path, records: list[dict]) -> list[int]:
    steps = []
    for number, r in enumerate(records, 1):
        value = r.get("step")
        if type(value) is not int:
            raise JournalError(f"{path}: record {number} has no integer step ({value!r})")
        steps.append(value)
    return steps


def check_resume_steps(run_dir: str | Path, steps: int) -> None:
    """Refuse to resume the run in ``run_dir`` with a job of ``steps`` RL steps when it has
    already completed more (a job file edited down): a resume would drop the later steps'
    metrics and report success on a run longer than its job.

    Raises:
        ConfigError: names the steps completed and the job's ``steps``.
        JournalError: as :func:`metrics_steps`.
    """
    path = Path(run_dir) / METRICS_FILE
    done = max(metrics_steps(path), default=-1) + 1
    if done > steps:
        raise ConfigError(f"{run_dir}: the run has completed {done} steps ({path}), more than the job's "
                          f"steps: {steps}; raise steps in the job file to continue it, or start a new run")


def drop_metrics_from(path: str | Path, step: int) -> list[int]:
    """Remove the records of steps ``>= step`` from the metrics journal at ``path`` (they run again
    after a rewind, so every step appears once); returns their steps. Rewritten in place when
    anything goes (a torn last line goes too): the journal's append-mode handle keeps writing at
    the (new) end.

    Raises:
        JournalError: as :func:`read_jsonl`.
    """
    path = Path(path)
    if not path.exists():
        return []
    records = read_jsonl(path)
    steps = _record_steps(path, records)
    keep = [r for r, s in zip(records, steps) if s < step]
    dropped = [s for s in steps if s >= step]
    if dropped or len(records) != sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip()):
        with open(path, "r+", encoding="utf-8") as fh:
            fh.seek(0)
            fh.truncate()
            fh.writelines(to_json(r) + "\n" for r in keep)
            fh.flush()
    return dropped
