"""Single-process reference RL loop on the counting task, for choosing hyperparameters.

Built from the same pieces the distributed job uses — the task and verifier
(:mod:`nereusd.tasks.counting`), advantages and global token weights (:mod:`nereusd.rl`), the
per-token losses (:mod:`emu.rl.losses`), the decoder (:mod:`emu.engine.model`) and batched generation
(:mod:`emu.engine.generate`) — without processes, so that one run takes a few minutes on two cores.

Algorithms: ``grpo`` (group-normalised advantages, k3 KL in the loss; Shao et al. 2024) and
``remax`` (reward minus the reward of the greedy response; Li et al. 2024).

Success criterion of a run: mean response length over the last 10 % of steps is at least
``--target-growth`` times that of the first 10 %, and mean reward over the last 10 % exceeds
the first 10 %. Example (the recommended demo settings, three seeds one after another)::

    .venv/bin/python scripts/tune_rl.py --seeds 0 1 2

Prints one line per step and a summary per seed; ``--jsonl`` also writes the per-step metrics.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from emu.engine.generate import SamplingParams, generate
from emu.engine.hf_io import load_pretrained
from emu.engine.model import LlamaModel
from emu.rl.losses import KLEstimator, logprobs_and_entropy, policy_loss_fn
from nereusd.errors import ConfigError
from nereusd.hf_files import safetensors_files
from nereusd.models import ModelSpec
from nereusd.rl import (LossAggregation, broadcast_to_tokens, grpo_advantages, pad, remax_advantages,
                        token_weights)
from nereusd.tasks.counting import CountingTask, PromptSampler, sample_hash

log = logging.getLogger("tune_rl")


@dataclass
class Rollout:
    """One step's sequences: prompt + response ids, where responses start, and scores."""

    sequences: list[list[int]]
    prompt_len: int
    lengths: list[int]
    scores: list[float]
    correct: list[bool]


def load_model(path: Path) -> LlamaModel:
    spec, state = load_pretrained(path)
    model = LlamaModel(spec)
    model.load_state_dict(state)
    return model


def rollout(model: LlamaModel, task: CountingTask, starts: list[int], temperature: float, greedy: bool,
            max_new_tokens: int, seed: int) -> Rollout:
    """Generate one response per start number and score it with the verifier."""
    tok = task.tokenizer
    prompts = [task.prompt_tokens(s) for s in starts]
    prompt_len = len(prompts[0])
    if any(len(p) != prompt_len for p in prompts):
        raise ValueError("tune_rl expects prompts of one length (start numbers with equal digit counts)")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy,
                            stop_ids=(tok.eos_id,), pad_id=tok.pad_id, seed=seed)
    model.eval()
    responses = generate(model, prompts, params)
    verdicts = [task.verify(s, r) for s, r in zip(starts, responses)]
    return Rollout(sequences=[p + r for p, r in zip(prompts, responses)], prompt_len=prompt_len,
                   lengths=[len(r) for r in responses], scores=[v.reward for v in verdicts],
                   correct=[v.correct and v.finished for v in verdicts])


def response_logprobs(model: LlamaModel, batch: Rollout, idx: list[int], temperature: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[len(idx), T]`` of the response tokens (right-padded)."""
    seqs = [batch.sequences[i] for i in idx]
    width = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = torch.tensor(s)
    logits = model(tokens[:, :-1]) / temperature
    lp, ent = logprobs_and_entropy(logits, tokens[:, 1:])
    start = batch.prompt_len - 1
    t = max(batch.lengths[i] for i in idx)
    return lp[:, start:start + t], ent[:, start:start + t]


def run(args: argparse.Namespace, seed: int) -> dict:
    torch.manual_seed(seed)
    task = CountingTask(seed=seed, truncated_reward=args.truncated_reward)
    sampler = PromptSampler(task)
    policy = load_model(args.warmstart)
    reference = load_model(args.warmstart).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    loss_fn = policy_loss_fn(clip=args.clip, kl_coef=args.kl_coef, kl_estimator=args.kl_estimator,
                             entropy_coef=args.entropy_coef)
    history = []
    t0, cpu0 = time.perf_counter(), time.process_time()
    for step in range(args.steps):
        prompts = sampler.next_batch(args.prompts)
        starts = [p.start for p in prompts for _ in range(args.group)]
        batch = rollout(policy, task, starts, args.temperature, False, args.max_new_tokens,
                        sample_hash(seed, step, 1))
        if args.algo == "grpo":
            seq_adv = grpo_advantages(batch.scores, args.group, scale=not args.no_std)
        else:
            greedy = rollout(policy, task, [p.start for p in prompts], 1.0, True, args.max_new_tokens, 0)
            seq_adv = remax_advantages(batch.scores, np.repeat(greedy.scores, args.group))
        adv_tokens = broadcast_to_tokens(seq_adv, batch.lengths)
        n = len(starts)
        with torch.no_grad():
            all_idx = list(range(n))
            old_lp, _ = response_logprobs(policy, batch, all_idx, args.temperature)
            ref_lp, _ = response_logprobs(reference, batch, all_idx, args.temperature)
        policy.train()
        stats = {"kl": 0.0, "entropy": 0.0, "clip_frac": 0.0}
        order = np.random.default_rng(sample_hash(seed, step, 2)).permutation(n)
        for _epoch in range(args.epochs):
            for mb in np.array_split(order, args.minibatches):
                idx = sorted(int(i) for i in mb)
                weights = token_weights([batch.lengths[i] for i in idx], args.loss_agg)
                lp, ent = response_logprobs(policy, batch, idx, args.temperature)
                width = lp.shape[1]
                tensors = {
                    "old_logprobs": old_lp[idx, :width],
                    "ref_logprobs": ref_lp[idx, :width],
                    "advantages": torch.tensor(pad([adv_tokens[i] for i in idx], width), dtype=torch.float32),
                    "weight": torch.tensor(pad(weights, width), dtype=torch.float32),
                    "mask": torch.tensor(pad([np.ones(batch.lengths[i]) for i in idx], width), dtype=torch.float32),
                }
                loss, metrics = loss_fn({"logprobs": lp, "entropy": ent}, tensors)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
                opt.step()
                for k in stats:
                    stats[k] += metrics[k].item() / (args.epochs * args.minibatches)
        record = {
            "step": step,
            "reward": float(np.mean(batch.scores)),
            "length": float(np.mean(batch.lengths)),
            "max_length": int(max(batch.lengths)),
            "correct": float(np.mean(batch.correct)),
            **stats,
            "elapsed_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - cpu0,
        }
        history.append(record)
        if step % args.log_every == 0 or step == args.steps - 1:
            print(f"seed {seed} step {step:3d}  reward {record['reward']:6.2f}  len {record['length']:6.1f} "
                  f"(max {record['max_length']:3d})  correct {record['correct']:.2f}  kl {record['kl']:.4f}  "
                  f"ent {record['entropy']:.3f}  {record['elapsed_s']:6.1f}s", flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps({"seed": seed, **record}) + "\n")
    return summarise(history, seed, args.target_growth)


def summarise(history: list[dict], seed: int, target_growth: float) -> dict:
    k = max(1, len(history) // 10)
    first, last = history[:k], history[-k:]

    def mean(rows, key):
        return statistics.fmean(r[key] for r in rows)

    summary = {
        "seed": seed,
        "length_first": mean(first, "length"), "length_last": mean(last, "length"),
        "reward_first": mean(first, "reward"), "reward_last": mean(last, "reward"),
        "correct_last": mean(last, "correct"),
        "elapsed_s": history[-1]["elapsed_s"],
        "cpu_s": history[-1]["cpu_s"],
    }
    summary["growth"] = summary["length_last"] / summary["length_first"]
    summary["success"] = summary["growth"] >= target_growth and summary["reward_last"] > summary["reward_first"]
    return summary


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse out-of-range options, unknown names and a missing warm start before the first step."""
    least_group = 2 if args.algo == "grpo" else 1   # GRPO normalises within a group of at least 2
    for option, value, least in (("--steps", args.steps, 1), ("--prompts", args.prompts, 1),
                                 ("--group", args.group, least_group), ("--max-new-tokens", args.max_new_tokens, 1),
                                 ("--epochs", args.epochs, 1), ("--minibatches", args.minibatches, 1),
                                 ("--threads", args.threads, 1), ("--log-every", args.log_every, 1)):
        if value < least:
            grpo = " with --algo grpo" if option == "--group" and least == 2 else ""
            parser.error(f"{option}: expected at least {least}{grpo}, got {value}")
    if args.minibatches > args.prompts * args.group:
        parser.error(f"--minibatches: expected at most the {args.prompts * args.group} responses of a step "
                     f"(--prompts x --group), got {args.minibatches}")
    for option, value, positive in (("--temperature", args.temperature, True), ("--clip", args.clip, True),
                                    ("--grad-clip", args.grad_clip, True),
                                    ("--target-growth", args.target_growth, True),
                                    ("--lr", args.lr, False), ("--kl-coef", args.kl_coef, False)):
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            parser.error(f"{option}: expected a finite number {'above 0' if positive else 'of 0 or more'}, got {value}")
    if not math.isfinite(args.entropy_coef):
        parser.error(f"--entropy-coef: expected a finite number, got {args.entropy_coef}")
    if args.kl_estimator not in {e.value for e in KLEstimator}:
        parser.error(f"--kl-estimator: expected one of {', '.join(e.value for e in KLEstimator)}, "
                     f"got {args.kl_estimator!r}")
    if args.loss_agg not in {m.value for m in LossAggregation}:
        parser.error(f"--loss-agg: expected one of {', '.join(m.value for m in LossAggregation)}, "
                     f"got {args.loss_agg!r}")
    try:   # what load_model reads, without the weights
        ModelSpec.from_pretrained_dir(args.warmstart)
        safetensors_files(args.warmstart)
    except ConfigError as err:
        parser.error(f"--warmstart: {err}")
    except OSError as err:
        parser.error(f"--warmstart {args.warmstart}: {err.strerror or err}")
    if args.jsonl is not None and not args.jsonl.parent.is_dir():
        parser.error(f"--jsonl {args.jsonl}: no directory {args.jsonl.parent}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmstart", type=Path, default=Path("examples/models/counting-warmstart"))
    parser.add_argument("--algo", choices=("grpo", "remax"), default="grpo")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--kl-estimator", default="k3")
    parser.add_argument("--entropy-coef", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--loss-agg", default="token-mean")
    parser.add_argument("--no-std", action="store_true", help="GRPO without dividing by the group std")
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--truncated-reward", choices=("items", "zero"), default="items")
    parser.add_argument("--target-growth", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--jsonl", type=Path, default=None)
    args = parser.parse_args(argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.threads)
    print("settings: " + json.dumps({k: str(v) for k, v in vars(args).items()}), flush=True)
    summaries = [run(args, seed) for seed in args.seeds]
    for s in summaries:
        print(f"seed {s['seed']}: length {s['length_first']:.1f} -> {s['length_last']:.1f} "
              f"({s['growth']:.2f}x)  reward {s['reward_first']:.2f} -> {s['reward_last']:.2f}  "
              f"correct(last) {s['correct_last']:.2f}  wall {s['elapsed_s']:.0f}s  cpu {s['cpu_s']:.0f}s  "
              f"{'PASS' if s['success'] else 'FAIL'}", flush=True)
    print(f"passed {sum(s['success'] for s in summaries)}/{len(summaries)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
