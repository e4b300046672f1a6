"""Communicators from a :class:`emu.state.groups.GroupPool` (4 gloo ranks): groups handed back
are reused for the same ranks without a ``new_group``, still carry collectives correctly, are
never shared by two ops of one set, and idle ones past the capacity are destroyed."""

from __future__ import annotations

import torch
import torch.distributed as dist

from emu.state.groups import GroupPool
from emu.state.primitives import Communicators
from tests.support.distributed import run_distributed


def _sum_over(comms: Communicators, op_id: str, devices, rank: int) -> float | None:
    if rank not in devices:
        return None
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x, group=comms.get(op_id, devices))
    return float(x)


def pool_body(rank: int, world: int) -> dict:
    pool = GroupPool(capacity=2)
    out = {}
    first = Communicators(pool=pool)
    for op_id, devices in (("a", (0, 1)), ("b", (0, 1)), ("c", (0, 1, 2, 3))):
        first.create(op_id, devices)
    out["distinct"] = first.get("a", (0, 1)) is not first.get("b", (0, 1)) if rank in (0, 1) else True
    out["first"] = [_sum_over(first, "a", (0, 1), rank), _sum_over(first, "c", (0, 1, 2, 3), rank)]
    created = pool.created
    held = first.get("c", (0, 1, 2, 3)) if rank < 4 else None
    first.destroy()                       # 3 idle, capacity 2: the oldest (a's) destroyed
    out["idle_after_release"] = len(pool.idle)
    second = Communicators(pool=pool)
    second.create("x", (0, 1, 2, 3))      # reused: no new_group
    second.create("y", (0, 1))            # b's group, still idle
    second.create("z", (0, 1))            # a's was destroyed: a new one
    out["reused"] = pool.reused
    out["created_after"] = pool.created - created
    out["same_group"] = second.get("x", (0, 1, 2, 3)) is held
    out["second"] = [_sum_over(second, "x", (0, 1, 2, 3), rank), _sum_over(second, "y", (0, 1), rank),
                     _sum_over(second, "z", (0, 1), rank)]
    second.destroy()
    return out


def test_group_pool_reuses_groups_on_every_rank_alike():
    for rank, r in enumerate(run_distributed(pool_body, 4)):
        assert r["distinct"], rank
        member = rank in (0, 1)
        assert r["first"] == [3.0 if member else None, 10.0], (rank, r)
        assert r["idle_after_release"] == 2 and r["reused"] == 2 and r["created_after"] == 1, (rank, r)
        assert r["same_group"], rank
        assert r["second"] == [10.0, 3.0 if member else None, 3.0 if member else None], (rank, r)
