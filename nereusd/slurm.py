"""Talking to Slurm: a typed client, the node-list parser, the table of Slurm's environment
variables, GPU visibility, and the allocation watcher that turns what Slurm does to a job into
pool-change events.

Output is parsed with explicit separators (``squeue -o '%i|%T|…'``), never by column width. A
failing command raises :class:`~nereusd.errors.SlurmError` with argv, exit code and stderr.

Traps written down here because they cost time once (see also scripts/slurm/):
  - An ``srun`` inside an allocation inherits ``SLURM_NNODES``/``SLURM_NTASKS`` from the batch
    step; pass ``-N``/``--ntasks-per-node`` explicitly, and ``--overlap`` or a second step blocks
    on resources the first one holds.
  - Nodes of one machine (emulated clusters, some containers) share ``hostname``: identify a node
    by ``SLURMD_NODENAME`` / ``SLURM_NODEID``.
  - ``CUDA_VISIBLE_DEVICES`` may hold per-job indices (cgroup ``ConstrainDevices``) or global ones
    (no constraint): count the entries, never use them as indices into ``SLURM_JOB_GPUS``.
  - With ``proctrack/linuxproc`` a double-forked process survives ``scancel``; keep every Nereus
    process a child of its step.
  - Without ``--no-kill`` on both ``sbatch`` and ``srun``, one failed node ends the whole job.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from nereusd.errors import SlurmError

log = logging.getLogger(__name__)

#: Slurm's environment variables that Nereus reads, and what they mean (``man sbatch``,
#: "OUTPUT ENVIRONMENT VARIABLES"; ``man srun``).
SLURM_ENV: Mapping[str, str] = {
    "SLURM_JOB_ID": "id of the allocation (batch job) this process belongs to",
    "SLURM_JOB_NODELIST": "compressed host list of the whole allocation, e.g. gpu[001-004]",
    "SLURM_JOB_NUM_NODES": "number of nodes of the allocation",
    "SLURM_NNODES": "nodes of the current step (inherited by an inner srun: pass -N explicitly)",
    "SLURM_NODEID": "index of this node within the step, 0-based",
    "SLURMD_NODENAME": "Slurm's name of this node (unique even when hostnames are not)",
    "SLURM_PROCID": "global rank of this task in the step",
    "SLURM_LOCALID": "rank of this task on its node",
    "SLURM_STEP_ID": "id of the job step (the batch script's step is 'batch')",
    "SLURM_SUBMIT_DIR": "directory sbatch was run from",
    "SLURM_GPUS_ON_NODE": "number of GPUs allocated to this step on this node",
    "SLURM_JOB_GPUS": "GPU indices allocated on this node (global numbering of the node)",
    "SLURM_STEP_GPUS": "GPU indices allocated to this step on this node",
    "CUDA_VISIBLE_DEVICES": "GPUs the CUDA runtime shows this process (per-job or global indices)",
    "ROCR_VISIBLE_DEVICES": "GPUs the ROCm runtime shows this process",
    "GPU_DEVICE_ORDINAL": "GPUs allocated, for runtimes other than CUDA/ROCm",
}

ACTIVE_STATES = frozenset({"RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "SUSPENDED"})
"""squeue states of a job that has not ended: ``resume`` refuses to submit beside one, and
``cancel`` cancels only these."""



@dataclass(frozen=True)
class SlurmContext:
    """Where this process sits in a Slurm job (from :data:`SLURM_ENV`); ``None`` where unset."""

    job_id: str | None
    node_name: str | None
    node_id: int | None
    nodes: tuple[str, ...]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "SlurmContext":
        """Read the context from an environment mapping (``os.environ``).

        Raises:
            SlurmError: if ``SLURM_NODEID`` is not an integer or the node list cannot be parsed.
        """
        node_id = env.get("SLURM_NODEID")
        if node_id is not None and not node_id.isdigit():
            raise SlurmError(f"SLURM_NODEID={node_id!r} is not an integer")
        nodelist = env.get("SLURM_JOB_NODELIST", "")
        return cls(job_id=env.get("SLURM_JOB_ID"), node_name=env.get("SLURMD_NODENAME"),
                   node_id=int(node_id) if node_id is not None else None,
                   nodes=tuple(parse_nodelist(nodelist)) if nodelist else ())


@dataclass(frozen=True)
class VisibleGpus:
    """GPUs Slurm made visible to this process: how many, their ids as given, and the variable."""

    count: int
    ids: tuple[str, ...]
    source: str


def visible_gpus(env: Mapping[str, str]) -> VisibleGpus:
    """The GPUs of this process, from Slurm's variables, without assuming a numbering.

    The runtime variables come first (``CUDA_VISIBLE_DEVICES``, ``ROCR_VISIBLE_DEVICES``): the CUDA
    or ROCm runtime renumbers what they list as ``0..count-1``, so callers use local indices
    ``range(count)``. ``SLURM_STEP_GPUS``, ``SLURM_JOB_GPUS`` and ``GPU_DEVICE_ORDINAL`` follow;
    ``SLURM_GPUS_ON_NODE`` gives only a count. Ids are kept as strings (they may be UUIDs).
    An empty result means no GPU was allocated.
    """
    for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS",
                 "GPU_DEVICE_ORDINAL"):
        value = env.get(name)
        if value is not None and value.strip() and value.strip() != "NoDevFiles":
            ids = tuple(v.strip() for v in value.split(",") if v.strip())
            return VisibleGpus(len(ids), ids, name)
    count = env.get("SLURM_GPUS_ON_NODE", "")
    if count.isdigit() and int(count) > 0:
        return VisibleGpus(int(count), tuple(str(i) for i in range(int(count))), "SLURM_GPUS_ON_NODE")
    return VisibleGpus(0, (), "")


# ------------------------------------------------------------------------------- node lists
def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str, whole: str) -> list[str]:
    out = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise SlurmError(f"node list {whole!r}: bad range {part!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise SlurmError(f"node list {whole!r}: range {part!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def parse_nodelist(text: str) -> list[str]:
    """Expand a Slurm host list: ``gpu[001-003,007],login1`` → ``gpu001 gpu002 gpu003 gpu007 login1``.

    Several bracket groups in one name expand as a product (``r[1-2]n[1-2]`` → r1n1 r1n2 r2n1
    r2n2); zero padding follows the range's first bound. Order is kept; "" and "(null)" give [].

    Raises:
        SlurmError: unbalanced brackets, an empty name or a malformed range (the message has the list).
    """
    text = text.strip()
    if not text or text == "(null)":
        return []
    if text.count("[") != text.count("]"):
        raise SlurmError(f"node list {text!r}: unbalanced brackets")
    names: list[str] = []
    for item in _split_top(text):
        if not item:
            raise SlurmError(f"node list {text!r}: empty name")
        expanded = [""]
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
            if not literal and not body:
                continue
            choices = _expand_ranges(body, text) if body else [""]
            expanded = [e + literal + c for e in expanded for c in choices]
        names.extend(expanded)
    return names


# ------------------------------------------------------------------------------- the client
@dataclass(frozen=True)
class JobInfo:
    """One line of ``squeue -o '%i|%T|%D|%B|%N|%r'``."""

    job_id: str
    state: str
    num_nodes: int
    batch_host: str
    nodes: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class NodeInfo:
    """One line of ``sinfo -N -o '%N|%T|%E'``: the node's state and the admin's reason."""

    name: str
    state: str
    reason: str

    @property
    def down(self) -> bool:
        """DOWN, FAIL or FAILING (``down*`` = not responding)."""
        base = self.state.rstrip("*~#!%$@^-+")
        return base in ("down", "fail", "failing") or base.startswith("down")

    @property
    def draining(self) -> bool:
        """DRAIN, DRAINING or DRAINED: the admin takes the node away."""
        return self.state.rstrip("*~#!%$@^-+").startswith("drain")


Runner = Callable[..., subprocess.CompletedProcess]


class SlurmClient:
    """Slurm's commands as typed calls.

    Args:
        runner: ``subprocess.run``-compatible callable (tests pass a fake).
        timeout_s: per-command limit in seconds.
    """

    def __init__(self, runner: Runner | None = None, timeout_s: float = 30.0) -> None:
        self._runner = runner or subprocess.run
        self.timeout_s = timeout_s

    def run(self, argv: Sequence[str], input_text: str | None = None) -> str:
        """Run one Slurm command; return stdout.

        Raises:
            SlurmError: the command is not installed, times out, or exits non-zero (the message
                has argv, exit code and stderr).
        """
        argv = list(argv)
        if self._runner is subprocess.run and shutil.which(argv[0]) is None:
            raise SlurmError(f"{argv[0]}: command not found on PATH (is Slurm installed, or its module loaded?)",
                             refused=True)
        try:
            proc = self._runner(argv, capture_output=True, text=True, timeout=self.timeout_s, input=input_text)
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{argv} did not finish within {self.timeout_s:.0f} s") from None
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]}: command not found (is Slurm installed?)", refused=True) from None
        if proc.returncode != 0:
            raise SlurmError(f"{argv} failed with exit code {proc.returncode}: {proc.stderr.strip()}", refused=True)
        return proc.stdout

    def sbatch(self, script: str, args: Sequence[str] = ()) -> str:
        """Submit a batch script given as text (on stdin); returns the job id.

        Raises:
            SlurmError: sbatch is missing or refuses the job (stderr has Slurm's reason).
        """
        out = self.run(["sbatch", "--parsable", *args], input_text=script).strip()
        job_id = out.split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch printed {out!r}, expected a job id")
        return job_id

    def job(self, job_id: str) -> JobInfo | None:
        """The job as squeue sees it (any state still in the controller), or ``None`` when gone.

        Raises:
            SlurmError: squeue fails for another reason than an unknown job.
        """
        try:
            out = self.run(["squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%i|%T|%D|%B|%N|%r"])
        except SlurmError as err:
            if "Invalid job id" in str(err):
                return None
            raise
        for line in out.splitlines():
            fields = line.split("|", 5)
            if len(fields) != 6:
                raise SlurmError(f"squeue line {line!r}: expected 6 '|'-separated fields")
            if fields[0] == str(job_id):
                if not (fields[2] or "0").isdigit():
                    raise SlurmError(f"squeue line {line!r}: node count {fields[2]!r} is not an integer")
                return JobInfo(fields[0], fields[1], int(fields[2] or 0), fields[3],
                               tuple(parse_nodelist(fields[4])), fields[5])
        return None

    def nodes(self, names: Sequence[str]) -> dict[str, NodeInfo]:
        """States of ``names`` (``sinfo -N``); a node may appear once per partition: first wins."""
        if not names:
            return {}
        out = self.run(["sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N|%T|%E"])
        result: dict[str, NodeInfo] = {}
        for line in out.splitlines():
            fields = line.split("|", 2)
            if len(fields) != 3:
                raise SlurmError(f"sinfo line {line!r}: expected 3 '|'-separated fields")
            result.setdefault(fields[0], NodeInfo(fields[0], fields[1].lower(), fields[2]))
        return result

    def cancel(self, job_id: str, signal: str | None = None) -> None:
        """``scancel [--signal=SIG] JOB``."""
        self.run(["scancel", *([f"--signal={signal}"] if signal else []), str(job_id)])

    def resize(self, job_id: str, num_nodes: int) -> None:
        """Shrink a running job to ``num_nodes`` (``scontrol update JobId=… NumNodes=…``)."""
        self.run(["scontrol", "update", f"JobId={job_id}", f"NumNodes={num_nodes}"])


# ------------------------------------------------------------------------------- the watcher
@dataclass(frozen=True)
class SlurmPoolEvent:
    """Something Slurm did to the pool: ``kind`` is ``node_down``, ``node_drain``,
    ``node_released`` (job shrink) or ``job_ending``; ``node`` is a Slurm node name."""

    kind: str
    job_id: str
    node: str | None
    detail: str


class AllocationWatcher:
    """Polls Slurm for the job's allocations and reports changes as :class:`SlurmPoolEvent`.

    One watcher per nereusd; it polls ``squeue`` and ``sinfo`` at ``min_interval_s`` after a
    change, backing off by ``factor`` per quiet poll up to ``max_interval_s`` (with ±10 % jitter),
    and doubling the interval after a failed command, so a large job never hammers slurmctld.
    Each node is reported once per kind. Runs in a daemon thread; ``on_event`` must be
    thread-safe (nereusd puts events on a queue that its loop drains).
    """

    def __init__(self, client: SlurmClient, job_ids: Sequence[str], on_event: Callable[[SlurmPoolEvent], None], *,
                 min_interval_s: float = 1.0, max_interval_s: float = 30.0, factor: float = 1.5) -> None:
        self.client = client
        self.job_ids = list(job_ids)
        self.on_event = on_event
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.factor = factor
        self.interval_s = min_interval_s
        self._known_nodes: dict[str, set[str]] = {}
        self._reported: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.polls = 0
        self.failures = 0
        self.last_error: str | None = None
        """Why the latest failed poll failed."""

    def add_job(self, job_id: str) -> None:
        """Watch another allocation (a ``grow`` job) too."""
        with self._lock:
            if job_id not in self.job_ids:
                self.job_ids.append(job_id)
                self.interval_s = self.min_interval_s

    def poll_once(self) -> list[SlurmPoolEvent]:
        """One round over every watched job; returns (and reports) the new events.

        What the watcher knows of a job changes only once the whole round over it succeeded,
        and an event counts as reported only once ``on_event`` took it: a round that fails
        part-way (``sinfo`` after ``squeue``, or ``on_event`` raising) is seen again, whole, by
        the next one.

        Raises:
            SlurmError: from the client; whatever ``on_event`` raises.
        """
        events: list[SlurmPoolEvent] = []
        seen: dict[str, set[str]] = {}
        with self._lock:
            job_ids = list(self.job_ids)
        for job_id in job_ids:
            info = self.client.job(job_id)
            known = self._known_nodes.get(job_id, set())
            if info is None or info.state not in ("RUNNING", "PENDING", "CONFIGURING"):
                state = info.state if info else "GONE"
                events += self._new("job_ending", job_id, None, f"job {job_id} is {state}")
                continue
            current = set(info.nodes)
            left = known - current
            states = self.client.nodes(sorted(current | left))
            for name in sorted(left):  # Slurm drops a DOWN node from a --no-kill job's list at once
                node = states.get(name)
                if node is None or not (node.down or node.draining):
                    events += self._new("node_released", job_id, name, f"node {name} left job {job_id} (job shrink)")
            for node in states.values():
                if node.down:
                    events += self._new("node_down", job_id, node.name, f"node {node.name} is {node.state}: {node.reason}")
                elif node.draining:
                    events += self._new("node_drain", job_id, node.name, f"node {node.name} is {node.state}: {node.reason}")
            seen[job_id] = current
        self.polls += 1
        for event in events:
            self.on_event(event)
            self._reported.add(self._key(event.kind, event.node, event.job_id))
        self._known_nodes.update(seen)
        return events

    @staticmethod
    def _key(kind: str, node: str | None, job_id: str) -> tuple[str, str]:
        return (kind, node or job_id)

    def _new(self, kind: str, job_id: str, node: str | None, detail: str) -> list[SlurmPoolEvent]:
        """``[the event]`` unless it was reported already (each node is reported once per kind)."""
        if self._key(kind, node, job_id) in self._reported:
            return []
        return [SlurmPoolEvent(kind, job_id, node, detail)]

    def _next_interval(self, changed: bool, failed: bool) -> float:
        if failed:
            self.interval_s = min(self.max_interval_s, self.interval_s * 2)
        elif changed:
            self.interval_s = self.min_interval_s
        else:
            self.interval_s = min(self.max_interval_s, self.interval_s * self.factor)
        return self.interval_s * random.uniform(0.9, 1.1)

    def _loop(self) -> None:
        """Poll until :meth:`stop`. A failed poll backs off and tries again, whatever it raised: a
        watcher thread that died would end pool tracking for good, silently. Slurm's own failures
        (:class:`SlurmError`: a command failed, output that does not parse) are warnings; anything
        else is a bug here and is logged with its traceback (:attr:`last_error` keeps it)."""
        while not self._stop.is_set():
            failed = changed = False
            try:
                changed = bool(self.poll_once())
            except SlurmError as err:
                failed = True
                self.failures += 1
                self.last_error = str(err)
                log.warning("allocation watcher: %s (next try in %.1f s)", err, self.interval_s * 2)
            except Exception as err:  # noqa: BLE001 - see the docstring: the thread must outlive it
                failed = True
                self.failures += 1
                self.last_error = f"{type(err).__name__}: {err}"
                log.exception("allocation watcher: poll failed (next try in %.1f s)", self.interval_s * 2)
            self._stop.wait(self._next_interval(changed, failed))

    def start(self) -> None:
        """Poll in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="slurm-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
