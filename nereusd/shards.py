"""Which slice of which parameter a ``(pp_rank, tp_rank)`` position holds: a pure shard spec.

The transition planner (:mod:`nereusd.transition`) and the data-plane primitives agree on what
a device holds and what it must send through this module. It mirrors, without torch, the
engine's sharding (:mod:`emu.engine.canonical` ``canonical_shapes`` / ``shard_dim`` and
:mod:`emu.engine.parallel` ``layer_range`` / ``stage_param_names``), which follows DESIGN.md
("EMU state and primitives", sharding table, Megatron convention):

==========================  ========================================  ====================
parameter                   TP                                        PP
==========================  ========================================  ====================
embedding ``[V, h]``        dim 0 (vocab-parallel)                    first stage
q/k/v ``[heads·d, h]``      dim 0, whole heads; k/v replicated when   owning layer's stage
and their biases            ``tp > num_kv_heads``
o ``[h, heads·d]``          dim 1                                     owning layer's stage
gate/up ``[f, h]``          dim 0                                     owning layer's stage
down ``[h, f]``             dim 1                                     owning layer's stage
norms (q/k norms too),      replicated                                final ones: last stage
value head
lm head ``[V, h]``          dim 0                                     last stage
==========================  ========================================  ====================

Optimizer tensors of a parameter are sharded exactly like it, so one :class:`Shard` names the
slice of the parameter *and* of its optimizer tensors.

Split points are equal chunks (``tp`` divides heads, vocabulary and ``f``; ``pp`` divides the
layers), so a coarser layout's shard is exactly the union of the finer layout's shards at
the positions ``t // k`` (``k`` the ratio of the degrees): the nesting that Split and Merge
rely on (paper §5.2).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from nereusd.errors import ConfigError, PlanError
from nereusd.models import ModelSpec
from nereusd.plan import Layout, Role

Position = tuple[int, int]
"""``(pp_rank, tp_rank)`` inside one replica."""


@dataclass(frozen=True, order=True)
class Shard:
    """The slice ``[start, stop)`` along ``dim`` of canonical parameter ``name``.

    A replicated (or unsplit) tensor is the full range of dim 0. ``full_shape`` is the
    canonical (unsharded) shape; elements are counted in the parameter's own units, and the
    same slice applies to every optimizer tensor of the parameter.
    """

    name: str
    dim: int
    start: int
    stop: int
    full_shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements in the slice (``(stop − start) · ∏ other dims``)."""
        rest = math.prod(s for i, s in enumerate(self.full_shape) if i != self.dim)
        return (self.stop - self.start) * rest

    @property
    def is_full(self) -> bool:
        """Whether the slice is the whole tensor."""
        return self.start == 0 and self.stop == self.full_shape[self.dim]

    def along(self, dim: int) -> "Shard":
        """The same slice expressed along ``dim`` (only a full tensor changes its dim).

        Raises:
            PlanError: if a partial slice is asked for along another dim.
        """
        if dim == self.dim:
            return self
        if not self.is_full:
            raise PlanError(f"{self.name}[{self.start}:{self.stop}] along dim {self.dim} cannot be "
                            f"re-expressed along dim {dim}")
        return Shard(self.name, dim, 0, self.full_shape[dim], self.full_shape)

    def contains(self, other: "Shard") -> bool:
        """Whether ``other`` (same parameter) lies inside this slice."""
        if self.name != other.name:
            return False
        if self.is_full:
            return True
        if other.dim != self.dim:
            return False
        return self.start <= other.start and other.stop <= self.stop

    def to_list(self) -> list[Any]:
        """JSON form ``[name, dim, start, stop, [shape…]]``."""
        return [self.name, self.dim, self.start, self.stop, list(self.full_shape)]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> "Shard":
        """Inverse of :meth:`to_list`.

        Raises:
            PlanError: if ``data`` is not a five-element list of the right types.
        """
        try:
            name, dim, start, stop, shape = data
            return cls(str(name), int(dim), int(start), int(stop), tuple(int(s) for s in shape))
        except (TypeError, ValueError):
            raise PlanError(f"shard: expected [name, dim, start, stop, shape], got {data!r}") from None


def value_head_for(role: Role) -> bool:
    """Critic and reward models carry a scalar ``value_head`` instead of ``lm_head``."""
    return role in (Role.CRITIC, Role.REWARD)


@functools.lru_cache(maxsize=64)
def canonical_shapes(spec: ModelSpec, value_head: bool = False) -> Mapping[str, tuple[int, ...]]:
    """Full shape of every canonical parameter (Hugging Face names, in HF order): the one table
    the engine (:mod:`emu.engine.canonical`), the transition planner and the primitives use.

    Qwen2 adds ``q/k/v_proj.bias`` (``[heads·d]``, ``[kv·d]``), Qwen3 ``q_norm``/``k_norm``
    (``[d]``, one RMSNorm shared by every head).
    """
    h, f, v, d = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn: dict[str, tuple[int, ...]] = {p + "self_attn.q_proj.weight": (q, h)}
        if spec.attention_bias:
            attn[p + "self_attn.q_proj.bias"] = (q,)
        attn[p + "self_attn.k_proj.weight"] = (kv, h)
        if spec.attention_bias:
            attn[p + "self_attn.k_proj.bias"] = (kv,)
        attn[p + "self_attn.v_proj.weight"] = (kv, h)
        if spec.attention_bias:
            attn[p + "self_attn.v_proj.bias"] = (kv,)
        attn[p + "self_attn.o_proj.weight"] = (h, q)
        if spec.qk_norm:
            attn[p + "self_attn.q_norm.weight"] = (d,)
            attn[p + "self_attn.k_norm.weight"] = (d,)
        shapes.update(attn)
        shapes.update({
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    shapes["model.norm.weight"] = (h,)
    if value_head:
        shapes["value_head.weight"] = (1, h)
        shapes["value_head.bias"] = (1,)
    elif not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def shard_dim(name: str, spec: ModelSpec, tp: int) -> int | None:
    """The dim along which ``name`` is split over ``tp`` ranks, or ``None`` when replicated
    (DESIGN.md sharding table; q/k/v biases shard with their rows, q/k norms replicate).
    """
    if tp == 1:
        return None
    if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
        return None if tp > spec.num_kv_heads else 0
    if name.endswith(("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight")):
        return 0
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    return None


def check_layout(spec: ModelSpec, layout: Layout, *, value_head: bool = False, generation: bool = False) -> None:
    """Check that ``layout`` can shard ``spec`` per the sharding table of this module — the one
    layout rule of the project: the job loader, the transition planner and the engine call it.

    ``tp`` divides the attention heads, the vocabulary and the MLP width (whole heads, equal
    vocab-parallel and column chunks), and ``tp`` and ``num_kv_heads`` divide one another (kv heads
    split, or replicated when ``tp`` is a multiple); ``pp`` divides the layers; tied embeddings
    need the embedding and the output head on one stage (``pp = 1``) unless the model has a value
    head instead of ``lm_head``; generation folds PP into DP (``pp = 1``).

    Raises:
        PlanError: ``layout tp<t>·pp<p>:`` and every rule that fails, naming the degree and the
            model dimension.
    """
    tp, pp = layout.tp, layout.pp
    problems = [f"{which}={degree} does not divide model {field}={value}" for which, degree, field, value in (
        ("tp", tp, "num_heads", spec.num_heads),
        ("tp", tp, "vocab_size", spec.vocab_size),
        ("tp", tp, "intermediate_size", spec.intermediate_size),
        ("pp", pp, "num_layers", spec.num_layers),
    ) if value % degree]
    kv = spec.num_kv_heads
    if kv % tp and tp % kv:
        problems.append(f"tp={tp} and num_kv_heads={kv}: one must divide the other (kv heads are split when "
                        "tp divides them, replicated when tp is a multiple)")
    if pp > 1 and spec.tie_word_embeddings and not value_head:
        problems.append("tie_word_embeddings needs pp=1 (embedding and head on one stage)")
    if pp > 1 and generation:
        problems.append("generation needs pp=1 (PP is folded into DP for generation)")
    if problems:
        raise PlanError(f"layout tp{tp}·pp{pp}: " + "; ".join(problems))


def recomputed_buffer(name: str, spec: ModelSpec) -> bool:
    """Whether ``name`` is a RoPE ``inv_freq`` buffer older checkpoints saved, which every loader
    recomputes (transformers too): the model's, or one of its layers' attention's."""
    if name == "model.rotary_emb.inv_freq":
        return True
    parts = name.split(".")
    return (len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) < spec.num_layers and parts[3:] == ["self_attn", "rotary_emb", "inv_freq"])


def check_checkpoint_shapes(spec: ModelSpec, shapes: Mapping[str, tuple[int, ...]], *, value_head: bool,
                            source: str, equal: Callable[[str, str], bool] | None = None) -> None:
    """Check a checkpoint's tensor shapes (:func:`nereusd.hf_files.safetensors_shapes`) against the
    canonical table of ``spec``: every parameter is present with its full shape, and nothing
    else is there. A value head may be absent (a critic or reward model starting from a policy
    draws one) but not partial (a weight without its bias); a model with a value head ignores
    the policy's ``lm_head``. A tied model (``tie_word_embeddings``) may hold ``lm_head.weight``
    only equal to the embedding (``equal(a, b)``, :func:`nereusd.hf_files.safetensors_equal`):
    transformers then keeps the two apart, and loading would drop the head. Other names
    (a layer beyond ``num_hidden_layers``, biases of a model without them) are refused: loading
    would ignore them and train another model than the checkpoint's (an adversarial helper,
    2026-12-06), except :func:`recomputed_buffer`.

    Raises:
        ConfigError: ``source`` and the missing, unexpected or wrong-shape names (at most five
            of each).
    """
    expected = canonical_shapes(spec, value_head)
    has_head = any(n.startswith("value_head.") for n in shapes)   # a value head is whole or absent
    missing = [n for n in expected if n not in shapes and (has_head or not n.startswith("value_head."))
               and not (value_head and n.startswith("lm_head"))]
    wrong = [f"{n} {tuple(shapes[n])} (config.json says {tuple(expected[n])})" for n in expected
             if n in shapes and tuple(shapes[n]) != tuple(expected[n])]
    tied_head = spec.tie_word_embeddings and not value_head and "lm_head.weight" in shapes
    unexpected = [n for n in shapes if n not in expected and not recomputed_buffer(n, spec)
                  and not (value_head and n.startswith("lm_head.")) and not (tied_head and n == "lm_head.weight")]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors: {', '.join(missing[:5])}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensors config.json does not describe (the engine would ignore them): "
                        f"{', '.join(sorted(unexpected)[:5])}")
    if tied_head and (equal is None or not equal("lm_head.weight", "model.embed_tokens.weight")):
        problems.append("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight "
                        "(set tie_word_embeddings: false in config.json to train that head)")
    if wrong:
        problems.append(f"{len(wrong)} tensors of the wrong shape: {'; '.join(wrong[:5])}")
    if problems:
        raise ConfigError(f"{source}: the weights do not match config.json: " + "; ".join(problems))


def layer_range(spec: ModelSpec, pp: int, pp_rank: int) -> range:
    """Decoder layers of pipeline stage ``pp_rank``: ``num_layers / pp`` contiguous layers."""
    per = spec.num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _on_stage(name: str, spec: ModelSpec, pp: int, pp_rank: int) -> bool:
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) in layer_range(spec, pp, pp_rank)
    if name == "model.embed_tokens.weight":
        return pp_rank == 0
    return pp_rank == pp - 1


@functools.lru_cache(maxsize=4096)
def shards_of(
    spec: ModelSpec, layout: Layout, position: Position, value_head: bool = False
) -> tuple[Shard, ...]:
    """Every shard held at ``position = (pp_rank, tp_rank)`` of a replica with ``layout``.

    Returns:
        The shards in canonical (HF) parameter order.

    Raises:
        PlanError: if ``layout`` cannot shard ``spec`` (:func:`check_layout`) or ``position``
            is outside it.
    """
    check_layout(spec, layout, value_head=value_head)
    pp_rank, tp_rank = position
    if not (0 <= pp_rank < layout.pp and 0 <= tp_rank < layout.tp):
        raise PlanError(f"position {position} is outside layout tp{layout.tp}·pp{layout.pp}")
    out = []
    for name, shape in canonical_shapes(spec, value_head).items():
        if not _on_stage(name, spec, layout.pp, pp_rank):
            continue
        dim = shard_dim(name, spec, layout.tp)
        if dim is None:
            out.append(Shard(name, 0, 0, shape[0], shape))
        else:
            size = shape[dim] // layout.tp
            out.append(Shard(name, dim, tp_rank * size, (tp_rank + 1) * size, shape))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def most_elements_per_device(spec: ModelSpec, tp: int, pp: int, value_head: bool = False) -> int:
    """Parameter elements on the most loaded device of a ``tp × pp`` replica: the largest
    pipeline stage's sum, over this module's table (:func:`canonical_shapes`, :func:`shard_dim`,
    :func:`layer_range`), of each parameter's elements divided over ``tp`` where it is split —
    what :func:`shard_elements` gives a valid layout's position, here for any degrees, without
    :func:`check_layout` (the cost model prices layouts the planner then refuses): an uneven
    split counts its larger piece, layers that ``pp`` does not divide go to the earlier stages.

    So k/v count whole on every rank when ``tp > num_kv_heads`` (replicated), Qwen2's q/k/v
    biases and Qwen3's q/k norms count, and a critic's or reward model's ``value_head``
    (``value_head=True``, :func:`value_head_for`) replaces the ``[V, h]`` output head.
    """
    per_stage = [0] * pp
    layers_per_stage = -(-spec.num_layers // pp)
    for name, shape in canonical_shapes(spec, value_head).items():
        numel = math.prod(shape)
        dim = shard_dim(name, spec, tp)
        if dim is not None:
            numel = numel // shape[dim] * -(-shape[dim] // tp)
        if name.startswith("model.layers."):
            per_stage[int(name.split(".")[2]) // layers_per_stage] += numel
        else:
            per_stage[0 if name == "model.embed_tokens.weight" else pp - 1] += numel
    return max(per_stage)


@functools.lru_cache(maxsize=4096)
def shard_elements(spec: ModelSpec, layout: Layout, position: Position, value_head: bool = False) -> int:
    """Parameter elements held at ``position`` of ``layout`` (sum of :func:`shards_of`)."""
    return sum(s.numel for s in shards_of(spec, layout, position, value_head))


def missing_pieces(
    spec: ModelSpec,
    value_head: bool,
    have: tuple[Layout, Position] | None,
    want: tuple[Layout, Position],
    peers: Sequence[tuple[int, Layout, Position]],
) -> list[tuple[int, Shard]]:
    """The pieces a device must receive to hold ``want`` when it already holds ``have``.

    Args:
        have: the device's current ``(layout, position)``, or ``None`` when it holds nothing.
        want: the ``(layout, position)`` it must hold afterwards.
        peers: ``(device, layout, position)`` of the devices it may receive from, in order of
            preference; each piece comes from the first peer holding it.

    Returns:
        ``(peer device, shard)`` pairs; together with ``have`` they cover ``want`` exactly
        (pieces are disjoint). Shards of nested layouts are equal or disjoint, which is what
        makes the first-come choice exact.

    Raises:
        PlanError: if the peers do not hold everything missing.
    """
    held = {s.name: s for s in shards_of(spec, have[0], have[1], value_head)} if have else {}
    peer_shards = [
        (dev, {s.name: s for s in shards_of(spec, lay, pos, value_head)}) for dev, lay, pos in peers
    ]
    out: list[tuple[int, Shard]] = []
    for need in shards_of(spec, want[0], want[1], value_head):
        mine = held.get(need.name)
        if mine is not None and mine.contains(need):
            continue
        offers = [(dev, shards[need.name]) for dev, shards in peer_shards if need.name in shards]
        # A parameter is split along one fixed dim; a full tensor may be written along any.
        dims = {s.dim for s in [need, *(o for _, o in offers), *([mine] if mine else [])] if not s.is_full}
        dim = dims.pop() if dims else need.dim
        need = need.along(dim)
        covered: list[tuple[int, int]] = []
        if mine is not None and need.contains(mine):
            mine = mine.along(dim)
            covered.append((mine.start, mine.stop))
        for dev, piece in offers:
            if piece.contains(need) and not need.contains(piece):
                piece = need  # a replicated peer sends just the slice wanted
            if not need.contains(piece):
                continue
            piece = piece.along(dim)
            if any(piece.start < b and a < piece.stop for a, b in covered):
                continue
            covered.append((piece.start, piece.stop))
            out.append((dev, piece))
        if sum(b - a for a, b in covered) != need.stop - need.start:
            raise PlanError(
                f"{need.name}[{need.start}:{need.stop}] along dim {need.dim}: peers "
                f"{[p[0] for p in peers]} do not hold the missing part"
            )
    return out
