"""The pure shard spec agrees with the engine's sharding and nests as Split/Merge need."""

from __future__ import annotations

import math

import pytest

from nereusd.errors import PlanError
from nereusd.models import ModelSpec
from nereusd.plan import Layout, Role
from nereusd.shards import (
    Shard,
    canonical_shapes,
    check_layout,
    missing_pieces,
    shard_dim,
    shard_elements,
    shards_of,
    value_head_for,
)

SPEC = ModelSpec(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=8,
                 num_kv_heads=2)
TIED = ModelSpec(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=8,
                 num_kv_heads=2, tie_word_embeddings=True)


def test_matches_engine_names_shapes_and_split_dims():
    emu_model = pytest.importorskip("emu.engine.canonical")
    emu_parallel = pytest.importorskip("emu.engine.parallel")
    for spec in (SPEC, TIED):
        for value_head in (False, True):
            assert dict(canonical_shapes(spec, value_head)) == emu_model.canonical_shapes(spec, value_head)
            for tp in (1, 2, 4, 8):
                for name in canonical_shapes(spec, value_head):
                    assert shard_dim(name, spec, tp) == emu_model.shard_dim(name, spec, tp), (name, tp)
            for pp in (1, 2, 4):
                if pp > 1 and spec.tie_word_embeddings and not value_head:
                    continue
                for p in range(pp):
                    ours = [s.name for s in shards_of(spec, Layout(1, pp), (p, 0), value_head)]
                    assert ours == emu_parallel.stage_param_names(spec, value_head, pp, p)


def test_slices_match_engine_chunks():
    torch = pytest.importorskip("torch")
    emu_model = pytest.importorskip("emu.engine.canonical")
    shapes = canonical_shapes(SPEC)
    for tp in (2, 4, 8):
        for t in range(tp):
            for s in shards_of(SPEC, Layout(tp, 1), (0, t)):
                full = torch.arange(math.prod(shapes[s.name])).reshape(shapes[s.name])
                engine = emu_model.shard_full_tensor(s.name, full, SPEC, tp, t)
                ours = full.narrow(s.dim, s.start, s.stop - s.start)
                assert torch.equal(engine, ours), (s.name, tp, t)


def test_hand_written_shards_tp2_pp2():
    by_name = {s.name: s for s in shards_of(SPEC, Layout(2, 2), (1, 1))}
    assert set(n.split(".")[2] for n in by_name if n.startswith("model.layers.")) == {"2", "3"}
    assert "model.embed_tokens.weight" not in by_name
    assert by_name["lm_head.weight"] == Shard("lm_head.weight", 0, 32, 64, (64, 32))
    o_proj = "model.layers.2.self_attn.o_proj.weight"
    assert by_name[o_proj] == Shard(o_proj, 1, 16, 32, (32, 32))
    assert by_name["model.layers.3.self_attn.k_proj.weight"].numel == 4 * 32  # one of two kv heads (d=4)
    assert by_name["model.norm.weight"].is_full


def test_kv_replicated_beyond_kv_heads():
    k = {s.name: s for s in shards_of(SPEC, Layout(4, 1), (0, 3))}["model.layers.0.self_attn.k_proj.weight"]
    assert k.is_full and k.numel == 2 * 4 * 32


def test_elements_sum_to_the_parameter_count_over_one_replica():
    for spec, vh in ((SPEC, False), (SPEC, True), (TIED, False)):
        for layout in (Layout(1, 1), Layout(2, 1), Layout(2, 2), Layout(1, 4)):
            if layout.pp > 1 and spec.tie_word_embeddings:
                continue
            total = sum(shard_elements(spec, layout, (p, t), vh)
                        for p in range(layout.pp) for t in range(layout.tp))
            # The engine's value head *replaces* lm_head (emu/engine/model.py), so count it that way.
            expected = spec.num_parameters() - (spec.vocab_size * spec.hidden_size + -spec.hidden_size - 1
                                                if vh else 0)
            if layout.tp == 1:
                assert total == expected
            else:  # norms (and the value head) are replicated on every TP rank
                assert total > expected


def test_the_most_loaded_device_is_counted_from_the_table():
    """``most_elements_per_device`` (the memory model's, cost model's and simulator's parameter
    count) is the largest position's ``shard_elements`` for every valid layout: k/v replicated past
    the kv heads, Qwen2's biases, Qwen3's q/k norms, tied embeddings and value heads included; and a
    whole model is its published size (Llama-3.1-8B 8,030,261,248, Qwen2.5-7B 7,615,616,512)."""
    from nereusd.models import preset
    from nereusd.shards import most_elements_per_device

    qwen2 = ModelSpec(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=8,
                      num_kv_heads=2, architecture="qwen2")
    qwen3 = ModelSpec(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=8,
                      num_kv_heads=2, explicit_head_dim=8, architecture="qwen3", tie_word_embeddings=True)
    checked = 0
    for spec in (SPEC, TIED, qwen2, qwen3):
        for vh in (False, True):
            for tp in (1, 2, 4, 8):
                for pp in (1, 2, 4):
                    layout = Layout(tp, pp)
                    try:
                        check_layout(spec, layout, value_head=vh)
                    except PlanError:
                        continue
                    most = max(shard_elements(spec, layout, (p, t), vh) for p in range(pp) for t in range(tp))
                    assert most_elements_per_device(spec, tp, pp, vh) == most, (spec, vh, tp, pp)
                    checked += 1
    assert checked > 60
    assert most_elements_per_device(preset("llama-3.1-8b"), 1, 1) == 8_030_261_248
    assert most_elements_per_device(preset("qwen2.5-7b"), 1, 1) == 7_615_616_512


@pytest.mark.parametrize("coarse,fine", [(Layout(2, 1), Layout(4, 1)), (Layout(1, 2), Layout(2, 4)),
                                         (Layout(1, 1), Layout(8, 4)), (Layout(2, 2), Layout(2, 4))])
def test_coarse_shard_is_gathered_from_its_group(coarse, fine):
    """A coarse shard = own fine shard + pieces of the fine positions (p//kp, t//kt) — Split."""
    kp, kt = fine.pp // coarse.pp, fine.tp // coarse.tp
    for p in range(fine.pp):
        for t in range(fine.tp):
            sigma = (p // kp, t // kt)
            group = [(q, u) for q in range(fine.pp) for u in range(fine.tp)
                     if (q // kp, u // kt) == sigma and (q, u) != (p, t)]
            pieces = missing_pieces(SPEC, False, (fine, (p, t)), (coarse, sigma),
                                    [(i, fine, pos) for i, pos in enumerate(group)])
            got = sum(piece.numel for _, piece in pieces)
            own = {s.name: s for s in shards_of(SPEC, fine, (p, t))}
            already = sum(min(own[s.name].numel, s.numel)
                          for s in shards_of(SPEC, coarse, sigma) if s.name in own)
            assert got + already == shard_elements(SPEC, coarse, sigma)


def test_missing_pieces_refuses_when_peers_lack_data():
    with pytest.raises(PlanError, match="do not hold the missing part"):
        missing_pieces(SPEC, False, (Layout(2, 1), (0, 0)), (Layout(1, 1), (0, 0)), [])


def test_check_layout_messages():
    with pytest.raises(PlanError, match="tp=3 does not divide model num_heads=8"):
        check_layout(SPEC, Layout(3, 1))
    with pytest.raises(PlanError, match="pp=8 does not divide model num_layers=4"):
        check_layout(SPEC, Layout(1, 8))
    with pytest.raises(PlanError, match="tie_word_embeddings needs pp=1"):
        check_layout(TIED, Layout(1, 2))
    check_layout(TIED, Layout(1, 2), value_head=True)


def test_shard_json_and_value_head_roles():
    s = Shard("x", 1, 2, 4, (3, 8))
    assert Shard.from_list(s.to_list()) == s and s.numel == 6
    with pytest.raises(PlanError):
        Shard.from_list(["x", 1])
    assert value_head_for(Role.CRITIC) and value_head_for(Role.REWARD) and not value_head_for(Role.ACTOR)
