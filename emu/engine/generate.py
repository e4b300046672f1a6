"""Batched autoregressive generation with a KV cache on one (TP-sharded) replica.

Prompts of different lengths are left-padded to a common length, so every sequence writes its
next token at the same cache position; the attention mask hides the padding and position ids
count only real tokens (``cumsum(mask) - 1``). The prompt is run once (prefill), then one token
per step (decode). Generation model-stages have ``pp == 1`` (PP is folded into DP for
generation, :func:`nereusd.shards.check_layout`); heads and the KV cache are TP-sharded.

Every TP rank ends with identical tokens: the vocab-parallel logits of the last position are
all-gathered, TP rank 0 picks the next tokens (greedy ``argmax``, or sampling from
``softmax(logits / temperature)`` with a ``torch.Generator`` seeded by ``seed`` — or, with
``seeds``, one generator per sequence, so that a sequence's draws do not depend on which replica
or wave it runs in, i.e. on the layout) and broadcasts them in the TP group.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from emu.engine.model import KVCache, LlamaModel
from emu.engine.parallel import StageGroups

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens.

    Attributes:
        max_new_tokens: at most this many tokens per response.
        temperature: softmax temperature (> 0) when sampling.
        greedy: take the argmax instead of sampling.
        stop_ids: a sequence stops after producing any of these (the tokenizer's EOS and the
            generation config's stop tokens; empty: never).
        pad_id: token used for left padding of prompts.
        seed: seed of the sampling generator.
        seeds: one seed per sequence (overrides ``seed``): each sequence samples from its own
            generator, independent of the batch it is in.
    """

    max_new_tokens: int
    temperature: float = 1.0
    greedy: bool = False
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0
    seed: int = 0
    seeds: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens ``[B, P]``, attention mask ``[B, P]`` and position ids ``[B, P]`` of left-padded prompts."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        if p:
            tokens[i, width - len(p):] = torch.tensor(p, dtype=torch.int64)
            mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return tokens.to(device), mask.to(device), positions.to(device)


def kv_cache_shape(model: LlamaModel, batch: int, max_len: int) -> tuple[int, int, int, int, int]:
    """``(layers, batch, kv_heads_local, max_len, head_dim)`` of this shard's cache."""
    attn = next(iter(model.model.layers.values())).self_attn
    return len(model.model.layers), batch, attn.n_kv_heads, max_len, model.spec.head_dim


def _next_tokens(logits_local: torch.Tensor, groups: Optional[StageGroups], params: SamplingParams,
                 gen: torch.Generator | list[torch.Generator]) -> torch.Tensor:
    """Pick ``[B]`` next tokens from this rank's ``[B, V/tp]`` logits; identical on all TP ranks."""
    tp = groups.tp if groups is not None else None
    if tp is None or tp.size == 1:
        full = logits_local
    else:
        parts = [torch.empty_like(logits_local) for _ in range(tp.size)]
        dist.all_gather(parts, logits_local.contiguous(), group=tp.group)
        order = [StageGroups.group_rank(groups.tp_ranks, t) for t in range(tp.size)]
        full = torch.cat([parts[g] for g in order], dim=-1)
    if params.greedy:
        chosen = full.argmax(dim=-1)
    else:
        probs = torch.softmax(full.float() / params.temperature, dim=-1)
        if isinstance(gen, list):   # one stream per sequence
            chosen = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gen)])
        else:
            chosen = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    if tp is not None and tp.size > 1:
        dist.broadcast(chosen, group=tp.group, group_src=StageGroups.group_rank(groups.tp_ranks, 0))
    return chosen


@torch.no_grad()
def generate(model: LlamaModel, prompts: list[list[int]], params: SamplingParams, *,
             groups: Optional[StageGroups] = None, device: torch.device = torch.device("cpu"),
             kv_cache: Optional[KVCache] = None) -> list[list[int]]:
    """Generate a response for every prompt.

    Args:
        model: a ``pp == 1`` shard with an LM head.
        prompts: token-id lists (may differ in length; empty prompts are not allowed).
        params: sampling parameters.
        groups: this rank's groups (``None`` for one process).
        kv_cache: a cache of at least ``B`` rows and ``max(len(prompt)) + max_new_tokens``
            positions (allocated here when ``None``).

    Returns:
        One response per prompt: generated ids, including the stop id when produced; at most
        ``max_new_tokens`` long. Identical on every TP rank.

    Raises:
        ValueError: for an empty prompt, or a sequence longer than ``spec.max_position``.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    batch, width = len(prompts), max(len(p) for p in prompts)
    total = width + params.max_new_tokens
    if total > model.spec.max_position:
        raise ValueError(f"generate: prompt {width} + max_new_tokens {params.max_new_tokens} = {total} "
                         f"exceeds the model's max_position {model.spec.max_position}")
    if params.max_new_tokens == 0:
        return [[] for _ in prompts]
    tokens, mask, positions = left_pad(prompts, params.pad_id, device)
    if kv_cache is None:
        layers, b, kvh, _, d = kv_cache_shape(model, batch, total)
        kv_cache = KVCache(list(model.layer_range), b, kvh, total, d, device)
    kv_cache.length = 0
    full_mask = torch.ones((batch, total), dtype=torch.int64, device=device)
    full_mask[:, :width] = mask
    if params.seeds is not None:
        if len(params.seeds) != batch:
            raise ValueError(f"generate: {len(params.seeds)} seeds for {batch} prompts")
        gen = [torch.Generator(device=device).manual_seed(int(s)) for s in params.seeds]
    else:
        gen = torch.Generator(device=device).manual_seed(params.seed)

    logits = model(tokens, attention_mask=full_mask[:, :width], position_ids=positions, kv_cache=kv_cache,
                   last_position_only=True)
    next_pos = positions[:, -1] + 1
    responses: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for step in range(params.max_new_tokens):
        chosen = _next_tokens(logits[:, -1], groups, params, gen)
        for i in torch.nonzero(~done).flatten().tolist():
            responses[i].append(int(chosen[i]))
        if params.stop_ids:
            done |= torch.isin(chosen, torch.tensor(params.stop_ids, device=chosen.device))
        if bool(done.all()) or step + 1 == params.max_new_tokens:
            break
        length = kv_cache.length + 1
        logits = model(chosen[:, None], attention_mask=full_mask[:, :length],
                       position_ids=next_pos[:, None], kv_cache=kv_cache)
        next_pos = next_pos + 1
    return responses
