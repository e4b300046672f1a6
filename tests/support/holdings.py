"""Canonical tensors and holdings for the data-plane tests: every test fills and checks shards
the same way (seeded per model-stage, parameter and slot), so a transition's output can be
compared with ``torch.equal`` against what the source held."""

from __future__ import annotations

import zlib

import torch

from emu.state.primitives import HoldingStore
from emu.state.unit import EmuShard, LogicalState, slots_for
from nereusd.plan import ModelStage, Plan
from nereusd.shards import value_head_for
from tests.support.specs import TINY as SPEC


def canonical(seed: int, ms: ModelStage, name: str, slot: str, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{ms}/{name}/{slot}".encode()))
    return torch.randn(shape, generator=gen)


def fill(shard: EmuShard, seed: int) -> None:
    for s in shard.shards:
        for slot in shard.slots:
            full = canonical(seed, shard.model_stage, s.name, slot, s.full_shape)
            shard.view(s.name, slot).copy_(full.narrow(s.dim, s.start, s.stop - s.start))


def logical_for(seed: int, ms: ModelStage) -> LogicalState:
    return LogicalState(step=seed % 7, version=3, policy_version=seed % 5, position=64 * seed, seed=seed)


def specs_for(plan: Plan, spec=SPEC):
    """What the executor needs per model-stage of ``plan``: ``(spec, value head, slots)``."""
    return {m: (spec, value_head_for(m.role), slots_for(m)) for m in plan}


def check_holdings(store: HoldingStore, plan: Plan, rank: int, seed: int, where: object) -> None:
    """``rank`` holds exactly ``plan``'s units, each with its logical state and every slot equal to
    the canonical tensors of ``seed`` (``where`` labels a failure)."""
    want = set()
    for m, cand in plan.items():
        if rank not in cand.devices:
            continue
        _, p, t = cand.coords_of(rank)
        want.add((m, cand.layout, (p, t)))
        h = store.get(m, cand.layout, (p, t))
        assert h.logical == logical_for(seed, m), (where, m, h.logical)
        for s in h.shards:
            for slot in h.slots:
                full = canonical(seed, m, s.name, slot, s.full_shape)
                exact = full.narrow(s.dim, s.start, s.stop - s.start)
                assert torch.equal(h.view(s.name, slot), exact), (where, m, s, slot)
    assert set(store.items) == want, (where, sorted(map(str, store.items)), sorted(map(str, want)))
