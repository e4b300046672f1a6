"""Model specifications: the shapes of a Llama-architecture decoder.

A :class:`ModelSpec` is built from a Hugging Face ``config.json`` (``LlamaConfig`` /
``Qwen2Config`` / ``Qwen3Config`` field names) or from a preset, and is what the engine
(`emu/model.py`), the cost and memory models and the planner agree on.
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{name}: expected a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
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
        return self.hidden_size // self.num_heads

    def num_parameters(self, value_head: bool = False) -> int:
        """Parameter count ``P`` (embedding, layers, final norm, output head[, value head])."""
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.num_kv_heads * self.head_dim
        per_layer = h * h + 2 * kv * h + h * h + 3 * f * h + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        total = v * h + self.num_layers * per_layer + h + head
        if value_head:
            total += h + 1
        return total

    def to_hf_config(self) -> dict[str, Any]:
        """A Hugging Face ``LlamaConfig``-style dict (what ``config.json`` holds)."""
        return {
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
