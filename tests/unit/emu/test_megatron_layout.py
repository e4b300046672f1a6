"""The Megatron state mapping (emu/engine/megatron_layout.py), on CPU.

- Round trip canonical → Megatron (every TP and PP rank) → canonical is bit-exact for Llama,
  Qwen2 (q/k/v biases, tied) and Qwen3 (q/k norms), local and Transformer-Engine names, at
  every ``(tp, pp)`` the models allow, parameters and Adam moments alike.
- Keys and shapes equal those of megatron-core 0.16.1's own ``GPTModel`` built on the meta device
  (tp = pp = 1 in this process; tp 2 × pp 2 on four gloo ranks; a tied model only at pp = 1:
  at pp > 1 ``GPTModel`` moves the last stage's copy of the embedding to CUDA when built).
- The conventions are Megatron's: its ``SelfAttention`` splits our fused QKV into the canonical
  q, k, v projections, its ``MLP`` computes ``down(silu(gate·x) ⊙ up·x)``, its vocab-parallel
  embedding looks up the canonical rows and its row-parallel ``linear_proj`` equals ``o_proj`` —
  run on CPU at tp 1 and on two gloo ranks at tp 2 (Megatron's modules run on CPU; its
  ``GPTModel.forward`` does not, so no full forward here; nor does its attention when ``tp`` exceeds
  the query groups — it gathers the fused QKV into a CUDA buffer — so that case rests on the round
  trip and the GPU check).

megatron-core is imported on CPU without patches; the tests skip when it is not installed
(``NEREUS_REQUIRE_MEGATRON=1``, set by ``.ci/run``, fails them instead).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from emu.engine.canonical import init_full_state
from emu.engine.megatron_layout import check_layout, from_megatron, padded_vocab, to_megatron
from nereusd.errors import ConfigError
from nereusd.shards import canonical_shapes
from tests.support.distributed import run_distributed
from tests.support.megatron import requires_megatron
from tests.support.specs import ARCHITECTURES, TINY


SPECS = {"llama": TINY, **ARCHITECTURES,
         "qwen2-untied": dataclasses.replace(ARCHITECTURES["qwen2-tied"], tie_word_embeddings=False, num_kv_heads=2)}


def layouts(spec):
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            try:
                check_layout(spec, tp, pp)
            except ConfigError:
                continue
            yield tp, pp


def shard_all(full, spec, tp, pp, te=False):
    return {(t, p): to_megatron(full, spec, tp, pp, t, p, te=te) for t in range(tp) for p in range(pp)}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("te", [False, True])
def test_round_trip_is_bit_exact_at_every_layout(name, te):
    spec = SPECS[name]
    full = init_full_state(spec, seed=3)
    moment = {n: torch.rand_like(t) for n, t in full.items()}   # an Adam moment maps the same way
    seen = list(layouts(spec))
    assert (1, 1) in seen and len(seen) >= 3, seen
    for tp, pp in seen:
        for state in (full, moment):
            back = from_megatron(shard_all(state, spec, tp, pp, te), spec, tp, pp, te=te)
            assert set(back) == set(canonical_shapes(spec)), (tp, pp)
            for n, t in state.items():
                assert torch.equal(back[n], t), (name, tp, pp, n)


def test_vocab_padding_and_bad_layouts():
    assert padded_vocab(32000, 1) == 32000 and padded_vocab(32001, 1) == 32128 and padded_vocab(151936, 8) == 152576
    spec = SPECS["qwen3"]
    full = init_full_state(spec, seed=1)
    emb = [to_megatron(full, spec, 2, 1, t, 0)["embedding.word_embeddings.weight"] for t in range(2)]
    assert [e.shape[0] for e in emb] == [128, 128]   # 32 tokens padded to 256 rows, 128 per rank
    assert torch.equal(emb[0][:32], full["model.embed_tokens.weight"]) and not emb[1].any()
    with pytest.raises(ConfigError, match=r"3 layers are not divisible by pp=2|2 layers are not divisible by pp=4"):
        check_layout(spec, 1, 4)
    with pytest.raises(ConfigError, match="num_query_groups=2 and tp=3"):
        check_layout(dataclasses.replace(spec, num_heads=6), 3, 1)
    with pytest.raises(ConfigError, match="value head"):
        to_megatron(init_full_state(spec, value_head=True), spec, 1, 1, 0, 0)
    with pytest.raises(ConfigError, match=r"no tensors from ranks \(tp, pp\) \[\(1, 0\)\]"):
        from_megatron({(0, 0): {}}, spec, 2, 1)


# ----------------------------------------------------------------------------- against Megatron
def _config(spec, **extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=spec.attention_bias,
        qk_layernorm=spec.qk_norm, use_cpu_initialization=True, perform_initialization=False,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, **extra)


def _meta_model(spec, tp, pp, pp_rank):
    """megatron-core's GPTModel of ``spec`` on this rank, on the meta device (no memory)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    with torch.device("meta"):
        return GPTModel(_config(spec, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                        get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm),
                        vocab_size=padded_vocab(spec.vocab_size, tp), max_sequence_length=spec.max_position,
                        pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                        share_embeddings_and_output_weights=spec.tie_word_embeddings,
                        position_embedding_type="rope")


def _shapes(module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def _megatron_world(rank, world, tp, pp):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def _keys_body(rank, world, tp, pp):
    t, p = _megatron_world(rank, world, tp, pp)
    out = {}
    for name, spec in SPECS.items():
        if spec.tie_word_embeddings and pp > 1:
            continue   # GPTModel moves the tied copy to CUDA at construction (setup_embeddings_and_output_layer)
        ours = {k: tuple(v.shape) for k, v in to_megatron(init_full_state(spec, seed=0), spec, tp, pp, t, p).items()}
        out[name] = (ours, _shapes(_meta_model(spec, tp, pp, p)))
    return out


@requires_megatron
def test_keys_and_shapes_are_gptmodels_at_tp1_pp1_and_tp2_pp2():
    for tp, pp in ((1, 1), (2, 2)):
        for r, report in enumerate(run_distributed(_keys_body, tp * pp, tp, pp, timeout_s=240)):
            for name, (ours, megatron) in report.items():
                assert ours == megatron, (name, tp, pp, r, set(ours) ^ set(megatron))


def _modules_body(rank, world, tp):
    """Megatron's own attention input projection, MLP, embedding and linear_proj loaded with our
    tensors on this TP rank; their outputs against the canonical formulas."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import VocabParallelEmbedding
    from megatron.core.transformer.spec_utils import build_module

    t, _ = _megatron_world(rank, world, tp, 1)
    errors = {}
    for name, spec in SPECS.items():
        if spec.num_kv_heads % tp:
            continue   # tp > query groups: Megatron all-gathers the fused QKV into a CUDA buffer
        full = init_full_state(spec, seed=7)
        mine = to_megatron(full, spec, tp, 1, t, 0)
        cfg = _config(spec, tensor_model_parallel_size=tp)
        layer = get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm).submodules
        attn = build_module(layer.self_attention, config=cfg, layer_number=1)
        mlp = build_module(layer.mlp, config=cfg)
        emb = VocabParallelEmbedding(padded_vocab(spec.vocab_size, tp), spec.hidden_size,
                                     init_method=torch.nn.init.zeros_, config=cfg)
        with torch.no_grad():
            attn.linear_qkv.weight.copy_(mine["decoder.layers.0.self_attention.linear_qkv.weight"])
            if spec.attention_bias:
                attn.linear_qkv.bias.copy_(mine["decoder.layers.0.self_attention.linear_qkv.bias"])
            attn.linear_proj.weight.copy_(mine["decoder.layers.0.self_attention.linear_proj.weight"])
            mlp.linear_fc1.weight.copy_(mine["decoder.layers.0.mlp.linear_fc1.weight"])
            mlp.linear_fc2.weight.copy_(mine["decoder.layers.0.mlp.linear_fc2.weight"])
            emb.weight.copy_(mine["embedding.word_embeddings.weight"])
            if spec.qk_norm:   # Megatron normalises q and k per head inside the projection
                attn.q_layernorm.weight.copy_(mine["decoder.layers.0.self_attention.q_layernorm.weight"])
                attn.k_layernorm.weight.copy_(mine["decoder.layers.0.self_attention.k_layernorm.weight"])
        torch.manual_seed(0)
        x = torch.randn(5, 2, spec.hidden_size)   # [sequence, batch, hidden], Megatron's order
        p = "model.layers.0."
        with torch.no_grad():
            q, k, v = attn.get_query_key_value_tensors(x)[:3]   # [s, b, heads on this rank, d]
            d = spec.head_dim

            def proj(n):
                out = x @ full[p + f"self_attn.{n}_proj.weight"].T
                return out + full[p + f"self_attn.{n}_proj.bias"] if spec.attention_bias else out

            def norm(t, n):   # Qwen3's per-head RMSNorm, as the canonical model applies it
                if not spec.qk_norm:
                    return t
                w = full[p + f"self_attn.{n}_norm.weight"]
                return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps) * w

            ref_q = norm(proj("q").view(5, 2, spec.num_heads, d), "q")
            ref_k = norm(proj("k").view(5, 2, spec.num_kv_heads, d), "k")
            ref_v = proj("v").view(5, 2, spec.num_kv_heads, d)
            per = spec.num_heads // tp
            want_q = ref_q[:, :, t * per:(t + 1) * per]
            groups = max(1, spec.num_kv_heads // tp)
            g0 = t * spec.num_kv_heads // tp if spec.num_kv_heads >= tp else t // (tp // spec.num_kv_heads)
            want_k, want_v = ref_k[:, :, g0:g0 + groups], ref_v[:, :, g0:g0 + groups]
            attn_out = torch.randn(5, 2, spec.num_heads * d)
            proj_out, _ = attn.linear_proj(attn_out[..., t * per * d:(t + 1) * per * d].contiguous())
            mlp_out, _ = mlp(x)
            gate, up = x @ full[p + "mlp.gate_proj.weight"].T, x @ full[p + "mlp.up_proj.weight"].T
            tokens = torch.randint(0, spec.vocab_size, (5, 2))
            looked_up = emb(tokens)
        errors[name] = {
            "q": (q - want_q).abs().max().item(), "k": (k - want_k).abs().max().item(),
            "v": (v - want_v).abs().max().item(),
            "proj": (proj_out - attn_out @ full[p + "self_attn.o_proj.weight"].T).abs().max().item(),
            "mlp": (mlp_out - (torch.nn.functional.silu(gate) * up) @ full[p + "mlp.down_proj.weight"].T)
            .abs().max().item(),
            "embedding": (looked_up - full["model.embed_tokens.weight"][tokens]).abs().max().item(),
        }
    return errors


@requires_megatron
@pytest.mark.parametrize("tp", [1, 2])
def test_megatrons_own_modules_compute_the_canonical_projections(tp):
    for errors in run_distributed(_modules_body, tp, tp, timeout_s=240):
        assert errors, "no architecture ran"
        for name, errs in errors.items():
            assert max(errs.values()) < 1e-5, (name, tp, errs)
