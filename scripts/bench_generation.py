"""Generation on vLLM against Nereus's native decoder, as Nereus runs them; weight sync; engine rebuild.

For each model (the demo's warm start, and Llamas of ~40 M and ~100 M parameters made here with
seeded random weights), batch size, response length and TP size, both engines generate the same
prompts (16 random token ids each) to exactly ``new_tokens`` tokens (no stop token; sampling at
temperature 1, per-request seeds) and the table gives generated tokens per second of wall time:

- **vllm**: :class:`emu.engine.vllm_engine.VllmEngine`, the engine process a worker owns (TP 2:
  two engine processes in their own world, started from two gloo ranks), after one warm-up
  call; start-up is not counted here (it is the "engine rebuild" figure).
- **native**: :func:`emu.engine.generate.generate` through a :class:`StageEngine` with the whole
  batch in one wave (TP 2: two gloo ranks), after one warm-up call.

Both get the same CPU threads: ``--threads`` at TP 1, one per rank at TP 2 (this machine has 2
cores). Then, for the ~100 M model at TP 1: **weight sync** — :meth:`VllmEngine.load_weights` of
the full state (the generation side of a weight synchronisation) in seconds and GB/s; and
**engine rebuild** — a generation TP 1 → 2 transition's engine part: stop the TP-1 engine, start
the two TP-2 engine processes and load their weights (what ``emu.worker.vllm_stages`` does in
``transition_finish``), wall time.

The last line: ``generation: vllm <a> tok/s; native <b> tok/s (<r>x); weight sync <s> s (<g> GB/s);
engine rebuild <t> s``, with a, b and r = a/b at the ~40 M model, batch 64, 128 new tokens, TP 1.

    GLOO_SOCKET_IFNAME=lo .venv/bin/python scripts/bench_generation.py            # the full grid
    GLOO_SOCKET_IFNAME=lo .venv/bin/python scripts/bench_generation.py --quick    # the headline point only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from emu.engine.canonical import init_full_state  # noqa: E402
from emu.engine.hf_io import load_pretrained  # noqa: E402
from emu.engine.parallel import build_stage_groups  # noqa: E402
from emu.engine.stage import StageEngine  # noqa: E402
from emu.engine.vllm_engine import EngineConfig, VllmEngine, free_port  # noqa: E402
from emu.state.devmem import DeviceMemory  # noqa: E402
from nereusd.cost.memory import kv_cache_bytes, vllm_block_tokens, vllm_kv_cache_tokens  # noqa: E402
from nereusd.models import ModelSpec  # noqa: E402
from nereusd.plan import Candidate, ModelStage  # noqa: E402
from tests.support.distributed import run_distributed  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 16
GEN = ModelStage.parse("actor/generation")


MODEL_NAMES = ("demo", "40M", "100M")
"""The keys of :func:`models`, known before loading any."""


def models() -> dict[str, ModelSpec]:
    demo, _ = load_pretrained(REPO / "examples" / "models" / "counting-warmstart")
    return {
        "demo": demo,
        "40M": ModelSpec(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=10, num_heads=8,
                         num_kv_heads=4, max_position=1024),
        "100M": ModelSpec(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12,
                          num_kv_heads=4, max_position=1024),
    }


def n_params(spec: ModelSpec) -> int:
    return sum(t.numel() for t in init_full_state(spec, seed=0).values())


def prompts(spec: ModelSpec, batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, spec.vocab_size, (batch, PROMPT_TOKENS), generator=gen).tolist()


def engine_config(spec: ModelSpec, tp: int, rank: int, batch: int, new_tokens: int, threads: int,
                  addr: str = "127.0.0.1", port: int = 0) -> EngineConfig:
    max_len = PROMPT_TOKENS + new_tokens
    block = vllm_block_tokens("cpu")
    return EngineConfig(spec=spec, tp=tp, tp_rank=rank, master_addr=addr, master_port=port, max_model_len=max_len,
                        kv_cache_bytes=kv_cache_bytes(spec, vllm_kv_cache_tokens(batch, max_len, block), tp, 1, 4),
                        block_tokens=block, max_num_seqs=batch, dtype="float32", device="cpu", threads=threads)


def timed_vllm(engine: VllmEngine, ps: list[list[int]], new_tokens: int) -> float:
    seeds = list(range(len(ps)))
    engine.generate(ps[:4], max_new_tokens=4, temperature=1.0, greedy=False, stop_ids=(), seeds=seeds[:4])
    start = time.perf_counter()
    out = engine.generate(ps, max_new_tokens=new_tokens, temperature=1.0, greedy=False, stop_ids=(), seeds=seeds)
    elapsed = time.perf_counter() - start
    assert all(len(r) == new_tokens for r in out)
    return len(ps) * new_tokens / elapsed


def _stage_engine(spec: ModelSpec, tp: int, rank: int, batch: int) -> StageEngine:
    cand = Candidate(tp, 1, 1, tuple(range(tp)), micro_batch=batch)
    groups = build_stage_groups(cand, rank)
    engine = StageEngine(model_stage=GEN, spec=spec, candidate=cand, rank=rank, groups=groups,
                         device=torch.device("cpu"), memory=DeviceMemory(rank, 1 << 40), value_head=False,
                         trainable=False, lr=0.0, weight_decay=0.0, grad_clip=None, micro_batch=batch,
                         recompute=False, max_tokens_per_micro_batch=None)
    engine.load_full_state(init_full_state(spec, seed=0))
    return engine


def timed_native(engine: StageEngine, ps: list[list[int]], new_tokens: int) -> float:
    engine.generate(ps[:4], max_new_tokens=4, temperature=1.0, seeds=list(range(4)))
    start = time.perf_counter()
    out = engine.generate(ps, max_new_tokens=new_tokens, temperature=1.0, seeds=list(range(len(ps))))
    elapsed = time.perf_counter() - start
    assert all(len(r) == new_tokens for r in out)
    return len(ps) * new_tokens / elapsed


def _tp2_rank(rank: int, world: int, which: str, spec: ModelSpec, batch: int, new_tokens: int, workdir: str):
    ps = prompts(spec, batch)
    if which == "native":
        return timed_native(_stage_engine(spec, world, rank, batch), ps, new_tokens)
    box = [("127.0.0.1", free_port("127.0.0.1")) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    engine = VllmEngine(engine_config(spec, world, rank, batch, new_tokens, 1, *box[0]), workdir=workdir)
    try:
        engine.load_weights(init_full_state(spec, seed=0).items(), version=1)
        return timed_vllm(engine, ps, new_tokens)
    finally:
        engine.close()


def tp1(which: str, spec: ModelSpec, batch: int, new_tokens: int, threads: int, workdir: str) -> float:
    torch.set_num_threads(threads)
    ps = prompts(spec, batch)
    if which == "native":   # a one-rank world: the engine's groups are process groups
        dist.init_process_group("gloo", init_method=f"file://{workdir}/native-store", rank=0, world_size=1)
        try:
            return timed_native(_stage_engine(spec, 1, 0, batch), ps, new_tokens)
        finally:
            dist.destroy_process_group()
            Path(f"{workdir}/native-store").unlink(missing_ok=True)
    engine = VllmEngine(engine_config(spec, 1, 0, batch, new_tokens, threads), workdir=workdir)
    try:
        engine.load_weights(init_full_state(spec, seed=0).items(), version=1)
        return timed_vllm(engine, ps, new_tokens)
    finally:
        engine.close()


def weight_sync_and_rebuild(spec: ModelSpec, threads: int, workdir: str) -> tuple[float, float, float]:
    state = init_full_state(spec, seed=0)
    engine = VllmEngine(engine_config(spec, 1, 0, 64, 128, threads), workdir=workdir)
    try:
        engine.load_weights(state.items(), version=1)          # warm
        got = engine.load_weights(state.items(), version=2)
    finally:
        start = time.perf_counter()
        engine.close()
    run_distributed(_rebuild_rank, 2, spec, workdir, timeout_s=900)
    rebuild = time.perf_counter() - start
    return got["load_s"], got["bytes"] / got["load_s"] / 1e9, rebuild


def _rebuild_rank(rank: int, world: int, spec: ModelSpec, workdir: str):
    box = [("127.0.0.1", free_port("127.0.0.1")) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    engine = VllmEngine(engine_config(spec, world, rank, 64, 128, 1, *box[0]), workdir=workdir)
    try:
        engine.load_weights(init_full_state(spec, seed=0).items(), version=1)
    finally:
        engine.close()
    return True


def int_list(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """``text``, comma-separated integers of at least 1, or a usage error naming ``option``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        parser.error(f"{option}: expected comma-separated integers of at least 1, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the headline point (40M, batch 64, 128 tokens, "
                                                             "TP 1), the weight sync and the rebuild")
    parser.add_argument("--models", default="demo,40M,100M")
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--new-tokens", default="128,256")
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="CPU threads at TP 1 (TP 2: one per rank)")
    args = parser.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODEL_NAMES]
    if unknown or not names:
        parser.error(f"--models: expected a comma-separated subset of {', '.join(MODEL_NAMES)}, got {args.models!r}")
    batches = int_list(parser, "--batches", args.batches)
    new_tokens = int_list(parser, "--new-tokens", args.new_tokens)
    tps = int_list(parser, "--tp", args.tp)
    if args.threads < 1:
        parser.error(f"--threads: expected at least 1, got {args.threads}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    specs = models()
    grid = [("40M", 64, 128, 1)] if args.quick else [
        (m, b, n, t) for m in names for b in batches for n in new_tokens for t in tps]
    rows = {}
    print(f"{'model':>6} {'params':>8} {'batch':>5} {'new':>4} {'tp':>2} {'vllm tok/s':>11} {'native tok/s':>12} "
          f"{'ratio':>6}", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        for name, batch, new_tokens, tp in grid:
            spec = specs[name]
            if PROMPT_TOKENS + new_tokens > spec.max_position:
                print(f"{name:>6} skipped: {PROMPT_TOKENS} + {new_tokens} tokens > max_position {spec.max_position}")
                continue
            got = {}
            for which in ("vllm", "native"):
                if tp == 1:
                    got[which] = tp1(which, spec, batch, new_tokens, args.threads, workdir)
                else:
                    got[which] = min(run_distributed(_tp2_rank, tp, which, spec, batch, new_tokens, workdir,
                                                     timeout_s=3600))
            rows[(name, batch, new_tokens, tp)] = got
            print(f"{name:>6} {n_params(spec) / 1e6:>7.1f}M {batch:>5} {new_tokens:>4} {tp:>2} {got['vllm']:>11.0f} "
                  f"{got['native']:>12.0f} {got['vllm'] / got['native']:>5.2f}x", flush=True)
        sync_s, gbps, rebuild_s = weight_sync_and_rebuild(specs["100M"], args.threads, workdir)
    head = rows.get(("40M", 64, 128, 1))
    a, b = (head["vllm"], head["native"]) if head else (float("nan"), float("nan"))
    print(f"weight sync (100M, {n_params(specs['100M']) * 4 / 1e9:.2f} GB fp32): {sync_s:.3f} s, {gbps:.2f} GB/s; "
          f"engine rebuild TP 1 -> 2: {rebuild_s:.1f} s")
    print(f"generation: vllm {a:.0f} tok/s; native {b:.0f} tok/s ({a / b:.2f}x); weight sync {sync_s:.3f} s "
          f"({gbps:.2f} GB/s); engine rebuild {rebuild_s:.1f} s")


if __name__ == "__main__":
    main()
