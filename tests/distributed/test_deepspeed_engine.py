"""The DeepSpeed ZeRO-1/2 training engine (emu/engine/deepspeed_stage.py) against the native one.

One spawn of 3 gloo ranks: ranks 0 and 1 form a dp = 2 ZeRO replica set (rank 2 is a pool member
outside it, as in a real pool), and every rank also runs the native one-process engine on the
whole batch. Per ZeRO stage and role, 3 training steps must give the native engine's metrics,
parameters and Adam moments within fp tolerance; then the EMU boundary is crossed: the dp = 2
replicas export their holding (parameters + full moments), and engines at dp = 1 (each rank
alone) and at dp = 2 on the reversed device order adopt it and export again — bit-exact. The
dp = 1 engine trains one more step, which must equal the native engine's fourth step.
"""

from __future__ import annotations

import pytest
import torch

from emu.engine.deepspeed_stage import DeepSpeedStageEngine
from emu.engine.parallel import build_stage_groups
from emu.state.devmem import DeviceMemory
from emu.state.unit import TRAIN_SLOTS, bind_engine, holding_of
from nereusd.plan import Candidate
from tests.distributed.test_engine_parallel import (ADAM_EPS, TRAIN, critic_loss, make_engine, per_token_inputs,
                                                    policy_loss, sequences, share)
from tests.support.distributed import run_distributed
from tests.support.specs import ENGINE as SPEC

pytest.importorskip("deepspeed")

TOL = 2e-5
STEPS = 3


def ds_engine(rank, cand, value_head, zero_stage, memory=None):
    groups = build_stage_groups(cand, rank)
    if groups is None:
        return None
    return DeepSpeedStageEngine(
        zero_stage=zero_stage, model_stage=TRAIN[value_head], spec=SPEC, candidate=cand, rank=rank, groups=groups,
        device=torch.device("cpu"), memory=memory or DeviceMemory(rank, 1 << 30), value_head=value_head,
        lr=1e-2, eps=ADAM_EPS, grad_clip=0.5, micro_batch=2)


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
    exported = holding_of(eng) if eng is not None else None      # collective over the pair
    if exported is not None:
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
    alone.release()
    # dp = 2 on the reversed devices adopts the pair's exported holding
    swapped = Candidate(1, 1, 2, (1, 0), zero_stage=zero_stage)
    eng2 = ds_engine(rank, swapped, value_head, zero_stage)
    if eng2 is not None:
        bind_engine(eng2, holding)
    back = holding_of(eng2) if eng2 is not None else None
    if back is not None:
        out["dp2_roundtrip_exact"] = bool(torch.equal(flat(back), flat(holding)))
        eng2.release()
    return out


def run_rank(rank, world):
    return {(z, vh): case(rank, world, z, vh) for z in (1, 2) for vh in (False, True)}


@pytest.mark.slow
def test_deepspeed_zero_matches_native_and_moves_exactly():
    per_rank = run_distributed(run_rank, 3)
    for rank, results in enumerate(per_rank):
        for (z, vh), r in results.items():
            label = f"rank {rank} zero{z} {'critic' if vh else 'actor'}"
            if rank < 2:
                assert r["metrics"] < TOL, (label, r)
                assert r["vs_native"] < TOL, (label, r)
                assert r["step"] == STEPS, (label, r)
                assert r["dp2_roundtrip_exact"], label
                # booked at DeepSpeed's partition sizes: fp32 master + m + v of half the model (+ padding)
                half = -(-r["params"] // 2)
                assert 12 * half <= r["booked_optimizer"] <= 12 * (half + 64), (label, r)
            assert r["dp1_roundtrip_exact"], label
            assert r["dp1_step"] == STEPS, label
            assert r["dp1_next_metrics"] < TOL, (label, r)
            assert r["dp1_next_state"] < TOL, (label, r)
