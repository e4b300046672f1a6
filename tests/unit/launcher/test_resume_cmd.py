"""``nereus-launch resume`` refuses what it cannot resume, before starting anything; the
launcher's crash summary (launcher/local.py) for a nereusd that died without one."""

from __future__ import annotations

import argparse
import json

import pytest

from nereusd.summary import crash_summary
from launcher.resume_cmd import job_file, run
from nereusd.errors import NereusError
from nereusd.journal import Event, Journal
from nereusd.rundir import RunDirLock


def _args(run_dir):
    return argparse.Namespace(run_dir=str(run_dir), gpus=False, quiet=True, restart=False)


def test_refuses_a_directory_without_a_run(tmp_path):
    with pytest.raises(NereusError, match="not a run directory"):
        run(_args(tmp_path))
    # a Slurm job cancelled while pending: say so, and how to submit it again (an adversarial trial)
    (tmp_path / "slurm.json").write_text("{}")
    with pytest.raises(NereusError, match="its Slurm job never started nereusd .* --overwrite"):
        run(_args(tmp_path))


def test_refuses_a_succeeded_job_and_a_live_one(tmp_path):
    journal = Journal(tmp_path)
    journal.event(Event.NEREUSD_STARTED, {"job_file": str(tmp_path / "job.yaml")})
    journal.event(Event.NEREUSD_STOPPED, {"status": "succeeded"})
    # a damaged summary: the journal says how the job stopped (it was resumed: an adversarial trial)
    (tmp_path / "summary.json").write_bytes(b"\x00\xff garbage")
    with pytest.raises(NereusError, match="the job succeeded; nothing to resume"):
        run(_args(tmp_path))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "succeeded"}))
    with pytest.raises(NereusError, match="the job succeeded; nothing to resume"):
        run(_args(tmp_path))
    lock = RunDirLock(tmp_path)   # a live nereusd holds it
    try:
        with pytest.raises(NereusError, match=r"nereusd \(pid \d+\) is still running this job"):
            run(_args(tmp_path))
    finally:
        lock.release()
        journal.close()


def test_job_file_is_the_recorded_one_else_the_copy(tmp_path):
    journal = Journal(tmp_path)
    journal.event(Event.NEREUSD_STARTED, {"job_file": str(tmp_path / "gone.yaml")})
    with pytest.raises(NereusError, match="no job file to resume with"):
        job_file(tmp_path)
    (tmp_path / "job.yaml").write_text("name: x\n")
    assert job_file(tmp_path) == tmp_path / "job.yaml"
    original = tmp_path / "original.yaml"
    original.write_text("name: x\n")
    journal.event(Event.NEREUSD_STARTED, {"job_file": str(original)})
    journal.close()
    (tmp_path / "events.jsonl").write_text((tmp_path / "events.jsonl").read_text().splitlines()[1] + "\n")
    assert job_file(tmp_path) == original


def test_crash_summary_is_written_only_without_a_final_one(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    summary = crash_summary(tmp_path, -9)
    assert summary["status"] == "crashed" and "signal SIGKILL" in summary["error"]
    assert summary["steps_completed"] == 2 and summary["resume"] == f"nereus-launch resume {tmp_path}"
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    (tmp_path / "summary.json").unlink()
    assert "signal SIGKILL" in crash_summary(tmp_path, 137, write=False)["error"]   # a shell's code for it
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed"}))
    assert crash_summary(tmp_path, 1) is None


@pytest.mark.parametrize("summary", [b"[1]", b'{"status": 5}', b"\xff\xfe not UTF-8"])
def test_a_damaged_summary_resumes_as_a_job_that_wrote_none(tmp_path, summary):
    """A list, a non-string status or bytes that are not UTF-8 in ``summary.json`` were
    tracebacks (AttributeError, UnicodeDecodeError; an adversarial helper, 2026-12-05): resume
    now goes on as for a job that died before its summary, here to the missing job file."""
    journal = Journal(tmp_path)
    journal.event(Event.NEREUSD_STARTED, {"job_file": str(tmp_path / "gone.yaml")})
    journal.close()
    (tmp_path / "summary.json").write_bytes(summary)
    with pytest.raises(NereusError, match="no job file to resume with"):
        run(_args(tmp_path))


def test_a_summary_set_aside_stays_in_the_run_directory_whatever_its_status_says(tmp_path):
    from launcher.resume_cmd import _set_aside_summary

    (tmp_path / "summary.json").write_text("{}")
    _set_aside_summary(tmp_path, "../../escaped")
    assert [p.name for p in tmp_path.iterdir()] == ["summary.______escaped.json"]


def test_a_job_file_edited_below_the_steps_run_is_refused_before_anything_moves(tmp_path):
    """A job file edited to fewer ``steps`` than the run completed dropped the later steps'
    metrics and reported "succeeded" (an adversarial helper, 2026-12-06): refused now, before
    the summary is set aside or a metric dropped; as many steps as ran is still a resume."""
    from pathlib import Path

    from nereusd.errors import ConfigError
    from nereusd.journal import check_resume_steps

    examples = Path(__file__).resolve().parents[3] / "examples"
    text = (examples / "counting_remax.yaml").read_text().replace("steps: 20", "steps: 3")
    text = text.replace("models/", str(examples / "models") + "/")
    (tmp_path / "job.yaml").write_text(text)
    journal = Journal(tmp_path)
    journal.event(Event.NEREUSD_STARTED, {"job_file": str(tmp_path / "job.yaml")})
    for step in range(5):
        journal.metric({"step": step})
    journal.close()
    (tmp_path / "summary.json").write_text(json.dumps({"status": "crashed"}))
    with pytest.raises(ConfigError, match=r"completed 5 steps .* more than the job's steps: 3"):
        run(_args(tmp_path))
    assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "crashed"}
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 5
    check_resume_steps(tmp_path, 5)   # all five ran: resuming finishes the run
    with pytest.raises(ConfigError, match="completed 5 steps"):
        check_resume_steps(tmp_path, 4)
    check_resume_steps(tmp_path / "no-metrics-here", 1)


def test_a_resume_whose_nereusd_stops_before_the_job_keeps_the_runs_summary(tmp_path, monkeypatch):
    """A resume onto a full disk set the run's summary aside, then nereusd stopped before it
    wrote one: ``status`` said nereusd was not answering (an adversarial trial, 2026-12-07). The
    run's summary goes back where nereusd wrote none; one it wrote stays."""
    from pathlib import Path

    from launcher import resume_cmd

    examples = Path(__file__).resolve().parents[3] / "examples"
    text = (examples / "counting_remax.yaml").read_text().replace("models/", str(examples / "models") + "/")
    (tmp_path / "job.yaml").write_text(text)
    journal = Journal(tmp_path)
    journal.event(Event.NEREUSD_STARTED, {"job_file": str(tmp_path / "job.yaml")})
    journal.close()
    (tmp_path / "summary.json").write_text(json.dumps({"status": "crashed"}))

    def stops_early(*args, **kwargs):
        assert not (tmp_path / "summary.json").exists()   # set aside while nereusd runs
        raise NereusError("nereusd exited with 1 before binding: cannot write …: No space left on device")

    monkeypatch.setattr(resume_cmd, "supervise", stops_early)
    with pytest.raises(NereusError, match="before binding"):
        run(_args(tmp_path))
    assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "crashed"}
    assert not (tmp_path / "summary.crashed.json").exists()

    def writes_its_own(*args, **kwargs):
        (tmp_path / "summary.json").write_text(json.dumps({"status": "failed"}))
        return 1

    monkeypatch.setattr(resume_cmd, "supervise", writes_its_own)
    assert run(_args(tmp_path)) == 1
    assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "failed"}
    assert json.loads((tmp_path / "summary.crashed.json").read_text()) == {"status": "crashed"}


def test_a_run_interrupted_before_nereusd_started_resumes_with_the_original_job_file(tmp_path):
    """Ctrl-C 2.5 s into ``local``: no nereusd recorded its job file, and ``resume`` read the
    copy ``job.yaml``, whose ``models/counting-warmstart`` then named a directory inside the run
    directory (a new user's trial, 2026-12-07). The copy's header names the original."""
    from launcher.local import JOB_COPY_HEADER

    original = tmp_path / "jobs" / "job.yaml"
    original.parent.mkdir()
    original.write_text("name: x\nmodels: {actor: models/a}\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("")
    (run_dir / "job.yaml").write_text(f"{JOB_COPY_HEADER}{original}\n" + original.read_text())
    assert job_file(run_dir) == original
    original.unlink()   # gone: the copy, whose error then says why its paths do not resolve
    assert job_file(run_dir) == run_dir / "job.yaml"
    with pytest.raises(NereusError, match="the job file the run was started with is gone"):
        run(_args(run_dir))
