"""Memory model: predicted peak bytes per device of one model-stage candidate.

Each formula lives in one function here with its source. All results are bytes on the most
loaded device of a replica (the first pipeline stage holds the embedding and the most
in-flight activations; the last holds the output head and the logits; we take the larger).

Components (paper §4.2 "Peak memory"; DESIGN.md "Cost model"):

- parameters, gradients, optimizer state — ZeRO-0: parameter and gradient in the compute dtype,
  an fp32 master copy when that dtype is narrower than fp32, and Adam ``m``, ``v`` in fp32:
  16 bytes per parameter for bf16 and for fp32, divided by ``tp·pp``; ZeRO-1/2 divide the
  optimizer state (and at stage 2 the gradients) by ``dp`` as well (:func:`zero_state_bytes`);
- activations — Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models" (MLSys 2023), §4, counted again for the engine's Llama block and checked against what
  autograd keeps (:func:`micro_batch_activation_bytes`, the engine books the same); full
  recomputation keeps only each layer's input;
- KV cache for generation; the head (final norm, logits or values) on the last stage; a fixed
  workspace;
- co-resident idle model-stages (their :attr:`MemoryEstimate.resident_bytes`), added by the
  planner for devices shared across phases;
- a plan is feasible only below ``(1 − headroom) · capacity`` with ``headroom = 10 %``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from nereusd.models import ModelSpec
from nereusd.plan import ZERO_STAGES, ModelStage, Stage
from nereusd.shards import most_elements_per_device, value_head_for

HEADROOM = 0.10
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
#: Framework workspace per device (cuBLAS/NCCL buffers, allocator slack), by device kind.
WORKSPACE_BYTES = {"cuda": 3 << 29, "rocm": 3 << 29, "cpu": 16 << 20}
ADAM_STATE_BYTES = 8  # m and v in fp32
ZERO_BUCKET_ELEMENTS = 50_000_000
"""Gradient reduce bucket of ZeRO-2 in elements (DeepSpeed's ``reduce_bucket_size``; its default,
5e8, preallocates 2 GB of fp32 on every rank): the workers pass ``min(this, parameters)``."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes per device of one model-stage candidate, by component.

    ``peak_bytes`` is the sum of ``components`` (the model-stage's own working peak);
    ``resident_bytes`` is what stays on the device while the model-stage is idle
    (parameters, plus gradients, master copy and Adam state for training: the engines keep the
    gradient buffers between steps, as Megatron-core's persistent ``main_grad`` buffer and
    DeepSpeed's partitions do; the native engine's ``p.grad`` and the DeepSpeed engine's
    ``gradients`` booking live as long as the engine).
    """

    components: Mapping[str, int]
    resident_bytes: int

    @property
    def peak_bytes(self) -> int:
        return sum(self.components.values())


def usable_bytes(capacity_bytes: int, headroom: float = HEADROOM) -> int:
    """Bytes a plan may use on a device of ``capacity_bytes``: ``(1 − headroom) · capacity``."""
    return int(capacity_bytes * (1.0 - headroom))


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (fp32 4, bf16/fp16 2, fp8 1)."""
    return DTYPE_BYTES[dtype]


def parameters_per_device(spec: ModelSpec, tp: int, pp: int, value_head: bool = False) -> int:
    """Parameters on the most loaded device of a ``(tp, pp)`` replica: the engine's sharding
    (DESIGN.md "EMU state", Megatron convention), counted from the one sharding table,
    :func:`nereusd.shards.most_elements_per_device`. ``value_head``: a critic's or reward
    model's scalar head instead of the ``[V, h]`` output head (:func:`nereusd.shards.value_head_for`).

    Until 2026-12-07 a formula of its own counted k/v split where the engine replicates them
    (``tp > num_kv_heads``: −2.7 % for Qwen2.5-1.5B at TP 4), left out Qwen2's biases and Qwen3's
    q/k norms, and gave critics and reward models an output head (+7.0 % for Llama-3.1-8B at
    TP 1), in the memory model, the cost model and the simulator's truths alike (a review).
    """
    return most_elements_per_device(spec, tp, pp, value_head)


def zero_bucket_elements(params: int) -> int:
    """ZeRO-2's reduce bucket (and the all-gather bucket) for ``params`` parameters:
    ``min(ZERO_BUCKET_ELEMENTS, params)`` rounded up to even (DeepSpeed asserts a multiple of 2)."""
    n = min(ZERO_BUCKET_ELEMENTS, params)
    return n + n % 2


def zero_state_bytes(params: int, dp: int, zero_stage: int, compute_bytes: int) -> dict[str, int]:
    """``gradients`` and ``optimizer`` bytes per device of a training replica of ``params`` parameters.

    ZeRO-0 (Rajbhandari et al., "ZeRO", SC 2020, §5): gradient in the compute dtype; Adam ``m``,
    ``v`` in fp32 plus an fp32 master copy when the compute dtype is narrower.
    ZeRO-1/2 as DeepSpeed 0.19 runs them (``runtime/zero/stage_1_and_2.py``): an fp32 master
    partition plus ``m`` and ``v`` of ``⌈P/dp⌉`` elements (``12·P/dp``; the master is a clone even
    in fp32); ZeRO-1 keeps full gradients and, for the step, an fp32 partition of them
    (``P·g + 4·P/dp``); ZeRO-2 keeps the fp32 gradient partition and one reduce bucket
    (``4·P/dp + g·bucket``, :func:`zero_bucket_elements`). DeepSpeed pads partitions to
    a few elements; the engine books its own sizes and logs the difference.

    Raises:
        ValueError: for a stage outside :data:`ZERO_STAGES` or ``dp < 1``.
    """
    if zero_stage not in ZERO_STAGES or dp < 1:
        raise ValueError(f"zero_state_bytes: zero_stage must be one of {ZERO_STAGES} and dp >= 1, "
                         f"got {zero_stage}, dp={dp}")
    if zero_stage == 0:
        return {"gradients": params * compute_bytes,
                "optimizer": params * (ADAM_STATE_BYTES + (4 if compute_bytes < 4 else 0))}
    part = math.ceil(params / dp)
    grads = params * compute_bytes if zero_stage == 1 else zero_bucket_elements(params) * compute_bytes
    return {"gradients": grads + 4 * part, "optimizer": (4 + ADAM_STATE_BYTES) * part}


def activation_bytes_per_token_layer(spec: ModelSpec, tp: int, act_bytes: int, seq_len: int,
                                     flash_attention: bool = True, packed: bool = False) -> float:
    """Bytes autograd keeps for backward per token per decoder layer, without sequence parallelism.

    Korthikanti et al. 2023, Eq. 2 (``sbh(10 + 24/t + 5as/(ht))`` at 16 bits for a GELU MLP of
    ``4h``) counted again for the engine's Llama block (:mod:`emu.engine.model`: RMSNorm, GQA
    attention through ``scaled_dot_product_attention``, SwiGLU) and checked tensor by tensor with
    ``torch.autograd.graph.saved_tensors_hooks`` (``tests/unit/emu/test_activation_bytes.py``):

    - ``6h`` replicated over TP: both norms' inputs and outputs, the q/k/v and the gate/up inputs;
    - ``4q/t``: q, k and v as attention reads them (GQA's k and v repeated to the local query
      heads) and the attention output;
    - ``4f/t``: SwiGLU's gate, up, ``silu(gate)`` and the product;
    - ``a/t + 2`` in fp32: the fused attention's log-sum-exp per head, both norms' ``rstd``;
    - ``a·s/t`` more without a fused attention kernel (softmax probabilities stored);
    - ``q/t`` more in a packed row (:mod:`emu.engine.batch`): each segment's attention output and
      their concatenation are both kept, where a padded batch's output projection reads a view.
    - with Qwen3's per-head q/k norms (``qk_norm``): their inputs and outputs and one ``rstd`` per
      head, ``2q/t + 2·kv_l·d + a/t + kv_l`` with ``kv_l = ⌈kv_heads/t⌉`` local kv heads.

    Elements × ``act_bytes`` (the statistics are fp32; counted at ``act_bytes`` too).
    """
    h, f = spec.hidden_size, spec.intermediate_size
    q, a = spec.num_heads * spec.head_dim, spec.num_heads
    elements = 6 * h + ((5 if packed else 4) * q + 4 * f + a) / tp + 2
    if spec.qk_norm:
        kv_local = math.ceil(spec.num_kv_heads / tp)
        elements += (2 * q + a) / tp + kv_local * (2 * spec.head_dim + 1)
    if not flash_attention:
        elements += a * seq_len / tp
    return elements * act_bytes


TOKEN_ID_BYTES = 8
"""int64 token ids."""


def head_activation_bytes(spec: ModelSpec, *, tp: int, batch: int, seq: int, head_positions: int,
                          act_bytes: int, vocab_head: bool) -> int:
    """Bytes the last pipeline stage keeps for backward after the decoder layers, per micro-batch
    of ``batch`` rows of ``seq`` tokens whose outputs are read at ``head_positions`` per row.

    The final norm (input, output, the head's input and ``rstd``: ``3h + 1`` per token), then with
    a vocabulary head the local logits ``[b, s, V/t]`` and, at the read positions, the shifted
    logits and their ``exp`` (``2·b·P·V/t``, :func:`emu.engine.parallel.vocab_parallel_logprobs_entropy`);
    with a value head the values ``[b, s]``. Measured as :func:`activation_bytes_per_token_layer`.
    """
    norm = batch * seq * (3 * spec.hidden_size + 1) * act_bytes
    if not vocab_head:
        return norm + batch * seq * act_bytes
    vocab = math.ceil(spec.vocab_size / tp)
    return norm + (batch * seq + 2 * batch * head_positions) * vocab * act_bytes


def micro_batch_activation_bytes(spec: ModelSpec, *, tp: int, layers: int, batch: int, seq: int, act_bytes: int,
                                 train: bool, recompute: bool = False, first_stage: bool = True,
                                 last_stage: bool = True, head_positions: int = 0, vocab_head: bool = True,
                                 flash_attention: bool = True, packed: bool = False) -> int:
    """Activation bytes of one micro-batch (``batch`` rows of ``seq`` tokens) on one device of a
    pipeline stage holding ``layers`` decoder layers: what the engine books before it runs one
    (:meth:`emu.engine.stage.StageEngine._run`) and what the memory model predicts
    (:func:`stage_memory`): one formula for both.

    - Training keeps every layer's set (:func:`activation_bytes_per_token_layer`); with full
      recomputation only each layer's input (``b·s·h``) plus the one layer being recomputed.
    - Inference (no backward) holds one layer's set at a time.
    - Every stage keeps RoPE's cos and sin (``2·b·s·head_dim``); the first the token ids; the last
      :func:`head_activation_bytes`.
    """
    per_layer = batch * seq * activation_bytes_per_token_layer(spec, tp, act_bytes, seq, flash_attention, packed)
    if not train:
        body = per_layer
    elif recompute:
        body = layers * batch * seq * spec.hidden_size * act_bytes + per_layer
    else:
        body = layers * per_layer
    total = body + 2 * batch * seq * spec.head_dim * act_bytes
    if first_stage:
        total += batch * seq * TOKEN_ID_BYTES
    if last_stage:
        total += head_activation_bytes(spec, tp=tp, batch=batch, seq=seq, head_positions=head_positions,
                                       act_bytes=act_bytes, vocab_head=vocab_head)
    return int(total)


def prefill_activation_bytes(spec: ModelSpec, *, tp: int, layers: int, batch: int, prompt: int, act_bytes: int,
                             flash_attention: bool = True) -> tuple[int, int]:
    """``(activations, head)`` bytes of the native decoder's prefill of ``batch`` prompts of
    ``prompt`` tokens (padded) on one TP rank holding ``layers`` decoder layers: what
    :meth:`emu.engine.stage.StageEngine.generate` books and :func:`stage_memory` predicts.

    The decoder layers hold one layer's inference set at a time
    (:func:`micro_batch_activation_bytes` without the head); the final norm and head run at each
    prompt's last position only (``LlamaModel.forward(last_position_only=True)``): the norm's
    ``3h + 1`` per row and the local logits ``[b, V/t]``. Sampling
    (:func:`emu.engine.generate._next_tokens`) then holds ``[b, V]`` tensors of the whole
    vocabulary: at ``t > 1`` the all-gathered parts, their concatenation and the probabilities
    (3), at ``t = 1`` the scaled logits and the probabilities (2). Pricing every prompt token's
    logits instead would be ``b·prompt·V/t`` elements (10 GB in fp32 for 64 prompts of 256
    tokens and Qwen2.5's vocabulary of 151,936).
    """
    body = micro_batch_activation_bytes(spec, tp=tp, layers=layers, batch=batch, seq=prompt, act_bytes=act_bytes,
                                        train=False, last_stage=False, flash_attention=flash_attention)
    norm_and_logits = head_activation_bytes(spec, tp=tp, batch=batch, seq=1, head_positions=0, act_bytes=act_bytes,
                                            vocab_head=True)
    sampling = (3 if tp > 1 else 2) * batch * spec.vocab_size * act_bytes
    return body, norm_and_logits + sampling


def micro_batches_per_call(per_replica: int, micro_batch: int, mini_batches: int = 1) -> int:
    """Micro-batches of one training call of a replica (one optimizer step's share of its
    ``per_replica`` sequences, ``mini_batches`` steps a pass): ``⌈per_replica / (b · mini_batches)⌉``,
    at least 1, as the cost model counts them and the engine runs them (its call's ``n_micro``)."""
    return max(1, -(-per_replica // (max(1, micro_batch) * max(1, mini_batches))))


def pipeline_in_flight(n_micro: int, pp: int, pp_rank: int) -> int:
    """Micro-batches whose training activations pipeline stage ``pp_rank`` holds at once:
    ``pp − pp_rank`` under 1F1B (Narayanan et al. 2021, §2.2), all ``n_micro`` under GPipe,
    which the engine runs when ``n_micro < pp`` (:func:`emu.engine.parallel.run_pipeline`).
    The engine books with it; :func:`stage_memory` predicts with it."""
    if pp == 1:
        return 1
    return n_micro if n_micro < pp else min(n_micro, pp - pp_rank)


def kv_bytes_per_token(spec: ModelSpec, tp: int, pp: int, kv_bytes: int) -> int:
    """KV-cache bytes one device holds per cached token: ``2 (k, v) · ⌈layers/pp⌉ ·
    kv_heads_per_rank · head_dim · kv_bytes``, kv heads split over ``tp`` and one per rank when
    ``tp > num_kv_heads`` (the query heads of a rank share one kv head: vLLM, Megatron, the
    engine's ``KVCache``). The memory model's cache and the cost model's decode read it."""
    return 2 * math.ceil(spec.num_layers / pp) * math.ceil(spec.num_kv_heads / tp) * spec.head_dim * kv_bytes


def kv_cache_bytes(spec: ModelSpec, tokens: int, tp: int, pp: int, kv_bytes: int) -> int:
    """KV cache on one device for ``tokens`` cached tokens (all sequences of the replica),
    :func:`kv_bytes_per_token` each."""
    return int(tokens * kv_bytes_per_token(spec, tp, pp, kv_bytes))


VLLM_BLOCK_TOKENS = {"cpu": 32}
"""Tokens per vLLM KV-cache block by device kind (default 16, vLLM's GPU default). The workers
pass it as ``block_size``; vLLM's CPU backend needs a multiple of 32 (its default, 128, would round
a small job's cache up fourfold)."""


def vllm_block_tokens(device_kind: str) -> int:
    return VLLM_BLOCK_TOKENS.get(device_kind, 16)


def vllm_kv_cache_tokens(sequences: int, max_len: int, block_tokens: int) -> int:
    """Tokens of a vLLM KV cache that holds ``sequences`` sequences of ``max_len`` tokens at once.

    vLLM allocates whole blocks of ``block_tokens`` per sequence and keeps one block back (the
    block pool's null block; ``vllm/v1/core/block_pool.py``):
    ``(sequences · ⌈max_len / block_tokens⌉ + 1) · block_tokens``. With this many tokens'
    ``kv_cache_memory_bytes`` (:func:`kv_cache_bytes`), vLLM reports a maximum concurrency of at
    least ``sequences`` and never preempts a wave of ``sequences``.
    """
    return (sequences * -(-max_len // block_tokens) + 1) * block_tokens


def logits_bytes(spec: ModelSpec, tokens: int, tp: int, backward: bool) -> int:
    """fp32 vocab-parallel logits of ``tokens`` tokens on the last stage (×2 with their gradient)."""
    return int(tokens * math.ceil(spec.vocab_size / tp) * 4 * (2 if backward else 1))


def stage_memory(
    spec: ModelSpec,
    model_stage: ModelStage,
    *,
    sequences: int,
    prompt_length: int,
    response_length: int,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    recompute: bool = False,
    dtype: str = "bf16",
    device_kind: str = "cuda",
    flash_attention: bool = True,
    engine_seq: int | None = None,
    zero_stage: int = 0,
    packed: bool = False,
    mini_batches: int = 1,
) -> MemoryEstimate:
    """Peak bytes per device of ``model_stage`` running as ``⟨tp, pp, dp⟩``.

    Args:
        sequences: sequences the model-stage processes per RL step (all replicas together);
            each replica holds ``ceil(sequences / dp)``.
        micro_batch: per-replica micro-batch ``b`` in sequences (inference and training); for
            generation the sequences decoded concurrently (vLLM ``max_num_seqs``), the rest
            running in later waves.
        recompute: full activation recomputation (training only).
        mini_batches: optimizer steps per pass (training): the pipeline holds the micro-batches of
            one step's call in flight (:func:`micro_batches_per_call`).
        dtype: compute dtype; parameters, gradients, activations and KV cache use it.
        flash_attention: whether the softmax probabilities are never stored: true of the
            engines here (``scaled_dot_product_attention`` is fused on CPUs and GPUs alike, and
            vLLM's kernels); false for an engine with an unfused attention.
        engine_seq: generation on an engine of its own (vLLM) whose ``max_model_len`` is this:
            the engine holds a copy of the shard's weights while it runs (the EMU keeps its
            shard for transitions; the engine sleeps between rollouts), ``engine_weights =
            parameters``, and a KV cache preallocated for ``micro_batch`` sequences of
            ``engine_seq`` tokens in whole blocks (:func:`vllm_kv_cache_tokens`) — the
            ``kv_cache_memory_bytes`` the workers give vLLM (:mod:`emu.worker.vllm_stages`).
        zero_stage: ZeRO stage of a training model-stage (:func:`zero_state_bytes`).
        packed: inference and training micro-batches are packed rows (a token budget,
            ``train.max_tokens_per_micro_batch``; ``micro_batch`` is then the priced count,
            :meth:`nereusd.workflow.Workload.priced_micro_batch`): the engine keeps one attention
            output more per layer (:func:`activation_bytes_per_token_layer`). Generation never
            packs.

    Returns:
        A :class:`MemoryEstimate`; see the module docstring for the formulas.
    """
    e = dtype_bytes(dtype)
    seq = prompt_length + response_length
    per_replica = math.ceil(sequences / dp)
    value_output = value_head_for(model_stage.role)
    params = parameters_per_device(spec, tp, pp, value_output)
    comp: dict[str, int] = {"parameters": params * e, "workspace": WORKSPACE_BYTES[device_kind]}
    resident = params * e
    b = min(micro_batch, per_replica)
    layers = math.ceil(spec.num_layers / pp)
    # the device holding the most: with pp > 1 the first stage (the embedding side, the most
    # micro-batches in flight) or the last (the head), whichever needs more; one formula with
    # the engine's booking (micro_batch_activation_bytes)
    if model_stage.stage is Stage.GENERATION:
        if engine_seq:
            # the engine's budget is its max_num_seqs, also where its share is smaller (an engine kept
            # through a pool growth: PlannerOptions.generation_micro_batch)
            tokens = vllm_kv_cache_tokens(max(1, micro_batch), max(seq, engine_seq), vllm_block_tokens(device_kind))
            comp["kv_cache"] = kv_cache_bytes(spec, tokens, tp, pp, e)
            comp["engine_weights"] = params * e
            comp["logits"] = logits_bytes(spec, b, tp, backward=False)   # vLLM computes the sampled positions' only
        else:
            comp["kv_cache"] = kv_cache_bytes(spec, b * seq, tp, pp, e)
        comp["activations"], head = prefill_activation_bytes(spec, tp=tp, layers=layers, batch=b, prompt=prompt_length,
                                                             act_bytes=e, flash_attention=flash_attention)
        if not engine_seq:
            comp["logits"] = head
    elif model_stage.stage is Stage.INFERENCE:
        comp["activations"] = micro_batch_activation_bytes(
            spec, tp=tp, layers=layers, batch=b, seq=seq, act_bytes=e, train=False, last_stage=False,
            flash_attention=flash_attention, packed=packed)
        comp["logits"] = head_activation_bytes(spec, tp=tp, batch=b, seq=seq, head_positions=response_length,
                                               act_bytes=e, vocab_head=not value_output)
    else:
        comp.update(zero_state_bytes(params, dp, zero_stage, e))
        resident += comp["optimizer"] + comp["gradients"]
        micro_batches = micro_batches_per_call(per_replica, b, mini_batches)
        head = head_activation_bytes(spec, tp=tp, batch=b, seq=seq, head_positions=response_length,
                                     act_bytes=e, vocab_head=not value_output)

        def held(pp_rank: int) -> tuple[int, int]:   # (activations, head) stage pp_rank holds at once
            n = pipeline_in_flight(micro_batches, pp, pp_rank)
            act = micro_batch_activation_bytes(
                spec, tp=tp, layers=layers, batch=b, seq=seq, act_bytes=e, train=True, recompute=recompute,
                first_stage=pp_rank == 0, last_stage=False, flash_attention=flash_attention, packed=packed)
            return n * act, n * head if pp_rank == pp - 1 else 0

        # the first stage holds the most micro-batches, the last the head: the larger of the two
        first, last = held(0), held(pp - 1)
        comp["activations"], comp["logits"] = first if sum(first) >= sum(last) else last
    return MemoryEstimate(MappingProxyType(comp), int(resident))
