"""Checkpoints of the RL driver's training state: save (atomic, verified, pruned), restore with
fallback to older checkpoints, and adopting the state kept workers hold (:mod:`nereusd.checkpoints`
keeps the directories' lifecycle).

:class:`DriverCheckpoints` is a part of :class:`nereusd.rl.driver.RLDriver` (its attributes are
the driver's: the control plane, journal, plan, job config, step index and sampler position), in
a module of its own as :mod:`nereusd.daemon.recovery` is for the live shell.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

from nereusd import checkpoints
from nereusd import protocol as P
from nereusd.errors import CheckpointUnreadable, StorageError, WorkerError
from nereusd.journal import METRICS_FILE, Event, drop_metrics_from, metrics_steps
from nereusd.plan import Stage

log = logging.getLogger(__name__)


class DriverCheckpoints:
    """:meth:`save_checkpoint`, :meth:`restore` and :meth:`adopt` (module docstring)."""

    def _training_devices(self) -> list[int]:
        """The devices of the plan's training model-stages: the ones a checkpoint is saved from and loaded into."""
        return sorted({d for ms, c in self.plan.items() if ms.stage == Stage.TRAINING for d in c.devices})

    def save_checkpoint(self, directory: str) -> None:
        """Save every training model-stage into ``directory``, atomically (:mod:`nereusd.checkpoints`):
        the workers write and verify ``<directory>.partial``, which is then renamed; older periodic
        checkpoints are pruned to ``checkpoint.keep_last``.

        Raises:
            WorkerError: a worker's save failed (``error_kind`` ``StorageError`` for the storage);
                the partial directory is deleted and earlier checkpoints are unchanged.
            StorageError: a role's checkpoint was not verified, or the rename failed.
        """
        members = self._training_devices()
        roles = sorted({ms.role.value for ms in self.plan if ms.stage == Stage.TRAINING})
        start = time.perf_counter()
        partial = checkpoints.partial_path(directory)
        checkpoints.discard_partial(directory)   # an earlier attempt's leftovers
        save = P.SaveCheckpointArgs(dir=str(partial))
        try:
            results = self.control.run({d: save for d in members})
            verified = {role: n for r in results.values() for role, n in r.result.get("verified_bytes", {}).items()}
            if sorted(verified) != roles:
                raise StorageError(f"checkpoint {partial}: roles {sorted(set(roles) - set(verified))} were not verified")
            extra: dict[str, Any] = {}
            if self.checkpoint_fields is not None:
                try:   # before the commit: a committed checkpoint always gets its event
                    extra = self.checkpoint_fields()
                except Exception:  # noqa: BLE001 - the checkpoint is good without it; a resume plans anew
                    log.exception("checkpoint %s: its extra fields failed; journalled without them", directory)
            checkpoints.commit(directory)
        except BaseException:
            checkpoints.discard_partial(directory)
            raise
        self.last_checkpoint = (directory, self.step_index, self.resume_position)
        pruned = checkpoints.prune(Path(directory).parent, self.cfg.checkpoint.keep_last, protect=directory)
        self.journal.event(Event.CHECKPOINT, {"dir": directory, "step": self.step_index,
                                          "sample_position": self.resume_position,
                                          "bytes": sum(verified.values()), "holds": checkpoints.held_models(self.job),
                                          "elapsed_s": time.perf_counter() - start,
                                          **({"pruned": [p.name for p in pruned]} if pruned else {}), **extra})

    def restore(self, checkpoint: tuple[str, int, int] | None,
                fallbacks: Sequence[tuple[str, int, int]] = ()) -> list[int]:
        """Load ``checkpoint`` (``(directory, step, sample position)``; ``None``: keep the initial
        weights, step 0) into the training model-stages of the current plan, on any layout,
        continue at its step and sample position, and synchronise the other model-stages'
        weights. Used after a checkpoint/restart and by ``nereusd --resume``. Once it has loaded,
        the metrics of the steps from its step on leave ``metrics.jsonl`` (they run again, so
        each step is there once); returns their steps. Nothing leaves before: a resume whose
        load failed dropped them, and the steps they recorded were lost for good (an adversarial
        trial, 2026-12-07).

        ``fallbacks``: older checkpoints, newest first, tried in turn when a worker reports that
        a checkpoint cannot be read (:class:`~nereusd.errors.StorageError`: a truncated or
        damaged file); each such one is journalled (``checkpoint_unreadable``, with the steps
        that then run again besides those of the newer one).

        Raises:
            CheckpointUnreadable: no checkpoint tried could be read.
            WorkerError: a worker died or failed otherwise.
        """
        step, position = 0, 0
        metrics = self.journal.run_dir / METRICS_FILE
        if checkpoint is not None:
            members = self._training_devices()
            tries = [checkpoint, *fallbacks]
            for i, (directory, step, position) in enumerate(tries):
                try:
                    self.control.run({d: P.LoadCheckpointArgs(dir=directory) for d in members}, 300)
                    break
                except WorkerError as err:
                    if err.error_kind != "StorageError":
                        raise
                    if i + 1 == len(tries):   # said as a storage fault, it pointed at the disk's free space
                        raise CheckpointUnreadable(
                            f"no checkpoint could be read (tried {', '.join(Path(t[0]).name for t in tries)}); "
                            f"the last: {err}") from None
                    older = tries[i + 1]
                    log.error("checkpoint %s cannot be read (%s); falling back to %s", directory, err, older[0])
                    again = [s for s in metrics_steps(metrics) if older[1] <= s < step]
                    self.journal.event(Event.CHECKPOINT_UNREADABLE, {"dir": directory, "error": str(err),
                                                                     "fallback": older[0], "step": older[1],
                                                                     "dropped_metrics": again})
            self.last_checkpoint = (directory, step, position)
        dropped = drop_metrics_from(metrics, step)
        self.rewind(step, position)
        self._sync_weights()
        return dropped

    def adopt(self, step: int, position: int) -> None:
        """Continue at ``step`` with the sampler at ``position`` on the EMUs that the workers kept
        in memory across a nereusd crash (``Daemon._keep_workers`` checked that their training
        state holds exactly ``step`` steps): nothing is loaded; the other model-stages' weights
        are synchronised from the training ones, as after :meth:`restore`."""
        self.rewind(step, position)
        self._sync_weights()

    def _periodic_checkpoint(self) -> Path:
        """The periodic checkpoint directory of the boundary before step ``step_index``."""
        return self.journal.run_dir / "checkpoints" / f"step{self.step_index:06d}"
