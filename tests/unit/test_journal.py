"""The journal's reader: a torn last line is skipped, any other damage is an error naming the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereusd.journal import METRICS_FILE, Event, Journal, JournalError, drop_metrics_from, read_jsonl


def test_a_torn_last_line_is_skipped(tmp_path):
    journal = Journal(tmp_path)
    journal.metric({"step": 0})
    journal.metric({"step": 1})
    journal.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 2, "rew')            # the writer died mid-line
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_a_line_torn_inside_a_character_is_skipped_too(tmp_path):
    (tmp_path / "events.jsonl").write_bytes('{"event": "a"}\n{"reason": "é'.encode()[:-1])
    assert read_jsonl(tmp_path / "events.jsonl") == [{"event": "a"}]


def test_line_ends_of_other_systems_read_and_an_unreadable_path_is_a_journal_error(tmp_path):
    (tmp_path / "crlf.jsonl").write_bytes(b'{"step": 1}\r\n{"step": 2}\r\n{"st')
    (tmp_path / "cr.jsonl").write_bytes(b'{"step": 1}\r{"step": 2}\r')
    assert [r["step"] for r in read_jsonl(tmp_path / "crlf.jsonl")] == [1, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "cr.jsonl")] == [1, 2]
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    with pytest.raises(JournalError, match="loop.jsonl: cannot read"):
        read_jsonl(tmp_path / "loop.jsonl")


def _append_records(path, stop) -> None:
    """Journals of 40 records of 3–7 KB, one ``write`` each, each journal a new file, until ``stop``."""
    import os

    while not stop.is_set():
        fd = os.open(f"{path}.new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
        os.close(fd)
        os.replace(f"{path}.new", path)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        for i in range(40):
            os.write(fd, (json.dumps({"i": i, "pad": "x" * (3000 + 997 * (i % 5))}) + "\n").encode())
        os.close(fd)


def test_records_appended_while_a_reader_reads_are_never_an_error(tmp_path):
    """A reader polling a journal that another process appends to (the launcher's progress poll on
    nereusd's ``events.jsonl``) sees only whole records and at most one torn last line. Records
    over a page (admission events are a few KB) are written by one ``write`` that becomes visible
    page by page: a text-mode ``readlines`` returned one as two lines and raised, in 1,764 of
    134,484 reads over 15 s here (2026-12-05); this is 3 s of the same."""
    import multiprocessing
    import time

    path = tmp_path / "events.jsonl"
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    writer = ctx.Process(target=_append_records, args=(str(path), stop))
    writer.start()
    reads, seen = 0, 0
    try:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            records = read_jsonl(path)
            assert [r["i"] for r in records] == list(range(len(records)))
            reads, seen = reads + 1, seen + len(records)
    finally:
        stop.set()
        writer.join(10)
    assert reads > 100 and seen > 0


@pytest.mark.parametrize("damage, match", [
    ('{"step": 0}\n{"step": 1, oops}\n{"step": 2}\n', r"metrics.jsonl:2: not a JSON line"),
    ('{"step": 0}\n{"step": 1, "x\n', r"metrics.jsonl:2: not a JSON line"),   # has its newline: not torn
    ('{"step": 0}\n[1, 2]\n', r"metrics.jsonl:2: expected a JSON object, got list"),
])
def test_damage_before_the_last_line_is_an_error(tmp_path, damage, match):
    (tmp_path / "metrics.jsonl").write_text(damage)
    with pytest.raises(JournalError, match=match):
        read_jsonl(tmp_path / "metrics.jsonl")


def test_drop_metrics_from_rewinds_the_open_journal(tmp_path):
    journal = Journal(tmp_path)
    for step in range(5):
        journal.metric({"step": step})
    assert drop_metrics_from(tmp_path / METRICS_FILE, 3) == [3, 4]
    journal.metric({"step": 3})    # the append handle writes at the new end
    journal.close()
    assert [r["step"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [0, 1, 2, 3]
    assert drop_metrics_from(tmp_path / "missing.jsonl", 0) == []


def test_events_are_of_a_known_kind(tmp_path):
    from nereusd.journal import Event

    journal = Journal(tmp_path)
    journal.event(Event.TRANSITION, {"step": 3})
    with pytest.raises(ValueError, match="'transtion' is not a valid Event"):
        journal.event("transtion", {"step": 3})
    journal.close()
    assert read_jsonl(tmp_path / "events.jsonl")[0]["event"] == "transition"


def test_journals_are_strict_json(tmp_path):
    """No ``Infinity``/``NaN`` tokens: strict readers (JavaScript, Go) refuse them."""
    from nereusd.journal import Event

    journal = Journal(tmp_path)
    journal.event(Event.ADMISSION, {"payback_steps": float("inf"), "alternatives": [{"x": float("-inf")}],
                                    "gap": float("nan")})
    journal.close()
    line = (tmp_path / "events.jsonl").read_text()
    assert "Infinity" not in line and "NaN" not in line
    record = read_jsonl(tmp_path / "events.jsonl")[0]
    assert record["payback_steps"] == "inf" and record["alternatives"] == [{"x": "-inf"}] and record["gap"] == "nan"


def test_a_journal_reopened_after_a_torn_write_cuts_the_fragment(tmp_path):
    journal = Journal(tmp_path)
    journal.metric({"step": 0})
    journal.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 1, "rew')
    journal = Journal(tmp_path)           # a new nereusd on the same run directory
    journal.metric({"step": 1})
    journal.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


def test_event_fields_cannot_overwrite_the_kind(tmp_path):
    from nereusd.journal import Event

    journal = Journal(tmp_path)
    journal.event(Event.TRIGGER, {"event": "forged", "time_s": -1})
    journal.close()
    record, = read_jsonl(tmp_path / "events.jsonl")
    assert record["event"] == "trigger" and record["time_s"] > 0


def test_other_damage_is_a_journal_error(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"step": 0}\n\xff\xfe\n')
    with pytest.raises(JournalError, match=r"a.jsonl:2: not UTF-8 text \(invalid start byte at byte 12\)"):
        read_jsonl(tmp_path / "a.jsonl")
    (tmp_path / "b.jsonl").write_text("[" * 5000 + "]" * 5000 + "\n{}\n")
    with pytest.raises(JournalError, match="b.jsonl:1: not a JSON line"):
        read_jsonl(tmp_path / "b.jsonl")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"reward": 1}\n')
    with pytest.raises(JournalError, match="record 2 has no integer step"):
        drop_metrics_from(tmp_path / "metrics.jsonl", 0)


def test_a_live_jobs_run_directory_is_locked_and_overwrite_refuses_it(tmp_path):
    """nereusd holds an flock on its run directory; ``--overwrite`` (clear_run_dir) refuses to
    delete a directory whose lock is held, and takes it once the owner is gone."""
    import os

    from nereusd.errors import NereusError
    from nereusd.rundir import RunDirLock, clear_run_dir, run_dir_owner

    run = tmp_path / "run"
    clear_run_dir(run, overwrite=False)
    assert (run / "logs").is_dir() and run_dir_owner(run) is None
    lock = RunDirLock(run)
    (run / "metrics.jsonl").write_text("{}\n")
    assert run_dir_owner(run) == str(os.getpid())
    with pytest.raises(NereusError, match=rf"run directory .*run is in use by another job \(nereusd pid {os.getpid()}\)"):
        RunDirLock(run)
    with pytest.raises(NereusError, match="exists and is not empty; pass --overwrite"):
        clear_run_dir(run, overwrite=False)
    with pytest.raises(NereusError, match=rf"belongs to a running job \(nereusd pid {os.getpid()}\).*does not delete"):
        clear_run_dir(run, overwrite=True)
    assert (run / "metrics.jsonl").exists()   # nothing of the live job was lost
    lock.release()
    assert run_dir_owner(run) is None
    clear_run_dir(run, overwrite=True)
    assert list(run.iterdir()) == [run / "logs"]


def test_overwrite_clears_a_run_directory_only(tmp_path, monkeypatch):
    """``--overwrite`` deleted any non-empty directory given as ``--run-dir``: a checkout, ``.``, or
    ``/`` (an adversarial trial, 2026-12-06). It now deletes only what runs write; anything else
    is named and nothing is deleted."""
    from nereusd.errors import NereusError
    from nereusd.rundir import clear_run_dir

    checkout = tmp_path / "checkout"
    (checkout / "src").mkdir(parents=True)
    (checkout / "src" / "code.py").write_text("x = 1\n")
    (checkout / "README.md").write_text("mine\n")
    (checkout / "logs").mkdir()
    with pytest.raises(NereusError, match=r"holds what no run writes \(README.md, src\): --overwrite deletes a "
                                          r"run directory only"):
        clear_run_dir(checkout, overwrite=True)
    assert (checkout / "src" / "code.py").read_text() == "x = 1\n" and (checkout / "README.md").exists()
    monkeypatch.chdir(checkout)
    with pytest.raises(NereusError, match="holds what no run writes"):
        clear_run_dir(Path("."), overwrite=True)
    with pytest.raises(NereusError, match="holds what no run writes"):
        clear_run_dir(Path("/"), overwrite=True)
    # a finished run's directory, a resumed one's kept summaries and a torn atomic write: cleared
    run = tmp_path / "run"
    for name in ("logs", "keys", "checkpoints/step000002", "tensorboard", "plots"):
        (run / name).mkdir(parents=True)
    for name in ("events.jsonl", "metrics.jsonl", "summary.json", "summary.stopped.json", "summary.stopped.2.json",
                 "summary.json.tmp", "job.yaml", "nereusd.json", "nereusd.lock", "loggers.tmp"):
        (run / name).write_text("{}\n")
    clear_run_dir(run, overwrite=True)
    assert [p.name for p in run.iterdir()] == ["logs"]
    # names are exact and of their kind (a verification trial): a user's package 'nereusd/' or
    # 'slurm/', a file 'summary' or 'summary.evil.json', a folder 'summary.json/' are not ours
    for name, is_dir in (("nereusd", True), ("slurm", True), ("summary", False), ("summary.evil.json", False),
                         ("summary.json", True)):
        other = tmp_path / f"other-{name}"
        (other / "logs").mkdir(parents=True)
        (other / "events.jsonl").write_text("{}\n")
        (other / name).mkdir() if is_dir else (other / name).write_text("mine\n")
        with pytest.raises(NereusError, match=rf"holds what no run writes \({name}\)"):
            clear_run_dir(other, overwrite=True)
        assert (other / name).exists()
    # a symlink to a run directory, and '.' inside one: emptied in place (rmtree of a link or of '.' failed)
    real = tmp_path / "real"
    (real / "checkpoints" / "step000002").mkdir(parents=True)
    (real / "summary.stopped.2.json").write_text("{}\n")
    link = tmp_path / "link"
    link.symlink_to(real)
    clear_run_dir(link, overwrite=True)
    assert link.is_symlink() and [p.name for p in real.iterdir()] == ["logs"]
    (real / "events.jsonl").write_text("{}\n")
    monkeypatch.chdir(real)
    clear_run_dir(Path("."), overwrite=True)
    assert [p.name for p in real.iterdir()] == ["logs"]


def test_a_full_disk_is_a_storage_error_and_leaves_no_torn_line(tmp_path, caplog):
    """/dev/full answers every write with ENOSPC; a short write (what a nearly full disk does) is
    cut back so the file ends at its last whole record. After the first fault, events are
    logged and dropped so that the job's teardown runs."""
    import io

    from nereusd.errors import StorageError
    from nereusd.journal import Journal

    journal = Journal(tmp_path)
    journal.metric({"step": 0})
    journal._metrics = open("/dev/full", "ab", buffering=0)
    with pytest.raises(StorageError, match=r"metrics.jsonl: cannot append: No space left on device"):
        journal.metric({"step": 1})
    journal.event(Event.JOB_FAILED, {"error": "disk full"})   # dropped and logged, not raised
    assert "event job_failed not journalled" in caplog.text
    assert read_jsonl(tmp_path / "events.jsonl") == []

    class HalfWrites(io.FileIO):
        def write(self, data):
            return super().write(bytes(data)[: len(data) // 2])

    journal = Journal(tmp_path / "b")
    journal.event(Event.JOB_FAILED, {"error": "first"})
    journal._events = HalfWrites(tmp_path / "b" / "events.jsonl", "ab")
    with pytest.raises(StorageError, match="events.jsonl: cannot append: short write"):
        journal.event(Event.JOB_FAILED, {"error": "second, torn"})
    assert (tmp_path / "b" / "events.jsonl").read_bytes().endswith(b"}\n")
    assert [e["error"] for e in read_jsonl(tmp_path / "b" / "events.jsonl")] == ["first"]


def test_a_run_directory_or_lock_in_the_way_is_a_clear_error(tmp_path):
    from nereusd.errors import NereusError
    from nereusd.rundir import LOCK_FILE, clear_run_dir

    (tmp_path / "file").write_text("x")
    with pytest.raises(NereusError, match="run directory .*file is a file"):
        clear_run_dir(tmp_path / "file", overwrite=True)
    run = tmp_path / "run"
    (run / LOCK_FILE).mkdir(parents=True)
    with pytest.raises(NereusError, match="cannot check whether a job owns this run directory"):
        clear_run_dir(run, overwrite=True)
    # under a file: a traceback (FileExistsError) before (an adversarial trial)
    from nereusd.rundir import LaunchLock
    with pytest.raises(NereusError, match=r"run directory .*file/sub/run: cannot create its parent .*file/sub: Not a directory"):
        LaunchLock(tmp_path / "file" / "sub" / "run")
    with pytest.raises(NereusError, match=r"run directory .*file/sub: cannot create it"):
        clear_run_dir(tmp_path / "file" / "sub", overwrite=False)


def test_a_journal_that_is_not_a_regular_file_is_refused(tmp_path):
    """``events.jsonl`` symlinked to ``/dev/zero`` was read forever (issue 17)."""
    link = tmp_path / "events.jsonl"
    link.symlink_to("/dev/zero")
    with pytest.raises(JournalError, match="events.jsonl: not a regular file"):
        read_jsonl(link)


def test_a_summary_that_cannot_be_written_leaves_no_tmp(tmp_path, monkeypatch):
    from pathlib import Path

    j = Journal(tmp_path)
    real = Path.write_text

    def full_disk(self, *a, **k):
        real(self, "")   # the file is created, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    j.summary({"status": "failed"})
    monkeypatch.setattr(Path, "write_text", real)
    assert not (tmp_path / "summary.json.tmp").exists() and not (tmp_path / "summary.json").exists()


def test_the_summary_of_a_full_disk_uses_the_space_reserve(tmp_path, monkeypatch):
    """A job stopped because the disk is full must still write why: the journal keeps a reserve
    file from the start and gives it up when the summary does not fit."""
    from nereusd import journal as J

    journal = J.Journal(tmp_path)
    assert (tmp_path / J.RESERVE_FILE).stat().st_size == J.RESERVE_BYTES
    real = J.Path.write_text
    calls = []

    def full_until_reserve_freed(self, text, *a, **kw):   # ENOSPC while the reserve holds the space
        calls.append(self.name)
        if (tmp_path / J.RESERVE_FILE).exists():
            raise OSError(28, "No space left on device")
        return real(self, text, *a, **kw)

    monkeypatch.setattr(J.Path, "write_text", full_until_reserve_freed)
    journal.summary({"status": "stopped", "error_kind": "StorageFault"})
    assert json.loads((tmp_path / "summary.json").read_text())["error_kind"] == "StorageFault"
    assert len(calls) == 2 and not (tmp_path / J.RESERVE_FILE).exists()
    journal.close()


def test_a_second_launch_into_a_run_directory_waits_for_the_first_to_hand_it_to_its_nereusd(tmp_path):
    """Two launches at the same instant once could both clear the directory; the launch lock
    makes the second wait until the first releases it (after its nereusd took RunDirLock), and
    then it finds the directory owned and refuses to clear it."""
    import subprocess
    import sys
    import time

    from nereusd.rundir import LaunchLock, RunDirLock, clear_run_dir
    from tests.support import REPO

    run = tmp_path / "runs" / "job"
    first = LaunchLock(run)
    clear_run_dir(run, overwrite=True)
    second = subprocess.Popen([sys.executable, "-c", (
        "import sys; from nereusd.rundir import LaunchLock, clear_run_dir; "
        f"lock = LaunchLock({str(run)!r}); print('got it', flush=True); "
        f"clear_run_dir(__import__('pathlib').Path({str(run)!r}), True)")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    time.sleep(1.0)
    assert second.poll() is None   # still waiting on the first launch
    owner = RunDirLock(run)        # the first job's nereusd takes the directory
    (run / "metrics.jsonl").write_text("{}\n")
    first.release()
    out, err = second.communicate(timeout=60)
    assert "got it" in out and second.returncode != 0 and "belongs to a running job" in err
    assert (run / "metrics.jsonl").exists()
    owner.release()
    first.release()   # idempotent
