"""Run a function on N spawned gloo ranks and collect what each returns.

Ranks are forked from a ``forkserver`` that preloaded torch. Each rank rendezvouses through a ``file://`` store in a temporary directory (no ports), runs
``fn(rank, world_size, *args)``, saves the return value with ``torch.save`` as its success
marker, and tears the process group down cleanly (barrier, ``gc.collect()``, barrier,
``destroy_process_group``; docs/platform.md). The parent judges every rank by its exit code *and*
its marker, and re-raises a rank's exception text.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _child(rank: int, world_size: int, tmp: str, fn_name: tuple[str, str], args: tuple) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # this rank's temporary files go inside the run's directory, which the parent removes: a rank
    # ends with os._exit, so what a library made at import would stay in /tmp (megatron-core
    # imports wandb, which makes two directories: 34 per suite run). ``fn``'s module is imported
    # here, after the switch, not when the arguments are unpickled.
    own_tmp = os.path.join(tmp, f"tmp.{rank}")
    os.makedirs(own_tmp, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = own_tmp
    module, name = fn_name
    fn = getattr(importlib.import_module(module), name)
    torch.set_num_threads(1)
    out = Path(tmp)
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
        torch.save(result, out / f"result.{rank}")
    except BaseException:
        (out / f"error.{rank}").write_text(traceback.format_exc())
        raise
    os._exit(0)  # after a clean teardown: skips a slow interpreter exit (docs/platform.md)


def _context_method() -> str:
    """``forkserver`` with torch preloaded: children fork from a server that imported torch once
    and ran no ops (no threads), instead of each re-importing torch (docs/platform.md: ~0.55 CPU-s each,
    18 s for 4 ranks on a loaded 2-core machine)."""
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed.pipelining", "emu.engine.stage"])
    return "forkserver"


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """``[fn(0, world_size, *args), …]`` computed on ``world_size`` spawned ranks; ``fn`` is a
    module-level function, imported by name in each rank.

    Raises:
        AssertionError: with the failing ranks' tracebacks, if any rank failed, timed out or
            left no success marker.
    """
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_child, args=(world_size, tmp, (fn.__module__, fn.__qualname__), args),
                                 nprocs=world_size,
                                 join=False, start_method=_context_method())
        deadline = time.monotonic() + timeout_s
        done = False
        while not done and time.monotonic() < deadline:
            try:
                done = ctx.join(timeout=0.5)
            except (mp.ProcessRaisedException, mp.ProcessExitedException):
                break
        errors = {r: (Path(tmp) / f"error.{r}").read_text()
                  for r in range(world_size) if (Path(tmp) / f"error.{r}").exists()}
        missing = [r for r in range(world_size) if not (Path(tmp) / f"result.{r}").exists()]
        codes = [p.exitcode for p in ctx.processes]
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        if errors or missing or any(c != 0 for c in codes):
            detail = "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(errors.items()))
            raise AssertionError(f"distributed run failed: exit codes {codes}, no marker from {missing}\n{detail}")
        return [torch.load(Path(tmp) / f"result.{r}", weights_only=False) for r in range(world_size)]
