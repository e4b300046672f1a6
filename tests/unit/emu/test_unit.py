"""EMU holdings on one process: slot-major views, engine binding, logical state (emu/state/unit.py)."""

from __future__ import annotations

import pytest
import torch

from emu.state.devmem import DeviceMemory
from emu.engine.stage import StageEngine
from emu.engine.parallel import build_stage_groups
from emu.state.unit import EmuShard, LogicalState, bind_engine, holding_of
from nereusd.errors import NereusError
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Role, Stage

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = ModelSpec(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 max_position=32)
MS = ModelStage(Role.ACTOR, Stage.TRAINING)


def engine() -> StageEngine:
    cand = Candidate(1, 1, 1, (0,))
    e = StageEngine(model_stage=MS, spec=SPEC, candidate=cand, rank=0, groups=build_stage_groups(cand, 0),
                    device=torch.device("cpu"), memory=DeviceMemory(0, 1 << 30), value_head=False, trainable=True,
                    lr=1e-2, grad_clip=1.0, micro_batch=2)
    e.initialize(seed=3)
    return e


def step(e: StageEngine) -> None:
    seqs, pls = [[1, 2, 3, 4, 5], [3, 1, 4]], [2, 1]
    weight = [[0.5] * (len(s) - p) for s, p in zip(seqs, pls)]
    e.train_step(seqs, pls, {"weight": weight},
                 lambda out, batch: (-(out["logprobs"] * batch["weight"]).sum(), {}))


def test_bound_engine_trains_bit_identically_and_lives_in_its_holding():
    plain, bound = engine(), engine()
    shard = bind_engine(bound, logical=LogicalState(seed=9))
    for _ in range(2):
        step(plain)
        step(bound)
    for name, p in plain.params.items():
        assert torch.equal(p, bound.params[name])
        assert bound.params[name].data_ptr() == shard.view(name, "param").data_ptr()
        st = plain.optimizer.state[p]
        assert torch.equal(st["exp_avg"], shard.view(name, "exp_avg"))
        assert torch.equal(st["exp_avg_sq"], shard.view(name, "exp_avg_sq"))
    assert holding_of(bound).logical == LogicalState(step=2, seed=9)
    # the parameters are the slot-major prefix of the buffer
    only = shard.params_only()
    assert only.buffer.data_ptr() == shard.buffer.data_ptr() and only.numel == shard.numel_per_slot


def test_rebinding_a_new_engine_to_a_holding_copies_nothing():
    first = engine()
    step(first)
    shard = bind_engine(first)
    second = engine()
    bind_engine(second, shard)
    for name, p in second.params.items():
        assert p.data_ptr() == shard.view(name, "param").data_ptr()
    other = EmuShard(MS, SPEC, False, Candidate(2, 1, 1, (0, 1)).layout, (0, 1), shard.slots)
    with pytest.raises(NereusError, match="does not fit engine"):
        bind_engine(engine(), other)


def test_dp_scaling_keeps_every_sample_once():
    state = LogicalState(position=96, seed=1)
    for dp, mb, accum in ((2, 4, 4), (4, 4, 2), (8, 2, 2)):  # global batch 32 each time
        seen = [i for r in range(dp) for i in state.replica_samples(dp, r, mb, accum)]
        assert seen == list(range(96, 128))
    a, b = state.replica_rng(0), state.replica_rng(1)
    assert not torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert LogicalState.from_tensor(state.to_tensor()) == state == LogicalState.from_dict(state.to_dict())
    with pytest.raises(NereusError, match="expected fields"):
        LogicalState.from_dict({"step": 1})
