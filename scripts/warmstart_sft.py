"""Supervised fine-tuning steps shared by the warm-start scripts (``make_warmstart.py`` for the
counting task, ``make_math_warmstart.py`` for the math example)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_batch(examples: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs [B, S-1], targets [B, S-1], loss mask [B, S-1])`` of ``(sequence, prompt_len)``
    pairs: right-padded with ``pad_id``, the loss on response tokens only."""
    width = max(len(seq) for seq, _ in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), width - 1)
    for i, (seq, prompt_len) in enumerate(examples):
        tokens[i, : len(seq)] = torch.tensor(seq)
        mask[i, prompt_len - 1: len(seq) - 1] = 1.0
    return tokens[:, :-1], tokens[:, 1:], mask


def sft_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, examples: list[tuple[list[int], int]],
             pad_id: int, vocab_size: int) -> float:
    """One optimizer step of the mean response-token cross-entropy (gradient clipped at norm 1);
    returns the loss."""
    inputs, targets, mask = make_batch(examples, pad_id)
    logits = model(inputs)
    nll = F.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1), reduction="none")
    loss = (nll * mask.reshape(-1)).sum() / mask.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(loss.detach())
