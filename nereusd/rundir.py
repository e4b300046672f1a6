"""Who owns a run directory and what it holds: the running nereusd's lock on it
(:class:`RunDirLock`), a launcher's claim while it clears one (:class:`LaunchLock`), and the
entries a run writes there, which ``--overwrite`` alone may delete (:func:`clear_run_dir`)."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path

from nereusd.errors import NereusError
from nereusd.journal import ENDPOINT_FILE, EVENTS_FILE, METRICS_FILE, RESERVE_FILE, SUMMARY_FILE

LOCK_FILE = "nereusd.lock"
"""Held (``fcntl.flock``, exclusive) by the nereusd that owns the run directory; it holds its pid."""


class RunDirLock:
    """The running job's claim on its run directory: taken by nereusd at start-up and released by
    the kernel when that process ends, however it ends (``kill -9`` included).

    Raises:
        NereusError: when another live process holds it (its pid is named).
    """

    def __init__(self, run_dir: str | Path) -> None:
        path = Path(run_dir) / LOCK_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(path, "a+")
        try:
            fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fh.seek(0)
            owner = self._fh.read().strip() or "?"
            self._fh.close()
            raise NereusError(f"run directory {run_dir} is in use by another job (nereusd pid {owner})") from None
        self._fh.seek(0)
        self._fh.truncate()
        self._fh.write(f"{os.getpid()}\n")
        self._fh.flush()

    def release(self) -> None:
        """Give the claim up (process exit does the same)."""
        self._fh.close()


class LaunchLock:
    """A launcher's claim, from clearing a run directory until its nereusd holds the directory's
    :class:`RunDirLock`: an exclusive ``flock`` on the run directory's parent, so that two
    launches into one directory at the same instant cannot both clear it (the second waits, then
    finds the first job's nereusd owning it). Launches into other directories of the same parent
    wait for those few seconds too."""

    def __init__(self, run_dir: str | Path) -> None:
        parent = Path(run_dir).resolve().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(parent, os.O_RDONLY)
        except OSError as err:   # a file in the way, /proc, no permission
            raise NereusError(f"run directory {run_dir}: cannot create its parent {parent}: "
                              f"{err.strerror or err}") from None
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def release(self) -> None:
        """Give the claim up (idempotent; process exit does the same)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def run_dir_owner(run_dir: str | Path) -> str | None:
    """The pid of the live nereusd holding ``run_dir``'s lock, or None when no process does."""
    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return None
    try:
        with open(path) as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return fh.read().strip() or "?"
    except OSError as err:   # a directory in its place, another user's file
        raise NereusError(f"{path}: cannot check whether a job owns this run directory: {err.strerror or err}") from None
    return None


RUN_DIR_DIRS = frozenset({"logs", "keys", "checkpoints", "tensorboard", "wandb", "plots"})
RUN_DIR_FILES = frozenset({
    METRICS_FILE, EVENTS_FILE, SUMMARY_FILE, RESERVE_FILE, ENDPOINT_FILE, LOCK_FILE, "job.yaml", "loggers.json",
    "slurm.json", "nereus.sbatch",
    SUMMARY_FILE + ".tmp", ENDPOINT_FILE + ".tmp", "loggers.tmp", "slurm.json.tmp"})   # atomic writes' leftovers
"""What a job, its launcher and ``report`` put in a run directory (the directories and the files),
with the summaries of stopped attempts a resume keeps (:data:`KEPT_SUMMARY`): all that
``--overwrite`` deletes."""
KEPT_SUMMARY = re.compile(r"summary\.(running|succeeded|failed|stopped|crashed|interrupted|preempted|unknown)"
                          r"(\.\d+)?\.json")
"""``summary.<status>[.N].json`` (``launcher.resume_cmd``)."""


def foreign_entries(path: Path) -> list[str]:
    """Entries of the directory ``path`` that no Nereus run puts there: a name not among
    :data:`RUN_DIR_DIRS`, :data:`RUN_DIR_FILES` or :data:`KEPT_SUMMARY`, or one of them of the
    other kind (a user's folder ``summary.json/`` is not ours). Names are exact: a folder
    ``nereusd/`` or ``slurm/`` beside a run's files is somebody's code."""
    def ours(entry: Path) -> bool:
        directory = entry.is_dir() and not entry.is_symlink()
        if entry.name in RUN_DIR_DIRS:
            return directory or entry.is_symlink()
        return not directory and (entry.name in RUN_DIR_FILES or KEPT_SUMMARY.fullmatch(entry.name) is not None)
    return sorted(e.name for e in path.iterdir() if not ours(e))


def clear_run_dir(path: Path, overwrite: bool) -> None:
    """Make ``path`` an empty run directory (with ``logs/``) for a new job.

    Raises:
        NereusError: when it exists and is not empty and ``overwrite`` is false; when a running
            job owns it (:class:`RunDirLock`): ``--overwrite`` never deletes a live job's files;
            or when it holds anything a run does not write (:func:`foreign_entries`):
            ``--overwrite`` deletes a run directory, not a directory that was given by mistake
            (``--run-dir .`` with ``--overwrite`` once deleted a checkout).
    """
    if path.exists() and not path.is_dir():
        raise NereusError(f"run directory {path} is a file; choose another --run-dir")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise NereusError(f"run directory {path} exists and is not empty; pass --overwrite or another --run-dir")
        owner = run_dir_owner(path)
        if owner is not None:
            raise NereusError(f"run directory {path} belongs to a running job (nereusd pid {owner}); --overwrite "
                              "does not delete a live job's files: stop it, or choose another --run-dir")
        foreign = foreign_entries(path)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise NereusError(f"run directory {path} holds what no run writes ({shown}): --overwrite deletes a "
                              "run directory only; choose another --run-dir, or empty it yourself")
        for entry in path.iterdir():   # the directory itself stays: '.', a symlink to it, its mode
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    try:
        (path / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise NereusError(f"run directory {path}: cannot create it: {err.strerror or err}") from None
