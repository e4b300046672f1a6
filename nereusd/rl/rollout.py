"""The batch of one RL step as the driver holds it: prompts, responses, scores, per-token signals.

Sequences are ragged lists of token ids; per-token signals (log-probs, values, advantages,
weights) are one list of floats per response token. Helpers here split the batch across DP
replicas (contiguous shares in the global sample order) and gather per-replica results back.
Pure Python + numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` ranges covering ``n`` items in ``parts`` shares whose sizes
    differ by at most one (the first ``n % parts`` shares get one more)."""
    base, extra = divmod(n, parts)
    ranges, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


@dataclass
class RolloutBatch:
    """One step's sequences. Index ``i`` is the ``i``-th response of the step; responses of
    one prompt are contiguous (``group_size`` of them)."""

    prompt_index: list[int]
    references: list
    """What each response's verifier compares it with (the task's ``Prompt.reference``)."""
    prompts: list[list[int]]
    responses: list[list[int]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    per_token: dict[str, list[list[float]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def sequences(self) -> list[list[int]]:
        return [p + r for p, r in zip(self.prompts, self.responses)]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def response_lens(self) -> list[int]:
        return [len(r) for r in self.responses]

    def select(self, indices: Sequence[int], keys: Sequence[str]) -> dict[str, Any]:
        """Payload of a train/inference task for the sequences ``indices``."""
        return {
            "sequences": [self.prompts[i] + self.responses[i] for i in indices],
            "prompt_lens": [len(self.prompts[i]) for i in indices],
            "per_token": {k: [list(map(float, self.per_token[k][i])) for i in indices] for k in keys},
        }


def as_lists(arrays: Sequence[np.ndarray]) -> list[list[float]]:
    return [np.asarray(a, dtype=np.float64).tolist() for a in arrays]


def mean_of(records: Sequence[dict[str, float]]) -> dict[str, float]:
    """Sum per key over replicas (the engine's metrics are already weighted partial sums)."""
    total: dict[str, float] = {}
    for rec in records:
        for key, value in rec.items():
            total[key] = total.get(key, 0.0) + float(value)
    return total
