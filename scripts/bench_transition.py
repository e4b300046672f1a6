"""Transition cost on local gloo workers: EMU primitives vs checkpoint/restart vs in-place DCP vs raw.

One training model-stage (fp32 parameters + Adam ``exp_avg``/``exp_avg_sq``, a few hundred MB)
goes through three transitions: scale-out tp2·dp1 → tp2·dp2 (2 → 4 devices), tp2·dp2 → tp2·dp4
(4 → 8) and a TP change tp4·dp1 → tp2·dp2 on 4 devices. Counted as on a cluster: every worker
of the largest world has started and joined before a transition begins.

* (a) ``emu``: communicator set-up (``new_group`` per gather group / rank pair), receive buffers
  allocated and touched, then the DAG's primitives (:mod:`emu.state.executor`), until the last rank is done.
* (b) ``ckpt-restart``: DCP save → every worker exits → a fresh world is spawned (``spawn``:
  new interpreters import torch) and joins → DCP load into the new layout (:mod:`emu.state.checkpoint`).
* (c) ``dcp-inplace``: DCP save and load into the new layout in the running world.
* (d) ``raw``: the same bytes with plain collectives on warm, touched buffers over pre-created
  groups (Extend pairs: broadcast; Split groups: all-gather), all pairs at once.

Prints one line per transition, with ``L̂_tran``: the transition engine's estimate of the same DAG
(:func:`nereusd.transition.estimate_l_tran`, the prediction admission uses, without its learned
terms) priced with the local site's link figures (``site_configs/local.yaml``: gloo over loopback)
and fp32 Adam state, against (a); above the last line the estimate's error per case and how many
are within 25 % (issue 16's target for ``L̂_tran``); and, last,
``transition: emu <s> s; ckpt-restart <x>x slower; dcp-inplace <y>x slower; emu/raw <r>`` over the sum.
Usage: ``python scripts/bench_transition.py [--hidden 512 --layers 8 --reps 3]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from emu.state.checkpoint import load_holdings, save_holdings
from emu.state.devmem import DeviceMemory
from emu.state.executor import TransitionExecutor
from emu.state.primitives import Communicators, HoldingStore, all_gather_single, create_communicators, gather_groups
from emu.state.unit import TRAIN_SLOTS, EmuShard, LogicalState, nbytes_of
from nereusd.errors import ConfigError
from nereusd.models import ModelSpec
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage
from nereusd.config.site import load_site
from nereusd.transition import AdamStateSizes, SiteLinkCosts, estimate_l_tran, plan_transition
from nereusd.transition.ops import OpKind

MS = ModelStage(Role.ACTOR, Stage.TRAINING)
CASES = [
    ("scale-out 2→4", Candidate(2, 1, 1, (0, 1)), Candidate(2, 1, 2, (0, 1, 2, 3))),
    ("scale-out 4→8", Candidate(2, 1, 2, (0, 1, 2, 3)), Candidate(2, 1, 4, tuple(range(8)))),
    ("tp4→tp2·dp2", Candidate(4, 1, 1, (0, 1, 2, 3)), Candidate(2, 1, 2, (0, 1, 2, 3))),
]
WORLD = 8


def spec_of(args) -> ModelSpec:
    h = args.hidden
    return ModelSpec(vocab_size=8192, hidden_size=h, intermediate_size=int(h * 2.75) // 64 * 64,
                     num_layers=args.layers, num_heads=8, num_kv_heads=8)


def holdings_of(spec: ModelSpec, cand: Candidate, rank: int, fill: bool) -> list[EmuShard]:
    if rank not in cand.devices:
        return []
    _, p, t = cand.coords_of(rank)
    h = EmuShard(MS, spec, False, cand.layout, (p, t), TRAIN_SLOTS, logical=LogicalState(step=3))
    if fill:
        torch.manual_seed(rank)
        h.buffer.normal_()
    return [h]


def _sync_time(t0: float) -> float:
    """Seconds from the common start ``t0`` until the last rank got here."""
    t = torch.tensor([time.time() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _start() -> float:
    dist.barrier()
    t = torch.tensor([time.time()], dtype=torch.float64)
    dist.broadcast(t, src=0)
    return float(t)


def emu_once(spec, src, dst, rank) -> float:
    dag = plan_transition(Plan({MS: src}), Plan({MS: dst}), {Role.ACTOR: spec}, devices_per_node=8)
    store = HoldingStore(DeviceMemory(rank, 1 << 40))
    for h in holdings_of(spec, src, rank, True):
        store.put(h, book=True)
    t0 = _start()
    ex = TransitionExecutor(dag, rank, store, {MS: (spec, False, TRAIN_SLOTS)})
    ex.prepare()
    for op in dag.ops:  # receive buffers allocated and touched while communicators come up
        if op.kind is OpKind.EXTEND and rank in op.target_devices:
            pos = op.target_positions[op.target_devices.index(rank)]
            store.preallocate(MS, op.target_layout, pos, nbytes_of(spec, False, op.target_layout, pos, 3) // 4)
    ex.run()
    elapsed = _sync_time(t0)
    ex.close()
    return elapsed


def raw_once(spec, src, dst, rank) -> float:
    dag = plan_transition(Plan({MS: src}), Plan({MS: dst}), {Role.ACTOR: spec}, devices_per_node=8)
    comms = Communicators()
    create_communicators(dag, comms)
    jobs = []
    for op in dag.ops:
        if op.kind is OpKind.EXTEND:
            for s, d, pos in zip(op.source_devices, op.target_devices, op.target_positions):
                if rank in (s, d):
                    n = nbytes_of(spec, False, op.source_layout, pos, 3) // 4
                    jobs.append(("bcast", torch.ones(n), s, comms.get(op.id, (s, d))))
        elif op.kind is OpKind.SPLIT:
            for g in gather_groups(op):
                if rank in g:
                    pos = op.source_positions[op.source_devices.index(rank)]
                    n = nbytes_of(spec, False, op.source_layout, pos, 3) // 4
                    bufs = (torch.ones(n * len(g)), torch.ones(n))
                    jobs.append(("gather", bufs, None, comms.get(op.id, g)))
    t0 = _start()
    works = [dist.broadcast(b, src=s, group=g, async_op=True) if kind == "bcast"
             else all_gather_single(b[0], b[1], group=g, async_op=True) for kind, b, s, g in jobs]
    for w in works:
        w.wait()
    elapsed = _sync_time(t0)
    comms.destroy()
    return elapsed


def dcp_save(spec, src, rank, directory) -> float:
    hs = holdings_of(spec, src, rank, True)
    t0 = _start()
    save_holdings(hs, directory)
    return _sync_time(t0)


def dcp_load(spec, dst, rank, directory) -> float:
    hs = holdings_of(spec, dst, rank, False)
    t0 = _start()
    load_holdings(hs, directory)
    return _sync_time(t0)


def world_main(rank: int, port: int, args, tmp: str, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=rank, world_size=WORLD)
    spec = spec_of(args)
    out = {}
    for i, (name, src, dst) in enumerate(CASES):
        emu = [emu_once(spec, src, dst, rank) for _ in range(args.reps)]
        raw = [raw_once(spec, src, dst, rank) for _ in range(args.reps)]
        inplace = []
        for r in range(args.reps):
            d = os.path.join(tmp, f"inplace{i}_{r}")
            inplace.append(dcp_save(spec, src, rank, d) + dcp_load(spec, dst, rank, d))
        save = dcp_save(spec, src, rank, os.path.join(tmp, f"restart{i}"))
        out[name] = {"emu": statistics.median(emu), "raw": statistics.median(raw),
                     "inplace": statistics.median(inplace), "save": save}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put((out, time.time()))
        results.close()
        results.join_thread()  # the queue's feeder thread must flush before os._exit
    os._exit(0)


def restart_main(rank: int, port: int, args, tmp: str, results, t_spawn: float) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{args.gen}/", store), rank=rank, world_size=WORLD)
    spec = spec_of(args)
    name, _, dst = CASES[args.case]
    hs = holdings_of(spec, dst, rank, False)
    load_holdings(hs, os.path.join(tmp, f"restart{args.case}"))
    elapsed = _sync_time(t_spawn)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        results.put(elapsed)
        results.close()
        results.join_thread()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers: expected at least 1, got {args.layers}")
    if args.reps < 1:
        parser.error(f"--reps: expected at least 1, got {args.reps}")
    if args.hidden < 32 or args.hidden % 16:   # 8 heads of an even head dimension; intermediate 2.75 x, in 64s
        parser.error(f"--hidden: expected a multiple of 16 of at least 32, got {args.hidden}")
    try:
        spec = spec_of(args)
    except ConfigError as err:
        parser.error(f"--hidden {args.hidden}: {err}")
    full = 12 * sum(s.numel for s in __import__("nereusd.shards", fromlist=["x"]).shards_of(
        spec, Candidate(1, 1, 1, (0,)).layout, (0, 0), False))
    print(f"model + Adam state: {full / 2**20:.0f} MiB; world of {WORLD} gloo ranks")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="bench_transition_")
    try:
        results = ctx.Queue()
        procs = [ctx.Process(target=world_main, args=(r, store.port, args, tmp, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        out, t_done = results.get(timeout=1800)
        for p in procs:
            p.join()
        exit_s = time.time() - t_done  # interpreter exit of every worker
        totals = {"emu": 0.0, "restart": 0.0, "inplace": 0.0, "raw": 0.0}
        links, sizes = SiteLinkCosts.from_site(load_site("local")), AdamStateSizes.for_dtype("fp32")
        errors = []
        for i, (name, _, _) in enumerate(CASES):
            args.case, args.gen = i, i + 1
            t_spawn = time.time()
            procs = [ctx.Process(target=restart_main, args=(r, store.port, args, tmp, results, t_spawn))
                     for r in range(WORLD)]
            for p in procs:
                p.start()
            start_load = results.get(timeout=1800)
            for p in procs:
                p.join()
            r = out[name]
            restart = r["save"] + exit_s + start_load
            _, src, dst = CASES[i]
            dag = plan_transition(Plan({MS: src}), Plan({MS: dst}), {Role.ACTOR: spec}, devices_per_node=8)
            predicted = estimate_l_tran(dag, sizes, links).l_tran_s
            errors.append(100.0 * (predicted / r["emu"] - 1.0))
            print(f"{name}: emu {r['emu']:.3f} s (L_tran {predicted:.3f} s, {errors[-1]:+.0f} %), raw {r['raw']:.3f} s, "
                  f"dcp-inplace {r['inplace']:.3f} s, ckpt-restart {restart:.3f} s (save {r['save']:.3f} + exit "
                  f"{exit_s:.3f} + spawn/join/load {start_load:.3f})")
            for k, v in (("emu", r["emu"]), ("restart", restart), ("inplace", r["inplace"]), ("raw", r["raw"])):
                totals[k] += v
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"L_tran vs emu (local site's links): {', '.join(f'{e:+.0f} %' for e in errors)}; within 25 %: "
          f"{sum(abs(e) <= 25 for e in errors)} of {len(errors)}")
    print(f"transition: emu {totals['emu']:.3f} s; ckpt-restart {totals['restart'] / totals['emu']:.1f}x slower; "
          f"dcp-inplace {totals['inplace'] / totals['emu']:.1f}x slower; emu/raw {totals['emu'] / totals['raw']:.2f}")


if __name__ == "__main__":
    main()
