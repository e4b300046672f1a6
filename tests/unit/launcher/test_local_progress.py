"""The progress bar of ``nereus-launch local`` (:class:`launcher.progress.Progress`), its signal
handling, and the checks of the devices it runs on (:mod:`launcher.local_devices`)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import tqdm.std

from launcher import local
from launcher.local import _raise_terminated, _Terminated
from launcher.local_devices import site_mismatch
from launcher.progress import Progress, switches_text


def test_the_progress_bar_shows_each_steps_response_cap(tmp_path):
    """Under a length curriculum the mean length alone does not say whether responses are being
    cut: the bar shows it against the step's cap (``max_new_tokens`` of its metrics line); a line
    without one (written before the field existed) shows the mean alone."""
    line = {"step": 0, "reward_mean": 0.5, "response_length_mean": 5.5, "step_latency_s": 1.0, "plan": {}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(line) + "\n")
    (tmp_path / "events.jsonl").write_text("")
    bar = Progress(total=4, quiet=True)
    bar.update(tmp_path)
    assert "len 5.5 step 1.0s" in bar.bar.postfix, bar.bar.postfix
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps(line | {"step": 1, "max_new_tokens": 24}) + "\n")
    bar.update(tmp_path)
    assert "len 5.5/24 step 1.0s" in bar.bar.postfix, bar.bar.postfix
    bar.close()


def test_a_sigterm_while_the_progress_bar_starts_is_not_swallowed(tmp_path, monkeypatch):
    """tqdm's constructor catches ``Exception`` around the start of its monitor thread. A SIGTERM
    that came just then was swallowed when the launcher's signal exception was an ``Exception``,
    and the job ran to ``succeeded`` (a CI failure of the SIGTERM e2e test); it must reach
    :func:`launcher.local.supervise`'s handler."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"step": 0, "reward_mean": 0.5, "response_length_mean": 5.5, "step_latency_s": 1.0, "plan": {}}) + "\n")
    (tmp_path / "events.jsonl").write_text("")

    def monitor_start(*_args):
        os.kill(os.getpid(), signal.SIGTERM)   # delivered to this (the main) thread at once
        raise AssertionError("the signal's exception should have come first")

    monkeypatch.setattr(tqdm.std, "TMonitor", monitor_start)
    monkeypatch.setattr(tqdm.std.tqdm, "monitor", None)
    monkeypatch.setattr(tqdm.std.tqdm, "monitor_interval", 10)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with pytest.raises(_Terminated, match="SIGTERM"):
            Progress(total=4, quiet=True).update(tmp_path)
    finally:
        signal.signal(signal.SIGTERM, previous)
        local._STOP.taken()


def test_a_sigterm_whose_exception_was_dropped_still_stops_the_supervising_loop():
    """An exception raised while a C extension's destructor runs is printed as "Exception
    ignored" and dropped (nereusd lost a SIGTERM so inside pyzmq, 2026-12-06): the launcher's
    loop also checks the signal its handler recorded."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except _Terminated:
            pass   # dropped, as a destructor would
        with pytest.raises(_Terminated, match="SIGTERM"):
            local._STOP.raise_pending()
    finally:
        signal.signal(signal.SIGTERM, previous)
        local._STOP.taken()
    local._STOP.raise_pending()   # nothing pending


def test_a_gpu_site_run_locally_on_cpu_devices_is_warned_about():
    """``site: h200-ib`` with ``local`` (no ``--gpus``) gave virtual CPU devices 141 GiB each
    without a word (an adversarial trial, 2026-12-06)."""
    from nereusd.config.site import load_site

    h200 = load_site("h200-ib")
    warning = site_mismatch(h200, gpus=False)
    assert warning.startswith("site 'h200-ib' describes cuda devices of") and "without --gpus" in warning
    assert site_mismatch(h200, gpus=True) is None
    assert site_mismatch(load_site("local"), gpus=False) is None


def test_a_stop_signal_during_a_process_start_waits_until_its_handle_is_kept():
    """A Ctrl-C that lands while ``subprocess.Popen`` returns (the child already running) must
    not lose the handle the teardown stops it by: inside ``_DeferredStop`` the signal is held,
    the assignment completes, and on leaving the block it acts as it would have —
    ``KeyboardInterrupt`` for SIGINT, ``_Terminated`` for SIGTERM under the launcher's handler,
    nothing where it is ignored. The previous handlers are back afterwards."""
    import os
    import signal

    from launcher import local

    # Python leaves SIGINT ignored when it starts ignored (a suite run in the background): set it
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = signal.signal(signal.SIGTERM, local._raise_terminated)
    try:
        handle = None
        with pytest.raises(KeyboardInterrupt):
            with local._DeferredStop():
                os.kill(os.getpid(), signal.SIGINT)
                handle = "started"
        assert handle == "started"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        handle = None
        with pytest.raises(local._Terminated):
            with local._DeferredStop():
                os.kill(os.getpid(), signal.SIGTERM)
                handle = "started"
        assert handle == "started"
        local._STOP.taken()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with local._DeferredStop():   # ignored before: ignored after
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def test_a_failed_jobs_last_line_says_how_far_it_got(tmp_path, capsys):
    """``nereus: failed: train failed on device 0: out of memory …`` did not say at which step (a
    new user's trial of the demo without adaptation, 2026-12-07): the failure line now says how
    many steps were done, as the crash line does."""
    import json

    from launcher.local import _report

    summary = {"status": "failed", "error": "train failed on device 0: out of memory", "steps_completed": 20}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert _report(tmp_path, interrupted=None) == 1
    assert "nereus: failed after 20 step(s): train failed on device 0: out of memory" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "steps_completed": 0, "error": "no plan fits"}))
    _report(tmp_path, interrupted=None)
    assert "nereus: failed: no plan fits" in capsys.readouterr().err   # before any step: as before


def test_gpus_on_a_node_without_one_is_refused_before_anything_starts(tmp_path, capsys):
    """``local --gpus`` here started nereusd and the agent, whose probe then failed (a new user's
    trial); the launcher probes first, as the agent does, and leaves no run directory."""
    from emu.inventory import probe_amd, probe_nvidia
    from launcher.cli import main

    if probe_nvidia() or probe_amd():
        pytest.skip("this node has a GPU")
    run_dir = tmp_path / "run"
    assert main(["local", "examples/counting_grpo.yaml", "--gpus", "--run-dir", str(run_dir), "--quiet"]) == 2
    assert "--gpus: no NVIDIA or AMD GPU found on this node" in capsys.readouterr().err
    assert not run_dir.exists()


def test_a_resume_from_a_checkpoint_is_a_restart_and_not_one_of_the_layout_switches():
    """A job resumed from a checkpoint (``restarts`` counts it; ``switches`` does not) read
    ``layout switches: 2 (of which 1 checkpoint/restart(s), …)`` where both switches were
    transitions (a resumed demo, 2026-12-07). The restarts are said beside the switches."""
    resumed = {"switches": 2, "restarts": 1, "lost_steps": 0, "resumes": 1}
    assert switches_text(resumed) == "layout switches: 2; checkpoint restarts: 1, 0 step(s) re-run"
    assert switches_text({"switches": 0}) == "layout switches: 0"
    assert switches_text({"switches": float("nan"), "restarts": "1"}) == "layout switches: 0"


def test_a_resumes_bar_goes_back_to_its_checkpoint_and_counts_only_switches_that_ran(tmp_path, capsys):
    """A resumed demo's bar started at the 7 steps done, counted on while the steps after the
    checkpoint ran again, and ended at ``32step``; it printed and counted an admitted switch of
    the interrupted attempt that never ran (a new user's trial, 2026-12-07)."""
    def line(step):
        return json.dumps({"step": step, "reward_mean": 0.5, "response_length_mean": 5.0, "step_latency_s": 1.0,
                           "plan": {}}) + "\n"

    metrics, events = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"
    metrics.write_text("".join(line(s) for s in range(7)))
    moved = {"from_plan": {"a": 1}, "to_plan": {"a": 2}}
    earlier = [{"event": "transition", "step": 2, **moved},
               {"event": "transition", "step": 3, "from_plan": {"a": 2}, "to_plan": {"a": 2}},   # a rebuild
               {"event": "admission", "step": 6, "verdict": "admit", "triggers": [], "target_plan": {}}]
    events.write_text("".join(json.dumps(e) + "\n" for e in earlier))
    bar = Progress(total=10, quiet=False, run_dir=tmp_path)
    assert (bar.seen, bar.switches) == (7, 1)   # the admission at step 6 never ran; the rebuild kept the plan
    with open(events, "a") as fh:
        fh.write(json.dumps({"event": "build"}) + "\n")
    bar.update(tmp_path)
    assert bar.bar.n == 7 and "switch admitted" not in capsys.readouterr().out   # not printed again
    metrics.write_text("".join(line(s) for s in range(4)))   # checkpoint step000004 loaded
    bar.update(tmp_path)
    assert bar.bar.n == 4
    with open(metrics, "a") as fh:
        fh.writelines(line(s) for s in range(4, 10))
    with open(events, "a") as fh:
        fh.write(json.dumps({"event": "transition", "step": 6, **moved}) + "\n")
    bar.update(tmp_path)
    assert bar.bar.n == 10 and bar.switches == 2
    bar.close()


def test_ctrl_c_reads_as_ctrl_c_and_says_how_to_resume(tmp_path, capsys):
    """After Ctrl-C the launcher said ``interrupted: nereusd received SIGTERM`` (it forwards the
    user's SIGINT as SIGTERM) and not how to go on (a new user's trial, 2026-12-07)."""
    from launcher.local import _report

    (tmp_path / "summary.json").write_text(json.dumps({"status": "interrupted", "steps_completed": 7,
                                                       "error": "nereusd received SIGTERM"}))
    assert _report(tmp_path, interrupted="Ctrl-C") == 130
    err = capsys.readouterr().err
    assert "nereus: interrupted after 7 step(s): Ctrl-C (nereus-launch stopped nereusd with SIGTERM)" in err, err
    assert f"`nereus-launch resume {tmp_path}` starts it again at step 0 (no checkpoint yet)" in err, err
    assert json.loads((tmp_path / "summary.json").read_text())["error"].startswith("Ctrl-C (")
    # a job stopped by another's signal (a Slurm scancel: nereusd's own SIGTERM) keeps nereusd's words
    (tmp_path / "summary.json").write_text(json.dumps({"status": "interrupted", "error": "nereusd received SIGTERM"}))
    assert _report(tmp_path, interrupted=None) == 130
    assert "nereus: interrupted: nereusd received SIGTERM" in capsys.readouterr().err


def test_a_resume_prints_the_plan_it_starts_on():
    """``resume`` did not print the launch plan ``local`` prints when it plans afresh (a new
    user's trial, 2026-12-07): the plan a resume starts on, from its checkpoint or on the kept
    workers, is printed as nereusd journals it; the job file's own plan is the launcher's line."""
    from launcher.progress import describe_event

    plan = {"actor/training": {"tp": 1, "pp": 2, "dp": 1, "devices": [0, 1]}}
    line = describe_event({"event": "launch_plan", "plan": plan, "source": "resumed: the plan of the checkpoint"})
    assert line.startswith("nereus: launch plan (resumed: the plan of the checkpoint): actor/training ") \
        and "pp2" in line, line
    assert describe_event({"event": "launch_plan", "plan": plan, "source": "planner"}).startswith(
        "nereus: planner's launch plan: actor/training")
    assert describe_event({"event": "launch_plan", "plan": plan, "source": "the job's plan"}) is None
    assert describe_event({"event": "launch_plan", "plan": None, "source": "resumed: x; planning as a new job"}) \
        == "nereus: launch plan: resumed: x; planning as a new job"
    kept = describe_event({"event": "workers_kept", "kept": True, "step": 7, "plan": plan})
    assert kept.startswith("nereus: continuing at step 7 on the workers kept in memory: actor/training"), kept
    assert describe_event({"event": "workers_kept", "kept": False, "reason": "x"}) is None


def test_a_resumes_bar_starts_at_its_checkpoint_and_says_where_it_resumes(tmp_path, capsys):
    """A bar that started at the 13 rows of ``metrics.jsonl`` went back to the checkpoint's 10 at
    ``-11.82step/s``, and nothing said where the resume started (a new user's trial, 2026-12-07)."""
    def line(step, latency_s=1.0):
        return json.dumps({"step": step, "reward_mean": 0.5, "response_length_mean": 5.0,
                           "step_latency_s": latency_s, "plan": {}}) + "\n"

    metrics, events = tmp_path / "metrics.jsonl", tmp_path / "events.jsonl"
    metrics.write_text("".join(line(s) for s in range(13)))
    events.write_text(json.dumps({"event": "nereusd_started"}) + "\n")
    bar = Progress(total=30, quiet=False, run_dir=tmp_path)
    with open(events, "a") as fh:
        fh.write(json.dumps({"event": "nereusd_resumed", "mode": "checkpoint", "step": 10,
                             "checkpoint": "/r/checkpoints/step000010", "dropped_metrics": [10, 11, 12]}) + "\n")
        fh.write(json.dumps({"event": "build"}) + "\n")
    bar.update(tmp_path)
    assert bar.bar.n == 10 and bar.bar.initial == 10
    assert "nereus: resuming at step 10 from checkpoint step000010 (steps 10–12 run again)" in capsys.readouterr().out
    bar.update(tmp_path)   # the checkpoint has not loaded yet: its later rows are still there
    assert bar.bar.n == 10
    # loaded, and step 10 ran again between two reads, back to as many rows as the old 13
    metrics.write_text("".join(line(s) for s in range(10)) + "".join(line(s, 0.9) for s in range(10, 13)))
    bar.update(tmp_path)
    assert bar.bar.n == 13 and bar.rewind_to is None
    bar.close()
    from launcher.progress import describe_event

    assert describe_event({"event": "nereusd_resumed", "mode": "checkpoint", "step": 0, "checkpoint": None,
                           "dropped_metrics": []}) == "nereus: resuming at step 0 from the initial weights (no step runs again)"
