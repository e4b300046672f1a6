"""Single-process tests of the Llama decoder (emu/engine/model.py) and HF directory I/O (emu/engine/hf_io.py)."""

from __future__ import annotations

import json

import pytest
import torch

from emu.engine.hf_io import load_pretrained, save_pretrained
from emu.engine.model import KVCache, LlamaModel, canonical_shapes, init_full_state
from nereusd.errors import ConfigError
from tests.support.specs import ENGINE as SPEC

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def test_names_and_shapes_follow_hugging_face():
    model = LlamaModel(SPEC, seed=0)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert shapes == canonical_shapes(SPEC)
    assert shapes["model.layers.3.self_attn.k_proj.weight"] == (32, 64)
    assert "lm_head.weight" in shapes and "value_head.weight" not in shapes
    assert sum(t.numel() for t in model.state_dict().values()) == SPEC.num_parameters()
    critic = LlamaModel(SPEC, value_head=True, seed=0)
    names = set(critic.state_dict())
    assert {"value_head.weight", "value_head.bias"} <= names and "lm_head.weight" not in names
    assert all(p.dtype == torch.float32 for p in critic.parameters())


def test_init_is_deterministic_per_seed():
    a, b, c = (LlamaModel(SPEC, seed=s).state_dict() for s in (3, 3, 4))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.equal(a["lm_head.weight"], init_full_state(SPEC, seed=3)["lm_head.weight"])


def test_forward_shapes_and_causality():
    model = LlamaModel(SPEC, seed=0)
    tokens = torch.randint(0, 16, (3, 9), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (3, 9, 16)
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 16
    assert torch.allclose(model(changed)[:, :6], logits[:, :6], atol=1e-6)
    values = LlamaModel(SPEC, value_head=True, seed=0)(tokens)
    assert values.shape == (3, 9)


def test_kv_cache_matches_full_forward():
    model = LlamaModel(SPEC, seed=1)
    tokens = torch.randint(0, 16, (2, 10), generator=torch.Generator().manual_seed(1))
    full = model(tokens)
    cache = KVCache(list(range(SPEC.num_layers)), 2, SPEC.num_kv_heads, 16, SPEC.head_dim, torch.device("cpu"))
    parts = [model(tokens[:, :6], kv_cache=cache)] + [model(tokens[:, i:i + 1], kv_cache=cache) for i in range(6, 10)]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)
    assert cache.length == 10


def test_left_padding_with_mask_and_positions_equals_unpadded():
    model = LlamaModel(SPEC, seed=2)
    seq = torch.tensor([[5, 3, 7, 1]])
    padded = torch.tensor([[0, 0, 5, 3, 7, 1]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    pos = torch.tensor([[0, 0, 0, 1, 2, 3]])
    out = model(padded, attention_mask=mask, position_ids=pos)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[:, 2:], model(seq), atol=1e-5)


def test_hf_directory_round_trip(tmp_path):
    model = LlamaModel(SPEC, value_head=True, seed=5)
    save_pretrained(tmp_path / "m", SPEC, model.state_dict())
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_key_value_heads"] == 2
    spec, state = load_pretrained(tmp_path / "m")
    assert spec == SPEC
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[n], t) for n, t in model.state_dict().items())
    with pytest.raises(ConfigError, match="neither model.safetensors"):
        (tmp_path / "m" / "model.safetensors").unlink()
        load_pretrained(tmp_path / "m")


def test_unseeded_init_follows_torch_manual_seed():
    torch.manual_seed(0)
    a = LlamaModel(SPEC).state_dict()
    torch.manual_seed(0)
    b = LlamaModel(SPEC).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    assert 0.015 < float(a["model.embed_tokens.weight"].std()) < 0.025


def test_logits_match_transformers_llama():
    """Same weights, same logits as Hugging Face ``LlamaForCausalLM`` (where transformers is installed)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in SPEC.to_hf_config().items()
                                         if k not in ("architectures", "model_type", "torch_dtype")})
    hf = transformers.LlamaForCausalLM(config).eval()
    ours = LlamaModel(SPEC, seed=6)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    tokens = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    mask[1, :4] = 0
    with torch.no_grad():
        want = hf(input_ids=tokens, attention_mask=mask).logits
        got = ours(tokens, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    assert torch.allclose(got[0], want[0], atol=1e-4)
    assert torch.allclose(got[1, 4:], want[1, 4:], atol=1e-4)
