"""Canonical state of a Llama model: parameter names and full shapes, initial values, TP slices.

The canonical state is a dict of full (unsharded) fp32 tensors under Hugging Face Llama names —
what ``model.safetensors`` holds (:mod:`emu.engine.hf_io`), what an engine loads from and gathers to,
and what transitions move shards of. Slicing follows the DESIGN.md sharding table (Megatron
convention): column-parallel on dim 0, row-parallel on dim 1, vocab-parallel embedding and head
on dim 0, k/v replicated when ``tp > num_kv_heads``; slices are ``torch.chunk`` of whole heads.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
from torch import nn

from nereusd.models import ModelSpec
from nereusd.shards import canonical_shapes, shard_dim  # noqa: F401 - one sharding table (DESIGN.md), torch-free

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of every matrix (GPT-2 / HF default)."""


def kv_replicated(spec: ModelSpec, tp: int) -> bool:
    """Whether k/v projections are replicated (``tp > num_kv_heads``) rather than split."""
    return tp > spec.num_kv_heads


# --------------------------------------------------------------------------- canonical state


def init_parameter(name: str, shape: tuple[int, ...], seed: Optional[int]) -> torch.Tensor:
    """Initial value of one canonical parameter (fp32, CPU).

    Norm weights are ones, biases zeros, matrices ``N(0, 0.02²)`` drawn from a generator seeded
    by ``(seed, crc32(name))``, so a shard can initialise only what it holds and still match
    the one-process model bit for bit (``seed=None``: torch's global RNG).
    """
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "model.norm.weight":
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if seed is None:
        return torch.randn(shape) * INIT_STD
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=gen) * INIT_STD


def init_full_state(spec: ModelSpec, *, value_head: bool = False, seed: int = 0,
                    names: Optional[list[str]] = None) -> dict[str, torch.Tensor]:
    """Canonical full tensors (HF names) of a freshly initialised model.

    Args:
        names: only these parameters (default: all of :func:`canonical_shapes`).
    """
    shapes = canonical_shapes(spec, value_head)
    wanted = list(shapes) if names is None else names
    return {n: init_parameter(n, shapes[n], seed) for n in wanted}


def num_parameters(module: nn.Module) -> int:
    """Parameter count of a module (its local shard)."""
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------- TP sharding rules


def replicated_grad_names(names: list[str], spec: ModelSpec, tp: int) -> list[str]:
    """Replicated parameters whose TP ranks compute *different* partial gradients, to be summed
    over the TP group:

    - k/v projections (and their biases) replicated because ``tp > num_kv_heads``: each rank
      uses one kv head;
    - Qwen3's ``q_norm``/``k_norm``: one weight shared by every head, each rank normalises only
      its own heads.

    (Layer norms and the value head see identical inputs and gradients on every TP rank.)
    """
    if tp == 1:
        return []
    ends = ("q_norm.weight", "k_norm.weight")
    if kv_replicated(spec, tp):
        ends += ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")
    return [n for n in names if n.endswith(ends)]


def shard_full_tensor(name: str, full: torch.Tensor, spec: ModelSpec, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's slice of canonical tensor ``full`` (a view; whole heads/rows)."""
    dim = shard_dim(name, spec, tp)
    if dim is None:
        return full
    return full.chunk(tp, dim=dim)[tp_rank]
