"""Model specifications: the shapes of a Llama-architecture decoder.

A :class:`ModelSpec` is built from a Hugging Face ``config.json`` (``LlamaConfig`` /
``Qwen2Config`` / ``Qwen3Config`` field names) or from a preset (:data:`PRESETS`,
:func:`preset`, :func:`resolve_model`), and is what the engine (`emu/engine/model.py`), the cost and
memory models and the planner agree on. Roles of one job may use different specs (e.g. a
smaller reward model).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from nereusd.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Shapes of a Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention).

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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{name}: expected a positive integer, got {value!r}")
        if not isinstance(self.explicit_head_dim, int) or self.explicit_head_dim < 0:
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

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    def num_parameters(self, value_head: bool = False) -> int:
        """Parameter count ``P``: embedding, layers, final norm, and either the output head
        (a policy) or, with ``value_head``, a scalar value head in its place (critic, reward
        model: the engine drops ``lm_head`` there)."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = q * h + 2 * kv * h + h * q + 3 * f * h + 2 * h
        if value_head:
            head = h + 1
        else:
            head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def to_hf_config(self) -> dict[str, Any]:
        """A Hugging Face ``LlamaConfig``-style dict (what ``config.json`` holds)."""
        extra = {"head_dim": self.explicit_head_dim} if self.explicit_head_dim else {}
        return extra | {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = "config.json") -> "ModelSpec":
        """Build from a Hugging Face config dict.

        Raises:
            ConfigError: naming ``source`` and the key when a required field is missing or bad.
        """
        def need(key: str) -> Any:
            if key not in config:
                raise ConfigError(f"{source}: {key}: required field is missing")
            return config[key]

        try:
            return cls(
                vocab_size=need("vocab_size"),
                hidden_size=need("hidden_size"),
                intermediate_size=need("intermediate_size"),
                num_layers=need("num_hidden_layers"),
                num_heads=need("num_attention_heads"),
                num_kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
                max_position=config.get("max_position_embeddings", 2048),
                rope_theta=float(config.get("rope_theta", 10000.0)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                explicit_head_dim=_explicit_head_dim(config),
            )
        except ConfigError as err:
            msg = str(err)
            raise ConfigError(msg if msg.startswith(source) else f"{source}: {msg}") from None

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> "ModelSpec":
        """Read ``<path>/config.json``.

        Raises:
            ConfigError: if the file is missing, not JSON, or lacks a field.
        """
        cfg_path = Path(path) / "config.json"
        try:
            data = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{cfg_path}: no such file (a Hugging Face model directory needs config.json)") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{cfg_path}: not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{cfg_path}: expected a JSON object")
        return cls.from_hf_config(data, source=str(cfg_path))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelSpec":
        return cls(**dict(data))


def _explicit_head_dim(config: Mapping[str, Any]) -> int:
    """``head_dim`` from a HF config when it differs from ``hidden_size // num_attention_heads``."""
    head_dim = config.get("head_dim")
    if head_dim is None:
        return 0
    if config.get("hidden_size", 0) == head_dim * config.get("num_attention_heads", 0):
        return 0
    return head_dim


#: Presets keyed by lower-case name. Shapes from each model's Hugging Face ``config.json``
#: (meta-llama/Llama-3.1-8B, Qwen/Qwen3-14B, Qwen/Qwen3-32B, meta-llama/Llama-3.3-70B-Instruct);
#: ``counting-tiny`` is the local demo model. Qwen3's per-head q/k RMSNorm weights
#: (2·head_dim per layer, < 0.001 % of P) are not counted.
PRESETS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, max_position=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
    ),
    "qwen3-14b": ModelSpec(
        vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40,
        num_kv_heads=8, max_position=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    "qwen3-32b": ModelSpec(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64,
        num_kv_heads=8, max_position=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        explicit_head_dim=128,
    ),
    "llama-3.3-70b": ModelSpec(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
        num_kv_heads=8, max_position=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
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
    if path.is_dir():
        return ModelSpec.from_pretrained_dir(path)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return ModelSpec.from_hf_config(data, source=str(path))
    raise ConfigError(f"model {text!r}: not a preset (one of {sorted(PRESETS)}), directory or config.json")
