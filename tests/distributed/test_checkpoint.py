"""DCP checkpoint of EMU holdings: saved on 4 ranks in one layout, loaded bit-exact on 3 ranks
in another (resharding on load), and on one process with no process group."""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed
from emu.state.checkpoint import load_holdings, parse_key, save_holdings, saved_plan, slice_key
from emu.state.unit import EmuShard, slots_for
from nereusd.errors import NereusError
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.shards import value_head_for
from tests.support.holdings import canonical, fill, logical_for
from tests.support.specs import TINY as SPEC

ACTOR = ModelStage(Role.ACTOR, Stage.TRAINING)
CRITIC = ModelStage(Role.CRITIC, Stage.TRAINING)
SAVED = Plan({ACTOR: Candidate(2, 2, 1, (0, 1, 2, 3)), CRITIC: Candidate(4, 1, 1, (3, 2, 1, 0))})
LOADED = Plan({ACTOR: Candidate(1, 1, 3, (2, 0, 1)), CRITIC: Candidate(2, 1, 1, (1, 2))})
SEED = 7


def holdings(plan: Plan, rank: int, filled: bool) -> list[EmuShard]:
    out = []
    for m, cand in plan.items():
        if rank in cand.devices:
            _, p, t = cand.coords_of(rank)
            h = EmuShard(m, SPEC, value_head_for(m.role), cand.layout, (p, t), slots_for(m),
                         logical=logical_for(SEED, m))
            if filled:
                fill(h, SEED)
            else:
                h.buffer.fill_(float("nan"))
            out.append(h)
    return out


def check(hs: list[EmuShard]) -> int:
    for h in hs:
        assert h.logical == logical_for(SEED, h.model_stage)
        for s in h.shards:
            for slot in h.slots:
                full = canonical(SEED, h.model_stage, s.name, slot, s.full_shape)
                assert torch.equal(h.view(s.name, slot), full.narrow(s.dim, s.start, s.stop - s.start)), (s, slot)
    return len(hs)


def save_body(rank: int, world: int, directory: str) -> int:
    save_holdings(holdings(SAVED, rank, True), directory, plan=SAVED)
    return rank


def load_body(rank: int, world: int, directory: str) -> int:
    assert saved_plan(directory) == SAVED
    hs = holdings(LOADED, rank, False)
    for h in hs:
        h.logical = logical_for(0, h.model_stage)
    load_holdings(hs, directory)
    return check(hs)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dcp") / "ckpt"
    run_distributed(save_body, 4, str(directory))
    return directory


def test_save_on_four_ranks_load_on_three_in_another_layout(ckpt):
    counts = run_distributed(load_body, 3, str(ckpt))
    assert counts == [1, 2, 2]
    # One process, no process group: the whole model in one tp1·pp1 holding per model-stage.
    one = Plan({ACTOR: Candidate(1, 1, 1, (0,)), CRITIC: Candidate(1, 1, 1, (0,))})
    hs = holdings(one, 0, False)
    load_holdings(hs, ckpt)
    assert check(hs) == 2


def test_missing_state_is_named(ckpt):
    other = ModelStage(Role.REWARD, Stage.INFERENCE)
    h = EmuShard(other, SPEC, True, Candidate(1, 1, 1, (0,)).layout, (0, 0), slots_for(other))
    with pytest.raises(NereusError, match="no state of reward/inference"):
        load_holdings([h], ckpt)


def test_slice_keys_round_trip():
    h = holdings(SAVED, 0, False)[0]
    s = h.shards[3]
    assert parse_key(slice_key(ACTOR, s, "exp_avg")) == ("actor/training", s.name, "exp_avg", s.dim, s.start, s.stop)
    assert parse_key("actor/training/logical") is None
