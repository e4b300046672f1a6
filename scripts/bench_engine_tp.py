"""Measure: hand-written Megatron TP (emu.engine.model) vs DTensor ``parallelize_module`` on CPU/gloo.

A SwiGLU MLP (gate/up column-parallel, down row-parallel), forward + backward, on 2 ranks;
median wall time of 20 repetitions after 3 warm-ups, for a tiny and a mid-sized shape. Both
variants' outputs and input gradients are checked against each other first.

Run: ``GLOO_SOCKET_IFNAME=lo .venv/bin/python scripts/bench_engine_tp.py``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.distributed import run_distributed  # noqa: E402

SHAPES = [("tiny h64 f128 tok64", 64, 128, 2, 32), ("mid h512 f1376 tok512", 512, 1376, 4, 128)]


def _bench(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _rank(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from emu.engine.model import MLP, TPGroup
    from nereusd.models import ModelSpec

    mesh = init_device_mesh("cpu", (world,))
    out = []
    for label, h, f, b, s in SHAPES:
        spec = ModelSpec(vocab_size=16, hidden_size=h, intermediate_size=f, num_layers=1, num_heads=4,
                         num_kv_heads=4)
        torch.manual_seed(0)
        full = MLP(spec, TPGroup())
        dt = MLP(spec, TPGroup())
        dt.load_state_dict(full.state_dict())
        dt = parallelize_module(dt, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                           "down_proj": RowwiseParallel()})
        manual = MLP(spec, TPGroup(world, rank, dist.group.WORLD))
        with torch.no_grad():
            for name, p in manual.named_parameters():
                dim = 1 if name.startswith("down") else 0
                p.copy_(full.state_dict()[name].chunk(world, dim=dim)[rank])
        x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(1))

        def step(mod):
            xi = x.clone().requires_grad_(True)
            y = mod(xi)
            y.square().sum().backward()
            return y.detach(), xi.grad

        y1, g1 = step(dt)
        y2, g2 = step(manual)
        assert torch.allclose(y1, y2, atol=1e-5) and torch.allclose(g1, g2, atol=1e-5)
        out.append((label, _bench(lambda: step(dt)), _bench(lambda: step(manual))))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)   # no options: --help prints the usage instead of running the benchmark
    torch.set_num_threads(1)
    results = run_distributed(_rank, 2)
    for label, t_dt, t_manual in results[0]:
        print(f"{label}: DTensor {t_dt * 1e3:.2f} ms, hand-written {t_manual * 1e3:.2f} ms, "
              f"ratio {t_dt / t_manual:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
