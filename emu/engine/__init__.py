"""The native engine: a decoder with Megatron-style TP, PP over layer blocks, DP and generation.

- :mod:`~emu.engine.model` — the decoder; :mod:`~emu.engine.parallel` — meshes, groups, TP/PP;
- :mod:`~emu.engine.stage` — ``StageEngine``: one model-stage's shard on one rank;
- :mod:`~emu.engine.generate` — decoding with a TP-sharded KV cache;
- :mod:`~emu.engine.canonical` and :mod:`~emu.engine.hf_io` — canonical (HF) tensors and files;
- :mod:`~emu.engine.batch` — padding and packing of token sequences.
"""
