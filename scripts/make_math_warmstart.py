"""Build the math example: a generated GSM8K-format dataset, a BPE tokenizer trained on it, and a
tiny Qwen2-architecture actor warm-started on part of its training split.

Writes (deterministic for a given ``--seed``)::

    examples/data/gsm8k-generated.jsonl     one {"question", "answer"} per line, GSM8K's format
    examples/models/gsm8k-tiny/             config.json, model.safetensors, tokenizer files,
                                            chat template, generation_config.json

**The dataset is generated, not GSM8K**: one- and two-step word problems over small numbers
(addition, subtraction, multiplication), each answer a worked line and ``#### <number>``, as in
GSM8K (Cobbe et al. 2021). Users point ``task.options.dataset`` at a real GSM8K parquet instead.

**The tokenizer** is byte-level BPE trained with ``tokenizers`` on the dataset's text, with Qwen2's
pre-tokenizer (so ``transformers`` loads it as ``Qwen2Tokenizer`` with the same ids whether or not
``config.json`` is beside it), a ChatML chat template (``<|im_start|>role ... <|im_end|>``, as
Qwen2.5's) and ``<|im_end|>`` as EOS. **The model** is ``Qwen2ForCausalLM`` (q/k/v biases), 128 wide, 4 layers, 4 heads of 32,
2 kv heads. It is trained by supervised fine-tuning on half of the training split (the rows the
job's ``eval_size`` holds out are never seen), so that pass@1 starts above zero and RL has
something to raise; 250 steps leave it short of memorising the set (greedy held-out pass@1 0.29
on the development machine), so RL has room. There (two threads) it takes about 80 s::

    .venv/bin/python scripts/make_math_warmstart.py
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from emu.engine.hf_io import save_pretrained  # noqa: E402
from emu.engine.model import LlamaModel  # noqa: E402
from nereusd.models import ModelSpec  # noqa: E402
from nereusd.tasks.dataset import read_records, split  # noqa: E402
from nereusd.tasks.tokenizer import HFTokenizer, train_bpe_tokenizer  # noqa: E402
from nereusd.tasks.verifiers import verify_gsm8k  # noqa: E402
from warmstart_sft import sft_step  # noqa: E402 - scripts/, beside this file

NAMES = ["Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max"]
ITEMS = ["apples", "pens", "books", "coins", "cards", "shells", "stamps", "marbles"]
EVAL_SIZE = 100
"""Rows the example job holds out (``task.options.eval_size``): the warm start never sees them."""


def problem(rng: random.Random) -> dict[str, str]:
    """One generated word problem in GSM8K's format (``answer`` ends with ``#### <number>``)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    kind = rng.choice(["add", "sub", "mul", "two"])
    if kind == "add":
        q = f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?"
        r, work = a + b, f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}."
    elif kind == "sub":
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {item}. {name} gives away {b}. How many {item} are left?"
        r, work = a - b, f"{name} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} left."
    elif kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"{name} buys {a} boxes with {b} {item} in each. How many {item} does {name} buy?"
        r, work = a * b, f"{name} buys {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}."
    else:
        c = rng.randint(2, 9)
        q = f"{name} has {a} {item}, gets {b} more and then {c} more. How many {item} does {name} have?"
        r = a + b + c
        work = f"First {a} + {b} = <<{a}+{b}={a + b}>>{a + b}. Then {a + b} + {c} = <<{a + b}+{c}={r}>>{r} {item}."
    return {"question": q, "answer": f"{work}\n#### {r}"}


def write_dataset(path: Path, rows: int, seed: int) -> None:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(rows):
            fh.write(json.dumps(problem(rng)) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / "examples" / "data" / "gsm8k-generated.jsonl")
    parser.add_argument("--out", type=Path, default=REPO / "examples" / "models" / "gsm8k-tiny")
    parser.add_argument("--rows", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    write_dataset(args.data, args.rows, args.seed)
    records = read_records(args.data, "question", "answer")
    args.out.mkdir(parents=True, exist_ok=True)
    train_bpe_tokenizer(args.out, [r.prompt + "\n" + r.answer for r in records], args.vocab)
    tok = HFTokenizer(args.out)
    vocab = -(-tok.vocab_size // 8) * 8   # divisible by tp 1, 2, 4, 8
    spec = ModelSpec(vocab_size=vocab, hidden_size=128, intermediate_size=352, num_layers=4, num_heads=4,
                     num_kv_heads=2, max_position=256, rms_norm_eps=1e-6, architecture="qwen2")
    train_rows, eval_rows = split(len(records), EVAL_SIZE, args.seed)   # as the job's task splits
    sft = [records[i] for i in train_rows[: len(train_rows) // 2]]
    examples = []
    for rec in sft:
        prompt = tok.render(rec.prompt)
        examples.append((prompt + tok.encode(rec.answer) + [tok.eos_id], len(prompt)))
    model = LlamaModel(spec, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30) * max(0.1, 1 - s / args.steps))
    rng = random.Random(args.seed)
    start = time.perf_counter()
    for step in range(args.steps):
        loss = sft_step(model, opt, sched, rng.sample(examples, args.batch), tok.pad_id, vocab)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss:.4f}  {time.perf_counter() - start:6.1f}s", flush=True)
    model.eval()
    right = 0
    held = [records[i] for i in eval_rows]
    with torch.no_grad():
        for rec in held:
            ids = tok.render(rec.prompt)
            x = torch.tensor([ids])
            out = []
            for _ in range(40):
                nxt = int(model(x)[0, -1].argmax())
                if nxt in tok.stop_ids:
                    break
                out.append(nxt)
                x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
            right += verify_gsm8k(tok.decode(out), rec.answer) > 0
    print(f"greedy pass@1 on the {len(held)} held-out rows: {right / len(held):.3f}", flush=True)
    save_pretrained(args.out, spec, model.state_dict())
    print(f"saved {args.data} and {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
