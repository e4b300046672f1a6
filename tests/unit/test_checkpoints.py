"""Checkpoint directories on the head node (nereusd/checkpoints.py): commit by rename, pruning
to the last K periodic ones, and which directory counts as the latest."""

from __future__ import annotations

import os
import time

import pytest

from nereusd import checkpoints
from nereusd.errors import StorageError


def _write(path, text="x"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "data").write_text(text)
    return path


def test_commit_renames_the_partial_and_replaces_an_older_one(tmp_path):
    final = tmp_path / "final"
    _write(final, "old")
    _write(checkpoints.partial_path(final), "new")
    checkpoints.commit(final)
    assert (final / "data").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_refused_rename_is_a_storage_error_and_keeps_the_old_checkpoint(tmp_path):
    final = _write(tmp_path / "final", "old")
    with pytest.raises(StorageError, match=r"final.partial could not be renamed to .*final"):
        checkpoints.commit(final)   # nothing was written: the partial is missing
    assert (final / "data").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_prune_keeps_the_newest_periodic_and_every_other_kind(tmp_path):
    for step in (2, 4, 6, 8, 10):
        _write(tmp_path / f"step{step:06d}")
    for name in ("final", "preempted-step000005", "fallback-step000007", "step000012.partial"):
        _write(tmp_path / name)
    deleted = checkpoints.prune(tmp_path, keep_last=2, protect=tmp_path / "step000002")
    assert sorted(p.name for p in deleted) == ["step000004", "step000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fallback-step000007", "final", "preempted-step000005", "step000002", "step000008", "step000010",
        "step000012.partial"]


def test_latest_ignores_unfinished_saves(tmp_path):
    assert checkpoints.latest(tmp_path / "none") is None
    done = _write(tmp_path / "step000002")
    time.sleep(0.01)
    _write(checkpoints.partial_path(tmp_path / "step000004"))
    _write(tmp_path / "final.old")
    os.utime(done, (time.time() - 60, time.time() - 60))
    assert checkpoints.latest(tmp_path) == done
    assert checkpoints.size_bytes(done) == 1
