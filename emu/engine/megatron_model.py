"""A megatron-core ``GPTModel`` for one model-stage shard: built from a :class:`ModelSpec`, on
the model-stage's own process groups, loaded from and read back to canonical tensors.

The model side of the Megatron backend (issue 15); the tensor mapping is
:mod:`emu.engine.megatron_layout`. What is here:

- :func:`megatron_config`: the ``TransformerConfig`` of a spec — RMSNorm, SwiGLU, no linear
  biases except Qwen2's q/k/v (``add_qkv_bias``), Qwen3's per-head q/k norms (``qk_layernorm``),
  ``kv_channels`` = the head dimension, grouped-query attention (``num_query_groups``), sequence
  parallelism whenever ``tp > 1`` and the layer spec supports it: Transformer Engine's norms do;
  the local spec's norm without Apex is torch's (``WrappedTorchNorm``), which refuses it, so the
  local spec runs ``tp > 1`` without sequence parallelism (activations of norms and dropout
  replicated over TP instead of split).
- :func:`rope_arguments`: RoPE as ``GPTModel`` takes it. Megatron's Llama-3 scaling fixes the low
  and high frequency factors at 1 and 4 and the original context at 8,192 (megatron-core 0.16.1,
  ``RotaryEmbedding._apply_scaling``); a spec with other values is refused, naming the field.
- :func:`stage_process_groups`: a ``ProcessGroupCollection`` holding the model-stage's own TP, PP
  and DP groups. Megatron's global ``parallel_state`` holds one layout per process, and a Nereus
  worker holds several model-stages of different layouts, so every ``GPTModel`` gets its groups
  explicitly (``pg_collection``) and ``parallel_state.initialize_model_parallel`` is never called
  (docs/DESIGN.md, "Megatron-core").
- :func:`build_gpt_model`, :func:`load_canonical`, :func:`megatron_tensors`: build one
  ``(tp_rank, pp_rank)`` shard, load it from canonical full tensors
  (:func:`~emu.engine.megatron_layout.to_megatron`), and read its tensors back under Megatron's
  names (for :func:`~emu.engine.megatron_layout.from_megatron`: checkpoints, transitions, weight
  sync in Hugging Face names).
- :func:`gather_canonical`: the replica's full canonical tensors on every rank, for a weight sync
  to vLLM in Hugging Face names (bucketed by ``VllmEngine.load_weights``, no disk), a transition
  or a checkpoint.
- :func:`allreduce_tp_replicated_grads`: Megatron's TP sum of the gradients of replicated
  parameters (sequence-parallel norms, q/k norms) for a bare ``GPTModel``.
- :func:`causal_mask` and :func:`logits`: a forward pass to ``[B, S, vocab]`` logits.

Not built yet (issue 15): the training and inference stage engine that runs these in a worker
(``backends: {<role>/training: megatron}``), pipeline schedules, the distributed optimizer.

megatron-core 0.16.1 is imported lazily: the rest of Nereus runs without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from emu.engine.megatron_layout import check_layout, from_megatron, padded_vocab, to_megatron
from nereusd.errors import ConfigError
from nereusd.models import ModelSpec
from nereusd.shards import layer_range

MEGATRON_LLAMA3_ROPE = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0, "rope_original_max_position": 8192}
"""The Llama-3 RoPE scaling parameters megatron-core 0.16.1 hard-codes (``_apply_scaling``'s
defaults; ``GPTModel`` passes only the factor)."""


def rope_arguments(spec: ModelSpec) -> dict[str, Any]:
    """``GPTModel`` keyword arguments for ``spec``'s rotary embedding.

    Raises:
        ConfigError: a Llama-3 scaling whose low/high frequency factors or original context differ
            from what Megatron hard-codes (:data:`MEGATRON_LLAMA3_ROPE`), naming the field.
    """
    args: dict[str, Any] = {"position_embedding_type": "rope", "rotary_percent": 1.0,
                            "rotary_base": spec.rope_theta, "rope_scaling": False}
    if spec.rope_type == "llama3":
        for name, megatron_value in MEGATRON_LLAMA3_ROPE.items():
            if getattr(spec, name) != megatron_value:
                raise ConfigError(f"model.{name}: {getattr(spec, name)} but megatron-core's Llama-3 RoPE scaling "
                                  f"fixes it at {megatron_value}; run this model on the native engine")
        args.update(rope_scaling=True, rope_scaling_factor=spec.rope_factor)
    return args


def megatron_config(spec: ModelSpec, tp: int, pp: int, *, dtype: torch.dtype = torch.float32,
                    sequence_parallel: bool = False) -> Any:
    """The ``TransformerConfig`` of ``spec`` at ``(tp, pp)``.

    Args:
        dtype: parameter and compute dtype (fp32 on CPU, bf16 on GPUs).
        sequence_parallel: split the sequence over TP outside attention and MLP (needs
            ``tp > 1`` and norms that support it; :func:`build_gpt_model` decides).

    Raises:
        ConfigError: the layout does not fit the model (:func:`check_layout`), or ``tp`` exceeds
            the query groups (see the code).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    check_layout(spec, tp, pp)
    if spec.num_kv_heads % tp:
        # megatron-core 0.16.1 splits a query group across TP ranks with parallel_state's global
        # TP rank and group (SelfAttention.get_query_key_value_tensors), which explicit
        # per-model-stage groups never set
        raise ConfigError(f"Megatron backend: tp={tp} exceeds the model's {spec.num_kv_heads} query groups "
                          f"(num_kv_heads); Megatron splits a group across ranks only through its global "
                          f"parallel state, which Nereus does not use — run tp <= {spec.num_kv_heads}")
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=spec.attention_bias,
        qk_layernorm=spec.qk_norm, attention_dropout=0.0, hidden_dropout=0.0,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=dtype, use_cpu_initialization=True, perform_initialization=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)


@dataclass(frozen=True)
class StageGroups:
    """One model-stage's process groups on this rank (``torch.distributed`` groups).

    Attributes:
        tp: the ranks of this rank's tensor-parallel group.
        pp: this rank's pipeline (the stages of one TP rank of one replica).
        dp: this rank's data-parallel group (same ``(tp_rank, pp_rank)`` in every replica).
        embd: first and last pipeline stage of this pipeline (tied embeddings' gradients).
    """

    tp: Any
    pp: Any
    dp: Any
    embd: Any


def stage_process_groups(groups: StageGroups) -> Any:
    """A ``ProcessGroupCollection`` of ``groups``: context parallelism is off, so ``cp`` is a
    group of this rank alone and ``tp_cp`` / ``dp_cp`` equal ``tp`` / ``dp``; ``mp`` (TP × PP) is
    needed only by Megatron's optimizer and left unset."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    own = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return ProcessGroupCollection(tp=groups.tp, pp=groups.pp, dp=groups.dp, embd=groups.embd, pos_embd=groups.embd,
                                  cp=own, tp_cp=groups.tp, dp_cp=groups.dp)


def build_gpt_model(spec: ModelSpec, tp: int, pp: int, pp_rank: int, pg_collection: Any, *,
                    dtype: torch.dtype = torch.float32, te: bool | None = None) -> Any:
    """``GPTModel`` shard of pipeline stage ``pp_rank`` (this rank's TP rank is its place in
    ``pg_collection.tp``), parameters uninitialised: load them with :func:`load_canonical`.

    Args:
        te: use the Transformer-Engine layer spec; default when ``transformer_engine`` imports.
            Sequence parallelism is on when ``tp > 1`` with it, off with the local spec (see the
            module docstring).

    Raises:
        ConfigError: the layout does not fit the model, or a RoPE scaling Megatron lacks.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.core.models.gpt.gpt_model import GPTModel

    if te is None:
        te = transformer_engine_available()
    config = megatron_config(spec, tp, pp, dtype=dtype, sequence_parallel=te and tp > 1)
    layer_spec = (get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm) if te
                  else get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm"))
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:   # per process, not per layout: local attention's scratch
        parallel_state._set_global_memory_buffer()
    layers = layer_range(spec, pp, pp_rank)
    model = GPTModel(config, layer_spec, vocab_size=padded_vocab(spec.vocab_size, tp),
                     max_sequence_length=spec.max_position, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                     share_embeddings_and_output_weights=spec.tie_word_embeddings, pg_collection=pg_collection,
                     **rope_arguments(spec))
    tp_rank = dist.get_rank(pg_collection.tp)
    if dist.get_rank(pg_collection.pp) != pp_rank:
        raise ConfigError(f"Megatron shard: pipeline stage {pp_rank} asked for, but this rank is stage "
                          f"{dist.get_rank(pg_collection.pp)} of its pipeline group (Megatron orders a group's "
                          f"ranks ascending)")
    model.nereus_ranks = (tp_rank, pp_rank)   # checked by load_canonical
    built = len(model.decoder.layers)
    if built != len(layers):
        raise ConfigError(f"Megatron built {built} layers on pipeline stage {pp_rank}, Nereus expects {len(layers)}")
    return model


def seed_model_parallel_rng(seed: int, tp_rank: int) -> None:
    """Register Megatron's CUDA RNG states (its attention forks ``model-parallel-rng`` even at
    dropout 0) with this rank's TP rank given explicitly: without it megatron-core reads the rank
    from ``parallel_state``, which Nereus never initialises. Once per process, on a GPU; CPU tests
    replace the fork instead (``tests/unit/emu/test_megatron_model.py``)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _tensor_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters and buffers that hold state, under their ``state_dict`` names (not
    Transformer Engine's ``_extra_state`` entries)."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def uses_te(model: torch.nn.Module) -> bool:
    """Whether ``model`` was built on the Transformer-Engine layer spec (norms fused into the
    next linear: ``…layer_norm_weight`` tensors)."""
    return any(k.endswith("layer_norm_weight") for k in model.state_dict())


def load_canonical(model: torch.nn.Module, full: Mapping[str, torch.Tensor], spec: ModelSpec, tp: int, pp: int,
                   tp_rank: int, pp_rank: int) -> None:
    """Copy canonical full tensors (HF names) into ``model``, the ``(tp_rank, pp_rank)`` shard
    (local or Transformer-Engine names, as the model was built).

    Raises:
        ConfigError: ``(tp_rank, pp_rank)`` is not the model's place in its groups (Megatron
            orders a group's ranks ascending: a candidate's devices must map to ascending ranks),
            or the shard's tensors and the mapping's differ in names or shapes (naming them): a
            model built for another layout or architecture.
    """
    ranks = getattr(model, "nereus_ranks", (tp_rank, pp_rank))
    if ranks != (tp_rank, pp_rank):
        raise ConfigError(f"Megatron shard: loading (tp rank, pp rank) {(tp_rank, pp_rank)} into the model of "
                          f"{ranks}, its place in its process groups")
    wanted = to_megatron(full, spec, tp, pp, tp_rank, pp_rank, te=uses_te(model))
    have = {k: v for k, v in _tensor_state(model).items() if not _is_derived(k)}
    if set(have) != set(wanted):
        raise ConfigError(f"Megatron shard tp{tp_rank}/{tp} pp{pp_rank}/{pp}: model tensors and mapping differ: "
                          f"model only {sorted(set(have) - set(wanted))[:5]}, "
                          f"mapping only {sorted(set(wanted) - set(have))[:5]}")
    bad = [k for k in wanted if tuple(have[k].shape) != tuple(wanted[k].shape)]
    if bad:
        raise ConfigError(f"Megatron shard tp{tp_rank}/{tp} pp{pp_rank}/{pp}: shapes differ for {bad[:5]}")
    with torch.no_grad():
        for k, t in wanted.items():
            have[k].copy_(t)


def _is_derived(name: str) -> bool:
    """State that no checkpoint carries: RoPE frequencies (recomputed from the config)."""
    return name.endswith("inv_freq")


def megatron_tensors(model: torch.nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """This shard's tensors under Megatron's names (parameters, or with ``grads`` their
    gradients), detached: one rank's entry of :func:`~emu.engine.megatron_layout.from_megatron`'s
    ``shards``."""
    out = {}
    for k, v in _tensor_state(model).items():
        if _is_derived(k):
            continue
        if grads:
            g = getattr(v, "main_grad", None) if getattr(v, "grad", None) is None else v.grad
            if g is None:
                continue
            out[k] = g.detach()
        else:
            out[k] = v.detach()
    return out


def gather_canonical(model: torch.nn.Module, spec: ModelSpec, tp: int, pp: int,
                     groups: StageGroups) -> dict[str, torch.Tensor]:
    """The replica's full canonical tensors (Hugging Face names), on every rank of the replica:
    each tensor all-gathered over the TP group (Megatron's TP shards of one tensor are equal in
    shape), the stages' tensors then exchanged over the pipeline group, and mapped by
    :func:`~emu.engine.megatron_layout.from_megatron`. What a weight sync hands vLLM
    (``VllmEngine.load_weights`` buckets it) and a transition or checkpoint reads; collective over
    the replica. Memory: the whole model once per rank, as the native engine's ``full_state``.

    Raises:
        ConfigError: the layout does not fit the model.
    """
    mine = megatron_tensors(model)
    tp_group, pp_group = groups.tp, groups.pp
    pp_rank = dist.get_rank(pp_group) if pp > 1 else 0
    stage: dict[tuple[int, int], dict[str, torch.Tensor]] = {(t, pp_rank): {} for t in range(tp)}
    for name in sorted(mine):   # the same order on every TP rank: one collective per tensor
        parts = [torch.empty_like(mine[name]) for _ in range(tp)] if tp > 1 else [mine[name]]
        if tp > 1:
            dist.all_gather(parts, mine[name].contiguous(), group=tp_group)
        for t in range(tp):
            stage[(t, pp_rank)][name] = parts[t]
    shards = dict(stage)
    if pp > 1:
        stages: list[Any] = [None] * pp
        dist.all_gather_object(stages, {k: {n: v.cpu() for n, v in d.items()} for k, d in stage.items()},
                               group=pp_group)
        for other in stages:
            shards.update(other)
    return from_megatron(shards, spec, tp, pp, te=uses_te(model))


def allreduce_tp_replicated_grads(model: torch.nn.Module, tp_group: Any) -> None:
    """Sum over the TP group the gradients of parameters that every TP rank holds whole but
    applies to a part of the work, so that each rank holds a part of the gradient: under sequence
    parallelism the parameters Megatron marks ``sequence_parallel`` (the norms: each rank saw a
    part of the sequence), and with ``qk_layernorm`` the q/k norms (each rank normalises its own
    heads). Parameters marked ``average_gradients_across_tp_domain`` are averaged. The rule of
    megatron-core 0.16.1's ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``),
    which needs a DDP-wrapped model; this is it for a bare ``GPTModel``. No-op at ``tp == 1``."""
    if dist.get_world_size(tp_group) == 1:
        return
    config = model.config
    summed, averaged = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if getattr(p, "average_gradients_across_tp_domain", False):
            averaged.append(p.grad)
        elif (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or \
                (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)):
            summed.append(p.grad)
    for grads, op in ((summed, dist.ReduceOp.SUM), (averaged, dist.ReduceOp.AVG)):
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=op, group=tp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[1, 1, S, S]`` bool, True where attention is masked (Megatron's convention)."""
    return torch.triu(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)


def logits(model: torch.nn.Module, input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A one-stage (``pp == 1``) forward: ``input_ids [B, S]`` int64 → this TP rank's logits
    ``[B, S, V_padded/tp]``, or at ``tp == 1`` the real vocabulary ``[B, S, vocab_size]``
    (the padding rows cut off). Causal attention, positions ``0 … S−1``."""
    b, s = input_ids.shape
    positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    out = model(input_ids, positions, attention_mask=causal_mask(s, input_ids.device))
    tp = model.config.tensor_model_parallel_size
    return out[..., :vocab_size] if tp == 1 else out
