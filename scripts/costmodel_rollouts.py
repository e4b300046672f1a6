"""The generation part of ``scripts/bench_costmodel.py``: vLLM rollouts (the module docstring
there says what is measured and how) against the cost model's generation model-stage."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from costmodel_common import (SPEC, barrier_s, calibrate_with, held_out_table, mape, max_abs_error,  # noqa: E402
                              noise_line, split_layouts)
from nereusd.config.site import SiteConfig  # noqa: E402
from nereusd.cost.calibration import PRIORS, Calibration, fit_efficiencies  # noqa: E402
from nereusd.cost.model import CostModel, StageCost  # noqa: E402
from nereusd.models import ModelSpec  # noqa: E402
from nereusd.plan import ModelStage, Role, Stage  # noqa: E402

GEN = ModelStage(Role.ACTOR, Stage.GENERATION)
GEN_WORLD = 2
"""Engine processes of every generation layout: one thread each, one per core of this 2-core
machine (two TP-1 replicas, or one TP-2 replica), so every rollout keeps both cores busy; each
process has a whole core, twice the share of one of the local site's four devices (the
training layouts' four devices share the cores instead)."""


@dataclass(frozen=True)
class GenLayout:
    """One vLLM generation configuration on :data:`GEN_WORLD` devices.

    ``max_num_seqs`` is the engine's concurrency (the plan's generation ``micro_batch``, the
    wave size); each of the ``dp`` replicas generates ``sequences`` responses of exactly
    ``response_len`` tokens to prompts of ``prompt_len`` tokens.
    """

    tp: int
    max_num_seqs: int
    sequences: int
    prompt_len: int
    response_len: int

    @property
    def dp(self) -> int:
        return GEN_WORLD // self.tp

    @property
    def engine_key(self) -> tuple[int, int]:
        """Layouts with the same key run on one engine (started once)."""
        return self.tp, self.max_num_seqs

    def describe(self) -> str:
        return (f"tp{self.tp} dp{self.dp} seqs{self.max_num_seqs} n{self.sequences} "
                f"p{self.prompt_len} r{self.response_len}")


GEN_LAYOUTS: tuple[GenLayout, ...] = (
    GenLayout(1, 8, 8, 32, 64), GenLayout(1, 8, 8, 32, 128), GenLayout(1, 8, 16, 32, 64),
    GenLayout(1, 8, 4, 128, 64), GenLayout(1, 8, 24, 32, 32),
    GenLayout(1, 32, 32, 32, 64), GenLayout(1, 32, 32, 128, 64), GenLayout(1, 32, 64, 32, 32),
    GenLayout(1, 32, 16, 32, 128), GenLayout(1, 32, 32, 32, 128),
    GenLayout(2, 8, 8, 32, 64), GenLayout(2, 8, 8, 32, 128), GenLayout(2, 8, 16, 32, 64),
    GenLayout(2, 8, 4, 128, 64), GenLayout(2, 8, 24, 32, 32),
    GenLayout(2, 32, 32, 32, 64), GenLayout(2, 32, 32, 128, 64), GenLayout(2, 32, 64, 32, 32),
    GenLayout(2, 32, 16, 32, 128), GenLayout(2, 32, 32, 32, 128),
)
"""20 layouts on four engines (TP 1 and 2, concurrency 8 and 32): one to three waves, prompts
of 32–128 tokens, responses of 32–128; every other one calibrates (:func:`split_layouts`)."""


def predict_generation(cm: CostModel, spec: ModelSpec, layout: GenLayout) -> StageCost:
    """Predicted seconds of ``layout``'s rollouts alone: the generation model-stage's cost without
    the weight synchronisation that precedes them (:meth:`CostModel.weight_sync_cost`), which the
    measurement does not include."""
    full = cm.stage_cost(spec, GEN, sequences=layout.sequences * layout.dp, prompt_length=layout.prompt_len,
                         response_length=layout.response_len, tp=layout.tp, pp=1, dp=layout.dp,
                         micro_batch=layout.max_num_seqs)
    sync = cm.weight_sync_cost(spec, layout.tp, 1, layout.dp).ideal_s_by_class
    ideal = {c: s - sync.get(c, 0.0) for c, s in full.ideal_s_by_class.items()}
    ideal = {c: s for c, s in ideal.items() if s > 1e-12}
    return StageCost(sum(s / cm.efficiency(c) for c, s in ideal.items()), ideal)


def measure_generation_rank(rank: int, layouts: list[dict], reps: int, workdir: str) -> dict:
    """On one of :data:`GEN_WORLD` ranks: per generation layout the wall seconds of every timed
    rollout on :class:`emu.engine.vllm_engine.VllmEngine`, the engine process a worker owns.

    Each engine (one per :attr:`GenLayout.engine_key`: a TP-1 engine per rank, or one TP-2 engine
    over both) is started, loaded with the model's weights and warmed up on each of its layouts;
    then ``reps`` rounds time one rollout of each of its layouts in turn, between two barriers.
    Responses are exactly ``response_len`` tokens (no stop token, temperature 1, a seed per request).
    """
    import torch
    import torch.distributed as dist

    from emu.engine.canonical import init_full_state
    from emu.engine.vllm_engine import EngineConfig, VllmEngine, free_port
    from nereusd.cost.memory import kv_cache_bytes, vllm_block_tokens, vllm_kv_cache_tokens

    state = init_full_state(SPEC, seed=0)
    items = [GenLayout(**raw) for raw in layouts]
    out = {"layouts": [{"times_s": [], "startup_s": 0.0} for _ in items]}
    block = vllm_block_tokens("cpu")
    for key in dict.fromkeys(lay.engine_key for lay in items):
        tp, max_num_seqs = key
        mine = [i for i, lay in enumerate(items) if lay.engine_key == key]
        max_len = max(items[i].prompt_len + items[i].response_len for i in mine)
        box = [free_port("127.0.0.1") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        cfg = EngineConfig(spec=SPEC, tp=tp, tp_rank=rank % tp, master_addr="127.0.0.1", master_port=box[0],
                           max_model_len=max_len,
                           kv_cache_bytes=kv_cache_bytes(SPEC, vllm_kv_cache_tokens(max_num_seqs, max_len, block),
                                                         tp, 1, 4),
                           block_tokens=block, max_num_seqs=max_num_seqs, dtype="float32", device="cpu", threads=1)
        engine = VllmEngine(cfg, workdir=workdir)
        try:
            engine.load_weights(state.items(), version=1)
            gen = torch.Generator().manual_seed(1 + rank // tp)   # replicas get different prompts
            work = {}
            for i in mine:
                lay = items[i]
                prompts = torch.randint(3, SPEC.vocab_size, (lay.sequences, lay.prompt_len), generator=gen).tolist()
                work[i] = prompts
                out["layouts"][i]["startup_s"] = engine.startup_s
                engine.generate(prompts, max_new_tokens=lay.response_len, temperature=1.0, greedy=False,
                                stop_ids=(), seeds=list(range(lay.sequences)))   # warm-up
            for _ in range(reps):
                for i in mine:
                    lay = items[i]
                    dist.barrier()
                    t0 = time.perf_counter()
                    got = engine.generate(work[i], max_new_tokens=lay.response_len, temperature=1.0, greedy=False,
                                          stop_ids=(), seeds=list(range(lay.sequences)))
                    dist.barrier()
                    out["layouts"][i]["times_s"].append(time.perf_counter() - t0)
                    if any(len(r) != lay.response_len for r in got):
                        raise RuntimeError(f"{lay.describe()}: responses of {sorted({len(r) for r in got})} tokens")
        finally:
            engine.close()
            dist.barrier()
    out["barrier_s"] = barrier_s(20)
    return out


def generation_report(rows: list[dict], site: SiteConfig) -> tuple[list[str], float, float]:
    """Printed lines of the generation part, its held-out MAPE and largest error (percent).

    The cost model sees ``site`` as :data:`GEN_WORLD` busy devices per node
    (:meth:`~nereusd.config.site.SiteConfig.with_busy_devices`): on the local site's four devices
    and two cores, each engine process has a whole core, twice a device's share."""
    site = site.with_busy_devices(GEN_WORLD)
    layouts = [GenLayout(**r["layout"]) for r in rows]
    measured = {lay: r["step_s"] for lay, r in zip(layouts, rows)}
    calib, held = split_layouts(layouts)
    lines = [noise_line(rows, "generation")]
    starts = {}
    for lay, row in zip(layouts, rows):
        starts.setdefault(lay.engine_key, row["startup_s"])
    lines.append("vLLM engine start-up: " + ", ".join(f"tp{tp} max_num_seqs {m}: {s:.1f} s"
                                                     for (tp, m), s in starts.items()))
    cal = calibrate_with(site, SPEC, [(lay, measured[lay]) for lay in calib], predict_generation)
    cm = CostModel(site, cal)
    lines.append("online calibration on the 'calib' rollouts: "
                 + ", ".join(f"{c} {e:.3f}" for c, e in cal.snapshot().items() if cal.samples(c)))
    lines.append(f"{'rollout':<34}{'set':>6}{'measured s':>12}{'predicted s':>13}{'error %':>9}{'spread':>8}")
    table, gen_mape, gen_max = held_out_table(
        [lay.describe() for lay in layouts], rows, [measured[lay] for lay in layouts], [lay in calib for lay in layouts],
        [predict_generation(cm, SPEC, lay).latency_s for lay in layouts])
    lines.extend(table)
    meas_held = [measured[lay] for lay in held]
    lines.append(f"held-out rollouts: {len(held)}; MAPE {gen_mape:.1f} %; max {gen_max:.1f} %")
    base = CostModel(site)
    eff = fit_efficiencies([(predict_generation(base, SPEC, lay).ideal_s_by_class, measured[lay]) for lay in calib],
                           PRIORS)
    fitted = CostModel(site, Calibration(priors=eff))
    pred = [predict_generation(fitted, SPEC, lay).latency_s for lay in held]
    lines.append(f"least-squares efficiencies instead (held-out): MAPE {mape(pred, meas_held):.1f} %; "
                 f"max {max_abs_error(pred, meas_held):.1f} % ("
                 + ", ".join(f"{c} {e:.3g}" for c, e in sorted(eff.items())) + ")")
    return lines, gen_mape, gen_max
