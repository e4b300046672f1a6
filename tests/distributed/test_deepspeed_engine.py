"""The DeepSpeed ZeRO-1/2 training engine (emu/engine/deepspeed_stage.py) against the native one.

One spawn of 3 gloo ranks: ranks 0 and 1 form a dp = 2 ZeRO replica set (rank 2 is a pool member
outside it, as in a real pool), and every rank also runs the native one-process engine on the
whole batch. Per ZeRO stage and role, 3 training steps must give the native engine's metrics,
parameters and Adam moments within fp tolerance; then the EMU boundary is crossed: the dp = 2
replicas export their holding (parameters + full moments), and engines at dp = 1 (each rank
alone) and at dp = 2 on the reversed device order adopt it and export again — bit-exact. The
dp = 1 engine trains one more step, which must equal the native engine's fourth step. DCP
checkpoints cross ZeRO stages and DP sizes both ways, bit-exact.

A second test runs 100 random transitions of a ZeRO model-stage through the transition planner
and executor, as a worker does.
"""

from __future__ import annotations

import random
import weakref

import pytest
import torch

from emu.engine.deepspeed_stage import DeepSpeedStageEngine
from emu.engine.parallel import build_stage_groups
from emu.state.devmem import DeviceMemory
from emu.engine.canonical import init_full_state
from emu.state.executor import TransitionExecutor
from emu.state.primitives import HoldingStore
from emu.state.unit import TRAIN_SLOTS, EmuShard, LogicalState, bind_engine, holding_of
from nereusd.plan import Candidate, Plan, Role
from nereusd.transition import AdamStateSizes, MemoryBudget, StateModel, check_feasibility, plan_transition
from tests.support.holdings import canonical, fill, specs_for
from tests.distributed.test_engine_parallel import (ADAM_EPS, TRAIN, critic_loss, make_engine, per_token_inputs,
                                                    policy_loss, sequences, share)
from tests.support.deepspeed import requires_deepspeed
from tests.support.distributed import run_distributed
from tests.support.specs import ENGINE as SPEC


TOL = 2e-5
STEPS = 3
SIZES = AdamStateSizes(param_bytes=4, master_bytes=0, optimizer_bytes=8)
"""The canonical holdings a transition moves: fp32 parameter + Adam m, v (12 bytes/element)."""


def ds_engine(rank, cand, value_head, zero_stage, memory=None, max_tokens=None):
    groups = build_stage_groups(cand, rank)
    if groups is None:
        return None
    return DeepSpeedStageEngine(
        zero_stage=zero_stage, model_stage=TRAIN[value_head], spec=SPEC, candidate=cand, rank=rank, groups=groups,
        device=torch.device("cpu"), memory=memory or DeviceMemory(rank, 1 << 30), value_head=value_head,
        lr=1e-2, eps=ADAM_EPS, grad_clip=0.5, micro_batch=2, max_tokens_per_micro_batch=max_tokens)


def step(eng, cand, dp_rank, value_head, step_no):
    seqs, pls = sequences()
    per_token = per_token_inputs(seqs, pls)
    seqs = [s[step_no % 3:] + s[:step_no % 3] for s in seqs]  # different data each step, same lengths
    return eng.train_step(share(seqs, cand.dp, dp_rank), share(pls, cand.dp, dp_rank),
                          {k: share(v, cand.dp, dp_rank) for k, v in per_token.items()},
                          critic_loss if value_head else policy_loss)


def rel(a: dict, b: dict) -> float:
    """Largest relative difference of two metric dicts (``grad_norm`` is O(1..100))."""
    return max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for k in b)


def flat(holding) -> torch.Tensor:
    return holding.buffer.clone()


def case(rank, world, zero_stage, value_head):
    own = Candidate(1, 1, 1, (rank,))
    native = make_engine(rank, own, build_stage_groups(own, rank), value_head)
    native.initialize(seed=7)
    bind_engine(native)
    ref_metrics = [step(native, own, 0, value_head, s) for s in range(STEPS)]
    ref = flat(holding_of(native))
    out = {}
    pair = Candidate(1, 1, 2, (0, 1), zero_stage=zero_stage)
    memory = DeviceMemory(rank, 1 << 30)
    eng = ds_engine(rank, pair, value_head, zero_stage, memory)
    if eng is not None:
        eng.initialize(seed=7)
        metrics = [step(eng, pair, eng.groups.dp_rank, value_head, s) for s in range(STEPS)]
        out["metrics"] = max(rel(m, r) for m, r in zip(metrics, ref_metrics))
        out["booked_optimizer"] = memory.entries()[(str(TRAIN[value_head]), "optimizer")]
        out["params"] = sum(p.numel() for p in native.params.values())
        # the export's one all-gather per slot gives exactly what DeepSpeed's per-parameter calls do
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        state = eng._adam_state()
        mine = {"fp32": eng._gathered(eng.ds_optimizer.single_partition_of_fp32_groups[0], "fp32"),
                **{k: eng._gathered(state[k], k) for k in ("exp_avg", "exp_avg_sq")}}
        theirs = {"fp32": {n: safe_get_full_fp32_param(p) for n, p in eng.params.items()},
                  **{k: {n: safe_get_full_optimizer_state(p, k) for n, p in eng.params.items()}
                     for k in ("exp_avg", "exp_avg_sq")}}   # every call on both ranks: they are collective
        out["gathered_as_deepspeed"] = [torch.equal(mine[k][n], theirs[k][n]) for k in mine for n in eng.params]
    exported = holding_of(eng) if eng is not None else None      # collective over the pair
    if exported is not None:
        # the export joined each slot straight into its holding row: the same values as the above
        rows = exported.buffer.view(3, exported.numel_per_slot)
        out["export_rows_as_gathered"] = eng._flat_is_holding_row(exported) and all(
            torch.equal(rows[i], torch.cat([mine[k][s.name].reshape(-1) for s in exported.shards]))
            for i, k in enumerate(("fp32", "exp_avg", "exp_avg_sq")))
        out["vs_native"] = float((flat(exported) - ref).abs().max())
        out["step"] = exported.logical.step
        eng.release()
    # dp = 1: every rank alone adopts the pair's holding (rank 2 adopts the native one)
    holding = exported if exported is not None else holding_of(native)
    alone = ds_engine(rank, own, value_head, zero_stage)
    bind_engine(alone, holding)
    again = holding_of(alone)
    out["dp1_roundtrip_exact"] = bool(torch.equal(flat(again), flat(holding)))
    out["dp1_step"] = again.logical.step
    nxt = step(alone, own, 0, value_head, STEPS)
    ref_next = step(native, own, 0, value_head, STEPS)
    out["dp1_next_metrics"] = rel(nxt, ref_next)
    out["dp1_next_state"] = float((flat(holding_of(alone)) - flat(holding_of(native))).abs().max())
    buffers = [weakref.ref(alone.ds_optimizer.single_partition_of_fp32_groups[0]),
               weakref.ref(alone.ds_optimizer.bit16_groups_flat[0])]
    alone.release()
    out["released_buffers_freed"] = all(ref() is None for ref in buffers)   # not left to a later gc
    # dp = 2 on the reversed devices adopts the pair's exported holding
    swapped = Candidate(1, 1, 2, (1, 0), zero_stage=zero_stage)
    eng2 = ds_engine(rank, swapped, value_head, zero_stage)
    if eng2 is not None:
        bind_engine(eng2, holding)
    back = holding_of(eng2) if eng2 is not None else None
    if back is not None:
        out["dp2_roundtrip_exact"] = bool(torch.equal(flat(back), flat(holding)))
    # the adoption by slices of the rows leaves DeepSpeed's partitions as its per-parameter calls do
    eng3 = ds_engine(rank, swapped, value_head, zero_stage)
    if eng3 is not None:
        eng3._flat_is_holding_row = lambda shard: False
        bind_engine(eng3, holding)
        partitions = [(e.ds_optimizer.single_partition_of_fp32_groups[0], e._adam_state()) for e in (eng2, eng3)]
        (m2, s2), (m3, s3) = partitions
        out["adopt_rows_as_per_parameter"] = bool(torch.equal(m2, m3)) and all(
            torch.equal(s2[k], s3[k]) for k in ("exp_avg", "exp_avg_sq")) and float(s2["step"]) == float(s3["step"])
        eng3.release()
    if eng2 is not None:
        eng2.release()
    return out


def checkpoint_case(rank, world, directory: str) -> dict:
    """A ZeRO-1 dp 2 checkpoint (ranks 0, 1; DCP through the canonical holding) loads into a
    ZeRO-0 engine and a ZeRO-1 engine at dp 1 on every rank, bit-exact; and a ZeRO-0 checkpoint
    loads into ZeRO-2 at dp 2 (as the worker's load_checkpoint does: holding, load, bind)."""
    from emu.state.checkpoint import load_holdings, save_holdings

    pair = Candidate(1, 1, 2, (0, 1), zero_stage=1)
    eng = ds_engine(rank, pair, False, 1)
    if eng is not None:
        eng.initialize(seed=7)
        for s in range(2):
            step(eng, pair, eng.groups.dp_rank, False, s)
    saved = holding_of(eng) if eng is not None else None
    save_holdings([saved] if saved is not None else [], f"{directory}/zero1", plan=Plan({TRAIN[False]: pair}))
    box = [flat(saved) if saved is not None else None]
    torch.distributed.broadcast_object_list(box, src=0)
    want = box[0]
    out = {}
    own = Candidate(1, 1, 1, (rank,))
    native = make_engine(rank, own, build_stage_groups(own, rank), False)
    bind_engine(native)
    h = holding_of(native)
    load_holdings([h], f"{directory}/zero1")
    bind_engine(native, h)
    out["zero1_to_zero0"] = bool(torch.equal(flat(holding_of(native)), want))
    alone = ds_engine(rank, own, False, 1)
    h = holding_of(alone)
    load_holdings([h], f"{directory}/zero1")
    bind_engine(alone, h)
    out["zero1_to_zero1_dp1"] = bool(torch.equal(flat(holding_of(alone)), want))
    alone.release()
    # the reverse: rank 2's native holding saved alone, loaded by a ZeRO-2 pair
    step(native, own, 0, False, 5)
    mine = holding_of(native)
    group = torch.distributed.new_group([2])
    if rank == 2:
        save_holdings([mine], f"{directory}/zero0", process_group=group)
        box = [flat(mine)]
    else:
        box = [None]
    torch.distributed.barrier()
    torch.distributed.broadcast_object_list(box, src=2)
    z2 = ds_engine(rank, Candidate(1, 1, 2, (0, 1), zero_stage=2), False, 2)
    if z2 is not None:
        h = holding_of(z2)
        load_holdings([h], f"{directory}/zero0")
        bind_engine(z2, h)
        out["zero0_to_zero2_dp2"] = bool(torch.equal(flat(holding_of(z2)), box[0]))
        z2.release()
    return out


def token_budget_case(rank, world, z=2) -> dict:
    """Token-budget micro-batches: the two replicas pack their shares into different numbers of
    micro-batches (ZeRO-2 reduces during every backward, so they must agree on a count, and the
    shorter one's padding backward must fill the buckets in a real backward's order) and still
    equal the native engine."""
    own = Candidate(1, 1, 1, (rank,))
    native = make_engine(rank, own, build_stage_groups(own, rank), False, max_tokens=12)
    native.initialize(seed=7)
    bind_engine(native)
    ref = [step(native, own, 0, False, s) for s in range(2)]
    pair = Candidate(1, 1, 2, (0, 1), zero_stage=z)
    eng = ds_engine(rank, pair, False, z, max_tokens=12)
    if eng is None:
        return {}
    eng.initialize(seed=7)
    seqs, pls = sequences()
    from emu.engine.batch import PackedBatch
    mine = share(list(range(len(seqs))), 2, eng.groups.dp_rank)
    index = eng._response_index([seqs[i] for i in mine], [pls[i] for i in mine])
    n_micro = PackedBatch.build([seqs[i] for i in mine], index, 2, torch.device("cpu"), max_tokens=12).n_micro
    got = [step(eng, pair, eng.groups.dp_rank, False, s) for s in range(2)]
    out = {"n_micro": n_micro, "metrics": max(rel(g, r) for g, r in zip(got, ref)),
           "state": float((flat(holding_of(eng)) - flat(holding_of(native))).abs().max())}
    eng.release()
    return out


def run_rank(rank, world, directory):
    out = {(z, vh): case(rank, world, z, vh) for z in (1, 2) for vh in (False, True)}
    out["checkpoint"] = checkpoint_case(rank, world, directory)
    out["token_budget"] = token_budget_case(rank, world)
    out["token_budget1"] = token_budget_case(rank, world, 1)
    return out


@pytest.mark.slow
@requires_deepspeed
def test_deepspeed_zero_matches_native_and_moves_exactly(tmp_path):
    per_rank = run_distributed(run_rank, 3, str(tmp_path))
    for key in ("token_budget", "token_budget1"):
        budget = [r.pop(key) for r in per_rank]
        assert budget[0]["n_micro"] != budget[1]["n_micro"], budget   # the case this checks
        for b in budget[:2]:
            assert b["metrics"] < TOL and b["state"] < TOL, (key, budget)
    for rank, results in enumerate(per_rank):
        ckpt = results.pop("checkpoint")
        assert ckpt["zero1_to_zero0"] and ckpt["zero1_to_zero1_dp1"], (rank, ckpt)
        assert ckpt.get("zero0_to_zero2_dp2", rank == 2), (rank, ckpt)
        for (z, vh), r in results.items():
            label = f"rank {rank} zero{z} {'critic' if vh else 'actor'}"
            if rank < 2:
                assert r["metrics"] < TOL, (label, r)
                assert r["vs_native"] < TOL, (label, r)
                assert r["step"] == STEPS, (label, r)
                assert r["dp2_roundtrip_exact"], label
                assert r["export_rows_as_gathered"] and r["adopt_rows_as_per_parameter"], label
                assert r["gathered_as_deepspeed"] and all(r["gathered_as_deepspeed"]), label
                # booked at DeepSpeed's partition sizes: fp32 master + m + v of half the model (+ padding)
                half = -(-r["params"] // 2)
                assert 12 * half <= r["booked_optimizer"] <= 12 * (half + 64), (label, r)
            assert r["dp1_roundtrip_exact"], label
            assert r["dp1_step"] == STEPS, label
            assert r["dp1_next_metrics"] < TOL, (label, r)
            assert r["dp1_next_state"] < TOL, (label, r)
            assert r["released_buffers_freed"], label


# --------------------------------------------------------------------------- random transitions

POOL = 4
TRANSITIONS = 100
ZERO_MS = TRAIN[False]


def zero_candidate(rnd, previous=None):
    """A random ZeRO-1/2 unit set of dp 1..4 on the pool (tp = pp = 1), different from ``previous``."""
    while True:
        dp = rnd.randint(1, POOL)
        cand = Candidate(1, 1, dp, tuple(rnd.sample(range(POOL), dp)), zero_stage=rnd.choice((1, 2)))
        if cand != previous:
            return cand


def zero_chain(seed: int) -> list[Candidate]:
    rnd = random.Random(seed)
    chain = [zero_candidate(rnd)]
    for _ in range(TRANSITIONS):
        chain.append(zero_candidate(rnd, chain[-1]))
    return chain


def engine_peak_bytes(cand: Candidate) -> int:
    """What a ZeRO engine of ``cand`` books by the memory model (parameters, gradients, optimizer
    partitions) plus what a rank keeps beside it through a transition: at most the 12
    bytes/element of an export (a re-partition keeps the parameters' holding, 4 bytes/element,
    and an old partition of ``m``, ``v``, at most 8 bytes/element)."""
    from nereusd.cost.memory import zero_state_bytes
    numel = sum(v.numel() for v in init_full_state(SPEC, value_head=False, seed=0).values())
    state = zero_state_bytes(numel, cand.dp, cand.zero_stage, 4)
    return 4 * numel + state["gradients"] + state["optimizer"] + 12 * numel + (64 << 10)  # + partition padding


def random_zero_transitions(rank: int, world: int, seed: int) -> dict:
    """The chain's transitions on this rank, as a worker runs them (ZeRO to ZeRO: each old replica
    keeps its partition and detaches its parameters, the planned DAG moves parameter-only
    holdings, the new replicas are built, take the parameters and receive their partitions,
    ``emu.engine.zero_repartition``), each new replica's partitions and parameters checked
    bit-exact against the canonical tensors after each one; at the end the export path too."""
    from emu.engine.deepspeed_stage import DeepSpeedStageEngine  # noqa: F811 (spawned process)
    from emu.engine.zero_repartition import keep_partition, repartition
    from nereusd.transition import repartitioned_by, zero_repartitioned

    chain = zero_chain(seed)
    models = {Role.ACTOR: SPEC}
    report = {"transitions": 0, "kinds": set(), "max_peak_ratio": 0.0, "dp": set(), "received_bytes": 0}
    logical = LogicalState(step=5, version=2, policy_version=2, position=320, seed=seed)

    def build(cand, memory):
        groups = build_stage_groups(cand, rank)   # collective over the world
        if groups is None:
            return None
        return DeepSpeedStageEngine(zero_stage=cand.zero_stage, model_stage=ZERO_MS, spec=SPEC, candidate=cand,
                                    rank=rank, groups=groups, device=torch.device("cpu"), memory=memory,
                                    value_head=False, lr=1e-2, grad_clip=0.5, micro_batch=2)

    first = chain[0]
    memory = DeviceMemory(rank, 1 << 34)
    engine = build(first, memory)
    if engine is not None:
        h = EmuShard(ZERO_MS, SPEC, False, first.layout, (0, 0), TRAIN_SLOTS, logical=logical)
        fill(h, seed)
        bind_engine(engine, h)
    flats = canonical_flats(engine, seed) if engine is not None else None
    for i, (cur, tgt) in enumerate(zip(chain, chain[1:])):
        cur_plan, tgt_plan = Plan({ZERO_MS: cur}), Plan({ZERO_MS: tgt})
        assert zero_repartitioned(cur_plan, tgt_plan) == {ZERO_MS}
        state_model = StateModel(models, SIZES, repartitioned_by(cur_plan, tgt_plan))   # as assess_transition
        need = max([*state_model.plan_bytes(cur_plan).values(), *state_model.plan_bytes(tgt_plan).values()])
        for factor in (1.0, 1.25, 1.5, 2.0, 3.0):
            budget = MemoryBudget(capacity_bytes=int(need * factor / 0.9) + 1, collective_buffer_bytes=1 << 30)
            dag = plan_transition(cur_plan, tgt_plan, models, devices_per_node=POOL, state=state_model, budget=budget)
            if check_feasibility(dag, state_model, budget).feasible:
                break
        limit = max(budget.limit_bytes, engine_peak_bytes(cur), engine_peak_bytes(tgt))
        memory = DeviceMemory(rank, limit)
        store = HoldingStore(memory)
        kept = None
        if engine is not None:   # detach as TransitionTasks._detach: keep the partition, the parameters to the store
            memory.allocate(str(ZERO_MS), "parameters", 4 * sum(p.numel() for p in engine.params.values()))
            holding, kept = keep_partition(engine, memory)
            assert holding.logical == logical, (i, holding.logical)
            check_holding(holding, seed, (i, cur.describe()))
            store.put(holding, book=True)
        ex = TransitionExecutor(dag, rank, store, {ZERO_MS: (SPEC, False, ("param",))})
        ex.prepare()
        ex.run()
        ex.close()
        engine = build(tgt, memory)
        if engine is not None:
            bind_engine(engine, store.pop(ZERO_MS, tgt.layout, (0, 0)))
        report["received_bytes"] += repartition(kept, engine, memory)
        if engine is not None:
            flats = flats or canonical_flats(engine, seed)
            check_partition(engine, flats, (i, tgt.describe()))
            assert engine.logical == logical, (i, engine.logical)
        assert not store.items, (i, list(store.items))
        assert (str(ZERO_MS), "partition") not in memory.entries(), i
        report["max_peak_ratio"] = max(report["max_peak_ratio"], memory.peak_bytes / limit)
        report["transitions"] += 1
        report["kinds"] |= {op.kind.value for op in dag.ops}
        report["dp"].add((cur.dp, tgt.dp))
    if engine is not None:
        check_holding(holding_of(engine), seed, "end")   # the export path: joined over the last DP group
        engine.release()
    return report


def canonical_flats(engine, seed) -> dict[str, torch.Tensor]:
    """The canonical tensors of each slot, flattened in DeepSpeed's flat-buffer order (the module's)."""
    return {slot: torch.cat([canonical(seed, ZERO_MS, name, slot, p.shape).reshape(-1)
                             for name, p in engine.params.items()]) for slot in TRAIN_SLOTS}


def check_partition(engine, flats, where) -> None:
    """``engine``'s parameters, master partition and Adam moment partitions equal the canonical
    tensors' slices, and its partition padding is zero."""
    opt = engine.ds_optimizer
    flat = opt.single_partition_of_fp32_groups[0]
    numel = flats["param"].numel()
    start, valid = engine._partition_span(flat, numel)
    state = engine._adam_state()
    assert torch.equal(opt.bit16_groups_flat[0][:numel], flats["param"]), where
    for slot, part in (("param", flat), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
        assert torch.equal(part[:valid], flats[slot][start:start + valid]), (where, slot)
        assert not part[valid:].any(), (where, slot)


def check_holding(h, seed, where) -> None:
    for s in h.shards:
        for slot in h.slots:
            exact = canonical(seed, ZERO_MS, s.name, slot, s.full_shape)
            assert torch.equal(h.view(s.name, slot), exact), (where, s.name, slot)


@pytest.mark.slow
@requires_deepspeed
def test_random_zero_transitions_keep_state_bit_exact():
    """100 random transitions of a ZeRO-1/2 training model-stage (dp 1–4, device moves, joins,
    leaves, ZeRO-stage changes) on 4 ranks, re-partitioned as a worker does, keep parameters and
    both Adam moments bit-exact against the canonical tensors that never moved; each
    transition's DAG is planned under the tightest budget of a few that is feasible, and no rank
    books beyond it (or beyond a ZeRO engine's model-predicted peak with what a transition keeps
    beside it, when that is larger)."""
    reports = run_distributed(random_zero_transitions, POOL, 5, timeout_s=600)
    for r in reports:
        assert r["transitions"] == TRANSITIONS
        assert r["max_peak_ratio"] <= 1.0
    assert sum(r["received_bytes"] for r in reports) > 0   # partitions crossed ranks, not only local copies
    r0 = reports[0]
    assert {"extend", "destroy"} <= r0["kinds"], r0["kinds"]
    assert {a for a, _ in r0["dp"]} == {1, 2, 3, 4}
