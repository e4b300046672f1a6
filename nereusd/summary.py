"""A job's figures from its run directory's journals: what ``summary.json`` holds besides the
outcome, for nereusd at the end of a job, and the summary the launcher or the batch script
writes when nereusd died without writing one (:func:`crash_summary`, with :func:`job_figures`)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from nereusd.errors import NereusError
from nereusd.journal import (EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, Event, read_jsonl, resume_restarts,
                             switch_kind, write_summary)


def earlier_attempts(run_dir: Path, include_latest: bool = False) -> dict[str, Any]:
    """What the nereusds before the latest one did in ``run_dir`` (``events.jsonl``), for a
    resumed job's summary (``include_latest``: every nereusd's, the latest's too, for a summary
    the launcher writes for a nereusd that died without one, :func:`job_figures`): ``switches``
    (:func:`~nereusd.journal.switch_kind`), ``restarts`` (checkpoint restarts, and resumes that
    are one: :func:`~nereusd.journal.resume_restarts`), ``lost_steps`` (steps they re-run, and
    the steps those resumes re-ran), ``resumes`` (``nereusd_resumed``, the latest nereusd's
    included), ``started_s`` (when the first started; 0.0 if unknown) and ``earlier_run_s`` (the
    seconds the nereusds before the latest ran, each from its start to its last event: without
    the time between a crash and its resume)."""
    out: dict[str, Any] = {"switches": 0, "restarts": 0, "lost_steps": 0, "resumes": 0, "started_s": 0.0,
                           "earlier_run_s": 0.0}
    events = read_jsonl(run_dir / EVENTS_FILE) if (run_dir / EVENTS_FILE).exists() else []
    starts = [i for i, e in enumerate(events) if e.get("event") == Event.NEREUSD_STARTED.value]
    if starts:
        out["started_s"] = float(events[starts[0]].get("time_s") or 0.0)
    for first, nxt in zip(starts, starts[1:]):   # each earlier nereusd: its start to its last event
        times = [float(e.get("time_s") or 0.0) for e in events[first:nxt]]
        out["earlier_run_s"] += max(0.0, max(times) - times[0]) if times and times[0] else 0.0
    restarts = resume_restarts(events)
    out["restarts"] += len(restarts)
    out["lost_steps"] += sum(steps for _, steps in restarts)
    for i, e in enumerate(events):
        if e.get("event") == Event.NEREUSD_RESUMED.value:
            out["resumes"] += 1
        elif starts and (include_latest or i < starts[-1]) and switch_kind(e):
            out["switches"] += 1
            if switch_kind(e) == "restart":
                out["restarts"] += 1
                out["lost_steps"] += int(e.get("lost_steps") or 0)
    return out


def summarise_metrics(run_dir: Path, summary: dict) -> None:
    """Add the run's figures from ``metrics.jsonl`` to ``summary``: steps, reward and response
    length of the first and last 10 % of steps, the best step's mean reward and its step, mean
    step latency, the final plan, the first and last step's response cap (``max_new_tokens_first``
    / ``_last``: a length curriculum raises it; absent from metrics written before the cap was
    recorded); and from ``events.jsonl``, when the job evaluates, the
    held-out pass@1 of the first and the last evaluation (``eval_pass_at_1_first`` /
    ``_last``, ``eval_prompts``).

    Raises:
        JournalError: a damaged ``metrics.jsonl``.
    """
    records = read_jsonl(run_dir / METRICS_FILE)
    if not records:
        return
    k = max(1, len(records) // 10)
    first, last = records[:k], records[-k:]

    def mean(rs: list, key: str) -> float:
        return sum(r[key] for r in rs) / len(rs)

    summary.update(
        steps_completed=len(records),
        reward_first_10pct=mean(first, "reward_mean"), reward_last_10pct=mean(last, "reward_mean"),
        response_length_first_10pct=mean(first, "response_length_mean"),
        response_length_last_10pct=mean(last, "response_length_mean"),
        mean_step_latency_s=mean(records, "step_latency_s"),
        final_plan=records[-1]["plan"],
    )
    summary["response_length_growth"] = summary["response_length_last_10pct"] / max(
        summary["response_length_first_10pct"], 1e-9)
    caps = [r.get("max_new_tokens") for r in (records[0], records[-1])]
    if all(isinstance(c, int) for c in caps):
        summary.update(max_new_tokens_first=caps[0], max_new_tokens_last=caps[1])
    best = max(records, key=lambda r: r["reward_mean"])   # first and last alone hide a collapse
    summary.update(reward_best=best["reward_mean"], reward_best_step=best["step"])
    events = read_jsonl(run_dir / EVENTS_FILE) if (run_dir / EVENTS_FILE).exists() else []
    evals = [e for e in events if e.get("event") == Event.EVALUATION.value and "pass_at_1" in e]
    if evals:   # held-out pass@1 before the first step (step -1) and at the last evaluation
        summary.update(eval_pass_at_1_first=evals[0]["pass_at_1"], eval_pass_at_1_last=evals[-1]["pass_at_1"],
                       eval_prompts=evals[-1].get("prompts"))


def job_figures(run_dir: Path) -> dict[str, Any]:
    """The figures of a summary written for a nereusd that died without one (``kill -9``, Ctrl-C
    before its handlers): every attempt's switches, restarts and re-run steps, the resumes, and
    :func:`summarise_metrics`'s; a damaged journal leaves out what it cannot give. Such a summary
    had only the outcome: a resume's early Ctrl-C replaced the job's summary (set aside by
    ``resume``) with one without its switches and rewards (an adversarial trial, 2026-12-07)."""
    figures: dict[str, Any] = {}
    try:
        attempts = earlier_attempts(Path(run_dir), include_latest=True)
        figures.update({k: attempts[k] for k in ("switches", "restarts", "lost_steps", "resumes")})
        summarise_metrics(Path(run_dir), figures)
    except (NereusError, KeyError, TypeError, ValueError, ZeroDivisionError):
        pass
    return figures


def crash_summary(run_dir: str | Path, returncode: int | None, write: bool = True) -> dict | None:
    """The summary of a nereusd that died without writing one (``kill -9``, out of memory, a
    crash before its handlers ran) — ``None`` when it wrote its own — written to
    ``summary.json`` with ``write``. ``returncode``: the process's (negative: a signal; above
    128: a shell's code for signal ``code − 128``), with the job's figures as far as its journals
    give them (:func:`job_figures`). Written by the local launcher and, once it
    stops starting nereusd again, by the Slurm batch script."""
    run_dir = Path(run_dir)
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
        if summary.get("status") != "running":
            return None
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    how = f"exit code {returncode}"
    signum = -returncode if returncode is not None and returncode < 0 else (
        returncode - 128 if returncode is not None and 128 < returncode < 160 else None)
    if signum is not None:
        try:
            how = f"signal {signal.Signals(signum).name}"
        except ValueError:
            pass
    metrics = read_jsonl(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).exists() else []
    summary = {**job_figures(run_dir), "status": "crashed",
               "error": f"nereusd died ({how}) without writing a summary",
               "error_kind": "DaemonCrashed", "steps_completed": len(metrics),
               "resume": f"nereus-launch resume {run_dir}"}
    if write:
        write_summary(run_dir, summary)
    return summary
