"""Benchmark the planner: search time by GPU count and plan quality against exhaustive search.

    .venv/bin/python scripts/bench_planner.py [--repeats 5] [--quick]

Search time: median of ``--repeats`` full planner runs (option enumeration, frontiers, search,
placement) for PPO on Llama-3.1-8B and Llama-3.3-70B on the H200 site at 8, 64, 256, 1,024 and
8,192 GPUs, printed with the cost of one cost-model evaluation measured in the same run as a
machine-speed baseline.

Quality: on models × GPU counts × response lengths, the planner's predicted step latency against
exhaustive enumeration of the same plan space (every combination of every model-stage's options
under the same GPU budgets and memory rule). The enumeration only drops options dominated in all
of GPUs, latency, peak and resident memory, which can never be needed. Prints the gap
distribution and the count of exact optima. The last line is the summary line of issue 3.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nereusd.cost.model import CostModel  # noqa: E402
from nereusd.models import preset  # noqa: E402
from nereusd.plan import Role  # noqa: E402
from nereusd.planner.search import Infeasible, Planner  # noqa: E402
from nereusd.planner.space import PlanProblem  # noqa: E402
from nereusd.config.site import load_site  # noqa: E402
from nereusd.workflow import Workload, build_workflow  # noqa: E402


def make_problem(site_name, model, gpus, response, batch=1024, algorithm="ppo"):
    site = load_site(site_name)
    site = site.with_nodes(max(1, -(-gpus // site.devices_per_node)))
    spec = preset(model)
    wl = Workload(prompt_length=512, response_length=response, global_batch=batch)
    return PlanProblem(build_workflow(algorithm), {r: spec for r in Role}, wl, site, tuple(range(gpus)))


def pareto(items, key):
    """Items not dominated (<= in every coordinate of key, < in one) by another."""
    items = sorted(items, key=key)
    kept = []
    for it in items:
        k = key(it)
        if not any(all(a <= b for a, b in zip(key(o), k)) for o in kept):
            kept.append(it)
    return kept


def exhaustive(planner: Planner) -> float | None:
    """Best step latency by enumerating every combination (synchronous workflows)."""
    n, usable = len(planner.problem.pool), planner.usable
    per_phase = []
    for phase in planner.phases:
        lists = [pareto(planner.all_options[m], lambda o: (o.gpus, o.latency_s, o.peak_bytes, o.resident_bytes))
                 for m in phase]
        records = []
        for combo in itertools.product(*lists):
            if sum(o.gpus for o in combo) > n:
                continue
            records.append((max(o.latency_s for o in combo), max(o.peak_bytes for o in combo),
                            max(o.resident_bytes for o in combo)))
        per_phase.append(pareto(records, lambda r: r))
    best = None
    for combo in itertools.product(*per_phase):
        total_b = sum(r[2] for r in combo)
        if any(r[1] + total_b - r[2] > usable for r in combo):
            continue
        lat = sum(r[0] for r in combo)
        best = lat if best is None or lat < best else best
    return best


def bench_time(repeats: int, gpu_counts) -> dict:
    out = {}
    for model in ("llama-3.1-8b", "llama-3.3-70b"):
        for gpus in gpu_counts:
            pb = make_problem("h200-ib", model, gpus, 8192)
            times, result = [], None
            for _ in range(repeats):
                t = time.perf_counter()
                try:
                    result = Planner(pb, CostModel(pb.site)).solve()
                except Infeasible:
                    result = None
                times.append(time.perf_counter() - t)
            ms = statistics.median(times) * 1e3
            out[(model, gpus)] = ms
            step = f"{result.predicted_step_latency_s:9.1f} s" if result else "infeasible"
            print(f"search  {model:14s} {gpus:5d} GPUs  median {ms:8.1f} ms  step {step}", flush=True)
    return out


def baseline_eval_us() -> float:
    """Microseconds per cost-model + memory-model evaluation on this machine (speed baseline)."""
    pb = make_problem("h200-ib", "llama-3.1-8b", 8, 1024)
    cm = CostModel(pb.site)
    m = pb.workflow.model_stages[-1]
    t = time.perf_counter()
    k = 2000
    for i in range(k):
        cm.refresh()
        cm.stage_cost(pb.spec(m), m, sequences=1024, prompt_length=512, response_length=1024,
                      tp=1, pp=1, dp=1 + i % 8, micro_batch=1)
    return (time.perf_counter() - t) / k * 1e6


def bench_quality(quick: bool):
    models = ("llama-3.1-8b", "qwen3-14b")
    gpus_list = (8, 12, 16)
    lengths = (1024, 2048, 4096)
    if quick:
        models, gpus_list = models[:1], gpus_list[:2]
    gaps, exact, rows = [], 0, 0
    for model, gpus, response in itertools.product(models, gpus_list, lengths):
        pb = make_problem("h200-ib", model, gpus, response, batch=256, algorithm="ppo")
        planner = Planner(pb, CostModel(pb.site))
        t = time.perf_counter()
        try:
            got = planner.solve().predicted_step_latency_s
        except Infeasible:
            got = None
        t_plan = time.perf_counter() - t
        t = time.perf_counter()
        best = exhaustive(planner)
        t_ex = time.perf_counter() - t
        if best is None and got is None:
            print(f"quality {model:14s} {gpus:3d} GPUs len {response:5d}: infeasible for both")
            continue
        rows += 1
        gap = (got - best) / best * 100 if got is not None and best is not None else float("inf")
        gaps.append(gap)
        exact += gap <= 1e-9
        print(f"quality {model:14s} {gpus:3d} GPUs len {response:5d}: planner {got:9.2f} s  exhaustive "
              f"{best:9.2f} s  gap {gap:6.3f} %  (plan {t_plan * 1e3:7.1f} ms, exhaustive {t_ex * 1e3:8.1f} ms)",
              flush=True)
    return gaps, exact, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer settings (smoke run)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, got {args.repeats}")
    base = baseline_eval_us()
    print(f"baseline: one stage-cost evaluation {base:.1f} us on this machine")
    counts = (8, 64, 256) if args.quick else (8, 64, 256, 1024, 8192)
    times = bench_time(args.repeats, counts)
    for (model, gpus), ms in times.items():
        print(f"ratio   {model:14s} {gpus:5d} GPUs  search = {ms * 1e3 / base:9.0f} x one evaluation")
    gaps, exact, rows = bench_quality(args.quick)
    if gaps:
        srt = sorted(gaps)
        print(f"gaps: median {statistics.median(srt):.3f} %, p90 {srt[int(0.9 * (len(srt) - 1))]:.3f} %, "
              f"max {srt[-1]:.3f} %")
    t1024 = times.get(("llama-3.1-8b", 1024), float("nan"))
    print(f"planner: 1024 GPUs {t1024:.1f} ms; exact {exact}/{rows}; max gap {max(gaps, default=0):.3f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
