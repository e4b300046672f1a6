"""The engine's decoder is Hugging Face's Llama, Llama-3, Qwen2/Qwen2.5 and Qwen3, to fp32 tolerance.

Tiny random checkpoints are built here with ``transformers`` (its own config classes, in the form
real checkpoints use: Llama-3's ``rope_scaling`` of type ``llama3``, Qwen2's q/k/v biases and tied
embeddings, Qwen3's q/k norms and explicit ``head_dim``), with every norm and bias moved off its
initial value so that their use shows. Loaded by :func:`emu.engine.hf_io.load_pretrained`, the
engine's one-process model must give the same logits and the same gradients; a model the engine
exports must load in ``transformers`` and give the same logits; a sharded checkpoint loads; a
config asking for what the engine does not compute is refused, naming the field. TP/PP layouts and
transitions of these architectures are checked against the one-process model in
``tests/distributed``.
"""

from __future__ import annotations

import json

import pytest
import torch

from emu.engine.hf_io import load_pretrained, save_pretrained
from nereusd.hf_files import INDEX_NAME
from emu.engine.model import LlamaModel
from nereusd.errors import ConfigError
from nereusd.models import ModelSpec

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_attention_heads=2, num_key_value_heads=1),
    "llama3": lambda: transformers.LlamaConfig(
        **COMMON, num_attention_heads=2, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_attention_heads=2, num_key_value_heads=1),
    "qwen2-tied": lambda: transformers.Qwen2Config(**COMMON, num_attention_heads=2, num_key_value_heads=2,
                                                   tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def hf_model(name: str, seed: int = 0):
    """A random ``transformers`` model of ``name`` with norms and biases off their initial values."""
    torch.manual_seed(seed)
    config = CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def ours_from(directory) -> tuple[ModelSpec, LlamaModel]:
    spec, state = load_pretrained(directory)
    model = LlamaModel(spec)
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=True)
    return spec, model.eval()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_gradients_match_transformers(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    spec, ours = ours_from(tmp_path)
    assert spec.architecture == {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen2-tied": "qwen2",
                                 "qwen3": "qwen3"}[name]
    tokens = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    weight = torch.randn(2, 40, 96, generator=torch.Generator().manual_seed(2))
    want = hf(input_ids=tokens).logits
    got = ours(tokens)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    (want * weight).sum().backward()
    (got * weight).sum().backward()
    hf_grads = dict(hf.named_parameters())
    for pname, p in ours.named_parameters():
        theirs = hf_grads[pname].grad
        assert torch.allclose(p.grad, theirs, rtol=1e-4, atol=1e-5), (pname, float((p.grad - theirs).abs().max()))


@pytest.mark.parametrize("name", ["llama3", "qwen2-tied", "qwen3"])
def test_an_exported_model_loads_in_transformers_with_the_same_logits(name, tmp_path):
    hf = hf_model(name, seed=4)
    hf.save_pretrained(tmp_path / "in", safe_serialization=True)
    spec, ours = ours_from(tmp_path / "in")
    save_pretrained(tmp_path / "out", spec, ours.state_dict())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    tokens = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(back(input_ids=tokens).logits, ours(tokens), atol=1e-5)
    assert ModelSpec.from_pretrained_dir(tmp_path / "out") == spec


def test_a_sharded_checkpoint_loads(tmp_path):
    hf = hf_model("qwen3")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / INDEX_NAME).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    _, ours = ours_from(tmp_path)
    tokens = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(ours(tokens), hf(input_ids=tokens).logits, atol=1e-5)


def _config(name: str, **changes) -> dict:
    data = CONFIGS[name]().to_dict()
    data.update(changes)
    return data


@pytest.mark.parametrize("config, key", [
    (_config("qwen2", use_sliding_window=True, sliding_window=16), "use_sliding_window"),
    (_config("qwen2", layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    (dict(_config("qwen2"), model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_experts=8),
     "model_type"),
    (_config("llama", num_local_experts=8), "num_local_experts"),
    (dict(_config("llama"), model_type="mistral", architectures=["MistralForCausalLM"]), "model_type"),
    (_config("llama", architectures=["LlamaForSequenceClassification"]), "architectures"),
    (_config("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
    (_config("llama", hidden_act="gelu"), "hidden_act"),
    (_config("llama", attention_dropout=0.1), "attention_dropout"),
    (_config("llama", mlp_bias=True), "mlp_bias"),
    (_config("llama", attention_bias=True), "attention_bias"),
    (_config("qwen3", attention_bias=True), "attention_bias"),
    (_config("llama", pretraining_tp=2), "pretraining_tp"),
    (_config("llama", partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_what_the_engine_does_not_compute_is_refused_naming_the_field(config, key):
    with pytest.raises(ConfigError, match=rf"cfg.json: {key}: "):
        ModelSpec.from_hf_config(config, source="cfg.json")


def test_rope_parameters_of_transformers_5_and_rope_scaling_of_checkpoints_read_alike():
    legacy = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 2, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    new = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")} | {
        "rope_parameters": dict(legacy["rope_scaling"], rope_theta=500000.0)}
    assert ModelSpec.from_hf_config(legacy) == ModelSpec.from_hf_config(new)
    assert ModelSpec.from_hf_config(new).rope_type == "llama3"
    with pytest.raises(ConfigError, match=r"rope_scaling.low_freq_factor: required by rope_type 'llama3'"):
        ModelSpec.from_hf_config(dict(legacy, rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    assert json.loads(json.dumps(ModelSpec.from_hf_config(new).to_hf_config()))["rope_scaling"]["factor"] == 8.0


@pytest.mark.parametrize("name", ["llama3", "qwen2-tied", "qwen3"])
def test_greedy_generation_with_the_kv_cache_matches_transformers(name, tmp_path):
    """The native decoder (prefill, then one token per step from the KV cache) continues prompts
    of different lengths (left-padded) exactly as ``transformers``' greedy decoding does."""
    from emu.engine.generate import SamplingParams, generate

    hf = hf_model(name, seed=6)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    _, ours = ours_from(tmp_path)
    prompts = [[5, 17, 3, 88], [40, 2]]
    got = generate(ours, prompts, SamplingParams(max_new_tokens=8, greedy=True))
    for prompt, response in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert response == want, (prompt, response, want)


def test_zero_key_value_heads_are_refused_not_read_as_missing():
    """``num_key_value_heads: 0`` was read as absent (= attention heads) and planned silently."""
    with pytest.raises(ConfigError, match=r"cfg.json: num_key_value_heads: expected an integer from 1 to 16,777,216, "
                                          r"got 0"):
        ModelSpec.from_hf_config(_config("llama", num_key_value_heads=0), source="cfg.json")
    # a 400-digit hidden size overflowed the memory model's floats (a bad-input search, 2026-12-06)
    with pytest.raises(ConfigError, match=r"cfg.json: hidden_size: expected an integer from 1 to 16,777,216"):
        ModelSpec.from_hf_config(_config("llama", hidden_size=10**400), source="cfg.json")
    # a string read "got 128", which looks valid (an adversarial trial, 2026-12-07)
    with pytest.raises(ConfigError, match=r"cfg.json: hidden_size: expected an integer from 1 to 16,777,216, got '128'"):
        ModelSpec.from_hf_config(_config("llama", hidden_size="128"), source="cfg.json")
    # the file's own key, not the spec's field (an adversarial trial, 2026-12-07)
    with pytest.raises(ConfigError, match=r"cfg.json: num_hidden_layers: expected an integer .* got 'four'"):
        ModelSpec.from_hf_config(_config("llama", num_hidden_layers="four"), source="cfg.json")
    assert ModelSpec.from_hf_config({k: v for k, v in _config("llama").items() if k != "num_key_value_heads"},
                                    source="cfg.json").num_kv_heads == 2


@pytest.mark.parametrize("changes, message", [
    (dict(tie_word_embeddings="false"), "tie_word_embeddings: expected true or false, got 'false'"),
    (dict(mlp_bias="false"), "mlp_bias: expected true or false, got 'false'"),
    (dict(use_sliding_window=0), "use_sliding_window: expected true or false, got 0"),
    (dict(attention_bias="true"), "attention_bias: expected true or false, got 'true'"),
    (dict(rms_norm_eps="tiny"), "rms_norm_eps: expected a number, got 'tiny'"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps: expected a positive number"),
    (dict(attention_dropout="none"), "attention_dropout: expected a number"),
    (dict(layer_types=5), "layer_types: expected a list"),
    (dict(rope_scaling="linear"), "rope_scaling: expected an object"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "ten thousand"}),
     "rope_parameters.rope_theta: expected a number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0}),
     "rope_parameters.rope_theta: expected a positive"),
    (dict(model_type=["qwen2"]), "model_type: expected a name"),
    (dict(architectures="Qwen2ForCausalLM"), "architectures: expected a list of class names"),
    (dict(layer_types=[{"type": "full_attention"}]), "layer_types: expected a list"),
])
def test_a_config_value_of_the_wrong_type_is_refused_naming_the_key(changes, message):
    """Found by an adversarial helper (2026-12-06): ``"tie_word_embeddings": "false"`` was read as
    true (``bool("false")``) and the model's head dropped; strings for numbers were tracebacks;
    ``"mlp_bias": "false"`` was refused as "true is not implemented"."""
    config = {k: v for k, v in _config("qwen2", **changes).items()
              if not (k == "rope_theta" and "rope_parameters" in changes)}
    with pytest.raises(ConfigError, match=rf"cfg.json: {message}"):
        ModelSpec.from_hf_config(config, source="cfg.json")


def test_tensors_the_config_does_not_describe_and_an_untied_head_are_refused(tmp_path):
    """Loading ignores what ``config.json`` does not name: a checkpoint with more layers than
    ``num_hidden_layers``, Qwen2's biases under ``model_type: llama``, or a tied model's
    differing ``lm_head.weight`` trained another model than the checkpoint's, without a word (an
    adversarial helper, 2026-12-06). Refused now; a tied head equal to the embedding is not."""
    from functools import partial

    from safetensors.torch import load_file, save_file

    from nereusd.hf_files import safetensors_equal, safetensors_shapes
    from nereusd.shards import check_checkpoint_shapes

    def check(directory):
        spec = ModelSpec.from_pretrained_dir(directory)
        check_checkpoint_shapes(spec, safetensors_shapes(directory), value_head=False, source=str(directory),
                                equal=partial(safetensors_equal, directory))

    for name in ("qwen2", "qwen2-tied"):
        hf_model(name).save_pretrained(tmp_path / name, safe_serialization=True)
        check(tmp_path / name)
    fewer = tmp_path / "qwen2"
    config = json.loads((fewer / "config.json").read_text())
    (fewer / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    with pytest.raises(ConfigError, match=r"tensors config.json does not describe .*model.layers.1."):
        check(fewer)
    as_llama = dict(config, model_type="llama", architectures=["LlamaForCausalLM"])
    (fewer / "config.json").write_text(json.dumps(as_llama))
    with pytest.raises(ConfigError, match=r"6 tensors config.json does not describe .*self_attn.k_proj.bias"):
        check(fewer)
    (fewer / "config.json").write_text(json.dumps(config))
    state = load_file(str(fewer / "model.safetensors"))
    buffers = {"model.layers.1.self_attn.rotary_emb.inv_freq": torch.ones(16),
               "model.rotary_emb.inv_freq": torch.ones(16)}
    save_file({**state, **buffers}, str(fewer / "model.safetensors"))
    check(fewer)   # RoPE buffers older checkpoints saved: recomputed
    save_file({**state, "adapter.rotary_emb.inv_freq": torch.ones(64, 64)}, str(fewer / "model.safetensors"))
    with pytest.raises(ConfigError, match="adapter.rotary_emb.inv_freq"):
        check(fewer)
    tied = tmp_path / "qwen2-tied"
    state = load_file(str(tied / "model.safetensors"))
    equal_head = state["model.embed_tokens.weight"].clone()
    save_file({**state, "lm_head.weight": equal_head}, str(tied / "model.safetensors"))
    check(tied)   # a tied head saved beside its embedding, equal: as transformers ties it
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"] + 1}, str(tied / "model.safetensors"))
    with pytest.raises(ConfigError, match="tie_word_embeddings is true but lm_head.weight differs"):
        check(tied)


def test_a_checkpoint_holding_nan_fails_the_build_naming_the_tensor(tmp_path):
    """NaN weights failed in the first generation's sampling ("probability tensor contains either
    inf, nan …"), naming neither the checkpoint nor the tensor (an adversarial helper, 2026-12-06)."""
    from safetensors.torch import load_file, save_file

    from emu.worker.runtime import initial_state
    from nereusd.protocol.tasks import RoleArgs

    hf_model("qwen2").save_pretrained(tmp_path, safe_serialization=True)
    spec = ModelSpec.from_pretrained_dir(tmp_path)
    role = RoleArgs(spec=spec.to_dict(), path=str(tmp_path))
    assert set(initial_state(role, spec, 0)) >= {"model.embed_tokens.weight", "lm_head.weight"}
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.norm.weight"][3] = float("nan")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor model.norm.weight holds NaN or infinity"):
        initial_state(role, spec, 0)
    fp8 = {k: v.to(torch.float8_e4m3fn) for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    fp8["model.norm.weight"] = torch.ones_like(fp8["model.norm.weight"], dtype=torch.float32).to(torch.float8_e4m3fn)
    save_file(fp8, str(tmp_path / "model.safetensors"))
    # CPU torch has no isfinite for float8: such a checkpoint loads, as before
    assert initial_state(role, spec, 0)["model.norm.weight"].dtype == torch.float8_e4m3fn
