"""Model specifications: the shapes and architecture of a Llama-family decoder.

A :class:`ModelSpec` is built from a Hugging Face ``config.json`` (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``; anything else is refused, naming the field) or from
a preset (:data:`PRESETS`,
:func:`preset`, :func:`resolve_model`), and is what the engine (`emu/engine/model.py`), the cost and
memory models and the planner agree on. Roles of one job may use different specs (e.g. a
smaller reward model).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from nereusd.errors import ConfigError, shortened
from nereusd.hf_files import read_json_object


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""The decoders the engine implements (``model_type`` → HF ``architectures`` entry)."""
ROPE_TYPES = ("default", "llama3")
"""RoPE variants the engine implements (Llama-3's frequency-dependent scaling, ``llama3``)."""
MAX_MODEL_DIMENSION = 1 << 24
"""Largest size, count or context a model config may give (16,777,216: above any published model's
vocabulary, width, depth or context; a 10^400 hidden size overflowed the memory model's floats)."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shapes of a Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) and the
    architecture details that change the function it computes.

    Attributes:
        vocab_size: vocabulary size ``V``.
        hidden_size: model width ``h``.
        intermediate_size: SwiGLU width ``f``.
        num_layers: decoder layers ``L``.
        num_heads: query heads; ``head_dim = hidden_size // num_heads``.
        num_kv_heads: key/value heads (GQA); divides ``num_heads``.
        max_position: longest sequence (prompt + response) in tokens.
        rope_theta: RoPE base.
        rms_norm_eps: RMSNorm epsilon.
        tie_word_embeddings: output head shares the token embedding.
        explicit_head_dim: per-head width when it is not ``hidden_size // num_heads``
            (Qwen3-32B: 64 heads of 128 on a 5120-wide model); 0 means the quotient.
        architecture: ``llama``, ``qwen2`` (q/k/v biases, :attr:`attention_bias`) or ``qwen3``
            (per-head q/k norms, :attr:`qk_norm`); :data:`ARCHITECTURES`.
        rope_type: ``default`` or ``llama3`` (:data:`ROPE_TYPES`).
        rope_factor, rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position:
            the ``llama3`` scaling's parameters (Llama-3.1: 8, 1, 4, 8192).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    explicit_head_dim: int = 0
    architecture: str = "llama"
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_MODEL_DIMENSION:
                raise ConfigError(f"model.{name}: expected an integer from 1 to {MAX_MODEL_DIMENSION:,}, "
                                  f"got {shortened(value, 40)}")   # quoted: the string "128" is not 128
        for name in ("rope_theta", "rms_norm_eps"):   # a NaN RoPE base trained on NaN losses (an adversarial trial)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"model.{name}: expected a finite number above 0, got {shortened(value, 40)}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError("model.tie_word_embeddings: expected true or false, got "
                              f"{shortened(self.tie_word_embeddings, 40)}")
        head_dim = self.explicit_head_dim
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 0:
            raise ConfigError(f"model.explicit_head_dim: expected an integer >= 0, got {self.explicit_head_dim!r}")
        if not self.explicit_head_dim and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size: {self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_kv_heads: num_heads={self.num_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim: RoPE needs an even head dimension, got {self.head_dim}")
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"model.architecture: {self.architecture!r} is not implemented "
                              f"(one of {sorted(ARCHITECTURES)})")
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"model.rope_type: {self.rope_type!r} is not implemented (one of {list(ROPE_TYPES)})")
        if self.rope_type == "llama3" and not (self.rope_factor > 0 and
                                               0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            raise ConfigError(f"model.rope_factor/rope_low_freq_factor/rope_high_freq_factor: need factor > 0 and "
                              f"0 < low < high, got {self.rope_factor}, {self.rope_low_freq_factor}, "
                              f"{self.rope_high_freq_factor}")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def attention_bias(self) -> bool:
        """q/k/v projections have biases (Qwen2, Qwen2.5), sharded with their rows."""
        return self.architecture == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Queries and keys get a per-head RMSNorm before RoPE (Qwen3), replicated over TP."""
        return self.architecture == "qwen3"

    def num_parameters(self, value_head: bool = False) -> int:
        """Parameter count ``P``: embedding, layers (with q/k/v biases and q/k norms when the
        architecture has them), final norm, and either the output head (a policy) or, with
        ``value_head``, a scalar value head in its place (critic, reward model: the engine drops
        ``lm_head`` there)."""
        h, f, v, d = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        q = self.num_heads * d
        kv = self.num_kv_heads * d
        per_layer = q * h + 2 * kv * h + h * q + 3 * f * h + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.qk_norm:
            per_layer += 2 * d
        if value_head:
            head = h + 1
        else:
            head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` of this model (``LlamaConfig`` / ``Qwen2Config`` /
        ``Qwen3Config`` fields), which ``transformers`` loads back into the same function."""
        cfg: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "torch_dtype": "float32",
        }
        if self.architecture == "llama":
            cfg.update(attention_bias=False, mlp_bias=False)
        elif self.architecture == "qwen3":
            cfg.update(attention_bias=False)
        if self.architecture in ("qwen2", "qwen3"):
            cfg.update(use_sliding_window=False, sliding_window=None)
        if self.rope_type == "llama3":
            cfg["rope_scaling"] = {"rope_type": "llama3", "factor": self.rope_factor,
                                   "low_freq_factor": self.rope_low_freq_factor,
                                   "high_freq_factor": self.rope_high_freq_factor,
                                   "original_max_position_embeddings": self.rope_original_max_position}
        return cfg

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = "config.json") -> "ModelSpec":
        """Build from a Hugging Face config dict (:func:`spec_fields_from_hf`).

        Raises:
            ConfigError: naming ``source`` and the key when a required field is missing or bad,
                or when the config asks for something the engine does not implement.
        """
        try:
            return cls(**spec_fields_from_hf(config, source))
        except ConfigError as err:
            msg = str(err)
            field, _, why = msg.partition(": ")   # the spec's own check names its field: say the file's key
            if field.startswith("model.") and why:
                msg = f"{HF_KEY_OF.get(field[6:], field[6:])}: {why}"
            raise ConfigError(msg if msg.startswith(source) else f"{source}: {msg}") from None

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> "ModelSpec":
        """Read ``<path>/config.json``.

        Raises:
            ConfigError: if the file is missing, not JSON, or lacks a field.
        """
        cfg_path = Path(path) / "config.json"
        try:
            data = read_json_object(cfg_path)
        except FileNotFoundError:
            raise ConfigError(f"{cfg_path}: no such file (a Hugging Face model directory needs config.json)") from None
        return cls.from_hf_config(data, source=str(cfg_path))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelSpec":
        return cls(**dict(data))


def shortest_context(specs: Mapping[str, ModelSpec], sequence_tokens: int) -> tuple[str, ModelSpec] | None:
    """The named model whose ``max_position`` is shortest, when ``sequence_tokens`` exceeds it.

    ``specs`` maps a name (a role) to its model; ``sequence_tokens`` is prompt plus response.
    Returns ``(name, spec)`` for the first model a sequence of that length does not fit, else None.
    ``nereus-launch run`` refuses such a job; ``nereus-launch plan`` warns.
    """
    if not specs:
        return None
    name = min(specs, key=lambda n: specs[n].max_position)
    return (name, specs[name]) if sequence_tokens > specs[name].max_position else None


#: Keys of a Hugging Face config that change nothing the engine computes (bookkeeping, generation
#: defaults, output flags). Every other key must be understood, or the config is refused.
HF_METADATA_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "return_dict",
    "output_attentions", "output_hidden_states", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class", "prefix", "task_specific_params",
    "max_window_layers", "quantization_config_ignored", "bad_words_ids", "begin_suppress_tokens",
    "decoder_start_token_id", "sep_token_id", "tf_legacy_loss", "torchscript", "use_bfloat16",
    "cross_attention_hidden_size", "add_cross_attention", "finetuning_task", "tie_encoder_decoder",
    "is_decoder", "pruned_heads", "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens",
})
_IMPLEMENTED_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
    "head_dim", "hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "rope_scaling",
    "rope_parameters", "use_sliding_window", "sliding_window", "layer_types", "pretraining_tp",
})


HF_KEY_OF = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "max_position": "max_position_embeddings",
             "explicit_head_dim": "head_dim", "architecture": "model_type"}
"""The ``config.json`` key of each :class:`ModelSpec` field named otherwise there (:func:`spec_fields_from_hf`),
for errors that name the file's key: ``num_hidden_layers: "four"`` was reported as ``model.num_layers``
(an adversarial trial, 2026-12-07)."""


def spec_fields_from_hf(config: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """:class:`ModelSpec` keyword arguments from a Hugging Face ``config.json``.

    Reads ``LlamaForCausalLM`` (with Llama-3's ``llama3`` RoPE scaling), ``Qwen2ForCausalLM``
    (q/k/v biases) and ``Qwen3ForCausalLM`` (q/k norms, explicit ``head_dim``), with RoPE in the
    ``rope_theta``/``rope_scaling`` form or transformers 5's ``rope_parameters``. Anything the
    engine does not compute is refused, never ignored: another architecture, an unknown key,
    sliding-window or sliding layers, an activation other than SiLU, attention dropout, MLP
    biases, Llama or Qwen3 ``attention_bias`` (biases on every projection), another RoPE type.

    Raises:
        ConfigError: ``<source>: <key>: ...`` naming the field.
    """
    def fail(key: str, why: str) -> None:
        raise ConfigError(f"{source}: {key}: {why}")

    def need(key: str) -> Any:
        if key not in config:
            fail(key, "required field is missing")
        return config[key]

    def number(key: str, default: float) -> float:
        value = config.get(key, default)
        return default if value is None else hf_number(value, f"{source}: {key}")

    def positive(key: str, default: float) -> float:
        value = number(key, default)
        if not value > 0:   # a negative epsilon made every norm NaN in the first forward pass
            fail(key, f"expected a positive number, got {value!r}")
        return value

    def flag(key: str, default: bool) -> bool:
        value = config.get(key, default)
        if not isinstance(value, bool):   # bool("false") is True: a string flag tied a model's head silently
            fail(key, f"expected true or false, got {value!r}")
        return value

    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type is not None and not isinstance(model_type, str):
        fail("model_type", f"expected a name such as 'qwen2', got {model_type!r}")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        fail("architectures", f"expected a list of class names such as ['Qwen2ForCausalLM'], got {archs!r}")
    if model_type is None and archs:
        model_type = {v: k for k, v in ARCHITECTURES.items()}.get(archs[0])
    if model_type not in ARCHITECTURES:
        fail("model_type", f"{model_type!r} ({', '.join(map(str, archs)) or 'no architectures'}) is not implemented; "
                           f"one of {sorted(ARCHITECTURES)} ({', '.join(ARCHITECTURES.values())})")
    if archs and list(archs) != [ARCHITECTURES[model_type]]:
        fail("architectures", f"{list(archs)} is not implemented for model_type {model_type!r} "
                              f"(expected [{ARCHITECTURES[model_type]!r}])")
    unknown = sorted(k for k in config if k not in HF_METADATA_KEYS and k not in _IMPLEMENTED_KEYS)
    if unknown:
        fail(unknown[0], f"not implemented (unknown to the engine; also unknown: {unknown[1:]})" if unknown[1:]
             else "not implemented (unknown to the engine)")
    if config.get("hidden_act", "silu") != "silu":
        fail("hidden_act", f"{config['hidden_act']!r} is not implemented (SwiGLU with silu only)")
    if number("attention_dropout", 0.0) != 0.0:
        fail("attention_dropout", f"{config['attention_dropout']} is not implemented (0 only)")
    if flag("mlp_bias", False):   # a string flag is refused as such, not as "true"
        fail("mlp_bias", "true is not implemented (MLP projections without biases only)")
    if number("pretraining_tp", 1) != 1:
        fail("pretraining_tp", f"{config['pretraining_tp']} is not implemented (1 only)")
    if flag("use_sliding_window", False):
        fail("use_sliding_window", "true is not implemented (full attention in every layer only)")
    if model_type == "llama" and config.get("sliding_window") is not None:
        fail("sliding_window", f"{config['sliding_window']} is not implemented")
    layer_types = config.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list)
                                        and all(isinstance(t, str) for t in layer_types)):
        fail("layer_types", f"expected a list of layer types, got {layer_types!r}")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        fail("layer_types", f"{sorted(set(layer_types))}: only full_attention layers are implemented")
    if flag("attention_bias", False) and model_type in ("llama", "qwen3"):
        fail("attention_bias", f"true is not implemented for {model_type} (biases on q/k/v/o)")
    rope = _rope(config, source)
    fields: dict[str, Any] = dict(
        vocab_size=need("vocab_size"), hidden_size=need("hidden_size"), intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"), num_heads=need("num_attention_heads"),
        num_kv_heads=config["num_attention_heads"] if config.get("num_key_value_heads") is None
        else config["num_key_value_heads"],
        max_position=config.get("max_position_embeddings", 2048),
        rms_norm_eps=positive("rms_norm_eps", 1e-6),   # transformers' default for Llama, Qwen2 and Qwen3
        tie_word_embeddings=flag("tie_word_embeddings", False),
        explicit_head_dim=_explicit_head_dim(config),
        architecture=model_type, **rope)
    return fields


def _rope(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """RoPE fields of a HF config: ``rope_theta`` and ``rope_scaling`` (transformers 4), or
    ``rope_parameters`` (transformers 5).

    Raises:
        ConfigError: for a RoPE type other than default and ``llama3``.
    """
    for name in ("rope_parameters", "rope_scaling"):
        if config.get(name) is not None and not isinstance(config[name], dict):
            raise ConfigError(f"{source}: {name}: expected an object (rope_type, factor, …), got {config[name]!r}")
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    merged = {**params, **scaling}
    key = "rope_scaling" if scaling else "rope_parameters"
    theta_key = f"{key}.rope_theta" if "rope_theta" in merged else "rope_theta"
    theta = hf_number(merged.get("rope_theta", config.get("rope_theta", 10000.0)), f"{source}: {theta_key}")
    if not theta > 0:
        raise ConfigError(f"{source}: {theta_key}: expected a positive number, got {theta!r}")
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{source}: {key}.rope_type: {kind!r} is not implemented (one of {list(ROPE_TYPES)})")
    out: dict[str, Any] = {"rope_theta": theta, "rope_type": kind}
    if kind == "llama3":
        try:
            out.update(rope_factor=hf_number(merged["factor"], f"{source}: {key}.factor"),
                       rope_low_freq_factor=hf_number(merged["low_freq_factor"], f"{source}: {key}.low_freq_factor"),
                       rope_high_freq_factor=hf_number(merged["high_freq_factor"],
                                                       f"{source}: {key}.high_freq_factor"),
                       rope_original_max_position=int(hf_number(merged["original_max_position_embeddings"],
                                                                f"{source}: {key}.original_max_position_embeddings")))
        except KeyError as err:
            raise ConfigError(f"{source}: {key}.{err.args[0]}: required by rope_type 'llama3'") from None
    return out


def hf_number(value: Any, where: str) -> float:
    """``value`` of a HF config as a finite float (JSON numbers; not a bool or a string).

    Raises:
        ConfigError: ``<where>: expected a number, got …``.
    """
    try:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))
    except OverflowError:   # a 400-digit integer
        ok = False
    if not ok:
        raise ConfigError(f"{where}: expected a number, got {str(value)[:40]!r}")
    return float(value)


def _explicit_head_dim(config: Mapping[str, Any]) -> int:
    """``head_dim`` from a HF config when it differs from ``hidden_size // num_attention_heads``."""
    head_dim = config.get("head_dim")
    if head_dim is None:
        return 0
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        return head_dim   # ModelSpec refuses it, naming explicit_head_dim
    if config.get("hidden_size", 0) == head_dim * config.get("num_attention_heads", 0):
        return 0
    return head_dim


#: Presets keyed by lower-case name. Shapes from each model's Hugging Face ``config.json``
#: (meta-llama/Llama-3.1-8B, Qwen/Qwen3-14B, Qwen/Qwen3-32B, meta-llama/Llama-3.3-70B-Instruct);
#: ``counting-tiny`` is the local demo model.
_LLAMA3_ROPE = dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_max_position=8192)
PRESETS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, max_position=131072, rope_theta=500000.0, rms_norm_eps=1e-5, **_LLAMA3_ROPE,
    ),
    "qwen3-14b": ModelSpec(
        vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40,
        num_kv_heads=8, max_position=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        architecture="qwen3",
    ),
    "qwen3-32b": ModelSpec(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64,
        num_kv_heads=8, max_position=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        explicit_head_dim=128, architecture="qwen3",
    ),
    "llama-3.3-70b": ModelSpec(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, max_position=131072, rope_theta=500000.0, rms_norm_eps=1e-5, **_LLAMA3_ROPE,
    ),
    # Qwen2.5-1.5B / -3B config.json (huggingface.co/Qwen/Qwen2.5-1.5B, /Qwen2.5-3B): q/k/v biases,
    # tied embeddings
    "qwen2.5-1.5b": ModelSpec(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
        num_kv_heads=2, max_position=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        architecture="qwen2",
    ),
    "qwen2.5-3b": ModelSpec(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16,
        num_kv_heads=2, max_position=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        architecture="qwen2",
    ),
    # Qwen2.5-7B config.json (huggingface.co/Qwen/Qwen2.5-7B): q/k/v biases, separate output embeddings
    "qwen2.5-7b": ModelSpec(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, max_position=131072, rope_theta=1000000.0, rms_norm_eps=1e-6, architecture="qwen2",
    ),
    "counting-tiny": ModelSpec(
        vocab_size=16, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4,
        num_kv_heads=2, max_position=160,
    ),
}


def preset(name: str) -> ModelSpec:
    """The preset called ``name`` (case-insensitive, e.g. ``Llama-3.1-8B``).

    Raises:
        ConfigError: for an unknown name; the message lists the presets.
    """
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"model {name!r}: unknown preset (one of {sorted(PRESETS)})") from None


def resolve_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name, a Hugging Face model directory, or a path to a ``config.json``.

    Raises:
        ConfigError: if it is none of these, or the config is malformed.
    """
    text = str(name_or_path)
    if text.lower() in PRESETS:
        return PRESETS[text.lower()]
    path = Path(text)
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError as err:   # a name too long for the file system
        raise ConfigError(f"model {shortened(text)}: {err.strerror}") from None
    if is_dir:
        return ModelSpec.from_pretrained_dir(path)
    if is_file:
        return ModelSpec.from_hf_config(read_json_object(path, "; is it a config.json?"), source=str(path))
    raise ConfigError(f"model {text!r}: not a preset (one of {sorted(PRESETS)}), directory or config.json")
