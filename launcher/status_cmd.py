"""``nereus-launch status [JOB]``: where a job stands, from a Slurm job id or a run directory (a
local run's too).

It asks the running nereusd over the CURVE-secured control plane (:func:`ask_nereusd`: plan,
pool, step, the last step's metrics, the last decision) and, once the job has ended or when
nereusd does not answer, prints the run's ``summary.json`` (:func:`_finished_lines`). The Slurm
states come from ``squeue``; where Slurm does not answer they read ``UNKNOWN`` and the run
directory still tells how the job went. Without JOB it lists the jobs submitted from this account
(``$NEREUS_HOME/jobs``, :mod:`launcher.submit`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from launcher.progress import duration_text, finite_number, resume_hint, switches_text
from launcher.submit import RECORD_FILE, _home, _read_record, resolve_run_dir
from nereusd import protocol as P
from nereusd.errors import NereusError, SlurmError
from nereusd.journal import ENDPOINT_FILE, SUMMARY_FILE, is_simulation_summary, to_json
from nereusd.slurm import SlurmClient


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status", help="plan, pool, step, the last step's reward and lengths, and last decision of a job "
                       "(all jobs without JOB)",
        description="Ask a job's nereusd (over its CURVE-secured control plane) for its step, plan, pool and last "
                    "decision; when it is not running, print the run's summary. JOB is a Slurm job id submitted "
                    "from this account or a run directory (a local run's too). Without JOB, list the jobs "
                    "submitted from this account with their Slurm state.")
    p.add_argument("job", nargs="?", help="Slurm job id or run directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_status)


def ask_nereusd(run_dir: Path, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """nereusd's live status over the control plane, or ``None`` when it does not answer.

    Raises:
        NereusError: the run's ``nereusd.json`` is not a nereusd record (damaged or foreign).
    """
    from launcher.pool_cmd import endpoint_record, exchange

    try:
        info = json.loads((run_dir / ENDPOINT_FILE).read_text())
    except (OSError, ValueError):   # ValueError: JSON or UTF-8 damage
        return None
    reply = exchange(run_dir, endpoint_record(info, run_dir / ENDPOINT_FILE), P.StatusRequest(), timeout_s)
    return reply.status if isinstance(reply, P.StatusReply) else None


def cmd_status(args: argparse.Namespace) -> int:
    if not args.job:
        index = _home() / "jobs"
        rows = []
        for entry in sorted(index.glob("*.json")) if index.is_dir() else []:
            known = json.loads(entry.read_text())
            if "grow_of" not in known:   # a grow allocation is listed with its job (`status JOB_ID`)
                rows.append({"job_id": entry.stem, "state": _slurm_states([entry.stem])[0][entry.stem],
                             "run_dir": known["run_dir"]})
        print(json.dumps(rows, indent=1) if args.json else
              "\n".join(f"{r['job_id']:>8} {r['state']:<12} {r['run_dir']}" for r in rows)
              or "no Slurm jobs submitted from here (a local run: nereus-launch status RUN_DIR)")
        return 0
    run_dir = resolve_run_dir(args.job)
    if (run_dir / RECORD_FILE).is_file():
        record = _read_record(run_dir)
        slurm, unreachable = _slurm_states([record["job_id"], *record["grow_job_ids"]])
    elif (run_dir / ENDPOINT_FILE).is_file() or (run_dir / SUMMARY_FILE).is_file():
        slurm, unreachable = {}, ""   # a local run (nereus-launch local): no allocation to ask Slurm about
    else:
        raise NereusError(f"{run_dir}: not a Nereus run directory (no {RECORD_FILE}, {ENDPOINT_FILE} or "
                          f"{SUMMARY_FILE}; has the job started?)")
    summary, malformed = None, ""
    if (run_dir / SUMMARY_FILE).is_file():
        try:
            summary = json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as err:   # UnicodeDecodeError is a ValueError
            malformed = f"{run_dir / SUMMARY_FILE}: unreadable ({type(err).__name__})"
        if summary is not None and not isinstance(summary, dict):
            summary, malformed = None, f"{run_dir / SUMMARY_FILE}: expected a JSON object"
        if is_simulation_summary(summary) and not (run_dir / ENDPOINT_FILE).is_file() \
                and not (run_dir / RECORD_FILE).is_file():
            raise NereusError(f"{run_dir}: the output of nereus-launch simulate, not a job's run directory "
                              f"(its results are in {run_dir / 'table.txt'})")
    ended = isinstance(summary, dict) and summary.get("status") not in (None, "running")
    # an ended job's nereusd is gone: asking it only waits out the timeout (5 s)
    out: dict[str, Any] = {"run_dir": str(run_dir), "slurm": slurm, "slurm_error": unreachable or None,
                           "nereusd": None if ended else ask_nereusd(run_dir), "summary": summary}
    if args.json:   # strict JSON: a summary's NaN reads back as Python's NaN, which json.dumps writes bare
        print(to_json(out, indent=1))
        return 0
    print(f"run {run_dir}: " + ("Slurm " + ", ".join(f"{j} {s}" for j, s in slurm.items()) if slurm else "local"))
    if unreachable:
        print(f"nereus: Slurm did not answer, so the state below is the run directory's ({unreachable})")
    live = out["nereusd"]
    if live:
        plan = ", ".join(f"{ms} tp{c['tp']} pp{c['pp']} dp{c['dp']}" for ms, c in live["plan"].items())
        done = ("no step done yet" if live["step"] is None   # start-up: workers, engines, step 0
                else f"{live['step'] + 1} steps done (last: step {live['step']})")
        print(f"{done} of {live['steps']} ({live['state']}); plan: {plan or 'not formed yet'}")
        for node, agent in sorted(live["pool"].items()):
            where = f" (allocation {agent['slurm_job_id']})" if agent.get("slurm_job_id") else ""
            print(f"  node {node}: devices {agent['devices']}{where}")
        if live.get("joining"):
            j = live["joining"]
            waiting = f"; devices {j['waiting']} wait for the next join" if j.get("waiting") else ""
            print(f"  joining in the background: devices {j['devices']} ({j['phase']}, {j['elapsed_s']:.0f} s so far)"
                  + waiting)
        step = live.get("last_metrics") or {}
        if step.get("response_length_mean") is not None:
            cap = f" (cap {step['max_new_tokens']})" if step.get("max_new_tokens") is not None else ""
            print(f"last step: reward {step['reward_mean']:.2f}, response length {step['response_length_mean']:.1f} "
                  f"mean, {step.get('response_length_max')} longest{cap}, {step['step_latency_s']:.1f} s")
        if live["last_decision"]:
            print(f"last decision: {live['last_decision']['reason']} -> {live['last_decision']['verdict']}")
    elif ended:
        print(_finished_lines(out["summary"], run_dir))
    else:
        print("nereusd is not answering (starting, or gone); see the logs in " + str(run_dir / "logs")
              + (f"; {malformed}" if malformed else ""))
    return 0


def _slurm_states(job_ids: list[str]) -> tuple[dict[str, str], str]:
    """``({job id: squeue state (a pending one's with squeue's reason: ``PENDING (Resources)``), or
    GONE once Slurm has forgotten it}, "")``; where squeue fails
    (Slurm down or unreachable from here) every state is ``UNKNOWN`` and the second item says why
    (the run directory still tells how the job went)."""
    client = SlurmClient()
    try:   # a pending job with why (--nodes over the partition pended with no word of it: an adversarial trial)
        return {jid: (f"{info.state} ({info.reason})" if info.state == "PENDING" and info.reason not in ("", "None")
                      else info.state) if (info := client.job(jid)) else "GONE" for jid in job_ids}, ""
    except SlurmError as err:
        return {jid: "UNKNOWN" for jid in job_ids}, str(err)[:300]


def _cap_text(caps: list[float]) -> str:
    """`` (cap 24)``, or `` (cap 8 → 24)`` where a length curriculum raised the cap."""
    first, last = (int(c) for c in caps)
    return f" (cap {last})" if first == last else f" (cap {first} → {last})"


def _finished_lines(s: dict, run_dir: Path) -> str:
    """What ``status`` prints for a job that has ended, from its ``summary.json``: the outcome,
    and where the summary has them (each figure a finite number, else its line is left out),
    reward, response length and its cap, held-out pass@1, switches and the final plan
    (:func:`nereusd.summary.summarise_metrics` writes them)."""
    def num(*keys: str) -> list[float] | None:
        values = [s.get(k) for k in keys]
        return values if all(map(finite_number, values)) else None

    steps = num("steps_completed")
    lines = [f"finished: {s.get('status')} after {int(steps[0]) if steps else 0} steps"
             + duration_text(s) + (f": {s['error']}" if s.get("error") else "")]
    reward, best, length = (num("reward_first_10pct", "reward_last_10pct"), num("reward_best", "reward_best_step"),
                            num("response_length_first_10pct", "response_length_last_10pct"))
    caps = num("max_new_tokens_first", "max_new_tokens_last")
    if reward:
        lines.append(f"reward {reward[0]:.2f} → {reward[1]:.2f}"
                     + (f" (best {best[0]:.2f} at step {best[1]:.0f})" if best else "")
                     + (f"; response length {length[0]:.1f} → {length[1]:.1f} tokens" if length else "")
                     + (_cap_text(caps) if length and caps else ""))
    passed = num("eval_pass_at_1_first", "eval_pass_at_1_last")
    if passed:
        lines.append(f"held-out pass@1 {passed[0]:.2f} → {passed[1]:.2f}")
    if num("switches") or num("restarts"):
        lines.append(switches_text(s))
    plan = s.get("final_plan")
    if isinstance(plan, dict) and plan and all(isinstance(c, dict) for c in plan.values()):
        lines.append("final plan: " + ", ".join(f"{ms} tp{c.get('tp')} pp{c.get('pp')} dp{c.get('dp')}"
                                                for ms, c in plan.items()))
    if s.get("status") != "succeeded":
        lines.append(resume_hint(run_dir, s.get("status"), s.get("steps_completed")))
    return "\n".join(lines)
