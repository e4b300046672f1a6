"""The lifecycle of checkpoint directories in ``RUN_DIR/checkpoints/``, on the head node.

A checkpoint is written atomically: the workers save into ``<name>.partial`` (torch DCP, one
checkpoint per role below it), each role's coordinator verifies what it wrote
(:func:`emu.state.checkpoint.verify_checkpoint`), and only then does nereusd rename it to
``<name>`` (:func:`commit`). A save that fails (disk full, read-only, quota, a lost worker)
leaves ``<name>.partial``, which is deleted, and every earlier checkpoint as it was. Periodic
checkpoints (``step<NNNNNN>``) are pruned to the job's ``checkpoint.keep_last`` newest after each
commit (:func:`prune`); ``final``, ``preempted-*`` and ``fallback-*`` are never pruned, and
neither is the one a restart would load.

The run directory is on storage that nereusd and the workers share (as their logs are).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from nereusd.errors import StorageError

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
PERIODIC = re.compile(r"^step(\d{6})$")


def free_space_note(directory: str | Path) -> str:
    """``" (N bytes free there)"`` for the nearest existing parent of ``directory`` (``""`` where
    that cannot be read): torch's own message on a full disk ("unexpected pos …") does not say
    the disk is full, nor does a failed write of a run directory's files."""
    path = Path(directory).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return f" ({shutil.disk_usage(path).free} bytes free there)"
    except OSError:
        return ""


def partial_path(directory: str | Path) -> Path:
    """Where a checkpoint for ``directory`` is written before it is committed."""
    directory = Path(directory)
    return directory.with_name(directory.name + PARTIAL_SUFFIX)


def discard_partial(directory: str | Path) -> None:
    """Delete the unfinished save of ``directory`` (best effort: a read-only disk keeps it)."""
    shutil.rmtree(partial_path(directory), ignore_errors=True)


def commit(directory: str | Path) -> None:
    """Make the verified ``<directory>.partial`` the checkpoint ``directory``.

    An existing ``directory`` (``final`` again after steps were re-run) is moved aside first and
    deleted only after the rename, so a crash in between leaves one complete checkpoint.

    Raises:
        StorageError: a rename the storage refused, naming the paths (the earlier checkpoint stays).
    """
    directory = Path(directory)
    partial = partial_path(directory)
    old = directory.with_name(directory.name + ".old")
    moved_aside = False
    try:
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            moved_aside = True
        os.replace(partial, directory)
    except OSError as err:
        if moved_aside:
            try:
                os.replace(old, directory)   # the earlier checkpoint back where a restart looks
            except OSError:
                pass
        raise StorageError(f"checkpoint {partial} could not be renamed to {directory}: {err.strerror or err}") from None
    shutil.rmtree(old, ignore_errors=True)


def periodic(root: str | Path) -> list[tuple[int, Path]]:
    """The committed periodic checkpoints under ``root``, ``(step, path)``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := PERIODIC.match(p.name))]
    return sorted(found)


def prune(root: str | Path, keep_last: int, protect: str | Path | None = None) -> list[Path]:
    """Delete all but the ``keep_last`` newest periodic checkpoints under ``root``, never
    ``protect`` (the checkpoint a restart would load). Returns what was deleted.

    A deletion the storage refuses is logged and skipped: pruning frees space, it never stops a job.
    """
    protect = Path(protect).resolve() if protect is not None else None
    doomed = [p for _, p in periodic(root)[:-keep_last] if p.resolve() != protect] if keep_last > 0 else []
    deleted = []
    for path in doomed:
        try:
            shutil.rmtree(path)
            deleted.append(path)
        except OSError as err:
            log.warning("could not prune checkpoint %s: %s", path, err)
    return deleted


def committed(root: str | Path) -> list[Path]:
    """Every committed checkpoint directory under ``root`` (no ``.partial`` or ``.old`` ones)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and not p.name.endswith((PARTIAL_SUFFIX, ".old"))]


def latest(root: str | Path) -> Path | None:
    """The most recently committed checkpoint under ``root`` (by modification time), or ``None``."""
    dirs = committed(root)
    return max(dirs, key=lambda p: p.stat().st_mtime) if dirs else None


def size_bytes(directory: str | Path) -> int:
    """Bytes of the files below ``directory`` (0 when it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def resume_records(run_dir: str | Path) -> list[dict]:
    """Every ``checkpoint`` event in ``events.jsonl`` whose checkpoint is still on disk, newest
    first, each with its ``dir`` in this run directory (:func:`resume_record`): what a resume
    falls back to when the newest cannot be read.

    Raises:
        JournalError: a damaged ``events.jsonl``.
    """
    from nereusd.journal import EVENTS_FILE, Event, read_jsonl

    root, out, seen = Path(run_dir) / "checkpoints", [], set()
    for record in reversed(read_jsonl(Path(run_dir) / EVENTS_FILE)):
        if record.get("event") != Event.CHECKPOINT.value:
            continue
        local = root / Path(record["dir"]).name
        if local.is_dir() and local.name not in seen:   # ``final`` again after re-run steps: its newest record
            seen.add(local.name)
            out.append({**record, "dir": str(local.resolve())})
    return out


def held_models(job) -> dict[str, dict]:
    """What a checkpoint of ``job`` holds, as its ``checkpoint`` events record it (``holds``):
    each trained model-stage's model (``{"actor/training": {"spec": …, "value_head": …}}``, the
    values as JSON reads them back), by which a resume knows the job still trains the same."""
    import json

    from nereusd.plan import Stage

    return json.loads(json.dumps({str(ms): {"spec": job.roles[ms.role].spec.to_dict(),
                                            "value_head": job.roles[ms.role].value_head}
                                  for ms in sorted(job.backends, key=str) if ms.stage == Stage.TRAINING}))


def check_resume_models(record: dict | None, job) -> None:
    """Refuse to resume from the checkpoint event ``record`` (the newest of
    :func:`resume_records`) a job that trains other model-stages or models than it holds (the
    job file's ``algorithm`` or ``models`` edited since): the load failed and blamed the
    checkpoints as damaged, every one in turn (an adversarial trial, 2026-12-07). Events
    written before ``holds`` was recorded are not checked.

    Raises:
        ConfigError: naming the model-stages that differ.
    """
    from nereusd.errors import ConfigError

    saved = record.get("holds") if record is not None else None
    if not isinstance(saved, dict):
        return
    held = held_models(job)
    if saved == held:
        return
    differs = [f"{ms}: the job trains it, the checkpoint holds none" for ms in sorted(set(held) - set(saved))]
    differs += [f"{ms}: the checkpoint holds it, the job does not train it" for ms in sorted(set(saved) - set(held))]
    differs += [f"{ms}: another model (its config differs)" for ms in sorted(set(saved) & set(held))
                if saved[ms] != held[ms]]
    raise ConfigError(f"checkpoint {record.get('dir')} does not hold what the job trains ({'; '.join(differs)}): was "
                      "the job file's algorithm or models changed? Resume with the job as it was, or start a new run")


def check_resume_checkpoints(run_dir: str | Path) -> None:
    """Refuse to resume the run in ``run_dir`` from scratch when ``events.jsonl`` records
    committed checkpoints, none pruned since, of which none is on disk (``RUN_DIR/checkpoints``
    deleted, emptied or replaced by a file): the resume re-ran every step from the initial
    weights and reported success (an adversarial trial, 2026-12-07).

    Raises:
        ConfigError: names the checkpoints recorded and where they were looked for.
        JournalError: a damaged ``events.jsonl``.
    """
    from nereusd.errors import ConfigError
    from nereusd.journal import EVENTS_FILE, Event, read_jsonl

    events = [r for r in read_jsonl(Path(run_dir) / EVENTS_FILE) if r.get("event") == Event.CHECKPOINT.value]
    pruned = {name for r in events for name in r.get("pruned") or ()}
    expected = list(dict.fromkeys(Path(r["dir"]).name for r in events if Path(r["dir"]).name not in pruned))
    if expected and not resume_records(run_dir):
        root = Path(run_dir) / "checkpoints"
        raise ConfigError(f"{run_dir}: events.jsonl records the checkpoints {', '.join(expected[-3:])}, but none is "
                          f"in {root} (deleted or moved?): a resume would run every step again from the initial "
                          "weights. Put them back, or start the job anew in another run directory")


def resume_record(run_dir: str | Path) -> dict | None:
    """The ``checkpoint`` event in ``events.jsonl`` of the newest committed checkpoint still on
    disk (its ``dir``, ``step``, ``sample_position`` and, in a live job, ``controller``: what the
    controller had learned, :meth:`~nereusd.control.controller.Controller.state`), or ``None``.

    Its ``dir`` is this run directory's own: every checkpoint is ``RUN_DIR/checkpoints/<name>``,
    and the event records the absolute path of the directory the run had then. A run directory
    moved since resumed from step 0 (its old path gone), and a copy resumed from the original's
    checkpoints (an adversarial trial, 2026-12-06).

    Raises:
        JournalError: a damaged ``events.jsonl``.
    """
    records = resume_records(run_dir)
    return records[0] if records else None

