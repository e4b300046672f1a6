"""Runs a transition DAG's primitives on one worker, concurrently where the DAG allows (paper §6.2).

Every worker of the world runs the same :class:`TransitionExecutor` on the same DAG:

1. :meth:`TransitionExecutor.prepare` creates the transition's communicators — a set of its
   own per op (:class:`emu.state.communicators.Communicators`), collective over the whole world, in DAG
   order — and returns the set-up time, which is part of the transition.
2. :meth:`TransitionExecutor.run` runs this device's part of a set of ops. Ops are taken level
   by level (level = longest chain of DAG edges before the op), and the ops of one level on
   this device run concurrently, one thread each, each on its own communicators: two
   concurrent ops never share a process group, even when they are of different model-stages
   on the same ranks, so their collectives cannot pair up with each other across ranks.
   Progress is guaranteed: by induction on the level, every rank reaches level ``L`` after
   the ops of lower levels complete, and then starts all of its level-``L`` ops at once, so no
   two ranks wait on each other in opposite orders. An edge between ops that share no device
   carries neither state nor memory (state edges join ops on a common device,
   release-before-acquire edges ops on the same device), so a device only waits for its own
   earlier ops. The controller (:mod:`nereusd.transition.runner`) may instead hand out ready
   sets one after another, which respects every edge exactly; a worker runs its tasks in the
   order they were sent, so two ops that one rank runs one after another run in that order on
   every rank they share.
3. :meth:`TransitionExecutor.close` destroys the communicators.

Per-op timings (:class:`OpTiming`, wall-clock seconds since the epoch, comparable across
processes on one host) go back to the controller.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

from emu.state.primitives import Communicators, HoldingStore, Specs, create_communicators, run_op
from nereusd.transition.dag import topological_order
from nereusd.transition.ops import Op, TransitionDag

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpTiming:
    """When this device ran its part of one op (``time.time()`` seconds) and what it moved."""

    op_id: str
    kind: str
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_dict(self) -> dict:
        return asdict(self)


def participates(op: Op, device: int) -> bool:
    """Whether ``device`` takes part in ``op`` (:attr:`~nereusd.transition.ops.Op.participants`)."""
    return device in op.participants


def levels(dag: TransitionDag) -> dict[str, int]:
    """Level of every op: 0 without predecessors, else 1 + the highest predecessor level."""
    level: dict[str, int] = {}
    for op_id in topological_order(dag):
        level[op_id] = 1 + max((level[p] for p in dag.predecessors(op_id)), default=-1)
    return level


class TransitionExecutor:
    """This device's executor of one transition DAG (module docstring).

    Args:
        dag: the global transition DAG (the same on every rank).
        device: this worker's global device index.
        store: this device's holdings (read, created and freed by the ops).
        specs: model shapes, value head and slots per model-stage of the DAG.
        rank_of: world rank of a global device (identity unless the world was re-formed).
        communicators: the whole DAG's communicator plan when ``dag`` is this device's slice
            (:meth:`~nereusd.transition.ops.TransitionDag.slices`); ``None``: ``dag`` is whole.
        pool: a :class:`emu.state.groups.GroupPool` the communicators come from and go back
            to (``None``: created and destroyed).
    """

    def __init__(self, dag: TransitionDag, device: int, store: HoldingStore, specs: Specs,
                 rank_of: Callable[[int], int] = lambda d: d, backend: Optional[str] = None,
                 communicators: Optional[list[tuple[str, list[int]]]] = None, pool=None) -> None:
        self.dag, self.device, self.store, self.specs = dag, device, store, specs
        self.communicators = communicators
        self.comms = Communicators(rank_of, backend, pool)
        self._level = levels(dag)
        self._lock = threading.Lock()
        self.done: set[str] = set()

    @property
    def setup_s(self) -> float:
        return self.comms.setup_s

    def prepare(self) -> float:
        """Create the DAG's communicators (collective over the world); returns the set-up seconds."""
        create_communicators(self.dag, self.comms, self.communicators)
        return self.comms.setup_s

    def mine(self, op_ids: Optional[Iterable[str]] = None) -> list[str]:
        """The ops (of ``op_ids``, default all) this device takes part in, in topological order."""
        wanted = None if op_ids is None else set(op_ids)
        return [x for x in topological_order(self.dag)
                if (wanted is None or x in wanted) and participates(self.dag.op(x), self.device)]

    def levels(self, op_ids: Optional[list[str]] = None) -> dict[str, int]:
        """The level :meth:`run` gives each op: the DAG's own without ``op_ids``, else counted over
        the edges between the ops named (every op named, this device's or not, so that every
        rank given the same ops finds the same levels)."""
        if op_ids is None:
            return self._level
        named, level = set(op_ids), {}
        for x in topological_order(self.dag):
            if x in named:
                level[x] = 1 + max((level[p] for p in self.dag.predecessors(x) if p in named), default=-1)
        return level

    def run(self, op_ids: Optional[Iterable[str]] = None) -> list[OpTiming]:
        """Run this device's part of ``op_ids`` (default: the whole DAG), level by level.

        Without ``op_ids`` the levels are those of :attr:`dag`, which must then be the whole DAG
        (every rank sees the same levels). With ``op_ids`` they count only the edges between the
        ops named: a ready set the controller hands out (:mod:`nereusd.transition.runner`) is one
        level on every rank. Levels of this device's slice would not do: ops X and Y of one
        ready set could be levels 0 and 1 on one rank and 1 and 0 on another (each has a
        predecessor only the other rank took part in), and the two ranks would wait on each
        other, each inside the op the other runs second.

        Raises:
            NereusError: if an op's holding is missing (e.g. run out of order), or what a
                primitive raises (``DeviceOutOfMemory``, a collective's ``RuntimeError`` when a
                peer died); ops of the same level that did not fail still complete first.
        """
        op_ids = None if op_ids is None else list(op_ids)
        level = self.levels(op_ids)
        by_level: dict[int, list[str]] = {}
        for x in self.mine(op_ids):
            by_level.setdefault(level[x], []).append(x)
        timings: list[OpTiming] = []
        for lvl in sorted(by_level):
            batch = by_level[lvl]
            if len(batch) == 1:
                timings.append(self._run_one(batch[0]))
                continue
            with ThreadPoolExecutor(max_workers=len(batch), thread_name_prefix="emu-op") as pool:
                futures = [pool.submit(self._run_one, x) for x in batch]
                errors = []
                for f in futures:
                    try:
                        timings.append(f.result())
                    except BaseException as err:  # noqa: BLE001 - re-raised below after the level drains
                        errors.append(err)
                if errors:
                    raise errors[0]
        return timings

    def _run_one(self, op_id: str) -> OpTiming:
        op = self.dag.op(op_id)
        start = time.time()
        run_op(op, self.device, self.store, self.comms, self.specs, self.dag.staging_bytes)
        end = time.time()
        with self._lock:
            self.done.add(op_id)
        log.debug("device %d: %s in %.4f s", self.device, op.describe(), end - start)
        return OpTiming(op_id, op.kind.value, start, end)

    def close(self) -> None:
        """Destroy the transition's communicators."""
        self.comms.destroy()


def merge_timings(per_device: Iterable[Iterable[dict]]) -> dict[str, dict]:
    """Per op, the earliest start and latest end over devices (``OpTiming.to_dict`` inputs).

    Returns:
        ``{op_id: {"kind", "start_s", "end_s", "duration_s"}}``.
    """
    out: dict[str, dict] = {}
    for timings in per_device:
        for t in timings:
            cur = out.setdefault(t["op_id"], {"kind": t["kind"], "start_s": t["start_s"], "end_s": t["end_s"]})
            cur["start_s"] = min(cur["start_s"], t["start_s"])
            cur["end_s"] = max(cur["end_s"], t["end_s"])
    for v in out.values():
        v["duration_s"] = v["end_s"] - v["start_s"]
    return out


