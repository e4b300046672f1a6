"""ZeRO-0 vs ZeRO-1 vs ZeRO-2 on 4 local ranks, and a live dp 2 → 4 move against a checkpoint restart.

All in one run, on a Llama of ``--hidden``/``--layers``/``--vocab`` (seeded random weights), fp32,
4 gloo ranks (virtual CPU devices):

1. **Step time and peak memory**: per ZeRO stage, a dp 4 training model-stage (ZeRO-0: the native
   engine; 1, 2: :class:`emu.engine.deepspeed_stage.DeepSpeedStageEngine`) runs ``--steps``
   optimizer steps of the same batch; the table gives the mean step time after one warm-up step
   and the device's peak *booked* bytes (:class:`emu.state.devmem.DeviceMemory`: parameters,
   gradients, optimizer state and activations as each engine books them — for DeepSpeed at the
   partition sizes it allocated), max over ranks.
2. **dp 2 → 4, live**: a ZeRO-1 model-stage trained on ranks 0–1 moves to ranks 0–3 as a worker
   moves it (:mod:`emu.engine.zero_repartition`: each old replica keeps its optimizer partition;
   the transition DAG that ``nereusd.transition`` plans moves the parameters, run by
   :class:`emu.state.executor.TransitionExecutor`; DeepSpeed engines built on 4 ranks take the
   parameters and receive their partitions) — wall time from the detach to the last partition
   received, max over ranks.
3. **dp 2 → 4, restart** (the alternative every frozen framework uses): the same dp 2 job as a
   2-process job of its own trains the same 2 steps and saves with DeepSpeed's own
   ``save_checkpoint`` (timed); DeepSpeed loads ZeRO state at another DP size only from a
   *universal* checkpoint, so ``deepspeed.checkpoint.ds_to_universal`` converts it (timed); then
   4 new processes — import, process group, model, ``deepspeed.initialize`` with
   ``load_universal``, ``load_checkpoint`` — until every rank has loaded; wall time of save,
   conversion and restart. Both moves
   are checked: the restarted and the moved states are compared with the saved one.

Last line: ``zero: stage1 peak <a>x of stage0; dp2->4 transition <t> s vs restart <u> s (<r>x)``.
Target r ≥ 10.

    GLOO_SOCKET_IFNAME=lo .venv/bin/python scripts/bench_zero.py
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from emu.engine.model import LlamaModel  # noqa: E402
from emu.engine.parallel import build_stage_groups  # noqa: E402
from emu.engine.stage import StageEngine  # noqa: E402
from emu.engine.zero_repartition import keep_partition, repartition  # noqa: E402
from emu.state.devmem import DeviceMemory  # noqa: E402
from emu.state.executor import TransitionExecutor  # noqa: E402
from emu.state.primitives import HoldingStore  # noqa: E402
from emu.state.unit import bind_engine, holding_of  # noqa: E402
from nereusd.errors import ConfigError  # noqa: E402
from nereusd.models import ModelSpec  # noqa: E402
from nereusd.plan import Candidate, ModelStage, Plan, Role, Stage  # noqa: E402
from nereusd.transition import AdamStateSizes, MemoryBudget, StateModel, plan_transition  # noqa: E402
from tests.support.distributed import run_distributed  # noqa: E402

MS = ModelStage(Role.ACTOR, Stage.TRAINING)
SIZES = AdamStateSizes(param_bytes=4, master_bytes=0, optimizer_bytes=8)
UNIVERSAL = {"checkpoint": {"load_universal": True}}


def make(rank: int, cand: Candidate, spec: ModelSpec, memory: DeviceMemory, micro_batch: int,
         ds_config: dict | None = None):
    groups = build_stage_groups(cand, rank)   # collective over the world
    if groups is None:
        return None
    kw = dict(model_stage=MS, spec=spec, candidate=cand, rank=rank, groups=groups, device=torch.device("cpu"),
              memory=memory, value_head=False, lr=1e-4, grad_clip=1.0, micro_batch=micro_batch)
    if not cand.zero_stage:
        return StageEngine(trainable=True, **kw)
    from emu.engine.deepspeed_stage import DeepSpeedStageEngine
    return DeepSpeedStageEngine(zero_stage=cand.zero_stage, ds_config=ds_config, **kw)


def batch(spec: ModelSpec, n: int, length: int):
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, spec.vocab_size, (length,), generator=gen).tolist() for _ in range(n)]
    pls = [length // 2] * n
    total = n * (length - length // 2)
    per_token = {"weight": [[1.0 / total] * (length - length // 2) for _ in range(n)],
                 "adv": [[1.0] * (length - length // 2) for _ in range(n)]}
    return seqs, pls, per_token


def loss_fn(outputs, b):
    return -(b["weight"] * b["adv"] * outputs["logprobs"]).sum(), {}


def train(engine, cand, seqs, pls, per_token):
    d, n = engine.groups.dp_rank, len(seqs)
    lo, hi = d * n // cand.dp, (d + 1) * n // cand.dp
    return engine.train_step(seqs[lo:hi], pls[lo:hi], {k: v[lo:hi] for k, v in per_token.items()}, loss_fn)


def body(rank: int, world: int, args: dict, ckpt: str) -> dict:
    spec = ModelSpec(**args["spec"])
    seqs, pls, per_token = batch(spec, args["batch"], args["length"])
    out: dict = {"stages": {}}
    for z in (0, 1, 2):
        cand = Candidate(1, 1, world, tuple(range(world)), zero_stage=z)
        memory = DeviceMemory(rank, 1 << 40)
        eng = make(rank, cand, spec, memory, args["micro_batch"])
        eng.initialize(seed=1)
        times = []
        for _ in range(args["steps"]):
            dist.barrier()
            t = time.perf_counter()
            train(eng, cand, seqs, pls, per_token)
            times.append(time.perf_counter() - t)
        out["stages"][z] = {"step_s": statistics.mean(times[1:]), "peak_bytes": memory.peak_bytes}
        if z:
            eng.release()
        del eng
    # The comparison's engines are garbage of this script's own making (a native engine's module
    # and optimizer sit in reference cycles): collected here, or they stay allocated through the
    # move below and slow it (DAG 1.43–1.81 s per rank instead of 0.62 s, a /tmp A/B). A worker
    # frees a detached engine's tensors explicitly and collects after every build and transition.
    gc.collect()
    # dp 2 on ranks 0-1: a trained ZeRO-1 model-stage, moved live to ranks 0-3
    pair, quad = Candidate(1, 1, 2, (0, 1), zero_stage=1), Candidate(1, 1, 4, (0, 1, 2, 3), zero_stage=1)
    memory = DeviceMemory(rank, 1 << 40)
    eng = make(rank, pair, spec, memory, args["micro_batch"])
    if eng is not None:
        eng.initialize(seed=1)
        for _ in range(2):
            train(eng, pair, seqs, pls, per_token)
    models = {Role.ACTOR: spec}
    dag = plan_transition(Plan({MS: pair}), Plan({MS: quad}), models, devices_per_node=world,
                          state=StateModel(models, SIZES), budget=MemoryBudget(capacity_bytes=1 << 40))
    dist.barrier()
    t = time.perf_counter()
    store = HoldingStore(memory)
    phases, kept = {}, None
    if eng is not None:   # detach as emu.worker.transition_tasks does: ZeRO to ZeRO keeps the partition
        holding, kept = keep_partition(eng, memory)
        store.put(holding, book=True)
    dist.barrier()
    phases["keep"] = time.perf_counter() - t
    ex = TransitionExecutor(dag, rank, store, {MS: (spec, False, ("param",))})   # parameters only
    ex.prepare()
    ex.run()
    ex.close()
    dist.barrier()
    phases["dag"] = time.perf_counter() - t - sum(phases.values())
    moved = make(rank, quad, spec, memory, args["micro_batch"])
    phases["build"] = time.perf_counter() - t - sum(phases.values())
    bind_engine(moved, store.pop(MS, quad.layout, (0, 0)))
    phases["adopt"] = time.perf_counter() - t - sum(phases.values())
    out["received_bytes"] = repartition(kept, moved, memory)
    dist.barrier()
    out["transition_s"] = time.perf_counter() - t
    phases["repartition"] = out["transition_s"] - sum(phases.values())
    out["phases"] = phases
    out["moved"] = holding_of(moved).buffer.clone()
    moved.release()
    return out


def frozen_body(rank: int, world: int, args: dict, ckpt: str) -> dict:
    """The frozen job at dp 2 (a world of its own: DeepSpeed's checkpoint API barriers on the whole
    world): the same 2 steps as the live pair, then DeepSpeed's save, timed."""
    spec = ModelSpec(**args["spec"])
    seqs, pls, per_token = batch(spec, args["batch"], args["length"])
    pair = Candidate(1, 1, 2, (0, 1), zero_stage=1)
    eng = make(rank, pair, spec, DeviceMemory(rank, 1 << 40), args["micro_batch"])
    eng.initialize(seed=1)
    for _ in range(2):
        train(eng, pair, seqs, pls, per_token)
    dist.barrier()
    t = time.perf_counter()
    eng.ds.save_checkpoint(ckpt, tag="dp2")
    dist.barrier()
    return {"save_s": time.perf_counter() - t}


def restart_body(rank: int, world: int, args: dict, ckpt: str, spawned_at: float) -> dict:
    """One rank of the restarted job (timed from the parent's spawn): import, engine, load."""
    import deepspeed  # noqa: F401  (what a restarted DeepSpeed job imports)

    spec = ModelSpec(**args["spec"])
    quad = Candidate(1, 1, 4, (0, 1, 2, 3), zero_stage=1)
    eng = make(rank, quad, spec, DeviceMemory(rank, 1 << 40), args["micro_batch"], UNIVERSAL)
    eng.ds.load_checkpoint(ckpt, tag="dp2_universal", load_optimizer_states=True)
    dist.barrier()
    done = time.time() - spawned_at
    state = holding_of(eng).buffer.clone()
    eng.release()
    return {"restart_s": done, "state": state}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (all replicas)")
    ap.add_argument("--length", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    for option, value, least, what in (
            ("--hidden", a.hidden, 1, ""), ("--layers", a.layers, 1, ""), ("--micro-batch", a.micro_batch, 1, ""),
            ("--vocab", a.vocab, 2, " (token ids are drawn from 1 .. vocab - 1)"),
            ("--length", a.length, 2, " (half prompt, half response)"),
            ("--steps", a.steps, 2, " (one warm-up step, then the timed ones)")):
        if value < least:
            ap.error(f"{option}: expected at least {least}{what}, got {value}")
    if a.batch < 4 or a.batch % 4:   # train() splits it over the replicas: 4 ranks, and 2 before the move
        ap.error(f"--batch: expected a positive multiple of 4 (an equal share for each of the 4 ranks), got {a.batch}")
    spec = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_layers=a.layers,
                num_heads=max(1, a.hidden // 64), num_kv_heads=max(1, a.hidden // 128), max_position=a.length)
    try:
        ModelSpec(**spec)
    except ConfigError as err:
        ap.error(f"--hidden {a.hidden}: {err} (heads: hidden // 64, KV heads: hidden // 128)")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    args = {"spec": spec, "batch": a.batch, "length": a.length, "micro_batch": a.micro_batch, "steps": a.steps}
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaModel(ModelSpec(**spec), value_head=False).parameters())
    print(f"model: {params / 1e6:.1f} M parameters (hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}), fp32; "
          f"4 gloo ranks; batch {a.batch} x {a.length} tokens, micro-batch {a.micro_batch}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        live = run_distributed(body, 4, args, tmp, timeout_s=1800)
        save_s = max(r["save_s"] for r in run_distributed(frozen_body, 2, args, tmp, timeout_s=1800))
        t = time.time()   # DeepSpeed loads another DP size only from a universal checkpoint
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        f"{tmp}/dp2", "--output_folder", f"{tmp}/dp2_universal", "--inject_missing_state"],
                       check=True, capture_output=True)
        convert_s = time.time() - t
        spawned = time.time()
        restarted = run_distributed(restart_body, 4, args, tmp, spawned, timeout_s=1800)
    print(f"{'stage':>6} {'step s':>8} {'peak MiB':>9}")
    for z in (0, 1, 2):
        step = statistics.mean(r["stages"][z]["step_s"] for r in live)
        peak = max(r["stages"][z]["peak_bytes"] for r in live)
        print(f"{'zero' + str(z):>6} {step:8.3f} {peak / 2**20:9.1f}")
    peak = {z: max(r["stages"][z]["peak_bytes"] for r in live) for z in (0, 1, 2)}
    transition = max(r["transition_s"] for r in live)
    restart = save_s + convert_s + max(r["restart_s"] for r in restarted)
    exact = all(torch.equal(x["moved"], y["state"]) for x, y in zip(live, restarted))
    phases = {k: max(r["phases"][k] for r in live) for k in live[0]["phases"]}
    print("dp2->4 live, by phase (max over ranks): " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
          + f"; partitions received {sum(r['received_bytes'] for r in live) / 2**20:.1f} MiB")
    print(f"dp2->4 live: {transition:.2f} s; DeepSpeed save {save_s:.2f} s + ds_to_universal {convert_s:.2f} s + restart "
          f"{max(r['restart_s'] for r in restarted):.2f} s; moved state == restarted state: {exact}")
    print(f"zero: stage1 peak {peak[1] / peak[0]:.2f}x of stage0; dp2->4 transition {transition:.2f} s "
          f"vs restart {restart:.2f} s ({restart / transition:.1f}x)")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
