"""Math reasoning with a rule-based reward: GSM8K- or MATH-style datasets, chat-templated prompts.

``task: {name: math, options: {...}}`` in a job (options below). Prompts are the dataset's
questions rendered with the actor's chat template (:class:`nereusd.tasks.tokenizer.HFTokenizer`),
drawn in the dataset's deterministic global order (:class:`nereusd.tasks.dataset.SampleOrder`);
a response is decoded and checked against the record's ground truth by the format's verifier
(:data:`nereusd.tasks.verifiers.VERIFIERS`): reward 1 when right, 0 otherwise. A held-out split
(``eval_size`` records) is the evaluation set (pass@1 of greedy responses, in the driver).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pydantic import ConfigDict

from nereusd.errors import ConfigError
from nereusd.tasks.dataset import SampleOrder, read_records, split
from nereusd.tasks.tokenizer import HFTokenizer
from nereusd.tasks.verifiers import REFERENCE_PROBLEMS, VERIFIERS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One prompt: its position ``index`` in the global sample order, its token ids, and the
    ``reference`` its verifier compares a response with (the record's ground truth)."""

    index: int
    tokens: tuple[int, ...]
    reference: str


@dataclass(kw_only=True)
class MathTask:
    """See the module docstring.

    Attributes:
        dataset: a ``.jsonl`` or ``.parquet`` file, relative to the job file.
        format: ``gsm8k`` (the number after ``####``) or ``boxed`` (``\\boxed{}``, math-verify).
        prompt_key, answer_key: the columns (dotted keys) of the question and the ground truth.
        system_prompt: prepended as a system message (none by default).
        instruction: appended to every question (e.g. how to state the answer); none by default.
        chat_template: render prompts with the tokenizer's chat template (else raw text).
        eval_size: records held out for evaluation (drawn from ``seed``); 0: none.
        max_prompt_length: longest prompt in tokens (``None``: no limit).
        overlong: what happens to a longer prompt: ``filter`` (dropped) or ``truncate`` (its
            first tokens cut, so the end with the generation prompt stays).
        seed: seed of the split and of the sample order.
        tokenizer_dir: the model directory whose tokenizer renders prompts, relative to the job
            file (default: the actor's).
    """

    dataset: str
    format: str = "gsm8k"
    prompt_key: str = "question"
    answer_key: str = "answer"
    system_prompt: str | None = None
    instruction: str | None = None
    chat_template: bool = True
    eval_size: int = 0
    max_prompt_length: int | None = None
    overlong: str = "filter"
    seed: int = 0
    tokenizer_dir: str | None = None
    base_dir: Path = field(default=Path("."), repr=False)
    model_dir: str | None = field(default=None, repr=False)

    name = "math"
    __pydantic_config__ = ConfigDict(extra="forbid")   # get_task validates options with pydantic

    def __post_init__(self) -> None:
        if self.format not in VERIFIERS:
            raise ConfigError(f"task.options.format: {self.format!r}: expected one of {sorted(VERIFIERS)}")
        if self.overlong not in ("filter", "truncate"):
            raise ConfigError(f"task.options.overlong: {self.overlong!r}: expected 'filter' or 'truncate'")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ConfigError(f"task.options.max_prompt_length: expected a positive integer, got {self.max_prompt_length}")
        if self.tokenizer_dir is not None:
            model_dir = self.base_dir / self.tokenizer_dir
        elif self.model_dir is not None:
            model_dir = Path(self.model_dir)
        else:
            raise ConfigError("task.options.tokenizer_dir: the math task needs a tokenizer: give models.actor (a "
                              "model directory) or task.options.tokenizer_dir")
        self._tokenizer = HFTokenizer(model_dir)
        records = read_records(self.base_dir / self.dataset, self.prompt_key, self.answer_key)
        first = records[0].prompt if isinstance(records[0].prompt, str) else records[0].prompt[-1]["content"]
        self._tokenizer.check_round_trip(first)
        train_rows, eval_rows = split(len(records), self.eval_size, self.seed)
        self.dropped = 0
        """Prompts dropped as longer than ``max_prompt_length`` (``overlong: filter``), both splits."""
        self.truncated = 0
        """Prompts cut to ``max_prompt_length`` (``overlong: truncate``)."""
        self._train = self._prompts([records[i] for i in train_rows])
        train_dropped = self.dropped
        self._eval = self._prompts([records[i] for i in eval_rows])
        self.eval_dropped = self.dropped - train_dropped
        """Of :attr:`dropped`, those of the held-out split (it is then smaller than ``eval_size``)."""
        if not self._train:
            raise ConfigError(f"{self.dataset}: every training prompt is longer than task.options.max_prompt_length="
                              f"{self.max_prompt_length} (overlong: filter)")
        if self.dropped or self.truncated:
            log.warning("%s: %d prompts longer than task.options.max_prompt_length=%s tokens dropped (%d of "
                        "them held out: %d evaluation prompts remain) and %d truncated", self.dataset, self.dropped,
                        self.max_prompt_length, self.eval_dropped, len(self._eval), self.truncated)
        self._order = SampleOrder(len(self._train), self.seed)

    def _prompts(self, records) -> list[tuple[tuple[int, ...], str]]:
        """Each record's prompt rendered to token ids (:meth:`HFTokenizer.render`), with its answer.

        Raises:
            ConfigError: a prompt the tokenizer or its chat template cannot take (a lone
                surrogate; :meth:`HFTokenizer.render`), one that renders to no tokens, or a
                reference the format's verifier could never match
                (:data:`~nereusd.tasks.verifiers.REFERENCE_PROBLEMS`), naming the dataset's row.
        """
        out = []
        for rec in records:
            prompt = rec.prompt
            if self.instruction:
                prompt = f"{prompt}\n{self.instruction}" if isinstance(prompt, str) else [
                    *prompt[:-1], {**prompt[-1], "content": f"{prompt[-1]['content']}\n{self.instruction}"}]
            where = f"{self.dataset}: row {rec.row}"
            try:
                ids = self._tokenizer.render(prompt, system_prompt=self.system_prompt,
                                             chat_template=self.chat_template)
            except (TypeError, ValueError) as err:   # the tokenizers' TextEncodeInput refuses a lone surrogate
                raise ConfigError(f"{where}: the tokenizer cannot encode its prompt ({type(err).__name__}: "
                                  f"{str(err)[:120]})") from None
            if not ids:
                raise ConfigError(f"{where}: the prompt renders to no tokens"
                                  + (" (the chat template writes nothing)" if self.chat_template else ""))
            problem = REFERENCE_PROBLEMS[self.format](rec.answer)
            if problem:
                other = "boxed checks other forms" if self.format == "gsm8k" else "gsm8k reads '#### <number>'"
                raise ConfigError(f"{where}: {self.answer_key} {rec.answer[:60]!r} {problem}, which the "
                                  f"{self.format} verifier cannot match (task.options.format: {other})")
            if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
                if self.overlong == "filter":
                    self.dropped += 1
                    continue
                ids = ids[-self.max_prompt_length:]
                self.truncated += 1
            out.append((tuple(ids), rec.answer))
        return out

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    @property
    def train_size(self) -> int:
        return len(self._train)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt of the task (training and evaluation), in tokens."""
        return max(len(t) for t, _ in self._train + self._eval)

    def prompt_at(self, index: int) -> Prompt:
        """The prompt at position ``index`` of the global sample order (epochs of permutations)."""
        tokens, answer = self._train[self._order.at(index)]
        return Prompt(index, tokens, answer)

    def eval_prompts(self) -> list[Prompt]:
        """The held-out prompts, in row order (their ``index`` counts from 0 within the split)."""
        return [Prompt(i, tokens, answer) for i, (tokens, answer) in enumerate(self._eval)]

    def score(self, reference: str, response: Sequence[int]) -> float:
        """1.0 when the decoded response's answer equals ``reference``, else 0.0 (verifier of
        :attr:`format`)."""
        return VERIFIERS[self.format](self._tokenizer.decode(response), reference)

    def to_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "format": self.format, "train": len(self._train), "eval": len(self._eval),
                "dropped": self.dropped, "eval_dropped": self.eval_dropped, "truncated": self.truncated}
