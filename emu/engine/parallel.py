"""Process groups, validation and tensor/pipeline-parallel plumbing of one model-stage.

A worker builds the groups of *every* model-stage of a plan, in canonical order, on every world
rank (members or not): ``torch.distributed.new_group`` is a collective over the whole world.
World rank equals global device index, and a candidate's device order is
``devices[(dp_rank * pp + pp_rank) * tp + tp_rank]`` (:class:`nereusd.plan.Candidate`).

``new_group`` orders a group's ranks by global rank, not by our tensor/pipeline position, so
:class:`StageGroups` keeps both and every collective that depends on order (all-gather of
shards, pipeline peers, broadcast sources) maps positions to group ranks explicitly.

Why TP is hand-written (Megatron's ``f``/``g`` operators in :mod:`emu.engine.model`) rather than
DTensor ``parallelize_module``: (1) kv heads *replicated* when ``tp > num_kv_heads`` (DESIGN.md
table) are a replicated weight whose TP ranks compute different partial gradients that must be
summed — no Colwise/Rowwise placement expresses that; (2) per-token log-probabilities and
entropy over vocab-parallel logits need their own reductions anyway; (3) primitives move
canonical per-parameter shards bit-exactly, which are plain tensors here; (4) measured on the
2-core dev machine (2 gloo ranks, SwiGLU MLP forward+backward, medians of 20, two runs under
load ~4.7; ``scripts/bench_engine_tp.py``): DTensor 33–43 ms vs hand-written 9–10 ms at h=64
(3.7–4.5×), 270–279 ms vs 207–248 ms at h=512, 512 tokens (1.1–1.3×) — per-op dispatch
overhead that dominates the tiny models local mode runs. Outputs and gradients agree (1e-5).
PP uses ``torch.distributed.pipelining`` (``PipelineStage`` with static shapes, rebuilt per call
because sequence length varies; ``Schedule1F1B``, or ``ScheduleGPipe`` when there are fewer
micro-batches than stages).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from emu.engine.canonical import canonical_shapes, shard_dim
from emu.engine.model import TPGroup, reduce_from_tp
from nereusd.models import ModelSpec
from nereusd.plan import Candidate
from nereusd.shards import layer_range

log = logging.getLogger(__name__)




@dataclass(frozen=True)
class StageGroups:
    """This rank's communicators for one model-stage.

    Attributes:
        candidate: the model-stage's candidate.
        rank: this world rank (= device index).
        dp_rank, pp_rank, tp_rank: coordinates of ``rank`` in the candidate.
        tp: tensor-parallel group (with ``tp_rank``) as the model uses it.
        pp_group, dp_group: process groups (``None`` when that degree is 1).
        tp_ranks, pp_ranks, dp_ranks: global ranks of this rank's groups in position order.
    """

    candidate: Candidate
    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    tp: TPGroup
    pp_group: Optional[dist.ProcessGroup]
    dp_group: Optional[dist.ProcessGroup]
    tp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.candidate.pp - 1

    @staticmethod
    def group_rank(ranks: tuple[int, ...], position: int) -> int:
        """Group rank of the member at ``position`` (``new_group`` sorts by global rank)."""
        return sorted(ranks).index(ranks[position])


def build_stage_groups(candidate: Candidate, my_rank: int, backend: Optional[str] = None) -> Optional[StageGroups]:
    """Create the TP, PP and DP groups of ``candidate``; call on every world rank, same order.

    Groups of size 1 are not created (on any rank). Returns ``None`` when ``my_rank`` is not in
    the candidate (it still took part in creating the groups).
    """
    def make(groups: list[tuple[int, ...]]) -> tuple[Optional[dist.ProcessGroup], tuple[int, ...]]:
        mine: tuple[Optional[dist.ProcessGroup], tuple[int, ...]] = (None, ())
        for ranks in groups:
            group = dist.new_group(list(ranks), backend=backend) if len(ranks) > 1 else None
            if my_rank in ranks:
                mine = (group, ranks)
        return mine

    tp_group, tp_ranks = make(candidate.tp_groups())
    pp_group, pp_ranks = make(candidate.pp_groups())
    dp_group, dp_ranks = make(candidate.dp_groups())
    if my_rank not in candidate.devices:
        return None
    dp_rank, pp_rank, tp_rank = candidate.coords_of(my_rank)
    return StageGroups(
        candidate=candidate, rank=my_rank, dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank,
        tp=TPGroup(candidate.tp, tp_rank, tp_group), pp_group=pp_group, dp_group=dp_group,
        tp_ranks=tp_ranks, pp_ranks=pp_ranks, dp_ranks=dp_ranks,
    )


# --------------------------------------------------------------------------- vocab-parallel math


def vocab_parallel_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup,
                                    with_entropy: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probability of ``targets`` and entropy from vocab-sharded logits (differentiable).

    Args:
        logits: ``[..., V/tp]``, this rank's vocabulary slice ``[tp_rank·V/tp, …)``.
        targets: ``[...]`` int64 token ids over the full vocabulary.

    Returns:
        ``(logprobs [...], entropy [...] or None)``, identical on every TP rank.

    Megatron's vocab-parallel cross-entropy (Shoeybi et al. 2019, §3): a max all-reduce for
    stability, then summed ``exp`` and the target logit are reduced over the TP group.
    """
    vocab_local = logits.shape[-1]
    logits_max = logits.detach().amax(dim=-1, keepdim=True)
    if tp.size > 1:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp.group)
    z = logits - logits_max
    exp_z = z.exp()
    sum_exp = reduce_from_tp(exp_z.sum(dim=-1), tp)
    local = targets - tp.rank * vocab_local
    inside = (local >= 0) & (local < vocab_local)
    picked = z.gather(-1, local.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
    target_z = reduce_from_tp(picked * inside, tp)
    log_sum = sum_exp.log()
    logprobs = target_z - log_sum
    entropy = None
    if with_entropy:
        entropy = log_sum - reduce_from_tp((exp_z * z).sum(dim=-1), tp) / sum_exp
    return logprobs, entropy


# --------------------------------------------------------------------------- canonical state


def stage_param_names(spec: ModelSpec, value_head: bool, pp: int, pp_rank: int) -> list[str]:
    """Canonical names held by pipeline stage ``pp_rank``, in canonical order."""
    layers = layer_range(spec, pp, pp_rank)
    out = []
    for name in canonical_shapes(spec, value_head):
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) in layers:
                out.append(name)
        elif name == "model.embed_tokens.weight":
            if pp_rank == 0:
                out.append(name)
        elif pp_rank == pp - 1:
            out.append(name)
    return out


def gather_tp(name: str, local: torch.Tensor, spec: ModelSpec, groups: StageGroups) -> torch.Tensor:
    """The canonical full tensor of ``name`` from this rank's TP shard (all TP ranks get it)."""
    dim = shard_dim(name, spec, groups.tp.size)
    if dim is None:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in groups.tp_ranks]
    dist.all_gather(parts, local.detach().contiguous(), group=groups.tp.group)
    order = [StageGroups.group_rank(groups.tp_ranks, t) for t in range(groups.tp.size)]
    return torch.cat([parts[g] for g in order], dim=dim)


def gather_pp(tensors: dict[str, torch.Tensor], spec: ModelSpec, value_head: bool,
              groups: StageGroups, suffixes: tuple[str, ...] = ("",)) -> dict[str, torch.Tensor]:
    """Share TP-full tensors of every pipeline stage with the whole PP group.

    ``tensors`` holds this stage's entries ``name + suffix`` (full shapes); each stage's entries
    travel as one flat broadcast (shapes are known to every rank from the spec).
    """
    pp = groups.candidate.pp
    if pp == 1:
        return dict(tensors)
    shapes = canonical_shapes(spec, value_head)
    out: dict[str, torch.Tensor] = {}
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    for p in range(pp):
        keys = [(n, s) for n in stage_param_names(spec, value_head, pp, p) for s in suffixes]
        numels = [torch.Size(shapes[n]).numel() for n, _ in keys]
        if p == groups.pp_rank:
            flat = torch.cat([tensors[n + s].reshape(-1).to(torch.float32) for n, s in keys])
        else:
            flat = torch.empty(sum(numels), dtype=torch.float32, device=device)
        dist.broadcast(flat, group=groups.pp_group, group_src=StageGroups.group_rank(groups.pp_ranks, p))
        for (n, s), piece in zip(keys, flat.split(numels)):
            out[n + s] = piece.view(shapes[n]).clone()
    return out


# --------------------------------------------------------------------------- pipeline


def run_pipeline(module: nn.Module, groups: StageGroups, device: torch.device, *,
                 tokens: Optional[torch.Tensor], n_micro: int, hidden_size: int, out_shape: tuple[int, ...],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], train: bool) -> list[torch.Tensor]:
    """Run ``n_micro`` micro-batches through this replica's pipeline with ``torch.distributed.pipelining``.

    Args:
        module: this stage's :class:`emu.engine.model.LlamaModel` shard.
        tokens: ``[n_micro·mb, S]`` int64 on the first stage (``None`` elsewhere).
        out_shape: last stage's per-micro-batch output shape, e.g. ``(mb, S, V/tp)``.
        loss_fn: on the last stage ``loss_fn(output, index)`` where ``index`` is a ``[1]``
            tensor holding the micro-batch number; returns a scalar (``train``) or any tensor.
        train: run backward (``loss`` SUM over micro-batches, no scaling) or forward only.

    Returns:
        On the last stage, ``loss_fn``'s results in micro-batch order; elsewhere ``[]``.
    """
    # Imported here: torch.distributed.pipelining pulls in torch._dynamo (~2 s of CPU per worker
    # start on a 2-core machine), and only workers holding a pp > 1 model-stage need it.
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp, p = groups.candidate.pp, groups.pp_rank
    mb, seq = out_shape[0], out_shape[1]
    meta = torch.device("meta")
    # Static metadata: float activations carry requires_grad so their gradients are exchanged.
    inp = (torch.empty(mb, seq, dtype=torch.int64, device=meta) if p == 0
           else torch.empty(mb, seq, hidden_size, device=meta, requires_grad=train))
    out = torch.empty(out_shape if p == pp - 1 else (mb, seq, hidden_size), device=meta, requires_grad=train)
    stage = PipelineStage(module, p, pp, device, input_args=(inp,), output_args=(out,), group=groups.pp_group)
    stage.stage_index_to_group_rank = {i: StageGroups.group_rank(groups.pp_ranks, i) for i in range(pp)}
    schedule_cls = Schedule1F1B if n_micro >= pp else ScheduleGPipe
    schedule = schedule_cls(stage, n_micro, loss_fn=loss_fn, scale_grads=False)
    args = (tokens,) if p == 0 else ()
    target = torch.arange(n_micro, device=device)
    results: list[torch.Tensor] = []
    if train:
        schedule.step(*args, target=target, losses=results, return_outputs=False)
    else:
        with torch.no_grad():
            schedule.eval(*args, target=target, losses=results, return_outputs=False)
    return results
