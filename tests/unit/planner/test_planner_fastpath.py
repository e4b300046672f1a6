"""The planner's fast path (vectorised costing, pre-sorted frontiers) gives the plans of the
scalar implementation it replaced.

``data/planner_golden_before.json`` holds the plans and predicted step latencies the planner
returned *before* the fast path (commit 0b331be), on 72 small cases (1–4 H200 nodes, PPO / GRPO
/ ReMax, synchronous and asynchronous, 512 and 4,096 response tokens, with and without
any-divisor TP/PP and recomputation). A change of the cost model's formulas changes them; the
file is then rewritten from the current planner (``python -m tests.unit.planner.test_planner_fastpath``)
and becomes a regression snapshot, while :func:`test_vectorised_costs_equal_stage_cost` keeps
checking the fast path against the scalar cost. Rewritten on 2026-12-04, when a generation wave's
prefill became one forward pass (was one per sequence): 6 of the 72 plans changed, 16 more
only their predicted latency. Rewritten on 2026-12-05, when a prefill's head moved to each
prompt's last position (was every prompt token): 2 plans changed, 60 more only their predicted
latency (median −0.04 %, at most −1.2 %). (A middle pipeline stage's p2p calls, counted the
same day, change nothing here: NCCL batches them, and these cases are on H200.) Rewritten on
2026-12-07, when parameter counts came from the sharding table (a critic's value head in place of
the output head, k/v replicated where the engine replicates them): no plan changed, 8 only their
predicted latency (at most 0.08 %).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from nereusd.cost import vector as costvec
from nereusd.cost.model import CostModel
from nereusd.planner.search import Planner, frontier
from nereusd.planner.space import PlannerOptions, _share, enumerate_options
from tests.support.planning import problem

GOLDEN = json.loads((Path(__file__).parent / "data" / "planner_golden_before.json").read_text())


@pytest.mark.parametrize("entry", GOLDEN, ids=lambda e: "-".join(f"{v}" for v in e["case"].values()))
def test_same_plan_as_before(entry):
    c = entry["case"]
    pb = problem(c["nodes"], c["algorithm"], asynchronous=c["asynchronous"], response=c["response"])
    # the golden plans predate the runtime's pp = 1 rule for generation: search as they did
    res = Planner(pb, CostModel(pb.site), PlannerOptions(any_divisor=c["any_divisor"], generation_pp=True,
                                                         allow_recompute=c["recompute"])).solve()
    assert res.plan.to_dict() == entry["plan"]
    assert res.predicted_step_latency_s == pytest.approx(entry["step_latency_s"], rel=1e-12)


@pytest.mark.parametrize("algorithm,mean_fraction,epochs", [("ppo", 1.0, 1), ("remax", 1.0, 1), ("ppo", 0.35, 1),
                                                             ("ppo", 1.0, 3)])
def test_vectorised_costs_equal_stage_cost(algorithm, mean_fraction, epochs):
    pb = problem(2, algorithm, response=2048)
    pb = dataclasses.replace(pb, workload=dataclasses.replace(pb.workload, response_mean_fraction=mean_fraction,
                                                              mini_batches=2, epochs=epochs))
    cm = CostModel(pb.site)
    opts = PlannerOptions(allow_recompute=True, micro_batches=(1, 2, 4))
    for m in pb.workflow.model_stages:
        sequences = pb.workflow.sequences(m, pb.workload)
        for o in enumerate_options(pb, m, cm, opts, float("inf")):
            # timed at the engine's padding (Workload.priced_pass): rows of different micro-batch
            # and pp differ in response length, which the vectorised path prices per group
            _, response = pb.workload.priced_pass(m.stage, o.micro_batch, _share(pb, m, o.dp), o.pp, sequences)
            kw = dict(sequences=sequences, prompt_length=pb.workload.prompt_length,
                      response_length=response, tp=o.tp, pp=o.pp, dp=o.dp,
                      micro_batch=o.micro_batch, recompute=o.recompute, response_mean_fraction=mean_fraction,
                      mini_batches=2, epochs=epochs)
            ref = cm.stage_cost(pb.spec(m), m, **kw)
            assert o.latency_s == pytest.approx(ref.latency_s, rel=1e-12), (m, o)
            assert dict(o.cost_by_class) == pytest.approx(dict(ref.ideal_s_by_class), rel=1e-12)
            fast = costvec.latencies(cm, pb.spec(m), m, dp=np.array([o.dp]), micro_batch=np.array([o.micro_batch]),
                                     recompute=np.array([o.recompute]),
                                     **{k: v for k, v in kw.items() if k not in ("dp", "micro_batch", "recompute")})
            assert fast[0] == pytest.approx(ref.latency_s, rel=1e-12)


def test_sorted_frontier_equals_frontier():
    pb = problem(2, "ppo", response=4096)
    planner = Planner(pb, CostModel(pb.site), PlannerOptions(allow_recompute=True))
    for m, opts in planner.all_options.items():
        peaks = sorted({o.peak_bytes for o in opts})
        for max_peak in (float("inf"), peaks[len(peaks) // 2], peaks[0]):
            for max_res in (float("inf"), min(o.resident_bytes for o in opts)):
                want = frontier(opts, max_peak, max_res)
                got = planner._sorted[m].frontier(max_peak, max_res)
                assert [o.layout for o in got] == [o.layout for o in want]


def _reference_take(free, count, prefer, index=None):
    """``placement._take`` as it was before the preference index (commit 0b331be)."""
    best, best_key = None, None
    nodes = {d_node for d_node, devs in free.items() if prefer and any(d in prefer for d in devs)}
    for node in nodes:
        devs = free[node]
        if len(devs) < count:
            continue
        key = (-min(sum(d in prefer for d in devs), count), len(devs), node)
        if best_key is None or key < best_key:
            best, best_key = node, key
    if best is None:
        for node, devs in free.items():
            if len(devs) >= count and (best_key is None or (len(devs), node) < best_key):
                best, best_key = node, (len(devs), node)
                if len(devs) == count:
                    break
    if best is None:
        return None
    devs = free[best]
    chosen = [d for d in devs if d in prefer][:count]
    chosen += [d for d in devs if d not in chosen][: count - len(chosen)]
    free[best] = [d for d in devs if d not in chosen]
    return sorted(chosen)


@pytest.mark.parametrize("nodes,first,second,shrink", [(2, 512, 4096, 0), (4, 1024, 8192, 0), (4, 512, 512, 8),
                                                       (3, 4096, 512, 4)])
def test_preferred_placement_same_as_before(monkeypatch, nodes, first, second, shrink):
    import dataclasses

    from nereusd.planner import placement
    pb = problem(nodes, "ppo", response=first)
    start = Planner(pb, CostModel(pb.site)).solve().plan
    pb2 = problem(nodes, "ppo", response=second)
    pb2 = dataclasses.replace(pb2, pool=pb2.pool[shrink:])
    fast = Planner(pb2, CostModel(pb2.site)).solve(start)
    monkeypatch.setattr(placement, "_take", _reference_take)
    slow = Planner(pb2, CostModel(pb2.site)).solve(start)
    assert fast.plan.to_dict() == slow.plan.to_dict()


def test_generation_keeps_pp_1_by_default():
    # the runtime folds PP into DP for generation: the default search never proposes otherwise
    cases = [e["case"] for e in GOLDEN if any(c["pp"] > 1 for k, c in e["plan"].items() if k.endswith("generation"))]
    assert cases, "the golden set should contain plans with pipelined generation"
    for c in cases[:4]:
        pb = problem(c["nodes"], c["algorithm"], asynchronous=c["asynchronous"], response=c["response"])
        res = Planner(pb, CostModel(pb.site), PlannerOptions(any_divisor=c["any_divisor"],
                                                             allow_recompute=c["recompute"])).solve()
        assert all(cand.pp == 1 for ms, cand in res.plan.items() if ms.stage.value == "generation"), c


def _regenerate() -> None:
    """Rewrite the golden file from the current planner (same cases, same options as the test)."""
    out = []
    for entry in GOLDEN:
        c = entry["case"]
        pb = problem(c["nodes"], c["algorithm"], asynchronous=c["asynchronous"], response=c["response"])
        res = Planner(pb, CostModel(pb.site), PlannerOptions(any_divisor=c["any_divisor"], generation_pp=True,
                                                             allow_recompute=c["recompute"])).solve()
        out.append({"case": c, "plan": res.plan.to_dict(), "step_latency_s": res.predicted_step_latency_s})
    path = Path(__file__).parent / "data" / "planner_golden_before.json"
    path.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    changed = sum(a["plan"] != b["plan"] for a, b in zip(GOLDEN, out))
    print(f"{path}: {len(out)} cases, {changed} plans changed")


if __name__ == "__main__":
    _regenerate()
