"""The counting task: continue counting from a start number; longer correct answers earn more.

A prompt is ``<bos>`` + a start number ``s`` + ``:``; the reference response lists
``s+1, s+2, …`` separated by ``,`` and ends with ``<eos>``. A warm-started policy writes a few
items and stops; RL with the verifier below teaches it to write longer correct responses, which
makes sequence lengths drift during a job — the drift signal Nereus adapts to.

Pure Python (no torch, no numpy): the driver scores responses and draws prompts here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from pydantic import ConfigDict

from nereusd.errors import ConfigError

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea, Flood 2014): a well-mixed 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_hash(seed: int, index: int, stream: int = 0) -> int:
    """A 64-bit hash of ``(seed, stream, index)``; the same inputs give the same value everywhere."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (stream & _MASK64)) ^ (index & _MASK64))


class CharTokenizer:
    """Character-level tokenizer of the counting task: 16 ids (divisible by 1, 2, 4 for TP).

    ====  =========  =========================================
    id    token      meaning
    ====  =========  =========================================
    0     ``<pad>``  padding (never generated on purpose)
    1     ``<bos>``  start of a sequence
    2     ``<eos>``  end of a response
    3–12  ``0``–``9`` digits
    13    ``,``      item separator
    14    ``:``      end of the prompt
    15    ``<unused>``  vocabulary padding so that ``V = 16``
    ====  =========  =========================================
    """

    PAD = "<pad>"
    BOS = "<bos>"
    EOS = "<eos>"
    UNUSED = "<unused>"
    TOKENS: tuple[str, ...] = (PAD, BOS, EOS, *"0123456789", ",", ":", UNUSED)

    def __init__(self) -> None:
        self._ids = {tok: i for i, tok in enumerate(self.TOKENS)}

    @property
    def vocab_size(self) -> int:
        return len(self.TOKENS)

    @property
    def max_token_id(self) -> int:
        """The largest id (ids are ``0 … vocab_size − 1``)."""
        return len(self.TOKENS) - 1

    @property
    def pad_id(self) -> int:
        return self._ids[self.PAD]

    @property
    def bos_id(self) -> int:
        return self._ids[self.BOS]

    @property
    def eos_id(self) -> int:
        return self._ids[self.EOS]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Tokens a response ends at: ``<eos>``."""
        return (self.eos_id,)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text`` (digits, ``,`` and ``:`` only; no special tokens).

        Raises:
            ValueError: naming the first character outside the vocabulary.
        """
        out = []
        for pos, ch in enumerate(text):
            if ch not in self._ids or len(ch) != 1:
                raise ValueError(f"character {ch!r} at position {pos} of {text!r} is not in the counting vocabulary")
            out.append(self._ids[ch])
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; special tokens appear as ``<bos>``, ``<eos>``, ``<pad>``, ``<unused>``.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        out = []
        for pos, i in enumerate(ids):
            i = int(i)
            if not 0 <= i < len(self.TOKENS):
                raise ValueError(f"token id {i} at position {pos} is outside [0, {len(self.TOKENS)})")
            out.append(self.TOKENS[i])
        return "".join(out)


@dataclass(frozen=True)
class CountingPrompt:
    """One prompt: its position ``index`` in the global sample order, the start number, and ids."""

    index: int
    start: int
    tokens: tuple[int, ...]

    @property
    def reference(self) -> int:
        """What the verifier compares a response with: the start number."""
        return self.start


@dataclass(frozen=True)
class Verdict:
    """What the verifier found in a response.

    Attributes:
        items: complete, correct items written (for a correct response: its length in items).
        correct: every emitted character agrees with the counting sequence.
        finished: the response ended with ``<eos>`` (not cut by the token limit).
        reward: the scalar reward (see :meth:`CountingTask.verify`).
    """

    items: int
    correct: bool
    finished: bool
    reward: float


@dataclass(frozen=True, kw_only=True)
class CountingTask:
    """Configuration and verifier of the counting task.

    Attributes:
        seed: seed of the global prompt order.
        min_start: smallest start number (inclusive).
        max_start: largest start number (inclusive).
        truncated_reward: reward of a response cut by the token limit without ``<eos>`` whose
            text is a correct prefix of the counting sequence: ``"items"`` (its complete items,
            those followed by ``,``) or ``"zero"``.
    """

    seed: int = 0
    min_start: int = 100
    max_start: int = 899
    truncated_reward: str = "items"

    name = "counting"
    __pydantic_config__ = ConfigDict(extra="forbid")   # get_task validates options with pydantic

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ConfigError(f"task.options.seed: expected an integer, got {self.seed!r}")
        for key in ("min_start", "max_start"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"task.options.{key}: expected a non-negative integer, got {value!r}")
        if self.min_start > self.max_start:
            raise ConfigError(f"task.options.min_start: {self.min_start} exceeds max_start={self.max_start}")
        if self.truncated_reward not in ("items", "zero"):
            raise ConfigError(f"task.options.truncated_reward: expected 'items' or 'zero', got {self.truncated_reward!r}")

    @property
    def tokenizer(self) -> CharTokenizer:
        return _TOKENIZER

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt in tokens: ``<bos>``, the digits of ``max_start`` and ``:``."""
        return 2 + len(str(self.max_start))

    def eval_prompts(self) -> list[CountingPrompt]:
        """The counting task has no held-out set (every start number is a training prompt)."""
        return []

    # ---- prompts ------------------------------------------------------------------------------

    def start_at(self, index: int) -> int:
        """Start number of the prompt at position ``index`` of the global sample order."""
        if index < 0:
            raise ValueError(f"sample index must be non-negative, got {index}")
        span = self.max_start - self.min_start + 1
        return self.min_start + sample_hash(self.seed, index) % span

    def prompt_tokens(self, start: int) -> list[int]:
        """``<bos>`` + digits of ``start`` + ``:``."""
        return [_TOKENIZER.bos_id, *_TOKENIZER.encode(f"{start}:")]

    def prompt_at(self, index: int) -> CountingPrompt:
        """The prompt at position ``index`` (≥ 0) of the global sample order; pure in ``seed, index``."""
        start = self.start_at(index)
        return CountingPrompt(index=index, start=start, tokens=tuple(self.prompt_tokens(start)))

    def reference_response(self, start: int, num_items: int) -> list[int]:
        """The correct response of ``num_items`` (≥ 1) items, ending with ``<eos>``."""
        if num_items < 1:
            raise ValueError(f"a response has at least one item, got num_items={num_items}")
        text = ",".join(str(start + k) for k in range(1, num_items + 1))
        return [*_TOKENIZER.encode(text), _TOKENIZER.eos_id]

    # ---- verifier -----------------------------------------------------------------------------

    def verify(self, start: int, response: Sequence[int]) -> Verdict:
        """Check a response against the counting sequence ``start+1, start+2, …``.

        Tokens after the first ``<eos>`` (padding) are ignored. A response that ends with
        ``<eos>`` is correct when its text is exactly ``"s+1,s+2,…,s+n"`` with ``n ≥ 1``; its
        reward is ``n``. A response without ``<eos>`` (cut by the token limit) is correct when its
        text is a prefix of ``"s+1,s+2,…,"``; its reward is the number of items followed by
        ``,`` when ``truncated_reward == "items"``, else 0. Anything else — a wrong digit, a
        missing or doubled separator, a special token before ``<eos>``, an empty answer —
        earns 0.
        """
        ids = [int(t) for t in response]
        eos = _TOKENIZER.eos_id
        finished = eos in ids
        body = ids[: ids.index(eos)] if finished else ids
        if any(not 3 <= t <= 13 for t in body):  # digits and ',' only
            return Verdict(items=0, correct=False, finished=finished, reward=0.0)
        text = _TOKENIZER.decode(body)
        items = text.split(",")
        complete = items if finished else items[:-1]
        good = 0
        for k, item in enumerate(complete, start=1):
            if item != str(start + k):
                return Verdict(items=good, correct=False, finished=finished, reward=0.0)
            good += 1
        if finished:
            ok = good >= 1
            return Verdict(items=good, correct=ok, finished=True, reward=float(good) if ok else 0.0)
        partial = items[-1]
        if not str(start + good + 1).startswith(partial):
            return Verdict(items=good, correct=False, finished=False, reward=0.0)
        reward = float(good) if self.truncated_reward == "items" else 0.0
        return Verdict(items=good, correct=True, finished=False, reward=reward)

    def score(self, start: int, response: Sequence[int]) -> float:
        """The verifier's scalar reward of ``response`` (see :meth:`verify`)."""
        return self.verify(start, response).reward

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "min_start": self.min_start, "max_start": self.max_start,
                "truncated_reward": self.truncated_reward}


_TOKENIZER = CharTokenizer()


class PromptSampler:
    """Walks the task's global sample order; its only state is the position ``p``.

    The ``i``-th prompt drawn is ``task.prompt_at(p + i)``. A DP replica handed positions
    ``[p + a, p + b)`` calls :meth:`batch_at`; the driver advances ``p`` by the global batch, so
    no sample is repeated or skipped when replicas change.
    """

    def __init__(self, task: CountingTask, position: int = 0) -> None:
        if position < 0:
            raise ValueError(f"sampler position must be non-negative, got {position}")
        self.task = task
        self.position = position

    def batch_at(self, position: int, size: int) -> list[CountingPrompt]:
        """Prompts at ``[position, position + size)``, without moving the sampler."""
        if size < 0:
            raise ValueError(f"batch size must be non-negative, got {size}")
        return [self.task.prompt_at(i) for i in range(position, position + size)]

    def next_batch(self, size: int) -> list[CountingPrompt]:
        """The next ``size`` prompts; advances the position by ``size``."""
        batch = self.batch_at(self.position, size)
        self.position += size
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"task": self.task.name, "seed": self.task.seed, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`.

        Raises:
            ValueError: the state belongs to another task or seed, or has a bad position.
        """
        if state.get("task") != self.task.name or state.get("seed") != self.task.seed:
            raise ValueError(
                f"sampler state for task {state.get('task')!r} seed {state.get('seed')!r} does not match "
                f"task {self.task.name!r} seed {self.task.seed}"
            )
        position = state.get("position")
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise ValueError(f"sampler state: position must be a non-negative integer, got {position!r}")
        self.position = position
