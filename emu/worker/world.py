"""Joining a world generation: ``init_process_group`` through the TCPStore that nereusd serves.

Rendezvous goes through the store under a prefix with the world's generation number, so that a
later generation can re-form the world in the same store (after the pool changed, the workers'
tensors stay in memory while the process group is replaced).
"""

from __future__ import annotations

from datetime import timedelta


def init_world(*, kind: str, local_index: int, rank: int, world_size: int, generation: int,
               store_host: str, store_port: int, timeout_s: float = 300.0):
    """Join generation ``generation`` of the world; returns ``(torch.device, store client, backend)``.

    Backend from the device: NCCL on CUDA (and ROCm builds, where it is RCCL), gloo on CPU.
    """
    import torch
    import torch.distributed as dist

    if kind in ("cuda", "rocm"):
        torch.cuda.set_device(local_index)
        device = torch.device("cuda", local_index)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    join_world(store, generation=generation, rank=rank, world_size=world_size, backend=backend,
               timeout=timedelta(seconds=timeout_s))
    return device, store, backend


def join_world(store, *, generation: int, rank: int, world_size: int, backend: str, timeout: timedelta) -> None:
    """``init_process_group`` for generation ``generation`` through ``PrefixStore("nereus/gen<g>/", store)``.

    Used at start and to re-form the world after the pool changed (the caller destroyed the
    previous generation's process group first; its tensors stay where they are).
    """
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"nereus/gen{generation}/", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)
