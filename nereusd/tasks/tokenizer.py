"""A model directory's tokenizer: ``transformers.AutoTokenizer``, its chat template and stop tokens.

:class:`HFTokenizer` gives the driver what the counting task's character tokenizer gives it
(``pad_id``, ``eos_id``, ``stop_ids``, ``vocab_size``, ``encode``, ``decode``) for a Hugging Face
tokenizer, plus :meth:`HFTokenizer.render`: a prompt rendered with the model's chat template
(``apply_chat_template`` with the generation prompt), with an optional system prompt. A response
ends at the tokenizer's EOS or any ``eos_token_id`` of the directory's ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from nereusd.errors import ConfigError

Messages = list[dict[str, str]]


class HFTokenizer:
    """The tokenizer of the Hugging Face model directory ``model_dir`` (module docstring).

    Raises:
        ConfigError: the directory has no loadable tokenizer, or it defines no EOS token.
    """

    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"{self.model_dir}: no loadable tokenizer ({type(err).__name__}: {err})") from None
        eos = self._tok.eos_token_id
        if eos is None:
            raise ConfigError(f"{self.model_dir}: the tokenizer defines no EOS token (eos_token)")
        stops = {int(eos)}
        gen_path = self.model_dir / "generation_config.json"
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text())
            except json.JSONDecodeError as err:
                raise ConfigError(f"{gen_path}: not valid JSON: {err}") from None
            extra = gen.get("eos_token_id")
            stops |= {int(x) for x in (extra if isinstance(extra, list) else [extra]) if x is not None}
        self.eos_id = int(eos)
        self.stop_ids: tuple[int, ...] = tuple(sorted(stops))
        pad = self._tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.vocab_size = len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` without special tokens (what a verifier reads)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def render(self, prompt: str | Messages, *, system_prompt: str | None = None,
               chat_template: bool = True) -> list[int]:
        """Token ids of ``prompt`` ready for generation.

        With ``chat_template`` the messages (a text prompt is one user message; ``system_prompt``
        is prepended unless the prompt has a system message) are rendered by the tokenizer's
        chat template with the generation prompt; without it the message contents are joined
        by blank lines and encoded as they are.

        Raises:
            ConfigError: ``chat_template`` asked for but the tokenizer has none.
        """
        messages: Messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system_prompt and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        if not chat_template:
            return self.encode("\n\n".join(m["content"] for m in messages))
        if not self.has_chat_template:
            raise ConfigError(f"{self.model_dir}: the tokenizer has no chat template; set task.options.chat_template: "
                              "false to use the prompt text as it is")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        return [len(self.encode(t)) for t in texts]
