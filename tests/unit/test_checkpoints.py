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


def test_resume_takes_the_run_directorys_own_checkpoints_after_a_move_or_a_copy(tmp_path):
    """A checkpoint event records the absolute path the run directory had. A moved run directory
    resumed from step 0 (that path gone) and a copy from the original's checkpoints; the record
    now names ``RUN_DIR/checkpoints/<name>`` of the directory resumed (an adversarial trial)."""
    import json

    from nereusd.checkpoints import resume_record
    from nereusd.journal import EVENTS_FILE

    original, copy = tmp_path / "original", tmp_path / "copy"
    events = "".join(json.dumps({"event": "checkpoint", "dir": str(original / "checkpoints" / f"step{s:06d}"),
                                 "step": s, "sample_position": 8 * s}) + "\n" for s in (2, 4, 6))
    for run in (original, copy):
        (run / "checkpoints" / "step000002").mkdir(parents=True)
        (run / "checkpoints" / "step000004").mkdir()
        (run / EVENTS_FILE).write_text(events)
    (original / "checkpoints" / "step000006").mkdir()
    assert resume_record(original)["dir"] == str((original / "checkpoints" / "step000006").resolve())
    record = resume_record(copy)   # the copy's own newest, not the original's step 6
    assert record["step"] == 4 and record["dir"] == str((copy / "checkpoints" / "step000004").resolve())
    moved = tmp_path / "moved"
    original.rename(moved)
    assert resume_record(moved)["dir"] == str((moved / "checkpoints" / "step000006").resolve())


def test_a_resume_without_any_of_the_recorded_checkpoints_is_refused(tmp_path):
    """``RUN_DIR/checkpoints`` deleted (or a file in its place) after checkpoints were committed:
    the resume re-ran every step from the initial weights and said it succeeded (an adversarial
    trial, 2026-12-07). It is refused, naming them; checkpoints pruned by ``keep_last`` are not
    expected, and a run that never checkpointed resumes from the initial weights as before."""
    import json
    import shutil

    from nereusd.errors import ConfigError
    from nereusd.journal import EVENTS_FILE

    run = tmp_path / "run"
    (run / "checkpoints" / "step000004").mkdir(parents=True)
    events = [{"event": "checkpoint", "dir": str(run / "checkpoints" / "step000002"), "step": 2},
              {"event": "checkpoint", "dir": str(run / "checkpoints" / "step000004"), "step": 4,
               "pruned": ["step000002"]}]
    (run / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    checkpoints.check_resume_checkpoints(run)   # step000004 is there
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(ConfigError, match=r"records the checkpoints step000004, but none is in .*checkpoints"):
        checkpoints.check_resume_checkpoints(run)
    (run / "checkpoints").write_text("not a directory")
    with pytest.raises(ConfigError, match="step000004"):
        checkpoints.check_resume_checkpoints(run)
    (run / EVENTS_FILE).write_text(json.dumps({"event": "nereusd_started"}) + "\n")
    checkpoints.check_resume_checkpoints(run)   # none was ever written: nothing to miss


def test_a_resume_of_a_job_that_now_trains_other_models_is_refused(tmp_path):
    """The job file's algorithm (GRPO → PPO: a critic) or model edited between a crash and its
    resume: every checkpoint was reported damaged in turn, and the job failed (an adversarial
    trial, 2026-12-07). Checkpoint events record what they hold (``holds``), and a resume whose
    job trains otherwise is refused, naming the model-stages; older events are not checked."""
    from nereusd.config.resolve import load_and_resolve
    from nereusd.errors import ConfigError

    base = """name: held
algorithm: {algorithm}
steps: 4
site: local
devices: 2
models: {{actor_config: {{vocab_size: 64, hidden_size: {hidden}, intermediate_size: 64, num_layers: 2,
                         num_heads: 4, num_kv_heads: 2, max_position: 64}}}}
rollout: {{prompts_per_step: 2, group_size: 2, max_new_tokens: 8}}
train: {{global_batch: 4, micro_batch: 1}}
"""

    def job(algorithm: str, hidden: int):
        path = tmp_path / f"{algorithm}{hidden}.yaml"
        path.write_text(base.format(algorithm=algorithm, hidden=hidden))
        return load_and_resolve(path)

    grpo = job("grpo", 32)
    record = {"dir": "/runs/x/checkpoints/step000004", "holds": checkpoints.held_models(grpo)}
    assert list(record["holds"]) == ["actor/training"] and record["holds"]["actor/training"]["spec"]["hidden_size"] == 32
    checkpoints.check_resume_models(record, grpo)
    with pytest.raises(ConfigError, match=r"step000004 does not hold what the job trains \(critic/training: the job "
                                          r"trains it, the checkpoint holds none\): was the job file's algorithm"):
        checkpoints.check_resume_models(record, job("ppo", 32))
    with pytest.raises(ConfigError, match=r"actor/training: another model \(its config differs\)"):
        checkpoints.check_resume_models(record, job("grpo", 48))
    checkpoints.check_resume_models({"dir": "old"}, job("ppo", 48))   # written before `holds`
    checkpoints.check_resume_models(None, job("ppo", 48))   # no checkpoint: the initial weights
