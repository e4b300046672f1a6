"""A worker dies in the middle of a transition: the state stays intact and recoverable.

Four gloo ranks rendezvous through a TCPStore the test serves (as nereusd does). The transition
moves an actor/training unit tp2 on devices 0,1 to two tp1 replicas on devices 2,3 (Split, two
Extends, Destroys). Rank 3 kills itself (``os._exit``) as its Extend starts. The survivors
share which ops they completed through the store, compute the intact holdings and units as the
controller does (:mod:`nereusd.transition.runner`), drop whatever is not part of those units,
re-form the world as generation 1 of three ranks keeping their tensors
(:func:`emu.worker.world.join_world`), plan a recovery transition from the intact units to a new
target on the survivors, run it, and check parameters, Adam state and logical state bit-exact.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support.distributed import _context_method
from emu.state.devmem import DeviceMemory
from emu.state.executor import TransitionExecutor
from emu.state.primitives import HoldingStore
from emu.state.unit import slots_for
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.shards import value_head_for
from nereusd.transition import plan_transition
from nereusd.transition.recovery import intact_holdings, intact_units
from tests.support.holdings import canonical, fill, logical_for
from tests.support.specs import TINY as SPEC, TINY_MODELS as MODELS

MS = ModelStage(Role.ACTOR, Stage.TRAINING)
CURRENT = Plan({MS: Candidate(2, 1, 1, (0, 1))})
TARGET = Plan({MS: Candidate(1, 1, 2, (2, 3))})
RECOVERY_TARGET = Plan({MS: Candidate(2, 1, 1, (2, 0))})
SEED, VICTIM, WORLD = 5, 3, 4


def _specs(plan):
    return {m: (SPEC, value_head_for(m.role), slots_for(m)) for m in plan}


def _child(rank: int, port: int, out: str) -> None:
    import emu.state.primitives as prim
    from emu.worker.world import join_world

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    join_world(store, generation=0, rank=rank, world_size=WORLD, backend="gloo", timeout=timedelta(seconds=10))
    holdings = HoldingStore(DeviceMemory(rank, 1 << 30))
    cand = CURRENT[MS]
    if rank in cand.devices:
        _, p, t = cand.coords_of(rank)
        h = holdings.allocate((MS, SPEC, False, slots_for(MS)), cand.layout, (p, t), logical_for(SEED, MS))
        fill(h, SEED)
        holdings.put(h)
    dag = plan_transition(CURRENT, TARGET, MODELS, devices_per_node=8)
    ex = TransitionExecutor(dag, rank, holdings, _specs(TARGET))
    ex.prepare()
    if rank == VICTIM:
        real = prim.extend

        def dying(op, me, *args):
            os._exit(17)
        prim.extend = dying
        del real
    failed = ""
    try:
        ex.run()
    except RuntimeError as err:  # the collective with the dead peer
        failed = str(err)[:200]
    # The controller's view: which ops completed everywhere (survivors publish what they ran).
    store.set(f"done/{rank}", json.dumps(sorted(ex.done)))
    survivors = [r for r in range(WORLD) if r != VICTIM]
    done_by = {r: set(json.loads(store.get(f"done/{r}"))) for r in survivors}
    completed = {op.id for op in dag.ops
                 if all(op.id in done_by[d] for d in op.devices if d != VICTIM) and VICTIM not in op.devices}
    intact = intact_holdings(dag, completed, dead={VICTIM})
    units, lost = intact_units(intact)
    assert lost == ()
    keep = {(MS, x, units[MS].layout, units[MS].coords_of(x)[1:]) for x in units[MS].devices}
    for key in list(holdings.items):
        if (key[0], rank, key[1], key[2]) not in keep:
            holdings.pop(*key)
    # Re-form the world without the dead rank, tensors in place.
    try:
        dist.destroy_process_group()
    except RuntimeError:
        pass
    devices = survivors
    new_rank = devices.index(rank)
    join_world(store, generation=1, rank=new_rank, world_size=len(devices), backend="gloo",
               timeout=timedelta(seconds=30))
    recovery = plan_transition(units, RECOVERY_TARGET, MODELS, devices_per_node=8)
    ex2 = TransitionExecutor(recovery, rank, holdings, _specs(RECOVERY_TARGET), rank_of=devices.index)
    ex2.prepare()
    ex2.run()
    ex2.close()
    checked = 0
    want = RECOVERY_TARGET[MS]
    if rank in want.devices:
        _, p, t = want.coords_of(rank)
        h = holdings.get(MS, want.layout, (p, t))
        assert h.logical == logical_for(SEED, MS)
        for s in h.shards:
            for slot in h.slots:
                full = canonical(SEED, MS, s.name, slot, s.full_shape)
                assert torch.equal(h.view(s.name, slot), full.narrow(s.dim, s.start, s.stop - s.start))
                checked += 1
    assert len(holdings.items) == (1 if rank in want.devices else 0)
    dist.barrier()
    dist.destroy_process_group()
    result = {"failed": failed, "completed": sorted(completed), "units": units.to_dict(), "checked": checked}
    Path(out, f"result.{rank}").write_text(json.dumps(result))
    os._exit(0)


def _spawn(child, nprocs: int, out: str, timeout_s: float) -> list:
    """Run ``child(rank, port, out)`` on ``nprocs`` ranks rendezvousing through a TCPStore this
    process serves; their exit codes (``None``: still running at the deadline, terminated)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.start_processes(child, args=(store.port, out), nprocs=nprocs, join=False,
                             start_method=_context_method())
    deadline = time.monotonic() + timeout_s
    for p in ctx.processes:
        p.join(max(1.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.terminate()
    return codes


def test_worker_death_mid_transition_leaves_state_recoverable():
    with tempfile.TemporaryDirectory() as out:
        codes = _spawn(_child, WORLD, out, 120)
        assert codes[VICTIM] == 17 and all(c == 0 for r, c in enumerate(codes) if r != VICTIM), codes
        results = {r: json.loads(Path(out, f"result.{r}").read_text()) for r in range(WORLD) if r != VICTIM}
    # Someone saw the collective with the dead rank fail; the units to replan from survived.
    assert any(r["failed"] for r in results.values())
    units = Plan.from_dict(results[0]["units"])
    assert MS in units and VICTIM not in units[MS].devices
    assert sum(r["checked"] for r in results.values()) > 0


CHUNKED_CURRENT = Plan({MS: Candidate(2, 1, 1, (0, 1))})
CHUNKED_TARGET = Plan({MS: Candidate(1, 1, 1, (0,))})


def _chunked_child(rank: int, port: int, out: str) -> None:
    """Rank 1 dies inside a chunked Split (at its third chunk); rank 0 must fail the op and keep
    booked exactly what its store holds: the half-filled new holding is released."""
    import emu.state.primitives as prim
    from emu.worker.world import join_world
    from nereusd.transition import AdamStateSizes, MemoryBudget, StateModel

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    join_world(store, generation=0, rank=rank, world_size=2, backend="gloo", timeout=timedelta(seconds=10))
    memory = DeviceMemory(rank, 1 << 30)
    holdings = HoldingStore(memory)
    cand = CHUNKED_CURRENT[MS]
    _, p, t = cand.coords_of(rank)
    h = holdings.allocate((MS, SPEC, False, slots_for(MS)), cand.layout, (p, t), logical_for(SEED, MS))
    fill(h, SEED)
    holdings.put(h)
    budget = MemoryBudget(capacity_bytes=1 << 30, collective_buffer_bytes=4096)
    dag = plan_transition(CHUNKED_CURRENT, CHUNKED_TARGET, MODELS, devices_per_node=8,
                          state=StateModel(MODELS, AdamStateSizes()), budget=budget)
    ex = TransitionExecutor(dag, rank, holdings, _specs(CHUNKED_TARGET))
    ex.prepare()
    if rank == 1:
        real, calls = prim._wait_all, []

        def dying(p2p):
            calls.append(1)
            if len(calls) == 3:
                os._exit(17)
            return real(p2p)
        prim._wait_all = dying
    failed = ""
    try:
        ex.run()
    except RuntimeError as err:
        failed = str(err)[:200]
    held = sum(x.nbytes for x in holdings.items.values())
    Path(out, f"result.{rank}").write_text(json.dumps(
        {"failed": failed, "in_use": memory.in_use_bytes, "held": held, "chunked": dag.staging_bytes}))
    os._exit(0)


def test_a_peer_lost_in_a_chunked_split_leaves_no_booking_behind():
    with tempfile.TemporaryDirectory() as out:
        codes = _spawn(_chunked_child, 2, out, 90)
        assert codes == [0, 17], codes
        result = json.loads(Path(out, "result.0").read_text())
    assert result["failed"], result          # the exchange with the dead peer failed
    assert result["held"] > 0, result       # its tp2 holding, kept
    assert result["in_use"] == result["held"], result
