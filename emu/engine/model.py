"""A Llama-family decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention), fp32: Llama and
Llama-3 (``llama3`` RoPE scaling), Qwen2/Qwen2.5 (q/k/v biases) and Qwen3 (q/k norms), with
tied or separate output embeddings.

The module tree and parameter names follow Hugging Face ``LlamaForCausalLM``
(``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``, …,
``model.norm.weight``, ``lm_head.weight``), so that a canonical state dict is exactly what a
Hugging Face ``model.safetensors`` holds. A critic or reward model replaces ``lm_head`` with a
scalar ``value_head`` (``value_head.weight [1, h]``, ``value_head.bias [1]``).

One class serves one process and every tensor/pipeline-parallel shard:

* **Tensor parallel** (Megatron convention, DESIGN.md sharding table): each module is built
  with its *local* shapes for a :class:`TPGroup`; column-parallel projections (q, k, v, gate,
  up) hold whole heads / rows of dim 0, row-parallel ones (o, down) hold columns of dim 1 and
  all-reduce their output; embedding and output head are vocab-parallel (dim 0). When
  ``tp > num_kv_heads`` the k/v projections are replicated on every rank and their gradients
  are summed over the TP group by the engine (see :func:`replicated_grad_names`).
* **Pipeline parallel**: a model holds a contiguous block ``layer_range`` of layers (kept in a
  ``ModuleDict`` under their global indices, so names never change), the embedding only on the
  first stage and the final norm and head only on the last.

With ``tp == 1`` and all layers the model is the plain one-process decoder; its
``forward(tokens)`` returns logits ``[B, S, V]`` (or values ``[B, S]``).

Sources: Touvron et al., "LLaMA" (2023) for the architecture; Hugging Face
``transformers/models/llama/modeling_llama.py`` for RoPE (``rotate_half``) and names; Shoeybi
et al., "Megatron-LM" (2019), §3 for the tensor-parallel split and its ``f``/``g`` operators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from emu.engine.canonical import (  # noqa: F401 (re-exported: the canonical state belongs with the model)
    INIT_STD, canonical_shapes, init_full_state, init_parameter, kv_replicated, num_parameters,
    replicated_grad_names, shard_dim, shard_full_tensor,
)
from nereusd.models import ModelSpec



# --------------------------------------------------------------------------- tensor parallel


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group a shard belongs to.

    Attributes:
        size: ``tp``.
        rank: this shard's tensor rank ``tp_rank`` (its position in the candidate's order).
        group: the process group (``None`` when ``size == 1``).
    """

    size: int = 1
    rank: int = 0
    group: Optional[dist.ProcessGroup] = None


SINGLE = TPGroup()


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce (SUM) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce (SUM) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Enter a column-parallel region (gradient summed over the TP group)."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp.group)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Leave a row-parallel region: sum the partial outputs of the TP group."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp.group)


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x²) + eps) · weight`` over the last dim (Zhang & Sennrich, 2019)."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_inv_freq(spec: ModelSpec, device: torch.device | None = None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim / 2]`` of ``spec``.

    ``inv_freq_i = theta^(-2i/d)`` (Su et al., "RoFormer", 2021); with ``rope_type == "llama3"``
    Llama-3's frequency-dependent scaling (Meta, Llama 3.1, 2024; as in transformers'
    ``_compute_llama3_parameters``): wavelengths longer than ``original / low_freq_factor`` are
    divided by ``factor``, shorter than ``original / high_freq_factor`` kept, and those between
    interpolated smoothly.
    """
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    if spec.rope_type != "llama3":
        return inv_freq
    factor, low, high = spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
    original = spec.rope_original_max_position
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(position_ids: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for ``position_ids [B, S]``: ``cos, sin`` of shape ``[B, 1, S, head_dim]``.

    HF Llama convention: angles ``position · inv_freq`` (:func:`rope_inv_freq`) duplicated
    across the two halves of a head.
    """
    inv_freq = rope_inv_freq(spec, position_ids.device)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)[:, None]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, S, d]`` by the tables of :func:`rope_cos_sin`."""
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Per-layer key/value cache of one shard: ``[B, kv_heads_local, max_len, head_dim]`` each.

    ``length`` is the number of positions already written (same for every sequence; left
    padding keeps batched prompts aligned).
    """

    def __init__(self, layers: list[int], batch: int, kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = {i: torch.zeros(shape, device=device, dtype=dtype) for i in layers}
        self.v = {i: torch.zeros(shape, device=device, dtype=dtype) for i in layers}
        self.max_len = max_len
        self.length = 0

    @staticmethod
    def nbytes_for(num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                   element_bytes: int = 4) -> int:
        """Bytes of a cache of that shape (keys and values of every layer)."""
        return 2 * num_layers * batch * kv_heads * max_len * head_dim * element_bytes

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v [B, kvh, S, d]`` at ``length`` and return the keys/values so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > max_len {self.max_len}")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Attention(nn.Module):
    """Grouped-query self-attention, column-parallel q/k/v and row-parallel o. Qwen2 gives q/k/v
    biases (sharded with their rows); Qwen3 normalises each query and key head (RMSNorm over
    ``head_dim``, one weight shared by the heads) before RoPE."""

    def __init__(self, spec: ModelSpec, tp: TPGroup, layer: int) -> None:
        super().__init__()
        d, h = spec.head_dim, spec.hidden_size
        self.spec, self.tp, self.layer = spec, tp, layer
        self.n_heads = spec.num_heads // tp.size
        self.kv_replicated = kv_replicated(spec, tp.size)
        n_kv_weight = spec.num_kv_heads if self.kv_replicated else spec.num_kv_heads // tp.size
        self.n_kv_heads = 1 if self.kv_replicated else n_kv_weight
        # With replicated k/v the local q heads all belong to one kv group.
        self.kv_select = tp.rank * self.n_heads // (spec.num_heads // spec.num_kv_heads)
        bias = spec.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, n_kv_weight * d, bias=bias)
        self.v_proj = nn.Linear(h, n_kv_weight * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | tuple[int, ...] | None, kv_cache: Optional[KVCache]) -> torch.Tensor:
        """``mask``: a boolean ``[B, 1, S, past + S]`` mask, a packed row's segment lengths, or
        ``None`` for plain causal attention over the row (no past)."""
        b, s, _ = x.shape
        d = self.spec.head_dim
        x = copy_to_tp(x, self.tp)
        q = self.q_proj(x).view(b, s, self.n_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, d).transpose(1, 2)
        if self.kv_replicated:
            k = k[:, self.kv_select:self.kv_select + 1]
            v = v[:, self.kv_select:self.kv_select + 1]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.append(self.layer, k, v)
        rep = self.n_heads // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if isinstance(mask, tuple):   # packed row (b == 1): each segment attends causally to itself
            out = torch.cat([F.scaled_dot_product_attention(qs, ks, vs, is_causal=True) for qs, ks, vs in
                             zip(q.split(mask, 2), k.split(mask, 2), v.split(mask, 2))], dim=2)
        elif mask is None:   # causal over the whole row: the fused kernel's own mask, none stored
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(b, s, self.n_heads * d)
        return reduce_from_tp(self.o_proj(out), self.tp)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))``; gate/up column-parallel, down row-parallel."""

    def __init__(self, spec: ModelSpec, tp: TPGroup) -> None:
        super().__init__()
        f = spec.intermediate_size // tp.size
        self.tp = tp
        self.gate_proj = nn.Linear(spec.hidden_size, f, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, f, bias=False)
        self.down_proj = nn.Linear(f, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp)
        return reduce_from_tp(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), self.tp)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, spec: ModelSpec, tp: TPGroup, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, tp, layer)
        self.mlp = MLP(spec, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class VocabParallelEmbedding(nn.Module):
    """Token embedding split over vocabulary rows; out-of-shard tokens contribute zeros."""

    def __init__(self, spec: ModelSpec, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        rows = spec.vocab_size // tp.size
        self.start = tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, spec.hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        return reduce_from_tp(out, self.tp)


class _Body(nn.Module):
    """The ``model.`` prefix of HF names: embedding, layers, final norm."""

    def __init__(self, spec: ModelSpec, tp: TPGroup, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec, tp) if first else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(spec, tp, i) for i in layers})
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if last else None


def attention_mask_4d(attention_mask: Optional[torch.Tensor], q_len: int, past: int,
                      batch: int, device: torch.device) -> torch.Tensor:
    """Boolean mask ``[B, 1, q_len, past + q_len]`` (True = may attend).

    Causal, minus key positions where ``attention_mask [B, past + q_len]`` is 0. Every query may
    attend to itself, so rows of padding queries stay finite (their outputs are never used).
    """
    total = past + q_len
    q_pos = torch.arange(past, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    mask = (k_pos <= q_pos)[None, None].expand(batch, 1, q_len, total)
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, :total].bool()
        mask = mask | (k_pos == q_pos)[None, None]
    return mask


class LlamaModel(nn.Module):
    """A (shard of a) Llama decoder with an LM head or a scalar value head.

    Args:
        spec: model shapes.
        value_head: replace ``lm_head`` by ``value_head`` (critic / reward model).
        tp: tensor-parallel group of this shard (:data:`SINGLE` for one process).
        layer_range: decoder layers held here (default: all), contiguous.
        seed: when given, parameters are initialised by :func:`init_full_state` (sliced to
            this shard, identical for every layout); otherwise matrices are drawn from torch's
            global RNG (``N(0, 0.02²)``, so ``torch.manual_seed`` makes them reproducible for one
            layout), norms are ones and biases zeros. On the meta device nothing is computed.

    Raises:
        ValueError: if ``tie_word_embeddings`` is set for a shard that has the head but not the
            embedding (pipeline-parallel tied heads are not supported).
    """

    def __init__(self, spec: ModelSpec, *, value_head: bool = False, tp: TPGroup = SINGLE,
                 layer_range: Optional[range] = None, seed: Optional[int] = None) -> None:
        super().__init__()
        layers = range(spec.num_layers) if layer_range is None else layer_range
        self.spec, self.tp, self.layer_range = spec, tp, layers
        self.is_first = layers.start == 0
        self.is_last = layers.stop == spec.num_layers
        self.has_value_head = value_head
        self.recompute = False
        """Activation recomputation: keep only layer inputs, redo each layer in backward."""
        self.model = _Body(spec, tp, layers, self.is_first, self.is_last)
        self.lm_head = None
        self.value_head = None
        if self.is_last and value_head:
            self.value_head = nn.Linear(spec.hidden_size, 1, bias=True)
        elif self.is_last and not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size // tp.size, bias=False)
        elif self.is_last and not self.is_first:
            raise ValueError("tie_word_embeddings needs the embedding and the head on one stage (pp == 1)")
        on_meta = any(p.is_meta for p in self.parameters())
        with torch.no_grad():
            if on_meta:
                pass
            elif seed is not None:
                full = init_full_state(spec, value_head=value_head, seed=seed, names=list(self.state_dict()))
                for name, param in self.named_parameters():
                    param.copy_(shard_full_tensor(name, full[name], spec, tp.size, tp.rank))
            else:
                for name, param in self.named_parameters():
                    param.copy_(init_parameter(name, tuple(param.shape), seed=None))

    def output_head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head: local logits ``[B, S, V/tp]`` or values ``[B, S]``."""
        x = self.model.norm(x)
        if self.value_head is not None:
            return self.value_head(x).squeeze(-1)
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return F.linear(copy_to_tp(x, self.tp), weight)

    def forward(self, inputs: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None,
                segments: Optional[list[int]] = None, last_position_only: bool = False) -> torch.Tensor:
        """Run this shard.

        Args:
            inputs: token ids ``[B, S]`` int64 on the first stage, else hidden ``[B, S, h]``.
            attention_mask: ``[B, past + S]`` (1 = real token, 0 = padding); ``None`` means
                all real (right padding needs no mask: causal attention never sees it).
            position_ids: ``[B, S]``; default ``past + arange(S)``.
            kv_cache: a :class:`KVCache` to append to and attend over (generation).
            segments: a packed row (``B == 1``, no ``kv_cache`` or ``attention_mask``): the token
                lengths of the sequences laid end to end in it, summing to ``S``; each attends
                causally to itself only (give ``position_ids`` restarting at 0 per segment).
                Exactly what each sequence computes alone (:mod:`emu.engine.batch`).
            last_position_only: the last stage runs its norm and head at position ``S − 1``
                only (a generation's prefill samples from it alone; the logits of every prompt
                token would be ``B·S·V/tp`` elements), so its output has ``S = 1``.

        Returns:
            On the last stage logits ``[B, S, V/tp]`` (``V`` when ``tp == 1``) or values
            ``[B, S]``; elsewhere hidden states ``[B, S, h]``.
        """
        b, s = inputs.shape[:2]
        past = kv_cache.length if kv_cache is not None else 0
        device = inputs.device
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=device).expand(b, s)
        x = self.model.embed_tokens(inputs) if self.is_first else inputs
        cos, sin = rope_cos_sin(position_ids, self.spec)
        if segments is not None:
            if b != 1 or kv_cache is not None or attention_mask is not None or sum(segments) != s:
                raise ValueError(f"segments {list(segments)} need one row of {s} tokens, no kv_cache and no mask")
            mask = tuple(segments)
        elif attention_mask is None and past == 0:
            # plainly causal: SDPA's is_causal instead of a [B, 1, S, S] mask, which autograd would
            # keep per layer for backward (B·S² elements each; 64 MiB per layer at S = 4,096 in fp32)
            mask = None
        else:
            mask = attention_mask_4d(attention_mask, s, past, b, device)
        for layer in self.model.layers.values():
            if self.recompute and kv_cache is None and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, mask, None, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, kv_cache)
        if kv_cache is not None:
            kv_cache.length = past + s
        if not self.is_last:
            return x
        return self.output_head(x[:, -1:] if last_position_only else x)
