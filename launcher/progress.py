"""What ``nereus-launch local`` prints while a job runs: a progress bar fed from
``metrics.jsonl``, and a line for each admitted switch, fallback and pool change of
``events.jsonl``; and how a run's outcome reads (``local``'s last lines, ``status``): its
switches and restarts, a resumed job's time, how to resume it."""

from __future__ import annotations

import math
from pathlib import Path

from nereusd.errors import NereusError
from nereusd.journal import EVENTS_FILE, JOB_PLAN_SOURCE, METRICS_FILE, Event, read_jsonl, switch_kind
from nereusd.plan import Candidate


def finite_number(value: object) -> bool:
    """Whether a ``summary.json`` figure is a finite number (not a bool, not ``"nan"``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def switches_text(summary: dict) -> str:
    """``layout switches: N`` and, where the job had any, its checkpoint restarts and the steps
    they re-ran, from ``summary.json`` (``switches`` counts transitions and in-run restarts;
    ``restarts`` also counts resumes from a checkpoint, which switch no layout: so the restarts
    are not said to be "of" the switches). A figure that is not a finite number reads 0."""
    def count(key: str) -> int:
        return int(summary[key]) if finite_number(summary.get(key)) else 0

    restarts = count("restarts")
    return f"layout switches: {count('switches')}" + (
        f"; checkpoint restarts: {restarts}, {count('lost_steps')} step(s) re-run" if restarts else "")


def duration_text(summary: dict) -> str:
    """`` in W s`` (``wall_time_s``); for a resumed job (``resumes``, ``job_run_time_s``,
    ``job_wall_time_s``) `` in R s over N nereusds (the last W s; T s since the first
    started)``: ``succeeded: 30 steps in 72 s`` after a resume read as if 72 s ran all 30 (a new
    user's trial, 2026-12-07). ``""`` without a finite ``wall_time_s``."""
    wall = summary.get("wall_time_s")
    if not finite_number(wall):
        return ""
    resumes, since, running = (summary.get(k) for k in ("resumes", "job_wall_time_s", "job_run_time_s"))
    if not (finite_number(resumes) and resumes > 0 and finite_number(since) and finite_number(running)):
        return f" in {wall:.0f} s"
    return (f" in {running:.0f} s over {int(resumes) + 1} nereusds (the last {wall:.0f} s; {since:.0f} s since the "
            "first started)")


def resume_hint(run_dir: Path, status: object, steps_done: object = None) -> str:
    """How to continue a job that ended without succeeding (``local``'s last lines, ``status``):
    from its latest checkpoint's step (:func:`nereusd.checkpoints.resume_record`), or step 0; a
    crashed one (``steps_done`` steps in ``metrics.jsonl``) within the site's
    ``liveness.resume_grace_s`` on the workers its agent kept, at the next step (the hint had
    named only the checkpoint: an adversarial trial, 2026-12-07)."""
    from nereusd.checkpoints import resume_record

    try:
        record = resume_record(run_dir)
    except (NereusError, OSError):   # a damaged events.jsonl: resume says so
        record = None
    where = (f"continues it at step {record['step']}, its latest checkpoint's" if record and "step" in record
             else "starts it again at step 0 (no checkpoint yet)")
    fix = " once its cause is fixed" if status in ("failed", "stopped") else ""
    if status == "crashed" and finite_number(steps_done):
        fix = (f"; within the site's liveness.resume_grace_s of the crash, at step {int(steps_done)} on the workers "
               "kept in memory (a local run's agent keeps them)")
    return f"`nereus-launch resume {run_dir}` {where}{fix}"


def launch_plan_line(job) -> str:
    """What ``local`` and ``resume`` say of the launch plan before nereusd starts (a
    :class:`~nereusd.config.resolve.ResolvedJob`): the job's plan, or that the planner chooses it
    (its ``launch_plan`` event then prints the plan, :func:`describe_event`)."""
    if job.config.adaptation.enabled and "plan" not in job.config.model_fields_set:
        return "nereus: launch plan: chosen by the planner for the initial conditions (no plan in the job)"
    return f"nereus: launch plan: {job.plan.describe()}"


def _plan_text(plan: dict) -> str:
    """A plan of an event (``{model-stage: candidate dict}``) as one line,
    ``actor/training tp2·pp1·dp2@[0,1,2,3] mb16; …``."""
    return "; ".join(f"{ms} {Candidate.from_dict(c).describe()}" for ms, c in plan.items())


def compact_plan(plan: dict) -> str:
    """``actor/training: {tp: 2, pp: 1, dp: 2}`` → ``aT2·1·2`` (role initial, stage initial upper-case);
    a ZeRO stage is appended as ``z1`` / ``z2`` (``aT1·1·4z1``)."""
    parts = []
    for name, cand in plan.items():
        role, _, stage = name.partition("/")
        zero = f"z{cand['zero_stage']}" if cand.get("zero_stage") else ""
        parts.append(f"{role[:1]}{stage[:1].upper()}{cand['tp']}·{cand['pp']}·{cand['dp']}{zero}")
    return " ".join(parts)


def describe_event(ev: dict) -> str | None:
    """One progress line for the launch plan, an admitted switch, a restart, a fallback or a pool
    change; else ``None``."""
    kind = ev.get("event")
    if kind == Event.ADMISSION and ev.get("verdict") == "admit":
        why = ", ".join(f"{t['signal']}{' (urgent)' if t['urgent'] else ''}" for t in ev.get("triggers", []))
        changed = [f"{ms} {Candidate.from_dict(c).describe()}" for ms, c in (ev.get("target_plan") or {}).items()
                   if c != (ev.get("current_plan") or {}).get(ms)]
        gain = ev.get("delta_l_s")   # ΔL = current − target step, a number, or "inf" when the current plan could not run
        if isinstance(gain, (int, float)) and math.isfinite(gain):
            gain_s = f"{abs(gain):.2f} s/step {'faster' if gain >= 0 else 'slower'}"
        else:
            gain_s = "the current plan cannot run"
        return (f"nereus: step {ev['step']}: switch admitted [{why}]: {'; '.join(changed) or 'placement'}"
                + (f" (predicted {gain_s}, L_tran {ev.get('l_tran_s') or 0:.2f} s)" if gain is not None else ""))
    if kind == Event.LAUNCH_PLAN and ev.get("source") != JOB_PLAN_SOURCE:   # launch_plan_line said that one
        source = ev.get("source")
        if not ev.get("plan"):
            return f"nereus: launch plan: {source}"
        label = "planner's launch plan" if source == "planner" else f"launch plan ({source})"
        return f"nereus: {label}: {_plan_text(ev['plan'])}"
    if kind == Event.NEREUSD_RESUMED and ev.get("mode") == "checkpoint":
        dropped = ev.get("dropped_metrics") if isinstance(ev.get("dropped_metrics"), list) else []
        again = (f"steps {min(dropped)}–{max(dropped)} run again" if len(dropped) > 1 else
                 f"step {dropped[0]} runs again" if dropped else "no step runs again")
        where = f"checkpoint {Path(ev['checkpoint']).name}" if ev.get("checkpoint") else "the initial weights"
        return f"nereus: resuming at step {ev.get('step')} from {where} ({again})"
    if kind == Event.WORKERS_KEPT and ev.get("kept") and isinstance(ev.get("plan"), dict):
        return f"nereus: continuing at step {ev.get('step')} on the workers kept in memory: {_plan_text(ev['plan'])}"
    if kind == Event.RESTART_STARTED:
        return (f"nereus: step {ev['step']}: restarting from {ev.get('checkpoint') or 'the initial weights'} on "
                f"devices {ev.get('world')}: {ev.get('reason')}")
    if kind == Event.FALLBACK:
        return f"nereus: step {ev['step']}: fallback {ev.get('action')}: {ev.get('reason')}"
    if kind == Event.POOL_CHANGED and "step" in ev:
        why = f" [{'; '.join(ev['sources'])}]" if ev.get("sources") else ""
        return (f"nereus: step {ev['step']}: pool change (joined {ev.get('joined')}, leaving {ev.get('leaving')}) "
                f"-> {len(ev.get('pool_devices', []))} devices{why}")
    if kind == Event.POOL_REQUEST_REFUSED:
        why = f" [{'; '.join(ev['sources'])}]" if ev.get("sources") else ""
        return f"nereus: pool change refused: remove {ev.get('remove')}: {ev.get('reason')}{why}"
    return None


class Progress:
    """A tqdm bar fed from ``metrics.jsonl``, started when the job has built its engines (the
    ``build`` event) or finished its first step: started with the launch, its first estimate took
    the workers' and vLLM engines' start-up (20–45 s) for a step and read 22 minutes for a
    one-minute job; the events printed before it (the launch plan, Prometheus, TensorBoard) ran
    into its 0 % line.

    The bar shows the steps ``metrics.jsonl`` holds. A resume (``run_dir`` given: the run
    directory as it is before nereusd starts) starts at the step its ``nereusd_resumed`` event
    continues from (the steps after its checkpoint leave the file once it loads), and an in-run
    checkpoint restart takes it back to its checkpoint's step; the events of the earlier
    attempts are not printed again, and its switches are the job's, as ``summary.json`` counts
    them (transitions and checkpoint restarts that ran). A resumed demo had counted past its
    total (``32step``) and printed and counted an earlier attempt's admitted switch that never
    ran (a new user's trial, 2026-12-07)."""

    def __init__(self, total: int, quiet: bool, run_dir: Path | None = None) -> None:
        self.total, self.bar = total, None
        self.quiet = quiet
        self.rewind_to: int | None = None   # a resume's checkpoint step, until its later steps leave the file
        self._stale: dict | None = None     # the row after that step when the resume began
        earlier = read_jsonl(run_dir / EVENTS_FILE) if run_dir is not None and (run_dir / EVENTS_FILE).exists() else []
        self.seen = len(read_jsonl(run_dir / METRICS_FILE)) if earlier and (run_dir / METRICS_FILE).exists() else 0
        self.events_seen = len(earlier)
        self.switches = sum(1 for ev in earlier if switch_kind(ev))

    def _started(self):
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.seen, unit="step", disable=self.quiet, dynamic_ncols=True,
                            desc="nereus")
        return self.bar

    def _write(self, line: str) -> None:
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def update(self, run_dir: Path) -> None:
        records = read_jsonl(run_dir / METRICS_FILE)
        events = read_jsonl(run_dir / EVENTS_FILE)
        for ev in events[self.events_seen:]:
            self.switches += bool(switch_kind(ev))
            line = describe_event(ev)
            if line and not self.quiet:
                self._write(line)
            if ev.get("event") == Event.NEREUSD_RESUMED and ev.get("dropped_metrics"):
                # the bar starts at the checkpoint's step: the steps after it leave metrics.jsonl
                # once it has loaded (a bar that started at the 13 rows there went back to 10 at
                # a rate of -11.8 step/s: a new user's trial, 2026-12-07)
                self.rewind_to = int(ev.get("step") or 0)
                self._stale = records[self.rewind_to] if len(records) > self.rewind_to else None
                if self.bar is None:
                    self.seen = min(self.seen, self.rewind_to)
            if ev.get("event") == Event.BUILD:
                self._started()
        self.events_seen = len(events)
        if self.rewind_to is not None:   # until the old row after the checkpoint is gone (dropped, or run again)
            if len(records) <= self.rewind_to or records[self.rewind_to] != self._stale:
                self.rewind_to = None
            else:
                records = records[:self.rewind_to]
        if len(records) == self.seen:
            return
        bar = self._started()
        if records:
            rec = records[-1]
            bar.set_postfix_str(
                f"reward {rec['reward_mean']:.2f} len {rec['response_length_mean']:.1f}"
                + (f"/{rec['max_new_tokens']}" if rec.get("max_new_tokens") is not None else "")
                + f" step {rec['step_latency_s']:.1f}s plan {compact_plan(rec.get('plan', {}))} "
                f"switches {self.switches}", refresh=False)
        if len(records) > self.seen:
            bar.update(len(records) - self.seen)
        else:   # a checkpoint loaded: the steps after it left the file and run again
            bar.n = bar.last_print_n = len(records)
            bar.refresh()
        self.seen = len(records)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
