"""Canonical (Hugging Face) tensors ↔ Megatron-core ``GPTModel`` tensors, per TP/PP rank.

The state mapping of the Megatron backend (issue 15): what a ``GPTModel`` built with
megatron-core 0.16.1's local or Transformer-Engine layer spec holds on tensor-parallel rank
``t`` of ``tp`` and pipeline stage ``p`` of ``pp``, under Megatron's own names, computed from the
canonical full tensors (:func:`nereusd.shards.canonical_shapes`) and back. Pure tensor
reshuffling, no collectives: it runs on CPU, and a transition between Megatron layouts goes
canonical → Megatron (:func:`to_megatron`) and Megatron → canonical (:func:`from_megatron`),
exactly. Adam's ``exp_avg``/``exp_avg_sq`` and an fp32 master copy have their parameter's shape
and are mapped by the same functions.

Megatron's conventions, read from its code (megatron-core 0.16.1):

- **Fused QKV** (``self_attention.linear_qkv``, ``ColumnParallelLinear`` of ``(nq + 2·ng)·d``
  rows): interleaved per query group — for each group ``g`` its ``nq/ng`` query heads, then
  ``k_g``, then ``v_g`` (``SelfAttention.get_query_key_value_tensors`` views the output as
  ``[..., ng/tp, (nq/ng + 2)·d]`` and splits it ``[nq/ng·d, d, d]``). TP rank ``t`` holds the
  ``t``-th of ``tp`` equal row chunks of that global tensor: whole groups when ``tp ≤ ng``; when
  ``tp > ng`` a part of one group, gathered at run time (the same function's
  ``num_query_groups < world_size`` branch). The bias (Qwen2) follows the rows.
- **SwiGLU** (``mlp.linear_fc1``, gated, ``2·f`` rows): each TP rank holds ``[gate_t; up_t]``
  (``MLP.forward``'s ``glu`` chunks the rank's output in two), not a chunk of ``[gate; up]``.
- **Row parallel** ``linear_proj`` and ``linear_fc2``: column chunks (dim 1).
- **Vocabulary**: embedding and output layer rows padded to :func:`padded_vocab` (Megatron-LM's
  ``make_vocab_size_divisible_by = 128`` times ``tp``), then split in ``tp`` row chunks; padding
  rows are zero and dropped on the way back (their content carries no state).
- **Norms**: replicated; with the local spec ``input_layernorm`` / ``pre_mlp_layernorm``, with
  the Transformer-Engine spec fused into the next linear as ``linear_qkv.layer_norm_weight`` /
  ``linear_fc1.layer_norm_weight``; Qwen3's per-head ``q_layernorm``/``k_layernorm``.
- **Pipeline**: stage ``p`` holds layers ``p·L/pp … (p+1)·L/pp − 1`` numbered from 0 on every
  stage, the embedding on the first stage, ``final_layernorm`` and ``output_layer`` on the last
  (a tied model keeps a copy of the embedding there when ``pp > 1``; one stage has none).

``tests/unit/emu/test_megatron_layout.py`` checks the keys and shapes against a ``GPTModel`` built
on the meta device, the round trip for Llama, Qwen2 and Qwen3 at every ``(tp, pp)``, and the
QKV and SwiGLU conventions against Megatron's own modules run on CPU.
"""

from __future__ import annotations

from typing import Mapping

import torch

from nereusd.errors import ConfigError
from nereusd.models import ModelSpec
from nereusd.shards import layer_range

VOCAB_DIVISIBLE_BY = 128
"""Megatron-LM's default ``make_vocab_size_divisible_by``."""

Shards = Mapping[tuple[int, int], Mapping[str, torch.Tensor]]
"""Per ``(tp_rank, pp_rank)``: that rank's Megatron tensors."""


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Rows of the embedding and output layer: ``vocab_size`` rounded up to a multiple of
    ``divisible_by · tp`` (Megatron-LM's ``_vocab_size_with_padding``)."""
    step = divisible_by * tp
    return -(-vocab_size // step) * step


def check_layout(spec: ModelSpec, tp: int, pp: int) -> None:
    """Raise unless Megatron can hold ``spec`` at ``(tp, pp)``.

    Raises:
        ConfigError: naming the constraint: heads, query groups, FFN width and fused QKV rows
            divisible by ``tp``; ``tp`` and the query groups dividing one another; layers
            divisible by ``pp``.
    """
    d, ng, nq = spec.head_dim, spec.num_kv_heads, spec.num_heads
    problems = []
    if nq % tp:
        problems.append(f"{nq} attention heads are not divisible by tp={tp}")
    if ng % tp and tp % ng:
        problems.append(f"num_query_groups={ng} and tp={tp} do not divide one another")
    if ((nq + 2 * ng) * d) % tp:
        problems.append(f"the fused QKV's {(nq + 2 * ng) * d} rows are not divisible by tp={tp}")
    if spec.intermediate_size % tp:
        problems.append(f"ffn width {spec.intermediate_size} is not divisible by tp={tp}")
    if spec.num_layers % pp:
        problems.append(f"{spec.num_layers} layers are not divisible by pp={pp}")
    if problems:
        raise ConfigError(f"Megatron layout tp={tp} pp={pp}: " + "; ".join(problems))


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """The global fused QKV (weight ``[rows, h]`` or bias ``[rows]``), interleaved per query group."""
    ng, d = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // ng
    rest = q.shape[1:]
    groups = torch.cat([q.reshape(ng, per * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)], dim=1)
    return groups.reshape(ng * (per + 2) * d, *rest)


def _split_qkv(fused: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_fuse_qkv`: ``(q, k, v)``."""
    ng, d = spec.num_kv_heads, spec.head_dim
    per = spec.num_heads // ng
    rest = fused.shape[1:]
    groups = fused.reshape(ng, (per + 2) * d, *rest)
    q, k, v = groups.split([per * d, d, d], dim=1)
    return q.reshape(ng * per * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def to_megatron(full: Mapping[str, torch.Tensor], spec: ModelSpec, tp: int, pp: int, tp_rank: int, pp_rank: int,
                *, te: bool = False) -> dict[str, torch.Tensor]:
    """The tensors ``GPTModel`` holds on rank ``(tp_rank, pp_rank)``, from canonical full tensors.

    Args:
        full: canonical tensors under Hugging Face names (:func:`nereusd.shards.canonical_shapes`;
            parameters, or one Adam moment of each).
        te: names of the Transformer-Engine spec (norms fused into the next linear) instead of the
            local spec.

    Returns:
        Megatron names → new tensors (contiguous; the caller may own them).

    Raises:
        ConfigError: the layout does not fit the model (:func:`check_layout`), or a value head.
    """
    check_layout(spec, tp, pp)
    if "value_head.weight" in full:
        raise ConfigError("Megatron layout: a value head (critic, reward model) has no GPTModel counterpart")
    out: dict[str, torch.Tensor] = {}
    vocab = padded_vocab(spec.vocab_size, tp)

    def chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[tp_rank].contiguous()

    first, last = pp_rank == 0, pp_rank == pp - 1
    embed = full["model.embed_tokens.weight"]
    if first:
        out["embedding.word_embeddings.weight"] = chunk(_pad_rows(embed, vocab), 0)
    for local, i in enumerate(layer_range(spec, pp, pp_rank)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
        a = src + "self_attn."
        qkv = _fuse_qkv(full[a + "q_proj.weight"], full[a + "k_proj.weight"], full[a + "v_proj.weight"], spec)
        out[dst + "self_attention.linear_qkv.weight"] = chunk(qkv, 0)
        if spec.attention_bias:
            bias = _fuse_qkv(full[a + "q_proj.bias"], full[a + "k_proj.bias"], full[a + "v_proj.bias"], spec)
            out[dst + "self_attention.linear_qkv.bias"] = chunk(bias, 0)
        out[dst + "self_attention.linear_proj.weight"] = chunk(full[a + "o_proj.weight"], 1)
        if spec.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = full[a + "q_norm.weight"].clone()
            out[dst + "self_attention.k_layernorm.weight"] = full[a + "k_norm.weight"].clone()
        m = src + "mlp."
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([chunk(full[m + "gate_proj.weight"], 0),
                                                        chunk(full[m + "up_proj.weight"], 0)])
        out[dst + "mlp.linear_fc2.weight"] = chunk(full[m + "down_proj.weight"], 1)
        out[dst + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")] = \
            full[src + "input_layernorm.weight"].clone()
        out[dst + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight")] = \
            full[src + "post_attention_layernorm.weight"].clone()
    if last:
        out["decoder.final_layernorm.weight"] = full["model.norm.weight"].clone()
        head = embed if spec.tie_word_embeddings else full["lm_head.weight"]
        if not (spec.tie_word_embeddings and pp == 1):   # one tied stage reads the embedding itself
            out["output_layer.weight"] = chunk(_pad_rows(head, vocab), 0)
    return out


def from_megatron(shards: Shards, spec: ModelSpec, tp: int, pp: int, *, te: bool = False) -> dict[str, torch.Tensor]:
    """Canonical full tensors (Hugging Face names) from every rank's Megatron tensors.

    Args:
        shards: ``{(tp_rank, pp_rank): that rank's tensors}`` for every rank of the layout.

    Raises:
        ConfigError: a rank missing, or the layout does not fit the model.
        KeyError: a tensor a rank should hold is missing.
    """
    check_layout(spec, tp, pp)
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in shards]
    if missing:
        raise ConfigError(f"Megatron layout tp={tp} pp={pp}: no tensors from ranks (tp, pp) {missing}")

    def gather(pp_rank: int, name: str, dim: int) -> torch.Tensor:
        return torch.cat([shards[(t, pp_rank)][name] for t in range(tp)], dim=dim)

    out: dict[str, torch.Tensor] = {}
    out["model.embed_tokens.weight"] = gather(0, "embedding.word_embeddings.weight", 0)[:spec.vocab_size].clone()
    for p in range(pp):
        for local, i in enumerate(layer_range(spec, pp, p)):
            src, dst = f"decoder.layers.{local}.", f"model.layers.{i}."
            a = dst + "self_attn."
            q, k, v = _split_qkv(gather(p, src + "self_attention.linear_qkv.weight", 0), spec)
            out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = \
                q.contiguous(), k.contiguous(), v.contiguous()
            if spec.attention_bias:
                q, k, v = _split_qkv(gather(p, src + "self_attention.linear_qkv.bias", 0), spec)
                out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = \
                    q.contiguous(), k.contiguous(), v.contiguous()
            out[a + "o_proj.weight"] = gather(p, src + "self_attention.linear_proj.weight", 1)
            if spec.qk_norm:
                out[a + "q_norm.weight"] = shards[(0, p)][src + "self_attention.q_layernorm.weight"].clone()
                out[a + "k_norm.weight"] = shards[(0, p)][src + "self_attention.k_layernorm.weight"].clone()
            fc1 = [shards[(t, p)][src + "mlp.linear_fc1.weight"].chunk(2, dim=0) for t in range(tp)]
            out[dst + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
            out[dst + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
            out[dst + "mlp.down_proj.weight"] = gather(p, src + "mlp.linear_fc2.weight", 1)
            out[dst + "input_layernorm.weight"] = shards[(0, p)][
                src + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")].clone()
            out[dst + "post_attention_layernorm.weight"] = shards[(0, p)][
                src + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight")].clone()
    out["model.norm.weight"] = shards[(0, pp - 1)]["decoder.final_layernorm.weight"].clone()
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = gather(pp - 1, "output_layer.weight", 0)[:spec.vocab_size].clone()
    return out
