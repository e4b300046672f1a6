"""Build the counting-task warm-start actor by supervised fine-tuning from scratch.

Reproduces ``examples/models/counting-warmstart/`` (Hugging Face format: ``config.json`` +
``model.safetensors``): a ~0.74 M-parameter Llama decoder (h=128, 4 layers, 4 heads, 2 kv
heads, vocabulary 16) trained on reference responses of the counting task
(:mod:`nereusd.tasks.counting`) with mostly 2–4 items and a small tail of longer ones, so that
RL can grow response length from a policy that already stops on its own. The tail (5 %
of examples with 5–16 items) teaches positions up to ~70 tokens; with a tail of only 5–8
items, GRPO growth stalled near the trained length (2.3–3.4×, 1 of 3 seeds ≥ 3× in 40 steps),
with 5–16 items the mean length passed 3× that of step 0 by step 10 in 3 of 3 seeds
(``scripts/tune_rl.py`` defaults). Greedy decoding of the result: 100 % correct, ~4 items.

Deterministic for a given ``--seed`` (single process, fixed torch threads). 300 steps take a
few minutes of one core (4–8 min wall on the loaded 2-core development machine); one thread is
faster than two there for these tiny matrices::

    .venv/bin/python scripts/make_warmstart.py --out examples/models/counting-warmstart
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

import torch

from emu.engine.hf_io import save_pretrained
from emu.engine.model import LlamaModel
from nereusd.models import preset
from nereusd.tasks.counting import CountingTask, sample_hash
from warmstart_sft import sft_step  # scripts/, beside this file

log = logging.getLogger("make_warmstart")

SPEC = preset("counting-tiny")
"""The warm-start architecture (0.74 M parameters; TP 1/2/4 divide heads, vocab and MLP width)."""

SFT_STREAM = 0x5F7
"""Hash stream of SFT start numbers, apart from the RL prompt order (stream 0)."""


def sft_example(task: CountingTask, seed: int, index: int, min_items: int, max_items: int,
                tail_frac: float, tail_max_items: int) -> tuple[list[int], int]:
    """Token ids of SFT example ``index`` and the position where its response starts.

    Items are uniform in ``[min_items, max_items]``; with probability ``tail_frac`` uniform in
    ``(max_items, tail_max_items]`` instead.
    """
    rng = random.Random(sample_hash(seed, index, SFT_STREAM))
    start = rng.randint(task.min_start, task.max_start)
    if tail_frac > 0 and rng.random() < tail_frac:
        items = rng.randint(max_items + 1, tail_max_items)
    else:
        items = rng.randint(min_items, max_items)
    prompt = task.prompt_tokens(start)
    return prompt + task.reference_response(start, items), len(prompt)


@torch.no_grad()
def greedy_eval(model: LlamaModel, task: CountingTask, seed: int, num: int, max_new_tokens: int
                ) -> dict[str, float]:
    """Greedy accuracy, mean items and the item-count histogram on ``num`` held-out prompts."""
    starts = [random.Random(sample_hash(seed, i, SFT_STREAM + 1)).randint(task.min_start, task.max_start)
              for i in range(num)]
    tokens = torch.tensor([task.prompt_tokens(s) for s in starts])
    done = torch.zeros(num, dtype=torch.bool)
    out = []
    for _ in range(max_new_tokens):
        nxt = model(tokens)[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, task.tokenizer.pad_id), nxt)
        out.append(nxt)
        done |= nxt == task.tokenizer.eos_id
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if bool(done.all()):
            break
    responses = torch.stack(out, dim=1).tolist()
    verdicts = [task.verify(s, r) for s, r in zip(starts, responses)]
    hist: dict[int, int] = {}
    for v in verdicts:
        hist[v.items] = hist.get(v.items, 0) + 1
    return {
        "accuracy": sum(v.correct and v.finished for v in verdicts) / num,
        "mean_items": sum(v.items for v in verdicts) / num,
        "histogram": dict(sorted(hist.items())),
    }


def train(args: argparse.Namespace) -> LlamaModel:
    torch.manual_seed(args.seed)
    task = CountingTask()
    model = LlamaModel(SPEC, seed=args.seed)
    log.info("model: %d parameters", sum(p.numel() for p in model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 1 - s / args.steps))
    t0 = time.perf_counter()
    for step in range(args.steps):
        base = step * args.batch
        examples = [sft_example(task, args.seed, base + i, args.min_items, args.max_items,
                                args.tail_frac, args.tail_max_items) for i in range(args.batch)]
        loss = sft_step(model, opt, sched, examples, task.tokenizer.pad_id, SPEC.vocab_size)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss:.4f}  {time.perf_counter() - t0:6.1f}s", flush=True)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("examples/models/counting-warmstart"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--min-items", type=int, default=2)
    parser.add_argument("--max-items", type=int, default=4)
    parser.add_argument("--tail-frac", type=float, default=0.05,
                        help="share of examples with more than --max-items items")
    parser.add_argument("--tail-max-items", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eval", type=int, default=256, help="held-out prompts for greedy evaluation")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    model = train(args)
    model.eval()
    stats = greedy_eval(model, CountingTask(), args.seed, args.eval, max_new_tokens=4 * args.tail_max_items + 8)
    print(f"greedy: accuracy {stats['accuracy']:.3f}  mean items {stats['mean_items']:.2f}  "
          f"items histogram {stats['histogram']}", flush=True)
    save_pretrained(args.out, SPEC, model.state_dict())
    print(f"saved {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
