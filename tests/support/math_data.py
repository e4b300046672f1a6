"""A tiny math dataset and model directory built at test time (nothing is downloaded).

:func:`build_math_dir` writes, under a directory::

    data.jsonl          GSM8K-format rows {"question", "answer"} (``answer`` ends "#### n")
    model/              a byte-level BPE tokenizer trained on the rows (ChatML template) and a
                        random Qwen2-architecture checkpoint of :data:`MATH_SPEC`'s shape
"""

from __future__ import annotations

import json
from pathlib import Path

from nereusd.models import ModelSpec

MATH_SPEC = ModelSpec(vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=2,
                      num_kv_heads=1, max_position=160, rms_norm_eps=1e-6, architecture="qwen2")
"""Vocabulary 320 (the BPE tokenizer below has at most 300 tokens), 160 positions."""


def rows(n: int = 40) -> list[dict[str, str]]:
    """``n`` addition problems in GSM8K's format; the lengths of the questions vary."""
    out = []
    for i in range(n):
        a, b = 3 + i, 7 + 2 * i
        filler = " It is a sunny day." * (i % 4)
        out.append({"question": f"Ann has {a} pens.{filler} She buys {b} more. How many pens does she have?",
                    "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"})
    return out


def build_math_dir(root: Path, n: int = 40, *, with_model: bool = True) -> Path:
    """Write ``data.jsonl`` and ``model/`` under ``root`` (module docstring); returns ``root``."""
    from emu.engine.hf_io import save_pretrained
    from emu.engine.model import LlamaModel
    from nereusd.tasks.tokenizer import train_bpe_tokenizer

    data = rows(n)
    root.mkdir(parents=True, exist_ok=True)
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    texts = [r["question"] + "\n" + r["answer"] for r in data]
    train_bpe_tokenizer(root / "model", texts, 300)
    if with_model:
        save_pretrained(root / "model", MATH_SPEC, LlamaModel(MATH_SPEC, seed=0).state_dict())
    return root
