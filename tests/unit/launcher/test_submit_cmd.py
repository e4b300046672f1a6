"""``submit`` and ``status`` without a cluster: a local run's status, and a refused submission
that leaves nothing behind."""

from __future__ import annotations

import json

import pytest

from launcher.cli import main
from nereusd.errors import SlurmError
from nereusd.slurm import SlurmClient


def test_status_reads_a_local_run_directory(tmp_path, capsys):
    """A run of ``nereus-launch local`` has no ``slurm.json``; ``status`` still reports it."""
    (tmp_path / "summary.json").write_text(json.dumps({"status": "succeeded", "steps_completed": 30}))
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "local" in out and "finished: succeeded after 30 steps" in out
    assert main(["status", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["slurm"] == {}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["status", str(empty)]) == 2
    assert "not a Nereus run directory" in capsys.readouterr().err


def test_status_of_an_ended_job_reads_its_summary_without_waiting_for_nereusd(tmp_path, capsys, monkeypatch):
    """An ended job's nereusd is gone; ``status`` asked it anyway and waited out its 5 s timeout,
    then printed one line. It now reads the summary at once and prints the outcome, reward,
    held-out pass@1, switches and the final plan."""
    import launcher.status_cmd as status_cmd

    asked = []
    monkeypatch.setattr(status_cmd, "ask_nereusd", lambda run_dir, timeout_s=5.0: asked.append(run_dir))
    (tmp_path / "nereusd.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": 1}))
    (tmp_path / "summary.json").write_text(json.dumps({
        "status": "succeeded", "steps_completed": 30, "wall_time_s": 47.4, "switches": 3, "restarts": 1,
        "reward_first_10pct": 0.38, "reward_last_10pct": 0.42, "reward_best": 0.5, "reward_best_step": 20,
        "response_length_first_10pct": 16.0, "response_length_last_10pct": 94.9,
        "eval_pass_at_1_first": 0.34, "eval_pass_at_1_last": 0.39,
        "final_plan": {"actor/training": {"tp": 1, "pp": 2, "dp": 2}}}))
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert not asked
    for line in ("finished: succeeded after 30 steps in 47 s", "reward 0.38 → 0.42 (best 0.50 at step 20)",
                 "held-out pass@1 0.34 → 0.39", "layout switches: 3; checkpoint restarts: 1, 0 step(s) re-run",
                 "final plan: actor/training tp1 pp2 dp2"):
        assert line in out, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    for caps, text in (((8, 24), "94.9 tokens (cap 8 → 24)"), ((24, 24), "94.9 tokens (cap 24)")):
        summary.update(max_new_tokens_first=caps[0], max_new_tokens_last=caps[1])
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        main(["status", str(tmp_path)])
        assert text in capsys.readouterr().out
    (tmp_path / "summary.json").write_text(json.dumps({"status": "running"}))
    main(["status", str(tmp_path)])
    assert asked   # a running job is asked


def test_status_of_a_running_job_says_how_many_steps_are_done(tmp_path, capsys, monkeypatch):
    """nereusd's ``step`` is the last step done (``None`` during start-up); ``status`` printed
    ``step None of 20`` for the first minute of a job."""
    import launcher.status_cmd as status_cmd

    live = {"job": "j", "state": "running", "step": None, "steps": 20, "plan": {}, "pool": {}, "last_decision": None}
    monkeypatch.setattr(status_cmd, "ask_nereusd", lambda run_dir, timeout_s=5.0: dict(live))
    (tmp_path / "nereusd.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": 1}))
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no step done yet of 20 (running); plan: not formed yet" in out and "None" not in out, out
    live.update(step=4, plan={"actor/training": {"tp": 2, "pp": 1, "dp": 2}})
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "5 steps done (last: step 4) of 20 (running); plan: actor/training tp2 pp1 dp2" in out
    assert "last step" not in out, out   # nereusd has no step's metrics to give
    live["last_metrics"] = {"reward_mean": 0.25, "response_length_mean": 11.5, "response_length_max": 24,
                            "max_new_tokens": 24, "step_latency_s": 1.25}
    assert main(["status", str(tmp_path)]) == 0
    assert ("last step: reward 0.25, response length 11.5 mean, 24 longest (cap 24), 1.2 s"
            in capsys.readouterr().out)
    live["joining"] = {"devices": [4, 5], "phase": "engines", "elapsed_s": 12.4}   # nereusd.daemon.joins
    assert main(["status", str(tmp_path)]) == 0
    assert "joining in the background: devices [4, 5] (engines, 12 s so far)\n" in capsys.readouterr().out
    live["joining"]["waiting"] = [6]   # arrived while the join ran
    assert main(["status", str(tmp_path)]) == 0
    assert ("joining in the background: devices [4, 5] (engines, 12 s so far); devices [6] wait for the next join"
            in capsys.readouterr().out)


def test_a_refused_submission_leaves_no_run_directory(tmp_path, monkeypatch, capsys):
    """sbatch refusing the job (no Slurm configuration here) must not leave keys and a script
    behind that make the same command fail with 'exists and is not empty'."""
    def refuse(self, script, args=()):
        raise SlurmError("sbatch: fatal: Could not establish a configuration source", refused=True)

    monkeypatch.setattr(SlurmClient, "sbatch", refuse)
    run_dir = tmp_path / "run"
    args = ["submit", "examples/counting_grpo.yaml", "--run-dir", str(run_dir)]
    for _ in range(2):   # the second attempt fails for the same reason, not for the directory
        assert main(args) == 2
        assert "configuration source" in capsys.readouterr().err
        assert not run_dir.exists()
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("{}\n")   # an earlier run's
    assert main(args + ["--overwrite"]) == 2
    assert run_dir.is_dir() and not any(run_dir.iterdir())


def test_a_submission_that_may_have_been_queued_keeps_its_run_directory(tmp_path, monkeypatch, capsys):
    """An sbatch that timed out may have queued the job, whose #SBATCH --output is in logs/:
    its keys, script and logs stay, and the error says to check squeue."""
    def slow(self, script, args=()):
        raise SlurmError("['sbatch', '--parsable'] did not finish within 30 s")

    monkeypatch.setattr(SlurmClient, "sbatch", slow)
    run_dir = tmp_path / "run"
    assert main(["submit", "examples/counting_grpo.yaml", "--run-dir", str(run_dir)]) == 2
    assert "may have been queued: check squeue" in capsys.readouterr().err
    assert (run_dir / "nereus.sbatch").is_file() and (run_dir / "keys").is_dir() and (run_dir / "logs").is_dir()


def test_status_of_a_malformed_summary_prints_what_it_can(tmp_path, capsys):
    """A summary.json with wrong-typed or missing fields crashed ``status`` (KeyError, ValueError,
    AttributeError on a list); one that is not JSON read as "nereusd is not answering" without
    naming the file (a bad-input search, 2026-12-05)."""
    bad = [{"status": "succeeded", "reward_last_10pct": "x", "reward_first_10pct": 0.1},
           {"status": "succeeded", "reward_last_10pct": 0.5},
           {"status": "succeeded", "eval_pass_at_1_last": 0.5, "reward_best": 0.7},
           {"status": "succeeded", "reward_first_10pct": 0.1, "reward_last_10pct": 0.2,
            "response_length_last_10pct": None, "switches": None, "final_plan": [1, 2], "wall_time_s": "fast"},
           {"status": "succeeded", "final_plan": {"a": 5}, "steps_completed": float("nan")}]
    for summary in bad:
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        assert main(["status", str(tmp_path)]) == 0, summary
        out = capsys.readouterr().out
        assert "finished: succeeded" in out, (summary, out)
    (tmp_path / "summary.json").write_text(json.dumps({"status": "succeeded", "reward_first_10pct": 0.1,
                                                       "reward_last_10pct": "x"}))
    main(["status", str(tmp_path)])
    assert "reward" not in capsys.readouterr().out   # a line with a bad figure is left out
    for content in (b"[1, 2]", b"\xff\xfe\x00", b"not json", b"[" * 100000):
        (tmp_path / "summary.json").write_bytes(content)
        assert main(["status", str(tmp_path)]) == 0
        assert "summary.json: " in capsys.readouterr().out, content


def test_status_json_is_strict_json_whatever_the_summary_holds(tmp_path, capsys):
    """A summary holding NaN (Python's reader accepts it) made ``status --json`` print a bare
    ``NaN``, which strict JSON readers (jq, JavaScript) refuse (a bad-input search, 2026-12-05)."""
    (tmp_path / "summary.json").write_text('{"status": "succeeded", "reward_best": NaN, "wall_time_s": Infinity}')
    assert main(["status", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))["summary"]
    assert summary["reward_best"] == "nan" and summary["wall_time_s"] == "inf"


def test_status_names_what_it_was_given_when_it_is_no_run_directory(tmp_path, capsys):
    """``status`` on a simulation's output said "nereusd is not answering … see the logs" (there
    are none), and on a mistyped path it named a job-index file under ~/.nereus (a new-user
    trial, 2026-12-05)."""
    (tmp_path / "summary.json").write_text(json.dumps({"length_trace": "generated ramp", "summary": [{"policy": "x"}]}))
    assert main(["status", str(tmp_path)]) == 2
    assert "the output of nereus-launch simulate, not a job's run directory" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "nonexistent")]) == 2
    assert "no such run directory" in capsys.readouterr().err


@pytest.mark.parametrize("record", ['{"endpoint": 5, "pid": "x"}', "[]", '{"endpoint": "garbage", "pid": 1}',
                                    '{"endpoint": "tcp://127.0.0.1:1", "pid": true}'])
def test_status_and_pool_on_a_damaged_nereusd_record_are_one_line(tmp_path, capsys, record):
    """Each was a traceback (TypeError, ValueError, AttributeError, ZMQError; adversarial helpers,
    2026-12-05): the record is checked before a socket is made."""
    (tmp_path / "nereusd.json").write_text(record)
    for argv in (["status", str(tmp_path)], ["pool", str(tmp_path), "--remove", "1"]):
        assert main(argv) == 2
        assert "nereusd.json: not a nereusd record" in capsys.readouterr().err


def test_status_of_a_slurm_run_when_slurm_does_not_answer_reads_the_run_directory(tmp_path, capsys, monkeypatch):
    """With Slurm down or unreachable, ``status`` of an ended Slurm run printed squeue's errors
    and nothing else (a new user's trial), although its summary said how the job went. It now
    says that Slurm did not answer and reads the run directory; so does the list of jobs."""
    def unreachable(self, argv, input_text=None):
        raise SlurmError(f"{argv} failed with exit code 1: squeue: fatal: Could not establish a configuration source",
                         refused=True)

    monkeypatch.setattr(SlurmClient, "run", unreachable)
    monkeypatch.setenv("NEREUS_HOME", str(tmp_path / "home"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "slurm.json").write_text(json.dumps({"job_id": "125", "grow_job_ids": ["126"], "site": "local",
                                                    "job": "job.yaml", "nodes": 1}))
    (run_dir / "summary.json").write_text(json.dumps({"status": "succeeded", "steps_completed": 30}))
    assert main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "Slurm 125 UNKNOWN, 126 UNKNOWN" in out and "finished: succeeded after 30 steps" in out, out
    assert "Slurm did not answer" in out and "configuration source" in out
    assert main(["status", str(run_dir), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["slurm"] == {"125": "UNKNOWN", "126": "UNKNOWN"} and "configuration source" in status["slurm_error"]
    (tmp_path / "home" / "jobs").mkdir(parents=True)
    (tmp_path / "home" / "jobs" / "125.json").write_text(json.dumps({"run_dir": str(run_dir)}))
    assert main(["status"]) == 0
    assert "125 UNKNOWN" in capsys.readouterr().out


def test_grow_refuses_a_job_that_is_not_running(tmp_path, capsys, monkeypatch):
    """``grow`` submitted an allocation for a COMPLETED job; its agent waited 30 s for a nereusd
    that was gone and failed (a new user's trial). Like ``shrink``, it now refuses a job that is
    not running, and submits nothing. (tests/e2e/test_slurm.py checks it on a real cluster.)"""
    submitted = []
    monkeypatch.setattr(SlurmClient, "run", lambda self, argv, input_text=None: "121|COMPLETED|1|nrs1|nrs1|None\n")
    monkeypatch.setattr(SlurmClient, "sbatch", lambda self, script, args=(): submitted.append(script) or "122")
    monkeypatch.setenv("NEREUS_HOME", str(tmp_path / "home"))
    record = {"job_id": "121", "grow_job_ids": [], "site": "local", "job": "examples/counting_grpo.yaml", "nodes": 1}
    (tmp_path / "slurm.json").write_text(json.dumps(record))
    (tmp_path / "nereusd.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": 1}))
    assert main(["grow", str(tmp_path), "--nodes", "1"]) == 2
    assert "job 121 is COMPLETED; only a running job grows" in capsys.readouterr().err
    assert not submitted and json.loads((tmp_path / "slurm.json").read_text()) == record


@pytest.mark.parametrize("command", ["status", "report", "resume", "pool"])
def test_a_mistyped_run_directory_reads_the_same_in_every_command(tmp_path, capsys, command):
    """``resume`` said "not a run directory (no events.jsonl)", ``report`` "no such directory" and
    ``status`` "no such run directory (a Slurm job id is a number)", ``pool`` "no running nereusd
    ([Errno 2] …)" for one missing path (new users' trials, 2026-12-07)."""
    extra = ["--remove", "1"] if command == "pool" else []
    missing = tmp_path / "runs" / "typo"
    assert main([command, str(missing), *extra]) == 2
    assert f"{missing}: no such run directory" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main([command, str(tmp_path / "afile"), *extra]) == 2
    assert "not a run directory (a file)" in capsys.readouterr().err


def test_status_of_a_resumed_or_unfinished_job_gives_the_jobs_time_and_how_to_resume(tmp_path, capsys):
    """``status`` of a resumed run said ``succeeded after 30 steps in 60 s``, the last nereusd's
    time, where the launcher said the job's; of an interrupted one it did not say how to go on (a
    new user's trial, 2026-12-07)."""
    (tmp_path / "nereusd.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": 1}))
    summary = {"status": "succeeded", "steps_completed": 30, "wall_time_s": 60.2, "resumes": 1,
               "job_run_time_s": 91.4, "job_wall_time_s": 99.0}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "finished: succeeded after 30 steps in 91 s over 2 nereusds (the last 60 s; 99 s since the first " \
           "started)" in out and "nereus-launch resume" not in out, out
    (tmp_path / "summary.json").write_text(json.dumps({"status": "interrupted", "steps_completed": 7,
                                                       "error": "Ctrl-C (nereus-launch stopped nereusd with SIGTERM)"}))
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "finished: interrupted after 7 steps: Ctrl-C" in out, out
    assert out.endswith(f"`nereus-launch resume {tmp_path.resolve()}` starts it again at step 0 (no checkpoint yet)\n"), out
    (tmp_path / "checkpoints" / "step000004").mkdir(parents=True)
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "checkpoint", "step": 4,
                                                       "dir": "/elsewhere/checkpoints/step000004"}) + "\n")
    main(["status", str(tmp_path)])
    assert f"resume {tmp_path.resolve()}` continues it at step 4, its latest checkpoint's\n" in capsys.readouterr().out


def test_cancel_of_a_job_that_has_ended_says_so_and_cancels_nothing(tmp_path, capsys, monkeypatch):
    """``cancel`` printed "cancelled job 192" for a job that had ended (NODE_FAIL), twice in a
    row (an adversarial trial on Slurm, 2026-12-07)."""
    cancelled = []
    states = {"121": "NODE_FAIL", "130": "PENDING"}
    monkeypatch.setattr(SlurmClient, "run", lambda self, argv, input_text=None: "".join(
        f"{j}|{states[j]}|1|nrs1|nrs1|None\n" for j in argv if j in states))
    monkeypatch.setattr(SlurmClient, "cancel", lambda self, job_id: cancelled.append(job_id))
    monkeypatch.setenv("NEREUS_HOME", str(tmp_path / "home"))
    record = {"job_id": "121", "grow_job_ids": ["130"], "site": "local", "job": "examples/counting_grpo.yaml", "nodes": 1}
    (tmp_path / "slurm.json").write_text(json.dumps(record))
    assert main(["cancel", str(tmp_path)]) == 0
    assert cancelled == ["130"] and "nereus: cancelled grow allocations ['130']" in capsys.readouterr().out
    states["130"] = "CANCELLED"
    assert main(["cancel", str(tmp_path)]) == 0
    assert cancelled == ["130"] and "job 121 has already ended (NODE_FAIL); nothing to cancel" in capsys.readouterr().out


def test_a_preemption_warning_at_the_start_of_the_time_limit_is_refused(tmp_path, capsys):
    """``preempt_signal_s: 1795`` with a 30-minute limit made a job checkpoint and stop 19 s in,
    and 999999 passed every check until sbatch refused it (an adversarial trial on Slurm,
    2026-12-07). The local site warns 60 s before its 30 minutes; ``--time 1`` is one minute."""
    job = "examples/counting_grpo.yaml"
    assert main(["render", job, "--site", "local", "--time", "1", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--time 1 with site 'local''s slurm.preempt_signal_s: the preemption warning 60 s before the end of a 1 " \
           "time limit (60 s) comes in its first half" in err, err
    assert main(["render", job, "--site", "local", "--time", "2", "--run-dir", str(tmp_path / "run")]) == 0


def test_a_grow_allocation_is_known_by_its_id_and_a_pending_job_says_why(tmp_path, capsys, monkeypatch):
    """``status 194`` (a grow allocation) was "not a job id submitted from here", and a job
    submitted with more nodes than the partition has read ``PENDING`` with no reason (an
    adversarial trial on Slurm, 2026-12-07)."""
    squeue = {"121": "121|RUNNING|1|nrs1|nrs1|None\n", "122": "122|PENDING|1|None||PartitionNodeLimit\n"}
    monkeypatch.setattr(SlurmClient, "run", lambda self, argv, input_text=None: "".join(
        squeue[j] for j in argv if j in squeue))
    monkeypatch.setattr(SlurmClient, "sbatch", lambda self, script, args=(): "122")
    monkeypatch.setenv("NEREUS_HOME", str(tmp_path / "home"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {"job_id": "121", "grow_job_ids": [], "site": "local", "job": "examples/counting_grpo.yaml", "nodes": 1}
    (run_dir / "slurm.json").write_text(json.dumps(record))
    (tmp_path / "home" / "jobs").mkdir(parents=True)
    (tmp_path / "home" / "jobs" / "121.json").write_text(json.dumps({"run_dir": str(run_dir)}))
    (run_dir / "nereusd.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": 1}))
    (run_dir / "summary.json").write_text(json.dumps({"status": "succeeded"}))
    assert main(["grow", "121", "--nodes", "1"]) == 0
    capsys.readouterr()
    assert main(["status", "122"]) == 0
    assert f"run {run_dir}: Slurm 121 RUNNING, 122 PENDING (PartitionNodeLimit)" in capsys.readouterr().out
    assert main(["status"]) == 0
    listed = capsys.readouterr().out
    assert "121" in listed and "122" not in listed, listed   # the grow allocation is its job's



def test_status_of_a_crashed_run_names_the_step_its_kept_workers_continue_at(tmp_path, capsys):
    """After ``kill -9`` of nereusd at step 23, ``status`` named only the checkpoint's step 20,
    where a resume within the grace continued at 23 on the kept workers (an adversarial trial)."""
    (tmp_path / "nereusd.json").write_text(json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": 1}))
    (tmp_path / "summary.json").write_text(json.dumps({"status": "crashed", "steps_completed": 23}))
    assert main(["status", str(tmp_path)]) == 0
    assert ("within the site's liveness.resume_grace_s of the crash, at step 23 on the workers kept in memory"
            in capsys.readouterr().out)
