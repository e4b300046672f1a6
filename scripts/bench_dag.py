"""Greedy transition schedule (``L̂_tran``) against the exact optimum from CP-SAT and SCIP.

    .venv/bin/python scripts/bench_dag.py [--cases 100] [--seed 0] [--time-limit 10] [--no-scip]

Needs the ``bench`` extra (``pip install -e .[bench]``: ortools, pyscipopt); a solver that is not
installed is skipped with a message.

Cases. Random transitions on the H200 site (``site_configs/h200-ib.yaml``, 8 devices per node,
NVLink inside a node, InfiniBand across): a pool of 8–16 devices (``--devices MIN:MAX``), two or three model-stages
(actor generation, reward inference, actor and critic training) whose candidates mostly cover the
whole pool, so that the model-stages share every device, as in
``tests/unit/transition/test_properties.py``; models ``counting-tiny``, a 1B (Llama-3.2-1B shapes) and
Llama-3.1-8B; the target keeps the model-stages (sometimes one joins or leaves) with new
``(tp, pp, dp)`` and devices. The pool is nearly full: every device also holds ``reserved_bytes``
(KV cache, activations of other work) chosen so that the fuller of the two plans leaves a random
0–5 % of the usable memory free on its fullest device. Each DAG comes from
:func:`nereusd.transition.plan_transition` with that memory budget (release-before-acquire edges
on tight devices); a case is redrawn when a layout cannot shard its model, a plan does not fit,
:func:`~nereusd.transition.memory.check_feasibility` refuses the transition (the controller
would not run it either), nothing moves (only Destroy and Create: makespan 0), or the MiB
rounding below makes its serial schedule not fit.

Scheduling instance (:func:`build_instance`), identical for the greedy and both solvers. One job
per op of the DAG with

* duration ``d_i`` = :func:`~nereusd.transition.cost.op_duration_s` (the same α-β link model,
  communicator set-ups and per-device serialisation as ``L̂_tran``), rounded up to ticks of
  ``--tick-us`` µs (default 10) so the solvers work in integers;
* ports ``P_i``: the devices whose link the op uses (its sends, receives, local slices and
  communicator set-ups, as ``estimate_l_tran`` counts them); Destroy and Create take no time and
  no port;
* memory on each device ``x`` (:meth:`~nereusd.transition.memory.StateModel.op_bytes`):
  ``up_ix = alloc + transient`` taken at the start, ``down_ix = transient + free`` given back at
  the end, in MiB (``up`` rounded up, ``down`` down: conservative); at time 0 each device holds
  its current state, workspace and reserved bytes (``base_x``, rounded up), and may hold at most
  ``⌊(1 − headroom) · capacity⌋`` (``limit``, rounded down).

The model: minimise ``C = max_i (S_i + d_i)`` over integer starts ``S_i ≥ 0`` subject to

* precedence: ``S_j ≥ S_i + d_i`` for every DAG edge ``i → j``;
* one port per device: jobs that share a port and take time do not overlap;
* memory: on every device, at every time ``t``,
  ``base_x + Σ_{S_i ≤ t} up_ix − Σ_{S_i + d_i ≤ t} down_ix ≤ limit`` (what ends at ``t`` is
  free for what starts at ``t``).

CP-SAT states it directly: intervals, ``NoOverlap`` per port, precedence, one reservoir
constraint per device. SCIP gets the MIP form: integer starts; for each pair of jobs that share
a port and are not ordered by the DAG, an order binary with big-M disjunctions; memory checked at
the start of every job that takes memory on ``x``, with binaries "``i`` started by then" and
"``i`` ended by then" (ordered pairs: tie-broken so two jobs starting together count each other
once; fixed by the DAG's transitive closure where it orders the pair; equal to the port order
when the pair shares a port) — peaks happen at starts, so this is the same constraint (one
corner differs: a zero-duration job the DAG orders before a release at the same instant; CP-SAT's
reservoir nets the two, the MIP does not); plus the valid bounds ``C ≥`` every device's port load
and ``C ≥ S_i +`` the longest path from ``i``. Big-M is the serial schedule's length (``Σ d_i``),
which is feasible because ``check_feasibility`` walked exactly that schedule; SCIP's feasibility
tolerance is 1e-7 so that a binary off by its tolerance cannot move a start by a tick. Both
solvers get the greedy schedule as a hint when it fits memory, a time limit
(``--time-limit`` s, default 10) and one thread (``--workers`` for CP-SAT; one is the fastest
on these small instances).

Greedy (:func:`greedy_starts`): ``estimate_l_tran``'s list schedule — ops in the DAG's
topological order, each as early as its predecessors and its ports allow, on the same ticks; the
script checks it equals ``estimate_l_tran`` and reports whether it keeps every device within
memory at every instant (:func:`schedule_problems`), which ``estimate_l_tran`` does not check.
Solver schedules are checked the same way.

Prints a table by model size (greedy/optimal, cases within 5 %, greedy schedules that fit
memory, cases where memory raises the optimum — CP-SAT solved once more without it —, proven
optima and wall times per solver), and the last line
``dag: greedy/optimal median <m> max <x>; speedup vs CP-SAT <s>x``: ratios over the cases with
a proven optimum (CP-SAT's, else SCIP's) where the greedy schedule fits memory (the others are
listed); speedup = median over cases of CP-SAT's wall time
(model building and solve) over the greedy's on the same instance (the DAG's topological order
and the list schedule, best of 5). Both start from the same durations; the line above it also
gives the ratio when costing the durations from the routes is counted once for both
(``estimate_l_tran``'s wall time, best of 5, added to the solver's), which is what a controller
calling a solver instead of ``estimate_l_tran`` would pay.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nereusd.errors import ConfigError, PlanError  # noqa: E402
from nereusd.cost.memory import HEADROOM, WORKSPACE_BYTES  # noqa: E402
from nereusd.models import ModelSpec, preset  # noqa: E402
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage  # noqa: E402
from nereusd.config.site import load_site  # noqa: E402
from nereusd.transition import (  # noqa: E402
    AdamStateSizes,
    MemoryBudget,
    SiteLinkCosts,
    StateModel,
    TransitionDag,
    check_feasibility,
    estimate_l_tran,
    plan_transition,
    topological_order,
)
from nereusd.transition.cost import LinkCosts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dag_schedule import (  # noqa: E402  (the scheduling instance, greedy and exact solvers)
    Instance,
    build_instance,
    greedy_starts,
    serial_starts,
    makespan,
    schedule_problems,
    Solution,
    solve_cpsat,
    solve_scip,
)

MIB = 1 << 20
STAGES = (ModelStage(Role.ACTOR, Stage.GENERATION), ModelStage(Role.REWARD, Stage.INFERENCE),
          ModelStage(Role.ACTOR, Stage.TRAINING), ModelStage(Role.CRITIC, Stage.TRAINING))
MODELS: dict[str, ModelSpec] = {
    "tiny": preset("counting-tiny"),
    "1b": ModelSpec(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                    num_heads=32, num_kv_heads=8),  # Llama-3.2-1B shapes
    "8b": preset("llama-3.1-8b"),
}


@dataclass(frozen=True)
class Case:
    model: str
    pool: int
    dag: TransitionDag
    state: StateModel
    budget: MemoryBudget


def _candidate(rng: random.Random, pool: int) -> Candidate:
    tp = rng.choice([t for t in (1, 2, 4, 8) if t <= pool])
    pp = rng.choice([p for p in (1, 2, 4) if tp * p <= pool])
    most = pool // (tp * pp)
    dp = most if rng.random() < 0.7 else rng.randint(1, most)  # mostly the whole pool
    return Candidate(tp, pp, dp, tuple(rng.sample(range(pool), tp * pp * dp)))


def draw_case(rng: random.Random, site, sizes: AdamStateSizes, pool_range: tuple[int, int] = (8, 16)) -> Case | None:
    """One random transition on a nearly full pool of ``pool_range`` devices (module docstring), or
    ``None`` to redraw."""
    pool = rng.randint(*pool_range)
    name = rng.choice(sorted(MODELS))
    models = {r: MODELS[name] for r in Role}
    stages = rng.sample(STAGES, rng.randint(2, 3))
    current = Plan({m: _candidate(rng, pool) for m in stages})
    kept = [m for m in stages if rng.random() > 0.1] or stages[:1]
    joining = [m for m in STAGES if m not in stages and rng.random() < 0.1]
    target = Plan({m: _candidate(rng, pool) for m in kept + joining})
    state = StateModel(models, sizes)
    try:
        need = max(max(state.plan_bytes(p).values(), default=0) for p in (current, target))
    except PlanError:
        return None
    usable = int((1 - HEADROOM) * site.device_memory_bytes) - WORKSPACE_BYTES[site.device_kind]
    if need == 0 or need > usable:
        return None
    reserved = max(0, usable - need - int(rng.uniform(0.0, 0.05) * usable))
    budget = MemoryBudget(capacity_bytes=site.device_memory_bytes, headroom=HEADROOM,
                          workspace_bytes=WORKSPACE_BYTES[site.device_kind],
                          reserved_bytes={x: reserved for x in range(pool)})
    try:
        dag = plan_transition(current, target, models, devices_per_node=site.devices_per_node,
                              state=state, budget=budget)
    except PlanError:
        return None
    if not dag.ops or not check_feasibility(dag, state, budget).feasible:
        return None
    return Case(name, pool, dag, state, budget)


# --- the benchmark -------------------------------------------------------------------------------

@dataclass
class Result:
    case: Case
    inst: Instance
    greedy: int
    """Greedy makespan, ticks."""
    greedy_fits: bool
    schedule_wall_s: float
    """Greedy schedule on the instance: topological order + list schedule (best of 5)."""
    l_tran_wall_s: float
    """``estimate_l_tran`` on the DAG: durations from the routes + the schedule (best of 5)."""
    solutions: dict[str, Solution]
    without_memory: int | None = None
    """CP-SAT's proven optimum without the memory constraint (``None``: not proven or not run)."""

    def optimum(self) -> int | None:
        for name in ("cp-sat", "scip"):
            sol = self.solutions.get(name)
            if sol is not None and sol.optimal:
                return sol.makespan
        return None


def _best_wall_s(fn, repeats: int = 5) -> float:
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return min(walls)


def run_case(case: Case, inst: Instance, links: LinkCosts, args, solvers: Sequence[str]) -> Result:
    """Greedy and exact schedules of one case; raises if the greedy replay is not ``L̂_tran``."""
    cost = estimate_l_tran(case.dag, case.state.sizes, links)
    if makespan(inst, greedy_starts(inst, ticks=False), ticks=False) != cost.l_tran_s:
        raise AssertionError(f"greedy replay differs from estimate_l_tran on {case.dag.summary()}")
    l_tran_wall = _best_wall_s(lambda: estimate_l_tran(case.dag, case.state.sizes, links))
    schedule_wall = _best_wall_s(lambda: (topological_order(case.dag), greedy_starts(inst)))
    starts = greedy_starts(inst)
    fits = not schedule_problems(inst, starts)
    hint = starts if fits else None
    sols = {}
    for name in solvers:
        if name == "cp-sat":
            sol = solve_cpsat(inst, time_limit_s=args.time_limit, workers=args.workers, hint=hint)
        else:
            sol = solve_scip(inst, time_limit_s=args.time_limit, hint=hint)
        if sol.makespan is not None:
            bad = schedule_problems(inst, sol.starts)
            if bad:
                print(f"  {name} schedule breaks the model: {bad[:3]}", file=sys.stderr)
        sols[name] = sol
    free = None
    if "cp-sat" in solvers:
        sol = solve_cpsat(inst, time_limit_s=args.time_limit, workers=args.workers, hint=starts, memory=False)
        free = sol.makespan if sol.optimal else None
    return Result(case, inst, makespan(inst, starts), fits, schedule_wall, l_tran_wall, sols, free)


def available_solvers(no_scip: bool) -> list[str]:
    out = []
    try:
        import ortools.sat.python.cp_model  # noqa: F401
        out.append("cp-sat")
    except ImportError:
        print("OR-Tools not installed (pip install -e .[bench]): CP-SAT skipped", file=sys.stderr)
    if not no_scip:
        try:
            import pyscipopt  # noqa: F401
            out.append("scip")
        except ImportError:
            print("pyscipopt not installed (pip install -e .[bench]): SCIP skipped", file=sys.stderr)
    return out


def _q(values: Sequence[float], fmt: str) -> str:
    if not values:
        return "-"
    return f"{format(statistics.median(values), fmt)} / {format(max(values), fmt)}"


def _ratios(results: Sequence[Result]) -> list[float]:
    """greedy/optimal where the optimum is proven and the greedy schedule fits memory."""
    return [r.greedy / r.optimum() for r in results if r.optimum() is not None and r.greedy_fits]


def report(results: Sequence[Result], solvers: Sequence[str]) -> str:
    """Table by model size, timings and the summary line (module docstring)."""
    rows = [("model", "cases", "ops med/max", "greedy/opt med/max", "≤5 %", "greedy fits", "mem binds",
             *[f"{s} opt/limit · wall med/max s" for s in solvers])]
    for name in [*sorted(MODELS), "all"]:
        rs = [r for r in results if name in ("all", r.case.model)]
        if not rs:
            continue
        ratios = _ratios(rs)
        binds = [r for r in rs if r.optimum() is not None and r.without_memory is not None]
        cells = [name, str(len(rs)), _q([len(r.inst.jobs) for r in rs], ".0f"), _q(ratios, ".4f"),
                 f"{sum(x <= 1.05 for x in ratios)}/{len(ratios)}",
                 f"{sum(r.greedy_fits for r in rs)}/{len(rs)}",
                 f"{sum(r.optimum() > r.without_memory for r in binds)}/{len(binds)}"]
        for s in solvers:
            sols = [r.solutions[s] for r in rs]
            proven = sum(x.optimal for x in sols)
            cells.append(f"{proven}/{len(sols) - proven} · {_q([x.wall_s for x in sols], '.3f')}")
        rows.append(tuple(cells))
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    ratios = _ratios(results)
    proven = [r for r in results if r.optimum() is not None]
    lines.append(f"cases with a proven optimum (CP-SAT, else SCIP): {len(proven)}/{len(results)}; "
                 f"greedy/optimal is over the {len(ratios)} of them where the greedy schedule fits memory")
    over = [f"{r.greedy / r.optimum():.4f}" for r in proven if not r.greedy_fits]
    if over:
        lines.append(f"greedy schedule over memory (estimate_l_tran does not check it) on {len(over)} cases, "
                     f"greedy/optimal there: {', '.join(over)}")
    both = [r for r in results
            if all(r.solutions.get(s) and r.solutions[s].optimal for s in ("cp-sat", "scip"))]
    if both:
        agree = sum(r.solutions["cp-sat"].makespan == r.solutions["scip"].makespan for r in both)
        lines.append(f"CP-SAT and SCIP both proven on {len(both)} cases, same optimum on {agree}")
    sched = [r.schedule_wall_s * 1e3 for r in results]
    l_tran = [r.l_tran_wall_s * 1e3 for r in results]
    lines.append(f"greedy schedule on the instance, ms med/max: {_q(sched, '.3f')}; estimate_l_tran on "
                 f"the DAG (durations from routes + schedule), ms med/max: {_q(l_tran, '.3f')}")
    speed = {}
    for s in solvers:
        speed[s] = statistics.median([r.solutions[s].wall_s / r.schedule_wall_s for r in results])
        end_to_end = statistics.median([(r.solutions[s].wall_s + r.l_tran_wall_s) / r.l_tran_wall_s
                                        for r in results])
        lines.append(f"{s} / greedy wall, median over cases: schedule {speed[s]:.0f}x; "
                     f"with the durations costed once for both (estimate_l_tran) {end_to_end:.1f}x")
    med = f"{statistics.median(ratios):.4f}" if ratios else "n/a"
    mx = f"{max(ratios):.4f}" if ratios else "n/a"
    sp = f"{speed['cp-sat']:.0f}" if "cp-sat" in speed else "n/a"
    lines.append(f"dag: greedy/optimal median {med} max {mx}; speedup vs CP-SAT {sp}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per exact solve")
    parser.add_argument("--workers", type=int, default=1, help="CP-SAT search threads")
    parser.add_argument("--tick-us", type=float, default=10.0, help="time unit of the solvers, µs")
    parser.add_argument("--site", default="h200-ib")
    parser.add_argument("--devices", default="8:16", metavar="MIN:MAX",
                        help="pool size range of the random transitions (default: %(default)s; 48:64 draws "
                        "transitions of the size the simulator's 64-GPU scenarios assess)")
    parser.add_argument("--no-scip", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="one line per case")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error(f"--cases: expected at least 1, got {args.cases}")
    if args.workers < 1:
        parser.error(f"--workers: expected at least 1 search thread, got {args.workers}")
    if not math.isfinite(args.time_limit) or args.time_limit <= 0:
        parser.error(f"--time-limit: expected a finite number of seconds above 0, got {args.time_limit}")
    if not math.isfinite(args.tick_us) or args.tick_us <= 0:
        parser.error(f"--tick-us: expected a finite number of µs above 0, got {args.tick_us}")
    try:
        site = load_site(args.site)
    except ConfigError as err:
        parser.error(f"--site: {err}")
    try:
        pool_range = tuple(int(x) for x in args.devices.split(":"))
    except ValueError:
        pool_range = ()
    if len(pool_range) != 2 or not 8 <= pool_range[0] <= pool_range[1] <= 256:   # 512 devices: 5 s a draw
        parser.error(f"--devices: expected MIN:MAX with 8 <= MIN <= MAX <= 256, got {args.devices!r}")
    solvers = available_solvers(args.no_scip)
    links = SiteLinkCosts.from_site(site)
    sizes = AdamStateSizes.for_dtype(site.compute_dtype)
    rng = random.Random(args.seed)
    results, redrawn, t0 = [], 0, time.perf_counter()
    while len(results) < args.cases:
        case = draw_case(rng, site, sizes, pool_range)
        if case is None:
            redrawn += 1
            continue
        inst = build_instance(case.dag, case.state, links, case.budget, tick_s=args.tick_us * 1e-6)
        if not any(j.ticks for j in inst.jobs) or schedule_problems(inst, serial_starts(inst)):
            redrawn += 1  # nothing moves (only Destroy/Create), or MiB rounding broke the serial schedule
            continue
        results.append(run_case(case, inst, links, args, solvers))
        if args.verbose:
            r = results[-1]
            print(f"{len(results):3d} {case.model:4s} {case.pool:2d} dev {len(r.inst.jobs):3d} ops "
                  f"greedy {r.greedy} fits {r.greedy_fits} {r.schedule_wall_s * 1e3:.3f} ms "
                  f"(L_tran {r.l_tran_wall_s * 1e3:.1f} ms); no-mem {r.without_memory}; " + "; ".join(
                      f"{s.solver} {s.makespan} {'opt' if s.optimal else 'lim'} {s.wall_s:.2f} s"
                      for s in r.solutions.values()), flush=True)
    print(f"{len(results)} transitions ({redrawn} draws redrawn: unshardable, over memory, refused, empty "
          f"or rounded out), "
          f"{time.perf_counter() - t0:.0f} s; solvers {', '.join(solvers) or 'none'}, "
          f"limit {args.time_limit:g} s, tick {args.tick_us:g} µs")
    print(report(results, solvers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
