"""``nereus-launch report RUN_DIR``: PNG plots of a run's metrics (matplotlib, no display needed)."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

from launcher.cli import output_directory, run_directory
from nereusd.cost.memory import HEADROOM, usable_bytes
from nereusd.errors import NereusError
from nereusd.journal import (ENDPOINT_FILE, EVENTS_FILE, METRICS_FILE, SUMMARY_FILE, Event, is_simulation_summary,
                             read_jsonl, resume_restarts, switch_kind)

#: (file name, title, y label, series key(s)) of the per-step plots.
_SERIES = (
    ("reward.png", "Reward", "mean reward", ("reward_mean",)),
    ("response_length.png", "Response length", "tokens", ("response_length_mean", "response_length_max")),
    ("step_latency.png", "Step latency", "seconds", ("step_latency_s",)),
    ("tokens_per_s.png", "Throughput", "generated tokens / s", ("tokens_per_s",)),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="write PNG plots of a run directory's metrics",
        description="Plot reward, response length, step and stage latency, throughput, peak memory per "
                    "device, held-out pass@1 (when the job evaluates), the plan timeline (each model-stage's "
                    "layout per step, switches and pool changes marked) and predicted against measured step "
                    "latency from RUN_DIR/metrics.jsonl and events.jsonl into RUN_DIR/plots/ (or --out): "
                    "reward.png, response_length.png, step_latency.png, tokens_per_s.png, stage_latency.png, "
                    "peak_memory.png, eval_pass_at_1.png, plan_timeline.png, predicted_vs_measured.png.",
    )
    parser.add_argument("run_dir", help="a run directory written by 'nereus-launch local'")
    parser.add_argument("--out", help="output directory (default RUN_DIR/plots)")
    parser.set_defaults(func=run_report)


MAX_BARS = 500
"""Steps up to which the stage latencies are drawn as stacked bars; a longer run's as stacked areas."""


def write_plots(run_dir: Path, out_dir: Path) -> list[Path]:
    """Write the plots and return their paths.

    Raises:
        NereusError: if ``run_dir`` has no metrics.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(run_dir / METRICS_FILE)
    if not records:
        if _simulation_output(run_dir):
            raise NereusError(f"{run_dir}: the output of nereus-launch simulate, not a job's run directory "
                              "(simulate wrote its plots there with it)")
        if (run_dir / EVENTS_FILE).is_file():
            raise NereusError(f"{run_dir}: no step has finished yet, so there is nothing to plot")
        raise NereusError(f"{run_dir / METRICS_FILE}: no metrics to plot (is this a run directory?)")
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    written = []
    for name, title, ylabel, keys in _SERIES:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for key in keys:
            ax.plot(steps, [r.get(key) for r in records], label=key, marker="." if len(steps) < 60 else None)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    stages = sorted({s for r in records for s in r.get("stage_latency_s", {})})
    values = [[r.get("stage_latency_s", {}).get(stage, 0.0) for r in records] for stage in stages]
    if len(steps) <= MAX_BARS:
        bottom = [0.0] * len(records)
        for stage, series in zip(stages, values):
            ax.bar(steps, series, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, series)]
    elif stages:   # one patch per stage: a bar per step and stage took 145 s and 1.4 GB at 20,000 steps
        ax.stackplot(steps, *values, labels=stages)
    ax.set(title="Stage latency", xlabel="step", ylabel="seconds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "stage_latency.png", dpi=100)
    plt.close(fig)
    written.append(out_dir / "stage_latency.png")

    fig, ax = plt.subplots(figsize=(7, 3.5))
    devices = sorted({d for r in records for d in r.get("peak_memory_bytes", {})}, key=int)
    styles = ("-", "--", ":", "-.")   # devices often book the same bytes: keep each line visible
    for k, device in enumerate(devices):
        ax.plot(steps, [r.get("peak_memory_bytes", {}).get(device, 0) / 2**20 for r in records],
                label=f"device {device}", ls=styles[k % len(styles)], lw=2.5 - 1.5 * k / max(1, len(devices) - 1),
                marker="o" if len(steps) <= 40 else None, ms=3)
    capacity = _device_memory_bytes(run_dir)
    if capacity:   # how close the devices came to their capacity is what the demo is about
        ax.axhline(capacity / 2**20, color="black", lw=1, label=f"capacity {capacity / 2**20:.0f} MiB")
        ax.axhline(usable_bytes(capacity) / 2**20, color="grey", lw=1, ls="--",
                   label=f"usable ({100 * (1 - HEADROOM):.0f} %): what plans may book")
    ax.set(title="Peak memory per device" + ("\n(a plan above the usable line: one the planner would not pick, "
                                             "e.g. the job file's launch plan)" if capacity else ""),
           xlabel="step", ylabel="MiB")   # two lines: one was cut off at both ends (a new user's trial)
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    if devices or capacity:
        ax.legend(fontsize=8, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(out_dir / "peak_memory.png", dpi=100)
    plt.close(fig)
    written.append(out_dir / "peak_memory.png")
    written += adaptation_plots(run_dir, records, out_dir, plt)
    written += evaluation_plot(run_dir, out_dir, plt)
    return written


def _simulation_output(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds ``nereus-launch simulate``'s output (its ``summary.json``)."""
    try:
        return is_simulation_summary(json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, RecursionError):
        return False


def _device_memory_bytes(run_dir: Path) -> int | None:
    """The job's device capacity from ``nereusd.json`` (``None`` when it is not there)."""
    try:
        value = json.loads((run_dir / ENDPOINT_FILE).read_text()).get("device_memory_bytes")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def evaluation_plot(run_dir: Path, out_dir: Path, plt) -> list[Path]:
    """``eval_pass_at_1.png``: held-out pass@1 against the steps completed (0: before the first
    step), from the journal's ``evaluation`` events; nothing when the job ran no evaluation."""
    by_step = {e["step"]: e for e in read_jsonl(run_dir / EVENTS_FILE) if e.get("event") == Event.EVALUATION.value}
    evals = [by_step[k] for k in sorted(by_step)]   # after a rewind, a step's last evaluation
    if not evals:
        return []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([e["step"] + 1 for e in evals], [e["pass_at_1"] for e in evals], marker="o")
    ax.set(title=f"Held-out pass@1 ({evals[-1]['prompts']} prompts, greedy)", xlabel="steps completed",
           ylabel="pass@1", ylim=(0, 1))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "eval_pass_at_1.png", dpi=100)
    plt.close(fig)
    return [out_dir / "eval_pass_at_1.png"]


def _layout(cand: dict) -> str:
    extra = (f" mb{cand['micro_batch']}" if cand.get("micro_batch") else "") + (" R" if cand.get("recompute") else "")
    return f"tp{cand['tp']}·pp{cand['pp']}·dp{cand['dp']} [{','.join(map(str, cand['devices']))}]{extra}"


def plan_segments(records: list[dict]) -> dict[str, list[tuple[int, int, str]]]:
    """Per model-stage, ``(first step, last step, layout text)`` runs of an unchanged candidate."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for rec in records:
        for ms, cand in rec.get("plan", {}).items():
            text = _layout(cand)
            runs = out.setdefault(ms, [])
            if runs and runs[-1][2] == text and runs[-1][1] == rec["step"] - 1:
                runs[-1] = (runs[-1][0], rec["step"], text)
            else:
                runs.append((rec["step"], rec["step"], text))
    return out


_MARK = {"transition": {"color": "red", "ls": "-", "zorder": 3}, "restart": {"color": "black", "ls": ":", "zorder": 4}}
"""How :func:`switches_ran`'s marks are drawn: a restart in black, over a switch at the same boundary."""


def switches_ran(events: list[dict]) -> list[tuple[float, str, str]]:
    """The layout switches that ran (:func:`~nereusd.journal.switch_kind`) and the resumes that
    restarted from a checkpoint (:func:`~nereusd.journal.resume_restarts`), as ``summary.json``
    counts them, as ``(x, kind, why)``: ``x`` the boundary on the step axis (a transition after
    step s at s + 0.5, a restart that re-runs step s at s − 0.5), ``kind`` ``"transition"`` or
    ``"restart"``, ``why`` (a caption) the signals of the admission the transition carried out
    (the last before it at its step: an interrupted attempt's admission may precede it), the
    restart's reason or the resume's checkpoint. Admissions alone are not switches: one whose
    step was interrupted never ran, and a resume admits it again (a new user's trial, 2026-12-07)."""
    out, admitted = [], {}
    for e in events:
        if e.get("event") == Event.ADMISSION and e.get("verdict") == "admit":
            admitted[e.get("step")] = ", ".join(t.get("signal", "?") for t in e.get("triggers", []))
        kind = switch_kind(e)
        if kind == "transition":
            why = admitted.get(e["step"]) or str(e.get("why", ""))[:60]
            out.append((e["step"] + 0.5, kind, f"after step {e['step']} ({why})"))
        elif kind == "restart":
            why = str(e.get("reason", ""))[:60]
            out.append((e["step"] - 0.5, kind, f"step {e['step']}: checkpoint restart ({why})"))
    for e, _ in resume_restarts(events):
        name = Path(e["checkpoint"]).name if e.get("checkpoint") else "the initial weights"
        out.append((e["step"] - 0.5, "restart", f"step {e['step']}: resumed from {name}"))
    return sorted(out, key=lambda mark: mark[0])


def adaptation_plots(run_dir: Path, records: list[dict], out_dir: Path, plt) -> list[Path]:
    """``plan_timeline.png`` (layout of every model-stage per step; the switches that ran and pool
    changes marked) and ``predicted_vs_measured.png`` (the controller's step-latency prediction
    against the measured critical path of model-stage times and the step's wall time)."""
    events = read_jsonl(run_dir / EVENTS_FILE) if (run_dir / EVENTS_FILE).exists() else []
    segments = plan_segments(records)
    switches = switches_ran(events)
    # below the bars, each model-stage's history and each switch's triggers: a run of a step or two
    # has no room for its layout (the demo's switches at steps 0-3 were unreadable)
    history = [f"{ms}: " + " → ".join(f"{lo}{'' if hi == lo else f'–{hi}'} {text}" for lo, hi, text in runs)
               for ms, runs in segments.items() if len(runs) > 1]
    if switches:
        history.append("switches and restarts: " + "; ".join(why for _, _, why in switches))
    wrapped = [line for text in history for line in textwrap.wrap(text, 130, subsequent_indent="    ")]
    height = 1.2 + 0.7 * max(1, len(segments))
    fig, ax = plt.subplots(figsize=(10, height + 0.19 * len(wrapped)))
    # red and purple mark switches and pool changes: not layout colours
    colors = [c for k, c in enumerate(plt.rcParams["axes.prop_cycle"].by_key()["color"]) if k not in (3, 4)]
    kinds: dict[str, str] = {}   # one colour per layout and devices, whatever the micro-batch
    span = max(1, max((hi for runs in segments.values() for _, hi, _ in runs), default=0) + 1)
    for row, (ms, runs) in enumerate(segments.items()):
        for lo, hi, text in runs:
            color = kinds.setdefault(text.split(" mb")[0], colors[len(kinds) % len(colors)])
            ax.barh(row, hi - lo + 1, left=lo - 0.5, color=color, alpha=0.5, edgecolor="k")
            if (hi - lo + 1) / span >= 0.25:
                ax.text((lo + hi) / 2, row, text, ha="center", va="center", fontsize=7)
            elif (hi - lo + 1) / span >= 0.1:
                ax.text((lo + hi) / 2, row, text.split(" ")[0], ha="center", va="center", fontsize=6)
    for at, kind, _ in switches:
        ax.axvline(at, lw=1.5, **_MARK[kind])
    for e in events:
        if e.get("event") == Event.POOL_CHANGED and "step" in e:
            ax.axvline(e["step"] + 0.5, color="purple", ls="--", lw=1)
    ax.set_yticks(range(len(segments)), list(segments))
    ax.set_xlabel("step (red: switch; black dotted: checkpoint restart; purple: pool change; colour: layout and "
                  "devices)")
    fig.suptitle("Plan timeline", fontsize=10)
    caption = len(wrapped) * 0.19 / (height + 0.19 * len(wrapped))
    if wrapped:
        fig.text(0.01, caption - 0.01, "\n".join(wrapped), fontsize=7.5, family="monospace", va="top")
    fig.tight_layout(rect=(0, caption + 0.02, 1, 0.95))
    fig.savefig(out_dir / "plan_timeline.png", dpi=100)
    plt.close(fig)

    preds = [e for e in events if e.get("event") == Event.STEP_PREDICTION]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if preds:
        steps = [e["step"] for e in preds]
        ax.plot(steps, [e.get("predicted_step_latency_s") for e in preds], "o-", label="predicted (cost model)")
        ax.plot(steps, [e.get("measured_stage_path_s") for e in preds], "s-", label="measured (model-stage path)")
        ax.plot(steps, [e.get("measured_step_latency_s") for e in preds], ".:", label="measured (step wall time)")
        for at, kind, _ in switches:
            ax.axvline(at, lw=1, **_MARK[kind])
        ax.legend()
    ax.set(title="Step latency: predicted vs measured (red: switch; black dotted: restart)", xlabel="step",
           ylabel="seconds")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "predicted_vs_measured.png", dpi=100)
    plt.close(fig)
    return [out_dir / "plan_timeline.png", out_dir / "predicted_vs_measured.png"]


def run_report(args: argparse.Namespace) -> int:
    run_dir = run_directory(args.run_dir)
    out_dir = output_directory(args.out if args.out else run_dir / "plots", "--out" if args.out else "plots directory")
    try:
        paths = write_plots(run_dir, out_dir)
    except (KeyError, TypeError, ValueError, AttributeError) as err:   # JSON, but not what nereusd writes
        raise NereusError(f"{run_dir}: a record of metrics.jsonl or events.jsonl is not one nereusd writes "
                          f"({type(err).__name__}: {str(err)[:80]}); was the journal edited?") from None
    for path in paths:
        print(path)
    return 0
