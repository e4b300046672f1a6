"""Tables, JSON and PNG plots of a simulated run (matplotlib with the Agg backend).

A run's summary per policy: mean step latency (s, transitions and failures included, waiting
for GPUs excluded), total time (s), switches, transition seconds and their share of the total
(and the shares spent at boundaries where the pool changed and in vLLM engine start-ups),
OOM events, restarts, stall seconds, the difference of mean step latency against the better
frozen baseline in percent (negative: faster), and the part of the oracle's headroom over that
baseline each policy captures (:func:`summary`).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Sequence

import numpy as np

from nereusd.sim.policies import FROZEN, ORACLE
from nereusd.sim.results import PolicyResult
from nereusd.traces import LengthTrace, PoolTrace


def summary(results: Sequence[PolicyResult]) -> list[dict]:
    """One row per policy (see the module docstring for the fields and units).

    ``vs_best_frozen_pct`` compares mean step latency with the better of the frozen baselines
    run (``frozen-start``, ``frozen-final``); ``oracle_headroom_pct`` is how much faster the
    oracle is than that baseline, and ``captured_pct`` the part of that headroom a policy
    realises, ``100·(best_frozen − policy)/(best_frozen − oracle)`` (``None`` without an oracle, a
    frozen baseline, or headroom). The oracle is ``oracle`` when it ran, else the first
    ``oracle@H``.
    """
    frozen = [r.mean_step_s for r in results if r.policy.kind == FROZEN]
    best_frozen = min(frozen) if frozen else None
    oracles = sorted((r for r in results if r.policy.kind == ORACLE), key=lambda r: r.policy.name != ORACLE)
    oracle = oracles[0].mean_step_s if oracles else None
    headroom = best_frozen - oracle if best_frozen is not None and oracle is not None else None
    rows = []
    for r in results:
        total = r.total_s
        rows.append({
            "policy": r.policy.name, "payback_margin": r.policy.payback_margin if r.policy.payback_margin != float("inf") else "inf",
            "mean_step_s": r.mean_step_s, "total_s": total, "switches": r.switches,
            "transition_s": r.transition_s, "transition_share_pct": 100.0 * r.transition_s / total if total else 0.0,
            "pool_transition_share_pct": 100.0 * r.pool_transition_s / total if total else 0.0,
            "engine_start_share_pct": 100.0 * r.engine_start_s / total if total else 0.0,
            "oom_events": r.oom_events, "restarts": r.restarts, "restart_s": r.restart_s, "stall_s": r.stall_s,
            "vs_best_frozen_pct": (100.0 * (r.mean_step_s / best_frozen - 1.0)) if best_frozen else None,
            "oracle_headroom_pct": 100.0 * headroom / best_frozen if headroom is not None and best_frozen else None,
            "captured_pct": 100.0 * (best_frozen - r.mean_step_s) / headroom if headroom else None,
            "oracle": oracles[0].policy.name if oracles else None,
            "margin_missed_steps": r.margin_missed_steps,
            "distinct_plans": len(r.plans),
        })
    return rows


NOISY_HEADROOM_PCT = 1.0
"""An oracle headroom (percent of the better frozen baseline's mean step) under which
:func:`format_table` says the captured share is noise-dominated: the measured truth's per-stage
noise is 3 % per step (σ), and a 100-step run at 0.2–0.4 % headroom read captured shares of
−7,440 % and −158 % (a new-user trial, 2026-12-05)."""


def format_table(rows: Sequence[dict]) -> str:
    """The summary as an aligned text table, then the oracle's headroom over the better frozen
    baseline, or what ``--policies`` lacks for the comparison columns."""
    header = ["policy", "mean step s", "total s", "switches", "transition s", "share %", "OOM",
              "restarts", "stall s", "vs best frozen %", "captured %"]
    body = [[r["policy"], f"{r['mean_step_s']:.2f}", f"{r['total_s']:.0f}", str(r["switches"]),
             f"{r['transition_s']:.1f}", f"{r['transition_share_pct']:.3f}", str(r["oom_events"]),
             str(r["restarts"]), f"{r['stall_s']:.0f}",
             "" if r["vs_best_frozen_pct"] is None else f"{r['vs_best_frozen_pct']:+.1f}",
             "" if r["captured_pct"] is None else f"{r['captured_pct']:.0f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    table = "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                      for row in [header] + body)
    headroom = next((r["oracle_headroom_pct"] for r in rows if r["oracle_headroom_pct"] is not None), None)
    if headroom is not None:
        table += f"\n{rows[0].get('oracle') or 'oracle'} headroom over the better frozen baseline: {headroom:.1f} %"
        if abs(headroom) < NOISY_HEADROOM_PCT:
            table += (f" (captured % divides by it: below {NOISY_HEADROOM_PCT:g} % it swings with the step noise "
                      "and means little)")
    elif rows and all(r["vs_best_frozen_pct"] is None for r in rows):
        table += ("\n(vs best frozen % needs a frozen baseline in --policies: frozen-start or frozen-final"
                  + ("" if rows[0].get("oracle") else "; captured % also needs the oracle") + ")")
    elif rows:
        table += "\n(captured % needs the oracle in --policies)"
    beat = [r["policy"] for r in rows if r["captured_pct"] is not None and r["captured_pct"] > 100.0
            and not r["policy"].startswith(ORACLE)]
    if beat:   # the oracle's switches are free, its restarts are not, and it does not plan against losses
        table += (f"\n({', '.join(beat)} ran faster than the oracle: it picks each step's fastest plan with free "
                  "switches, but pays the restarts a pool loss forces like any policy and does not choose plans "
                  "against them; where the pool changes often, that makes it no bound)")
    for r in rows:
        if r.get("margin_missed_steps"):
            table += (f"\n({r['policy']}: no plan left that share of memory free at {r['margin_missed_steps']} "
                      "steps; it ran the best plan that fits there)")
    return table


def to_json(results: Sequence[PolicyResult], meta: dict) -> dict:
    """Everything: the setting, the summary rows, per-step series and admission records."""
    return {
        **meta,
        "summary": summary(results),
        "policies": {
            r.policy.name: {
                "plans": r.plans,
                "steps": [vars(x) for x in r.records],
                "decisions": r.decisions,
            } for r in results
        },
    }


def write(out_dir: str | Path, results: Sequence[PolicyResult], meta: dict, lengths: LengthTrace,
          pool: PoolTrace) -> list[Path]:
    """Write ``summary.json``, ``run.json``, ``table.txt`` and the PNG plots into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summary(results)
    (out / "summary.json").write_text(json.dumps({**meta, "summary": rows}, indent=1, default=str))
    (out / "run.json").write_text(json.dumps(to_json(results, meta), default=str))
    (out / "table.txt").write_text(_title(meta) + "\n" + format_table(rows) + "\n")
    return [out / "summary.json", out / "run.json", out / "table.txt"] + plot(out, results, meta)


def _title(meta: dict) -> str:
    gen = " [GENERATED length trace]" if meta.get("length_generated") else ""
    engines = "; generation on vLLM" if meta.get("generation") == "vllm" else ""
    rebuild = (meta.get("truth") or {}).get("engine_rebuild_s")
    engines += f" (engine start-up {rebuild:g} s)" if engines and rebuild else ""
    return (f"{meta['model']} {meta['algorithm']} on {meta['gpus']} x {meta['site']}, {meta['steps']} steps; "
            f"lengths: {meta['length_trace']}{gen}; pool: {meta['pool_trace']}{engines}")


def plot(out: Path, results: Sequence[PolicyResult], meta: dict) -> list[Path]:
    """Step latency over steps, plan timeline, pool size and sequence length (one PNG each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths = []
    title = _title(meta)

    def save(fig, name):
        fig.suptitle(textwrap.fill(title, 110), fontsize=7)   # one long line was cut at both sides
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(9, 4))
    every = []
    for r in results:
        xs = [x.step for x in r.records if not x.oom]
        ys = [x.step_s + x.transition_s + x.restart_s for x in r.records if not x.oom]
        every += ys
        ax.plot(xs, ys, lw=0.8, label=r.policy.name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("step latency incl. transitions (s)")
    if every:   # a restart's few hundred seconds would flatten every step into one line
        top = 1.15 * float(np.percentile(every, 99))
        if max(every) > top:
            ax.set_ylim(0, top)
            ax.set_xlabel(f"RL step (y cut at {top:.0f} s: restarts and slow transitions above it, up to "
                          f"{max(every):.0f} s)")
    ax.legend(fontsize=7)
    save(fig, "step_latency.png")

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.1 * len(results) + 1), sharex=True, squeeze=False)
    ooms = False
    for ax, r in zip(axes[:, 0], results):
        ax.step([x.step for x in r.records], [x.plan_id for x in r.records], where="post", lw=0.8)
        for x in r.records:
            if x.oom:
                ooms = True
                ax.axvline(x.step, color="red", lw=0.6)
        ax.set_ylabel(r.policy.name, fontsize=7)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-0.5, max((x.plan_id for x in r.records), default=0) + 0.5)
    axes[-1, 0].set_xlabel("RL step (y: the policy's own plan number, in order of first use" +
                           ("; red: OOM)" if ooms else ")"))
    save(fig, "plan_timeline.png")

    fig, ax = plt.subplots(figsize=(9, 3))
    for r in results:
        ax.step([x.step for x in r.records], [x.pool for x in r.records], where="post", lw=0.8, label=r.policy.name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("GPUs in the pool")
    ax.legend(fontsize=7)
    save(fig, "pool.png")

    fig, ax = plt.subplots(figsize=(9, 3))
    ref = results[0]
    seen = {}
    for x in ref.records:
        seen.setdefault(x.step, x.length)
    ax.plot(list(seen), list(seen.values()), lw=0.8)
    ax.set_xlabel("RL step")
    ax.set_ylabel("longest response (tokens)", fontsize=8)   # the trace's length: the step's longest
    save(fig, "sequence_length.png")
    return paths
