"""Benchmark the adaptation policies in the cluster-scale simulator (issue 7).

    .venv/bin/python scripts/bench_sim.py [--steps 1000] [--gpus 16,64,256,1024] [--real-gpus ...]
        [--jobs 2] [--quick]

Settings: Llama-3.1-8B PPO on the H200 site (global batch 1,024, prompts of 512 tokens) at each
GPU count, on

- the *generated* long-CoT ramp (500 → 8,000 tokens over the run, noise resampled from a real
  trace — labelled generated) with the ``us-east-2b`` spot pool;
- the real length traces ``verl-amd-7b-grpo`` and ``deepgrpo-tree`` with the ``us-west-2a``
  spot pool, and ``verl-0.5b-ppo`` with ``us-east-2b`` (each cut to ``--steps``; a shorter
  trace repeats);

for frozen, nereus (γ = 0.5), greedy, periodic-3 and oracle; then γ ∈ {0, 0.25, 0.5, 1} on the
ramp at 64 GPUs. Prints one paper-style table per setting and a summary; the last line is

    sim: nereus vs frozen <x> %; vs greedy <y> %; switch overhead <z> %

with ``x`` and ``y`` the mean over settings of nereus's mean step latency relative to frozen's
and greedy's (negative: nereus faster) and ``z`` nereus's transition seconds over its total
seconds, summed over settings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nereusd.sim.policies import parse_policies  # noqa: E402
from nereusd.sim.report import format_table, summary  # noqa: E402
from nereusd.sim.scenario import Scenario, build, run_policies  # noqa: E402

POLICIES = "frozen,nereus,greedy,periodic-3,oracle"
GAMMAS = "frozen,nereus@0,nereus@0.25,nereus,nereus@1,greedy,oracle"
TRACES = [("generated-ramp", "us-east-2b"), ("verl-amd-7b-grpo", "us-west-2a"),
          ("deepgrpo-tree", "us-west-2a"), ("verl-0.5b-ppo", "us-east-2b")]


def run_setting(length: str, pool: str, gpus: int, steps: int, policies: str, jobs: int):
    start, cpu = time.perf_counter(), time.process_time()
    sim, meta = build(Scenario(gpus=gpus, steps=steps, length_trace=length, pool_trace=pool))
    results = run_policies(sim, parse_policies(policies), jobs=jobs)
    rows = summary(results)
    gen = " [GENERATED]" if meta["length_generated"] else ""
    print(f"\n== {gpus} GPUs, lengths {meta['length_trace']}{gen}, pool {meta['pool_trace']}, {steps} steps "
          f"(wall {time.perf_counter() - start:.1f} s, main-process CPU {time.process_time() - cpu:.1f} s)")
    print(format_table(rows), flush=True)
    return {r["policy"]: r for r in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--gpus", default="16,64,256,1024", help="GPU counts for the generated ramp")
    parser.add_argument("--real-gpus", default=None, help="GPU counts for the real traces (default: --gpus)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes per setting")
    parser.add_argument("--quick", action="store_true", help="200 steps, 16 and 64 GPUs, ramp and one real trace")
    args = parser.parse_args()
    gpus_list = [int(g) for g in args.gpus.split(",")]
    real_gpus = [int(g) for g in (args.real_gpus or args.gpus).split(",")]
    traces, steps = TRACES, args.steps
    if args.quick:
        gpus_list, real_gpus, traces, steps = [16, 64], [16, 64], TRACES[:2], 200
    t0 = time.perf_counter()
    vs_frozen, vs_greedy, tran, total = [], [], 0.0, 0.0
    for length, pool in traces:
        for gpus in (gpus_list if length == "generated-ramp" else real_gpus):
            rows = run_setting(length, pool, gpus, steps, POLICIES, args.jobs)
            n, f, g = rows["nereus"], rows["frozen"], rows["greedy"]
            vs_frozen.append(100.0 * (n["mean_step_s"] / f["mean_step_s"] - 1))
            vs_greedy.append(100.0 * (n["mean_step_s"] / g["mean_step_s"] - 1))
            tran += n["transition_s"]
            total += n["total_s"]
    print("\n== gamma sensitivity")
    run_setting("generated-ramp", "us-east-2b", 64, steps, GAMMAS, args.jobs)
    print(f"\nsettings: {len(vs_frozen)}; nereus vs frozen per setting: "
          + ", ".join(f"{x:+.1f}" for x in vs_frozen))
    print(f"nereus vs greedy per setting: " + ", ".join(f"{x:+.1f}" for x in vs_greedy))
    print(f"bench wall time {time.perf_counter() - t0:.0f} s")
    print(f"sim: nereus vs frozen {statistics.mean(vs_frozen):+.1f} %; vs greedy {statistics.mean(vs_greedy):+.1f} %; "
          f"switch overhead {100.0 * tran / total:.3f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
