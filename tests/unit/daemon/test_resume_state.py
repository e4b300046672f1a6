"""Which controller state a resumed nereusd takes (``Daemon._resumed_controller``): all of it or
none. The checkpoint event's state is taken when the job file is the one it was journalled under,
the plan's devices are the job's and the plan fits the responses seen; otherwise the job plans as
a new one would, and ``events.jsonl`` says why."""

from __future__ import annotations

from types import SimpleNamespace

from nereusd.config.resolve import load_and_resolve
from nereusd.config.site import load_site
from nereusd.control.jobs import controller_for_job, job_fingerprint
from nereusd.daemon.app import Daemon
from nereusd.journal import Journal, read_jsonl
from nereusd.plan import Candidate, Plan
from tests.support import REPO, demo_job

PROMPT = 5


def _record(controller, job, **changes) -> dict:
    return {"dir": "/x", "step": 4, "sample_position": 32, "job_sha256": job_fingerprint(job),
            "controller": {**controller.state(), **changes}}


def _resumed(tmp_path, job, record):
    journal = Journal(tmp_path / "run")
    daemon = SimpleNamespace(job=job, site=load_site(job.config.site), journal=journal)
    controller = Daemon._resumed_controller(daemon, record, SimpleNamespace(prompt_length=PROMPT))
    journal.close()
    launches = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "launch_plan"]
    return controller, launches[-1]


def test_the_checkpoints_state_is_taken_whole_or_not_at_all(tmp_path):
    job = demo_job(curriculum=False)
    site = load_site(job.config.site)
    saved = controller_for_job(job, site, job.plan, PROMPT)
    saved.length = 16   # short responses seen: the launch plan fits
    saved.calibration.observe("gemm", 1.0, 4.0)

    controller, launch = _resumed(tmp_path / "a", job, _record(saved, job))
    assert controller is not None and controller.plan == job.plan and launch["plan"] == job.plan.to_dict()
    assert controller.calibration.snapshot() == saved.calibration.snapshot() and controller.length == 16

    other = _record(saved, job)
    other["job_sha256"] = "0" * 64   # RUN_DIR/job.yaml edited since
    controller, launch = _resumed(tmp_path / "b", job, other)
    assert controller is None and launch["plan"] is None and "job file differs" in launch["source"]

    wide = Plan({ms: Candidate(c.tp, c.pp, c.dp, tuple(d + 4 for d in c.devices), c.micro_batch)
                 for ms, c in job.plan.items()})
    controller, launch = _resumed(tmp_path / "c", job, _record(saved, job, plan=wide.to_dict()))
    assert controller is None and "beyond the job's 4" in launch["source"]

    # the demo's launch plan cannot hold its longest responses (README): a restart's checkpoint
    # may carry such a plan; it is not resumed into
    controller, launch = _resumed(tmp_path / "d", job, _record(saved, job, length=job.config.rollout.max_new_tokens))
    assert controller is None and "over the usable device memory" in launch["source"]

    # under the demo's curriculum, the plan is checked at the responses the resumed step may
    # generate, as the boundary before it would: a checkpoint after a step cut at 24 tokens, at
    # the step whose cap is 48, holds the launch plan that does not fit 48 (it was checked at the
    # checkpoint's own length, which fits)
    staged = demo_job()
    seen = controller_for_job(staged, load_site(staged.config.site), staged.plan, PROMPT)
    seen.length = 24
    controller, launch = _resumed(tmp_path / "d48", staged, {**_record(seen, staged), "step": 10})
    assert controller is None and "over the usable device memory at 48-token responses" in launch["source"]
    controller, launch = _resumed(tmp_path / "d24", staged, {**_record(seen, staged), "step": 5})
    assert controller is not None and launch["plan"] == staged.plan.to_dict()

    controller, launch = _resumed(tmp_path / "e", job, _record(saved, job, monitor="garbage"))
    assert controller is None and "malformed" in launch["source"]


def test_a_state_that_restore_once_took_and_then_crashed_on_is_refused_whole(tmp_path):
    """A bad-input search (2026-12-05) found states ``restore`` accepted that then crashed the
    resumed nereusd (an ``OverflowError`` its fallback did not catch) or silently changed what the
    controller does (a nan memory ratio hid the largest one from ``max``; a nan threshold never
    fired; ``bool("false")`` is True). Each is now refused as malformed, and the job plans as a
    new one would."""
    job = load_and_resolve(REPO / "examples" / "counting_grpo.yaml")
    saved = controller_for_job(job, load_site(job.config.site), job.plan, PROMPT)
    saved.length = 16
    good = saved.state()
    monitor = {**good["monitor"], "deltas": {**good["monitor"]["deltas"], "sequence_length": float("nan")}}
    bad = [dict(length=10 ** 400), dict(length=0), dict(lengths={**good["lengths"], "window": [10 ** 400]}),
           dict(lengths={**good["lengths"], "window": "999"}), dict(memory_ratios=[float("nan"), 2.0]),
           dict(efficiency=-1.0), dict(predicted_step_s=float("inf")), dict(relaunch="false"),
           dict(replay=[1_000_000, 1_000_000_000]), dict(transition_overhead_s=float("nan")),
           dict(version=2.0), dict(monitor=monitor)]
    for k, changes in enumerate(bad):
        controller, launch = _resumed(tmp_path / str(k), job, _record(saved, job, **changes))
        assert controller is None, changes
        assert "not used" in launch["source"], (changes, launch["source"])
    controller, _ = _resumed(tmp_path / "good", job, _record(saved, job))
    assert controller is not None


def test_nereusd_resumed_says_whether_the_state_was_restored(tmp_path):
    """``controller_state`` was true whenever the checkpoint carried a state, even one refused."""
    journal = Journal(tmp_path / "run")
    daemon = SimpleNamespace(journal=journal, run_dir=tmp_path / "run")
    record = {"dir": "/x", "step": 4, "controller": {"version": 1}}
    Daemon._journal_resume(daemon, record, None, restored=False)
    Daemon._journal_resume(daemon, record, None, restored=True)
    journal.close()
    resumed = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "nereusd_resumed"]
    assert [e["controller_state"] for e in resumed] == [False, True]


def test_a_resumed_jobs_run_time_leaves_out_the_time_between_a_crash_and_its_resume(tmp_path):
    """``job_wall_time_s`` is since the first nereusd started (1,333 s for ~15 s of work after a
    resume the next day, an adversarial trial); ``earlier_run_s`` adds up each earlier nereusd's
    own time, its start to its last event, as ``job_run_time_s`` does with the latest's."""
    import json

    from nereusd.daemon.app import earlier_attempts

    events = [{"event": "nereusd_started", "time_s": 100.0}, {"event": "checkpoint", "time_s": 110.0},
              {"event": "transition", "time_s": 111.0, "from_plan": {"a": 1}, "to_plan": {"a": 1}},   # a rebuild
              {"event": "transition", "time_s": 112.0, "from_plan": {"a": 1}, "to_plan": {"a": 2}},   # killed here
              {"event": "nereusd_started", "time_s": 1400.0}, {"event": "nereusd_resumed", "mode": "checkpoint",
                                                               "dropped_metrics": [4], "time_s": 1401.0}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    out = earlier_attempts(tmp_path)
    assert out["started_s"] == 100.0 and out["earlier_run_s"] == 12.0
    assert (out["resumes"], out["restarts"], out["lost_steps"], out["switches"]) == (1, 1, 1, 1)


def test_a_resume_that_re_runs_nothing_from_the_initial_weights_is_no_restart(tmp_path):
    """A job interrupted before its first step finished, then resumed, read ``checkpoint
    restarts: 1, 0 step(s) re-run`` (a new user's trial, 2026-12-07): it loaded nothing and re-ran
    nothing. One from the initial weights that re-runs steps is a restart, as is one from a
    checkpoint that re-runs none."""
    import json

    from nereusd.daemon.app import earlier_attempts

    def resumed(checkpoint, dropped, loaded=None):
        events = [{"event": "nereusd_started", "time_s": 1.0},
                  {"event": "nereusd_started", "time_s": 9.0},
                  {"event": "nereusd_resumed", "mode": "checkpoint", "checkpoint": checkpoint,
                   "dropped_metrics": dropped, "time_s": 9.5}]
        if loaded is not None:
            events.append({"event": "checkpoint_loaded", "dir": checkpoint, "dropped_metrics": loaded})
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        out = earlier_attempts(tmp_path)
        return out["resumes"], out["restarts"], out["lost_steps"]

    assert resumed(None, []) == (1, 0, 0)
    assert resumed(None, [0, 1]) == (1, 1, 2)
    assert resumed("/run/checkpoints/step000004", [], loaded=[]) == (1, 1, 0)
    # interrupted before its checkpoint loaded: nothing re-ran (it was counted, and the next
    # resume's re-run steps twice: an adversarial trial, 2026-12-07)
    assert resumed("/run/checkpoints/step000004", [4, 5]) == (1, 0, 0)
    # fell back to an older checkpoint: the steps that loaded one dropped
    assert resumed("/run/checkpoints/step000004", [4, 5], loaded=[2, 3, 4, 5]) == (1, 1, 4)


def test_a_job_resumed_at_a_forced_step_starts_on_the_forced_layout(tmp_path):
    """A nereusd lost while it restarted the job into the layout ``adaptation.forced`` sets for
    step 4 resumed from the checkpoint written before that restart (step 4, the old plan), and
    ran on the old plan: the boundary that applies an entry runs before the entry's step, and
    none runs before a resumed job's first step. It now starts on the forced layout, which its
    controller (and the ``frozen`` policy's launch plan) takes; one it cannot run is not used,
    and ``events.jsonl`` says why."""
    import dataclasses

    from nereusd.config.job import ForcedSwitchConfig, StagePlanConfig
    from nereusd.control.jobs import forced_plan
    from nereusd.control.policy import PolicyKind
    from nereusd.plan import ModelStage

    demo = load_and_resolve(REPO / "examples" / "counting_grpo.yaml")
    entries = [ForcedSwitchConfig(at_step=4, model_stages={"actor/training": StagePlanConfig(tp=1, pp=2)}),
               ForcedSwitchConfig(at_step=5, model_stages={"actor/training": StagePlanConfig(tp=1, pp=1)}),
               ForcedSwitchConfig(at_step=6, model_stages={"actor/training": StagePlanConfig(devices=[0, 1, 2, 5])}),
               ForcedSwitchConfig(at_step=10, model_stages={"actor/training": StagePlanConfig(tp=4)}),
               ForcedSwitchConfig(at_step=12, model_stages={"actor/inference": StagePlanConfig(micro_batch=8)})]
    config = demo.config.model_copy(update={"adaptation": demo.config.adaptation.model_copy(update={"forced": entries})})
    job = dataclasses.replace(demo, config=config)
    site = load_site(job.config.site)
    saved = controller_for_job(job, site, job.plan, PROMPT)
    saved.length = 16
    world = [0, 1, 2, 3]

    def resume(name, step, resumed):
        journal = Journal(tmp_path / name)
        daemon = SimpleNamespace(job=job, site=site, journal=journal)
        plan = Daemon._forced_at_resume(daemon, step, job.plan, resumed, SimpleNamespace(prompt_length=PROMPT), world)
        journal.close()
        return plan, [e["source"] for e in read_jsonl(tmp_path / name / "events.jsonl") if e["event"] == "launch_plan"]

    forced = forced_plan(job, job.plan, {"actor/training": StagePlanConfig(tp=1, pp=2)})
    assert forced != job.plan
    controller, _ = _resumed(tmp_path / "a", job, _record(saved, job))
    controller.policy = dataclasses.replace(controller.policy, kind=PolicyKind.FROZEN)
    plan, sources = resume("b", 4, controller)
    assert plan == forced and controller.plan == forced and controller.base_plan == forced
    assert sources == ["resumed: the layout adaptation.forced sets for step 4"]
    # the checkpoint's controller state not used: the job's new controller is built on the plan
    assert resume("c", 4, None) == (forced, sources)
    # no entry for the step: the plan as it was, nothing said
    assert resume("d", 7, None) == (job.plan, [])
    # an entry on a device outside the world is not used
    plan, sources = resume("e", 6, None)
    assert plan == job.plan and len(sources) == 1
    assert "not used (it uses devices [5], which are not in the pool [0, 1, 2, 3])" in sources[0]
    assert plan[ModelStage.parse("actor/training")].devices == (0, 1, 2, 3)
    # a layout over memory is not used: for the resumed controller at the responses it had seen
    # (step 5 under the 24-token cap: training at DP 4 keeps the whole model on every device)
    controller, _ = _resumed(tmp_path / "f", job, {**_record(saved, job), "step": 5})
    plan, sources = resume("g", 5, controller)
    assert plan == job.plan and controller.plan == job.plan
    assert "not used (it is predicted over the usable device memory at" in sources[0]
    # ... and for a job planned afresh at the responses its launch plan is for: step 10's cap of
    # 48 tokens, which TP 4 training holds (47.5 MB) and micro-batches of 8 at TP 2 do not
    tp4 = forced_plan(job, job.plan, {"actor/training": StagePlanConfig(tp=4)})
    assert resume("h", 10, None) == (tp4, ["resumed: the layout adaptation.forced sets for step 10"])
    plan, sources = resume("i", 12, None)
    assert plan == job.plan and "over the usable device memory at 48-token responses" in sources[0]


def test_a_summary_the_launcher_writes_for_a_dead_nereusd_keeps_the_jobs_figures(tmp_path):
    """``kill -9`` of nereusd, or a resume's Ctrl-C before nereusd's handlers: the summary the
    launcher wrote had only the outcome, and ``status`` lost the job's switches, restarts and
    rewards (a resume had set the job's summary aside: an adversarial trial, 2026-12-07)."""
    import json

    from nereusd.summary import crash_summary

    events = [{"event": "nereusd_started", "time_s": 1.0},
              {"event": "transition", "step": 1, "from_plan": {"a": 1}, "to_plan": {"a": 2}},
              {"event": "nereusd_started", "time_s": 9.0},
              {"event": "nereusd_resumed", "mode": "checkpoint", "checkpoint": "/r/checkpoints/step000002",
               "dropped_metrics": [2]},
              {"event": "checkpoint_loaded", "dir": "/r/checkpoints/step000002", "dropped_metrics": [2]},
              {"event": "transition", "step": 3, "from_plan": {"a": 2}, "to_plan": {"a": 3}}]   # killed after it
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    row = {"reward_mean": 1.0, "response_length_mean": 4.0, "step_latency_s": 1.0, "plan": {"a": 3}}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({**row, "step": s}) + "\n" for s in range(4)))
    summary = crash_summary(tmp_path, -9, write=False)
    assert summary["status"] == "crashed" and summary["steps_completed"] == 4
    assert (summary["switches"], summary["restarts"], summary["lost_steps"], summary["resumes"]) == (2, 1, 1, 1)
    assert summary["reward_last_10pct"] == 1.0 and summary["final_plan"] == {"a": 3}
